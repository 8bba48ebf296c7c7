"""``goaway-when-idle``: a third-party drain strategy for ztwisted.

When a pod starts terminating, each of its inbound HBONE connections gets a
graceful GOAWAY as soon as it carries no tunnel: idle ones at once, busy ones
when their last tunnel ends. Until then clients keep opening new tunnels on a
busy connection, so a terminating pod does not cost a TLS handshake per new
app connection (the worry with ``goaway-on-start``), and clients do not keep
idle pooled connections to a pod that is going away.
"""

from __future__ import annotations

from twisted.logger import Logger
from twisted.plugin import IPlugin
from zope.interface import implementer

from ztwisted.interfaces import IDrainStrategy

log = Logger()

GOAWAY_SENT, WAITING, NOTHING_TO_DO = "goaway-sent", "waiting", "nothing-to-do"


@implementer(IPlugin, IDrainStrategy)
class GoawayWhenIdle:
    name = "goaway-when-idle"
    description = (
        "when a pod starts terminating, graceful GOAWAY on each of its inbound connections once it carries no tunnel"
    )

    def __init__(self) -> None:
        self._watches: dict[str, IdleWatch] = {}  # by workload uid

    def attach(self, node) -> None:
        pass  # nothing to configure on the node

    def pod_terminating(self, node, workload):
        watch = self._watches.setdefault(workload.uid, IdleWatch(node.clock))
        idle, busy = watch.add(node.inbound_connections(workload))
        log.info(
            "pod {pod} terminating: GOAWAY on {idle} idle connections now, on {busy} more when their tunnels end",
            pod=workload.name,
            idle=idle,
            busy=busy,
        )
        # Returning None: the event is complete at once. The pod keeps serving,
        # and whoever raised the event (an admin request, the node agent) need
        # not wait for tunnels that may last for hours.

    def pod_removed(self, node, workload):
        # Too late to wait for idleness: the node (or a strategy composed with
        # this one, such as last-mile) ends what is left.
        watch = self._watches.pop(workload.uid, None)
        if watch is not None:
            watch.stop()

    def destination_removed(self, node, workload):
        return None

    def proxy_stopping(self, node):
        # The node drains every connection gracefully anyway.
        for watch in self._watches.values():
            watch.stop()
        self._watches.clear()


class IdleWatch:
    """The inbound connections of one terminating pod; each gets GOAWAY once it has no stream."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.active = True
        self._watched_streams: set = set()

    def add(self, connections) -> tuple[int, int]:
        """Watch ``connections``; returns how many got GOAWAY now and how many are busy."""
        outcomes = [self._check(connection) for connection in connections]
        return outcomes.count(GOAWAY_SENT), outcomes.count(WAITING)

    def stop(self) -> None:
        self.active = False
        self._watched_streams.clear()

    def _check(self, connection) -> str:
        """GOAWAY ``connection`` if it carries no tunnel; else look again when one of them ends."""
        if not self.active or not connection.usable:
            return NOTHING_TO_DO  # stopped watching, or the connection is already ending
        if not connection.streams:
            connection.drain(graceful=True, deadline=None)
            return GOAWAY_SENT
        for stream in list(connection.streams.values()):
            if stream not in self._watched_streams:
                self._watched_streams.add(stream)
                stream.finished.addBoth(self._stream_ended, connection, stream)
        return WAITING

    def _stream_ended(self, outcome, connection, stream):
        self._watched_streams.discard(stream)
        if self.active:
            # Act on the connection from a fresh call stack, not from inside its own frame handling.
            self.clock.callLater(0, self._check, connection)
        return outcome  # others wait on this Deferred too: pass its result on
