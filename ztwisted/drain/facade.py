"""What drain strategies may see and do: the node's view, plus the drain deadlines."""

from __future__ import annotations

import attrs
from twisted.internet import defer

from ztwisted.interfaces import IDrainView


@attrs.define
class DrainDeadline:
    """The drain bounds: ``--pod-drain-timeout``, and the proxy-stopping deadline once it is set."""

    clock: object
    drain_timeout: float
    pod_drain_timeout: float
    _deadline: float | None = None

    def start(self) -> None:
        """The proxy started stopping: the deadline is ``drain_timeout`` from now."""
        self._deadline = self.clock.seconds() + self.drain_timeout

    def reached_now(self) -> None:
        self._deadline = self.clock.seconds()

    def time_left(self) -> float:
        """Seconds until the proxy-stopping deadline (the full timeout before it started)."""
        if self._deadline is None:
            return self.drain_timeout
        return max(0.0, self._deadline - self.clock.seconds())


@attrs.define
class DrainFacade:
    """The node as drain strategies see it (``node`` in each :class:`~ztwisted.interfaces.IDrainStrategy` method).

    Strategies act on connections through ``connection.drain(graceful,
    deadline)`` (see :class:`ztwisted.h2.connection.HBONEConnection`), which
    returns a Deferred that fires when the connection is gone.
    """

    _view: IDrainView
    _deadline: DrainDeadline

    @property
    def clock(self):
        return self._view.clock

    @property
    def random(self):
        """The node's random number generator (seeded with ``--random-seed``)."""
        return self._view.random

    @property
    def pod_drain_timeout(self) -> float:
        """Seconds a pod-removal drain may take (``--pod-drain-timeout``)."""
        return self._deadline.pod_drain_timeout

    @property
    def drain_timeout(self) -> float:
        """Seconds the proxy-stopping drain may take (``--drain-timeout``)."""
        return self._deadline.drain_timeout

    def drain_time_left(self) -> float:
        """Seconds until the proxy-stopping deadline (the full timeout before it started)."""
        return self._deadline.time_left()

    def stop_listening(self, workload) -> defer.Deferred:
        """Close the inbound listeners of a local workload; established connections stay."""
        return self._view.stop_listening(workload)

    def inbound_connections(self, workload=None) -> list:
        """Inbound HBONE connections of one local workload, or of all."""
        return self._view.inbound_connections(workload)

    def pool_connections(self, workload=None) -> list:
        """Pooled outbound connections to any address of ``workload``, or all."""
        return self._view.pool_connections(workload)

    def pool_connections_from(self, workload) -> list:
        """Pooled outbound connections that ``workload`` (a local pod) opened."""
        return self._view.pool_connections_from(workload)

    def retire(self, connection) -> defer.Deferred:
        """No new tunnels on the pooled ``connection``; it closes after the last one."""
        return self._view.retire(connection)

    @property
    def connect_backoff(self):
        """``delay(consecutive_failures) -> seconds`` before the pool connects again, or None."""
        return self._view.connect_backoff

    @connect_backoff.setter
    def connect_backoff(self, backoff) -> None:
        self._view.connect_backoff = backoff

    def local_workloads(self):
        return self._view.local_workloads()


def drain_all(connections, graceful: bool, deadline: float | None) -> defer.Deferred:
    """Drain every connection; fires when all are gone."""
    return defer.gatherResults([c.drain(graceful=graceful, deadline=deadline) for c in connections], consumeErrors=True)
