"""The zope interfaces of ztwisted, in one place."""

from twisted.internet.interfaces import IPushProducer
from zope.interface import Attribute, Interface


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


class IDrainStrategy(Interface):
    """How connections end when pods or the proxy go away.

    A strategy receives the lifecycle events below and acts through the
    node's drain facade (:class:`ztwisted.drain.facade.DrainFacade`). Each
    handler may return a Deferred; the event is complete when it fires.
    Built-in and third-party strategies are Twisted plugins: objects
    providing ``twisted.plugin.IPlugin`` and this interface in a
    ``twisted/plugins/`` module.
    """

    name = Attribute("The name used with --drain-strategy (lower case, no commas).")
    description = Attribute("One line for --drain-strategy help.")

    def attach(node):
        """Called once when the proxy starts, before any event: configure the node if needed."""

    def pod_terminating(node, workload):
        """A local pod started terminating; it is still Running and must keep accepting traffic."""

    def pod_removed(node, workload):
        """A local pod is going away; the node closes what is left once this completes."""

    def destination_removed(node, workload):
        """A remote workload disappeared from discovery."""

    def proxy_stopping(node):
        """The proxy process is shutting down; the node drains what is left once this completes."""
