"""The zope interfaces of ztwisted, in one place."""

from twisted.internet.interfaces import IPushProducer
from zope.interface import Attribute


class IPipeEnd(IPushProducer):
    """One end of a spliced byte pipe: an app's TCP socket or an HBONE stream.

    Two ends are coupled by :func:`ztwisted.splice.splice`; each end passes
    what its remote side sends to its partner with the methods below, and
    pauses its partner (``IPushProducer``) when it cannot take more.
    """

    finished = Attribute(
        "Deferred that fires with an outcome string ('closed', 'reset', ...) "
        "once both directions of this end are done."
    )
    bytes_received = Attribute("Bytes received from this end's remote side.")
    bytes_sent = Attribute("Bytes sent to this end's remote side.")

    def set_partner(partner):
        """Couple this end with the end that receives what this end's remote sends."""

    def write(data):
        """Send ``data`` to this end's remote side."""

    def write_eof():
        """Half-close toward this end's remote side (TCP FIN / END_STREAM)."""

    def abort():
        """Tear this end down at once (TCP RST / RST_STREAM)."""
