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
        "Deferred that fires with an outcome string ('closed', 'reset', ...) once both directions of this end are done."
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


class IDrainView(Interface):
    """The node as the drain layer sees it: its local workloads and their drainable connections.

    Drain strategies (through :class:`ztwisted.drain.facade.DrainFacade`),
    the drain controller and the drain admin endpoints use only this view;
    nothing else enumerates connections. A connection is ended with
    ``connection.drain(graceful, deadline)`` (see
    :class:`ztwisted.h2.connection.HBONEConnection`).
    """

    clock = Attribute("The reactor, as IReactorTime.")
    random = Attribute("The node's random number generator (seeded with --random-seed).")
    connect_backoff = Attribute(
        "The pool's connect backoff: an object with delay(consecutive_failures) -> seconds, or None."
    )

    def local_workloads():
        """The local workloads still served."""

    def local_workload(uid_or_name):
        """A local workload by uid, ``name`` or ``namespace/name``; None if there is none."""

    def inbound_connections(workload=None):
        """Inbound HBONE connections of one local workload, or of all."""

    def pool_connections(workload=None):
        """Pooled outbound connections to any address of ``workload``, or all."""

    def pool_connections_from(workload):
        """Pooled outbound connections that ``workload`` (a local pod) opened."""

    def app_connections(workload=None):
        """Plain TCP connection sets: one local workload's plaintext inbound, or all of them and
        the outbound apps (15001/15080). Each has ``abort_all()``, ``ended()`` (Deferreds) and
        is false when empty."""

    def retire(connection):
        """Hand out no new tunnels on the pooled ``connection``; close it after the last."""

    def stop_listening(workload=None):
        """Close the listeners of one local workload, or of all; established connections stay."""

    def withdraw(workload):
        """Stop counting ``workload`` as local (a pod being removed), before its drain."""

    def close_workload(workload, forget):
        """After its drain: close ``workload``'s listeners and, if ``forget``, its pod network."""


class IDrainEvents(Interface):
    """Where drain events are raised: the node agent, configuration reloads, the admin API, signals.

    Provided by :class:`ztwisted.drain.controller.DrainController`; each
    method returns a Deferred that fires once the event and its clean-up
    are complete.
    """

    stopping = Attribute("True once the proxy is stopping (draining): nothing new is opened from then on.")

    def pod_terminating(workload):
        """A local pod started terminating; it keeps serving."""

    def pod_removed(workload, forget=True):
        """A local pod is going away (``forget=False``: it is restarted with a changed configuration)."""

    def destination_removed(workload):
        """A remote workload disappeared from discovery."""

    def begin_proxy_drain():
        """The proxy is stopping: stop accepting, let the strategies act, drain up to the deadline."""

    def stop_now():
        """A second signal: end every connection at once."""
