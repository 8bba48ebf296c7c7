"""The node as the drain layer sees it: the one place that enumerates its connections."""

from __future__ import annotations

import attrs
from twisted.internet import defer
from zope.interface import implementer

from ztwisted.interfaces import IDrainView
from ztwisted.model import Workload
from ztwisted.node import Node


@implementer(IDrainView)
@attrs.define
class NodeView:
    """:class:`ztwisted.interfaces.IDrainView` over a :class:`~ztwisted.node.Node`."""

    _node: Node

    @property
    def _pool(self):
        return self._node.outbound.pool

    @property
    def clock(self):
        return self._node.context.reactor

    @property
    def random(self):
        return self._node.context.random

    @property
    def connect_backoff(self):
        return self._pool.connect_backoff

    @connect_backoff.setter
    def connect_backoff(self, backoff) -> None:
        self._pool.connect_backoff = backoff

    def local_workloads(self) -> tuple[Workload, ...]:
        return self._node.workloads.all()

    def local_workload(self, uid_or_name: str) -> Workload | None:
        return self._node.workloads.find(uid_or_name)

    def inbound_connections(self, workload: Workload | None = None) -> list:
        listeners = self._node.listeners
        if workload is None:
            return [c for each in listeners.values() for c in each.hbone.connections]
        return list(listeners[workload.uid].hbone.connections) if workload.uid in listeners else []

    def pool_connections(self, workload: Workload | None = None) -> list:
        if workload is None:
            return self._pool.connections()
        return [c for ip in workload.workload_ips for c in self._pool.connections(str(ip))]

    def pool_connections_from(self, workload: Workload) -> list:
        return [c for ip in workload.workload_ips for c in self._pool.connections(source_ip=str(ip))]

    def app_connections(self, workload: Workload | None = None) -> list:
        listeners = self._node.listeners
        if workload is None:
            return [self._node.outbound.app_connections, *(each.plaintext.connections for each in listeners.values())]
        return [listeners[workload.uid].plaintext.connections] if workload.uid in listeners else []

    def retire(self, connection) -> defer.Deferred:
        return self._pool.retire(connection)

    def stop_listening(self, workload: Workload | None = None) -> defer.Deferred:
        if workload is None:
            return defer.gatherResults([each.stop_listening() for each in self._node.listeners.values()])
        listeners = self._node.listeners.get(workload.uid)
        return listeners.stop_listening() if listeners is not None else defer.succeed(None)

    def withdraw(self, workload: Workload) -> None:
        self._node.workloads.withdraw(workload)

    def close_workload(self, workload: Workload, forget: bool) -> defer.Deferred:
        return self._node.close_workload(workload, forget)
