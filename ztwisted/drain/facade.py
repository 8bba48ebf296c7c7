"""What drain strategies may see and do on a node: its listeners, connections, pool and clock."""

from __future__ import annotations

from twisted.internet import defer


class DrainFacade:
    """The node as drain strategies see it.

    Strategies act on connections through ``connection.drain(graceful,
    deadline)`` (see :class:`ztwisted.h2.connection.HBONEConnection`), which
    returns a Deferred that fires when the connection is gone.
    """

    def __init__(self, node):
        self._node = node

    @property
    def clock(self):
        return self._node.reactor

    @property
    def random(self):
        """The node's random number generator (seeded with ``--random-seed``)."""
        return self._node.random

    @property
    def pod_drain_timeout(self) -> float:
        """Seconds a pod-removal drain may take (``--pod-drain-timeout``)."""
        return self._node.pod_drain_timeout

    @property
    def drain_timeout(self) -> float:
        """Seconds the proxy-stopping drain may take (``--drain-timeout``)."""
        return self._node.drain_timeout

    def drain_time_left(self) -> float:
        """Seconds until the proxy-stopping deadline (the full timeout before it started)."""
        return self._node.drain_time_left()

    def stop_listening(self, workload) -> defer.Deferred:
        """Close the inbound listeners of a local workload; established connections stay."""
        listeners = self._node.listeners.get(workload.uid)
        if listeners is None:
            return defer.succeed(None)
        return listeners.stop_listening()

    def inbound_connections(self, workload=None) -> list:
        """Inbound HBONE connections of one local workload, or of all."""
        if workload is None:
            return [c for listeners in self._node.listeners.values() for c in listeners.hbone.connections]
        listeners = self._node.listeners.get(workload.uid)
        return list(listeners.hbone.connections) if listeners is not None else []

    def pool_connections(self, workload=None) -> list:
        """Pooled outbound connections to any address of ``workload``, or all."""
        pool = self._node.outbound.pool
        if workload is None:
            return pool.connections()
        return [c for ip in workload.workload_ips for c in pool.connections(str(ip))]

    def pool_connections_from(self, workload) -> list:
        """Pooled outbound connections that ``workload`` (a local pod) opened."""
        pool = self._node.outbound.pool
        return [c for ip in workload.workload_ips for c in pool.connections(source_ip=str(ip))]

    @property
    def pool(self):
        """The outbound pool (e.g. to set ``connect_backoff``)."""
        return self._node.outbound.pool

    def local_workloads(self):
        return self._node.local_workloads()


def drain_all(connections, graceful: bool, deadline: float | None) -> defer.Deferred:
    """Drain every connection; fires when all are gone."""
    return defer.gatherResults([c.drain(graceful=graceful, deadline=deadline) for c in connections], consumeErrors=True)
