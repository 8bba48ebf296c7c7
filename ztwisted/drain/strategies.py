"""The built-in drain strategies: the seed discussion's options, and Envoy's gradual drain.

Their plugin objects are in ``plugins/ztwisted_strategies.py``. Each handler
gets the node's :class:`~ztwisted.drain.facade.DrainFacade`. What a strategy
leaves undone the drain controller does after the event: on *pod removed* it
aborts the pod's remaining connections and closes its listeners (ztunnel's
behaviour); on *proxy stopping* it drains everything gracefully up to the
deadline.
"""

from __future__ import annotations

import random

import attrs
from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.plugin import IPlugin
from zope.interface import implementer

from ztwisted.drain.facade import drain_all
from ztwisted.interfaces import IDrainStrategy

log = Logger()


@implementer(IPlugin, IDrainStrategy)
class DrainStrategy:
    """A strategy that does nothing on any event; subclasses override what they handle."""

    name = ""
    description = ""

    def attach(self, node) -> None:
        pass

    def pod_terminating(self, node, workload):
        return None

    def pod_removed(self, node, workload):
        return None

    def destination_removed(self, node, workload):
        return None

    def proxy_stopping(self, node):
        return None

    def __repr__(self) -> str:
        return f"<drain strategy {self.name}>"


class Immediate(DrainStrategy):
    name = "immediate"
    description = "when a pod is removed, close its listeners and reset its connections at once (ztunnel's behaviour)"

    def pod_removed(self, node, workload):
        node.stop_listening(workload)
        return drain_all(node.inbound_connections(workload), graceful=False, deadline=None)


class GoawayOnStart(DrainStrategy):
    name = "goaway-on-start"
    description = "when a pod starts terminating, tell its clients (HTTP/2 GOAWAY) to open new tunnels elsewhere; it keeps serving"

    def pod_terminating(self, node, workload):
        # The pod still accepts new connections; clients reconnect on demand.
        # The event completes once the GOAWAYs are sent, not when streams end.
        connections = node.inbound_connections(workload)
        for connection in connections:
            connection.drain(graceful=True, deadline=None)
        log.info(
            "GOAWAY sent on {count} connections of terminating pod {pod}", count=len(connections), pod=workload.name
        )


class LastMile(DrainStrategy):
    name = "last-mile"
    description = "when a pod is removed, accept nothing new and let its tunnels finish (up to --pod-drain-timeout) before the node agent goes on"

    def pod_removed(self, node, workload):
        node.stop_listening(workload)
        deadline = node.pod_drain_timeout
        return drain_all(
            node.inbound_connections(workload) + node.pool_connections_from(workload), graceful=True, deadline=deadline
        )


@attrs.define
class ExponentialBackoff:
    """Per-key connect backoff: ``base * 2^(n-1)`` after the n-th consecutive failure, capped, plus jitter."""

    base: float = 0.025
    cap: float = 1.0
    jitter: float = 0.5
    rng: random.Random = attrs.field(factory=random.Random, converter=lambda rng: rng or random.Random())

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        delay = min(self.cap, self.base * 2 ** (failures - 1))
        return delay * (1 + self.rng.uniform(0, self.jitter))


class ClientEvict(DrainStrategy):
    name = "client-evict"
    description = (
        "when a remote workload goes away, stop reusing pooled connections to it; retry failing peers with backoff"
    )

    def attach(self, node) -> None:
        node.connect_backoff = ExponentialBackoff(rng=node.random)

    def destination_removed(self, node, workload):
        connections = node.pool_connections(workload)
        for connection in connections:
            node.retire(connection)
        log.info(
            "retired {count} pooled connections to removed {workload}", count=len(connections), workload=workload.name
        )


@attrs.define(eq=False, repr=False)  # DrainStrategy's repr names the strategy
class Gradual(DrainStrategy):
    name = "gradual"
    description = "when the proxy stops, spread its GOAWAYs over the drain window so clients do not all reconnect at once (as Envoy)"

    #: GOAWAYs are spread over this share of the drain window; the rest is for streams to finish
    spread = 0.8

    #: the order in which connections get their GOAWAY
    rng: random.Random = attrs.field(factory=random.Random, converter=lambda rng: rng or random.Random())

    def proxy_stopping(self, node):
        connections = node.inbound_connections() + node.pool_connections()
        self.rng.shuffle(connections)
        window = node.drain_time_left() * self.spread
        sent = []
        for index, connection in enumerate(connections):
            at = window * index / max(1, len(connections))
            sent.append(deferLater(node.clock, at, self._goaway, node, connection))
        return defer.gatherResults(sent, consumeErrors=True)

    def _goaway(self, node, connection) -> None:
        connection.drain(graceful=True, deadline=node.drain_time_left())


BUILT_IN = (Immediate, GoawayOnStart, LastMile, ClientEvict, Gradual)
