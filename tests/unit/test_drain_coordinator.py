"""The drain coordinator, each built-in strategy, and the pool's connect backoff, on fakes and a task.Clock.

Strategies act through a real :class:`DrainFacade` and :class:`NodeView` over a
small fake node whose outbound pool is a real :class:`ConnectionPool`; connections are fakes
that record ``drain(graceful, deadline)`` calls and end when the test says so.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import attr
import pytest
from twisted.internet import defer, task
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.testing import MemoryReactorClock

from ztwisted.ca import CertificateAuthority, CertificateStore
from ztwisted.context import ProxyContext
from ztwisted.drain.controller import POD_DRAIN_GRACE, DrainController
from ztwisted.drain.coordinator import DrainCoordinator
from ztwisted.drain.facade import DrainDeadline, DrainFacade
from ztwisted.drain.strategies import (
    ClientEvict,
    DrainStrategy,
    ExponentialBackoff,
    GoawayOnStart,
    Gradual,
    Immediate,
    LastMile,
)
from ztwisted.hbone.pool import ConnectionPool, PoolKey
from ztwisted.hbone.tracking import LiveConnections
from ztwisted.metrics import Metrics
from ztwisted.model import Mesh, Workload
from ztwisted.network import HostNetwork
from ztwisted.node import Node
from ztwisted.readiness import Readiness
from ztwisted.view import NodeView
from ztwisted.workloads import LocalWorkloads

POD = Workload(uid="c//v1/Pod/default/echo", name="echo", namespace="default", workload_ips=["10.0.1.1"], node="n")
OTHER_POD = Workload(
    uid="c//v1/Pod/default/other", name="other", namespace="default", workload_ips=["10.0.1.2"], node="n"
)
REMOTE = Workload(
    uid="c//v1/Pod/default/remote", name="remote", namespace="default", workload_ips=["10.0.2.1"], node="m"
)
OTHER_REMOTE = Workload(
    uid="c//v1/Pod/default/far", name="far", namespace="default", workload_ips=["10.0.2.2"], node="m"
)


@attr.s(frozen=True)
class DrainCall:
    at: float = attr.ib()
    graceful: bool = attr.ib()
    deadline: float | None = attr.ib()


class FakeConnection:
    """An HBONE connection as strategies and the pool see it; it ends when the test calls ``end``."""

    def __init__(self, clock, name: str = "connection"):
        self.clock = clock
        self.name = name
        self.drains: list[DrainCall] = []
        self.closed = defer.Deferred()
        self.ended_by: str | None = None
        self.streams: dict = {}
        self.stream_finished_hook = None

    @property
    def usable(self) -> bool:
        return self.ended_by is None and not self.drains

    @property
    def available_streams(self) -> int:
        return 100 if self.usable else 0

    def open_tunnel(self, authority, headers=()):
        return defer.succeed(SimpleNamespace(authority=authority))

    def drain(self, graceful: bool = True, deadline: float | None = None) -> defer.Deferred:
        self.drains.append(DrainCall(self.clock.seconds(), graceful, deadline))
        gone = defer.Deferred()
        self.closed.addBoth(lambda result: (gone.callback(self.ended_by), result)[1])
        return gone

    def end(self, ended_by: str = "drained") -> None:
        self.ended_by = ended_by
        self.closed.callback(ended_by)

    def __repr__(self) -> str:
        return f"<FakeConnection {self.name}>"


class FakeListeners:
    """A local workload's listeners (``WorkloadListeners``): its HBONE connections and a stop count."""

    def __init__(self, workload, connections=()):
        self.workload = workload
        self.hbone = SimpleNamespace(connections=set(connections))
        self.plaintext = SimpleNamespace(connections=LiveConnections())
        self.stopped = 0
        for connection in connections:
            # As InboundHBONE does: a connection leaves the set when it is gone.
            connection.closed.addBoth(lambda result, c=connection: (self.hbone.connections.discard(c), result)[1])

    def stop_listening(self) -> defer.Deferred:
        self.stopped += 1
        return defer.succeed(None)


class FakeNode:
    """The node attributes NodeView reads; the pool is a real ConnectionPool over fake connections."""

    def __init__(self, clock, *, pod_drain_timeout: float = 3.0, drain_timeout: float = 5.0):
        self.context = SimpleNamespace(reactor=clock, random=random.Random(108))
        self.random = self.context.random
        self.deadline = DrainDeadline(clock, drain_timeout, pod_drain_timeout)
        self.listeners: dict[str, FakeListeners] = {}
        self.workloads = SimpleNamespace(all=lambda: tuple(listeners.workload for listeners in self.listeners.values()))
        self.opened: list[FakeConnection] = []
        self.outbound = SimpleNamespace(pool=ConnectionPool(clock, self._connect), app_connections=LiveConnections())

    @property
    def reactor(self):
        return self.context.reactor

    def _connect(self, key: PoolKey) -> defer.Deferred:
        connection = FakeConnection(self.reactor, f"{key.source_ip}->{key.destination[0]}")
        self.opened.append(connection)
        return defer.succeed(connection)

    def serve(self, workload, count: int) -> list[FakeConnection]:
        connections = [FakeConnection(self.reactor, f"inbound {workload.name} {i}") for i in range(count)]
        self.listeners[workload.uid] = FakeListeners(workload, connections)
        return connections

    def pooled(self, source: Workload, destination: Workload) -> FakeConnection:
        """A pooled connection from a workload to another, through the real pool."""
        key = PoolKey(
            str(source.identity),
            {str(destination.identity)},
            (str(destination.workload_ips[0]), 15008),
            str(source.workload_ips[0]),
        )
        tunnel = self.outbound.pool.open_tunnel(key, f"{destination.workload_ips[0]}:8080")
        assert tunnel.called
        return self.opened[-1]

    def start_proxy_drain(self) -> None:
        self.deadline.start()


def facade_of(node: FakeNode) -> DrainFacade:
    return DrainFacade(NodeView(node), node.deadline)


@pytest.fixture
def clock():
    return task.Clock()


@pytest.fixture
def node(clock):
    return FakeNode(clock)


@pytest.fixture
def facade(node):
    return facade_of(node)


def no_drains(*connections) -> bool:
    return all(c.drains == [] for c in connections)


# -- immediate ----------------------------------------------------------------------


def test_immediate_aborts_the_pods_inbound_connections_and_stops_its_listeners(node, facade):
    a, b = node.serve(POD, 2)
    (other,) = node.serve(OTHER_POD, 1)
    outbound = node.pooled(POD, REMOTE)

    removed = Immediate().pod_removed(facade, POD)

    assert node.listeners[POD.uid].stopped == 1
    assert node.listeners[OTHER_POD.uid].stopped == 0
    assert a.drains == b.drains == [DrainCall(0, False, None)]
    assert no_drains(other, outbound)
    a.end("abrupt")
    assert not removed.called
    b.end("abrupt")
    assert removed.called


def test_immediate_ignores_every_other_event(node, facade):
    connections = node.serve(POD, 1) + [node.pooled(POD, REMOTE)]
    strategy = Immediate()
    node.start_proxy_drain()
    for handled in (
        strategy.pod_terminating(facade, POD),
        strategy.destination_removed(facade, REMOTE),
        strategy.proxy_stopping(facade),
    ):
        assert handled is None
    assert no_drains(*connections)
    assert node.listeners[POD.uid].stopped == 0


# -- goaway-on-start ----------------------------------------------------------------


def test_goaway_on_start_drains_gracefully_without_deadline_and_completes_at_once(node, facade):
    a, b = node.serve(POD, 2)
    (other,) = node.serve(OTHER_POD, 1)
    outbound = node.pooled(POD, REMOTE)

    terminating = defer.maybeDeferred(GoawayOnStart().pod_terminating, facade, POD)

    assert terminating.called  # although neither connection has ended
    assert a.drains == b.drains == [DrainCall(0, True, None)]
    assert no_drains(other, outbound)
    assert node.listeners[POD.uid].stopped == 0  # the pod keeps accepting


def test_goaway_on_start_leaves_pod_removal_to_the_node(node, facade):
    connections = node.serve(POD, 2)
    assert GoawayOnStart().pod_removed(facade, POD) is None
    assert no_drains(*connections)


# -- last-mile ----------------------------------------------------------------------


def test_last_mile_stops_listening_and_drains_inbound_and_the_pods_own_pool_with_the_pod_deadline(clock):
    node = FakeNode(clock, pod_drain_timeout=2.5)
    facade = facade_of(node)
    a, b = node.serve(POD, 2)
    (other_inbound,) = node.serve(OTHER_POD, 1)
    own = node.pooled(POD, REMOTE)
    own_second = node.pooled(POD, OTHER_REMOTE)
    not_own = node.pooled(OTHER_POD, REMOTE)

    removed = LastMile().pod_removed(facade, POD)

    assert node.listeners[POD.uid].stopped == 1
    assert node.listeners[OTHER_POD.uid].stopped == 0
    for connection in (a, b, own, own_second):
        assert connection.drains == [DrainCall(0, True, 2.5)], connection
    assert no_drains(other_inbound, not_own)
    for connection in (a, b, own):
        connection.end()
        assert not removed.called
    own_second.end("drain-deadline")
    assert removed.called


def test_last_mile_with_nothing_open_completes_at_once(node, facade):
    node.serve(POD, 0)
    assert LastMile().pod_removed(facade, POD).called


# -- client-evict -------------------------------------------------------------------


def test_client_evict_installs_the_exponential_backoff_on_attach(node, facade):
    assert node.outbound.pool.connect_backoff is None
    ClientEvict().attach(facade)
    backoff = node.outbound.pool.connect_backoff
    assert isinstance(backoff, ExponentialBackoff)
    assert (backoff.base, backoff.cap, backoff.jitter) == (0.025, 1.0, 0.5)
    assert backoff.rng is node.random, "the jitter follows the node's --random-seed"


def test_exponential_backoff_is_25ms_doubling_capped_at_1s_plus_up_to_half_jitter():
    backoff = ExponentialBackoff(rng=random.Random(81))
    reference = random.Random(81)
    assert backoff.delay(0) == 0.0
    for failures in range(1, 12):
        base = min(1.0, 0.025 * 2 ** (failures - 1))
        delay = backoff.delay(failures)
        assert delay == pytest.approx(base * (1 + reference.uniform(0, 0.5)))
        assert base <= delay <= 1.5 * base
    assert min(1.0, 0.025 * 2**5) == 0.8 and min(1.0, 0.025 * 2**6) == 1.0  # the cap bites from the 7th failure


def test_exponential_backoff_jitter_covers_zero_to_fifty_percent():
    backoff = ExponentialBackoff(rng=random.Random(1))
    factors = [backoff.delay(1) / 0.025 for _ in range(2000)]
    assert 1.0 <= min(factors) < 1.01
    assert 1.49 < max(factors) <= 1.5


def test_client_evict_retires_the_pool_connections_to_the_removed_destination(node, facade):
    inbound = node.serve(POD, 1)
    to_removed = [node.pooled(POD, REMOTE), node.pooled(OTHER_POD, REMOTE)]
    to_other = node.pooled(POD, OTHER_REMOTE)
    pool = node.outbound.pool

    removed = defer.maybeDeferred(ClientEvict().destination_removed, facade, REMOTE)

    assert removed.called
    for connection in to_removed:
        assert connection.drains == [DrainCall(0, True, None)]  # no new streams, close after the last
    assert no_drains(to_other, *inbound)
    for connection in to_removed:
        connection.end()
    assert pool.connections(destination_ip="10.0.2.1") == []
    assert pool.connections() == [to_other]


def test_a_retired_connection_is_not_handed_out_again(node, facade):
    retired = node.pooled(POD, REMOTE)
    ClientEvict().destination_removed(facade, REMOTE)
    fresh = node.pooled(POD, REMOTE)  # say discovery brings the workload back
    assert fresh is not retired
    assert len(node.opened) == 2


# -- gradual ------------------------------------------------------------------------


def test_gradual_spreads_graceful_drains_over_80_percent_of_the_time_left(clock):
    node = FakeNode(clock, drain_timeout=10.0)
    facade = facade_of(node)
    connections = node.serve(POD, 2) + node.serve(OTHER_POD, 1) + [node.pooled(POD, REMOTE)]
    clock.advance(100)
    node.start_proxy_drain()

    stopping = Gradual(rng=random.Random(81)).proxy_stopping(facade)

    assert no_drains(*connections)  # even the first goes out from the clock, not synchronously
    for second in (0, 2, 4):
        clock.advance(0 if second == 0 else 2)
        assert not stopping.called
    clock.advance(1)
    assert not stopping.called
    clock.advance(1)
    assert stopping.called  # once the last GOAWAY is sent; the node waits for the connections
    calls = sorted((call for c in connections for call in c.drains), key=lambda call: call.at)
    # 4 connections over 0.8 * 10 s: one every 2 s; each may run until the process deadline.
    assert calls == [DrainCall(100 + t, True, 10.0 - t) for t in (0, 2, 4, 6)]
    assert all(len(c.drains) == 1 for c in connections)


def test_gradual_uses_the_time_left_when_the_event_arrives(clock):
    node = FakeNode(clock, drain_timeout=10.0)
    facade = facade_of(node)
    connections = node.serve(POD, 2)
    node.start_proxy_drain()
    clock.advance(5)  # other strategies or the admin took half of the window already

    Gradual(rng=random.Random(3)).proxy_stopping(facade)
    clock.advance(0)
    clock.advance(2)

    assert sorted(call.at for c in connections for call in c.drains) == [5, 7]  # 0.8 * 5 s / 2
    assert sorted(call.deadline for c in connections for call in c.drains) == [3, 5]


def test_gradual_order_is_random(clock):
    def first_drained(seed):
        node = FakeNode(clock, drain_timeout=10.0)
        connections = sorted(node.serve(POD, 6), key=lambda c: c.name)
        Gradual(rng=random.Random(seed)).proxy_stopping(facade_of(node))
        clock.advance(0)
        return next(c.name for c in connections if c.drains)

    assert len({first_drained(seed) for seed in range(30)}) > 1


# -- the coordinator ----------------------------------------------------------------


class RecordingStrategy(DrainStrategy):
    """Records each call in a shared journal and returns a Deferred the test fires."""

    def __init__(self, name: str, journal: list):
        self.name = name
        self.description = f"records events as {name}"
        self.journal = journal
        self.pending: dict[str, defer.Deferred] = {}

    def _record(self, event, node, *args):
        self.journal.append((self.name, event, node, *args))
        self.pending[event] = defer.Deferred()
        return self.pending[event]

    def attach(self, node):
        self.journal.append((self.name, "attach", node))

    def pod_terminating(self, node, workload):
        return self._record("pod_terminating", node, workload)

    def pod_removed(self, node, workload):
        return self._record("pod_removed", node, workload)

    def destination_removed(self, node, workload):
        return self._record("destination_removed", node, workload)

    def proxy_stopping(self, node):
        return self._record("proxy_stopping", node)


class Raising(DrainStrategy):
    name = "raising"

    def pod_removed(self, node, workload):
        raise RuntimeError("boom in pod_removed")


class Failing(DrainStrategy):
    name = "failing"

    def pod_removed(self, node, workload):
        return defer.fail(ValueError("later boom"))


@pytest.fixture
def metrics():
    return Metrics()


@pytest.fixture
def journal():
    return []


def coordinator_for(strategies, metrics, clock, facade=None):
    return DrainCoordinator(strategies, facade if facade is not None else object(), metrics, clock)


def test_attach_reaches_each_strategy_in_order_with_the_facade(metrics, clock, journal):
    facade = object()
    coordinator = coordinator_for(
        [RecordingStrategy("a", journal), RecordingStrategy("b", journal)], metrics, clock, facade
    )
    coordinator.attach()
    assert journal == [("a", "attach", facade), ("b", "attach", facade)]
    assert coordinator.names == "a,b"


@pytest.mark.parametrize(
    "event, args",
    [("pod_terminating", (POD,)), ("pod_removed", (POD,)), ("destination_removed", (REMOTE,)), ("proxy_stopping", ())],
)
def test_each_event_goes_to_each_strategy_in_order_and_completes_when_all_have(metrics, clock, journal, event, args):
    facade = object()
    first, second = RecordingStrategy("a", journal), RecordingStrategy("b", journal)
    coordinator = coordinator_for([first, second], metrics, clock, facade)

    done = getattr(coordinator, event)(*args)

    assert journal == [("a", event, facade, *args), ("b", event, facade, *args)]
    second.pending[event].callback(None)
    assert not done.called
    first.pending[event].callback(None)
    assert done.called


def test_events_are_counted_per_strategy_and_event(metrics, clock, journal):
    strategies = [RecordingStrategy("a", journal), RecordingStrategy("b", journal)]
    coordinator = coordinator_for(strategies, metrics, clock)
    coordinator.pod_removed(POD)
    coordinator.pod_removed(OTHER_POD)
    coordinator.proxy_stopping()

    def count(strategy, event):
        return metrics.sample("ztwisted_drain_events_total", {"strategy": strategy, "event": event})

    assert count("a", "pod_removed") == count("b", "pod_removed") == 2
    assert count("a", "proxy_stopping") == count("b", "proxy_stopping") == 1
    assert count("a", "pod_terminating") is None


def test_event_durations_are_recorded_on_the_clock(metrics, clock, journal):
    strategy = RecordingStrategy("a", journal)
    coordinator = coordinator_for([strategy], metrics, clock)
    coordinator.pod_removed(POD)
    clock.advance(2.5)
    strategy.pending["pod_removed"].callback(None)

    def sample(suffix, **labels):
        return metrics.sample(f"ztwisted_drain_duration_seconds{suffix}", {"event": "pod_removed", **labels})

    assert sample("_count") == 1
    assert sample("_sum") == 2.5
    assert sample("_bucket", le="2.0") == 0
    assert sample("_bucket", le="3.0") == 1
    assert metrics.sample("ztwisted_drain_duration_seconds_count", {"event": "proxy_stopping"}) is None


def test_a_failing_strategy_is_logged_and_counted_without_blocking_the_others(metrics, clock, journal, logged):
    last = RecordingStrategy("last", journal)
    coordinator = coordinator_for([Raising(), Failing(), last], metrics, clock)

    done = coordinator.pod_removed(POD)

    assert [entry[:2] for entry in journal] == [("last", "pod_removed")]  # reached despite the failures before it
    assert not done.called
    last.pending["pod_removed"].callback(None)
    assert done.called
    results = []
    done.addBoth(results.append)
    assert results == [None]  # the event itself succeeds
    for name in ("raising", "failing"):
        assert metrics.sample("ztwisted_drain_event_failures_total", {"strategy": name, "event": "pod_removed"}) == 1
        assert metrics.sample("ztwisted_drain_events_total", {"strategy": name, "event": "pod_removed"}) == 1
    assert metrics.sample("ztwisted_drain_event_failures_total", {"strategy": "last", "event": "pod_removed"}) is None
    failures = {(event.get("strategy"), event["log_failure"].type) for event in logged if "log_failure" in event}
    assert failures == {("raising", RuntimeError), ("failing", ValueError)}
    assert metrics.sample("ztwisted_drain_duration_seconds_count", {"event": "pod_removed"}) == 1


def test_the_coordinator_drives_real_strategies_through_the_facade(node, facade, metrics, clock):
    inbound = node.serve(POD, 1)
    own_pool = node.pooled(POD, REMOTE)
    coordinator = DrainCoordinator([ClientEvict(), LastMile()], facade, metrics, clock)
    coordinator.attach()
    assert isinstance(node.outbound.pool.connect_backoff, ExponentialBackoff)

    removed = coordinator.pod_removed(POD)

    assert inbound[0].drains == own_pool.drains == [DrainCall(0, True, 3.0)]
    clock.advance(1.5)
    inbound[0].end()
    own_pool.end()
    assert removed.called
    assert metrics.sample("ztwisted_drain_duration_seconds_sum", {"event": "pod_removed"}) == 1.5
    for name in ("client-evict", "last-mile"):
        assert metrics.sample("ztwisted_drain_events_total", {"strategy": name, "event": "pod_removed"}) == 1


# -- the node around the strategies ------------------------------------------------------


class Hanging(DrainStrategy):
    """A strategy whose Deferreds never fire (a bug in a third-party strategy, say)."""

    name = "hanging"

    def pod_removed(self, node, workload):
        return defer.Deferred()

    def proxy_stopping(self, node):
        return defer.Deferred()


@pytest.fixture(scope="module")
def certificate_authority(tmp_path_factory):
    return CertificateAuthority.load_or_create_dev(tmp_path_factory.mktemp("ca"))


class RealNode:
    """A real Node, its view and its drain controller, on a memory reactor."""

    def __init__(self, certificate_authority, strategies, *, drain_timeout=5.0, pod_drain_timeout=3.0, pods=(POD,)):
        self.reactor = MemoryReactorClock()
        workloads = LocalWorkloads(Mesh(list(pods), [], []), "n", HostNetwork(self.reactor))
        self.certificates = CertificateStore(certificate_authority, self.reactor)
        self.node = Node(ProxyContext(self.reactor, Metrics(), self.certificates, workloads))
        deadline = DrainDeadline(self.reactor, drain_timeout, pod_drain_timeout)
        self.drain = DrainController(NodeView(self.node), strategies, Metrics(), deadline, Readiness())

    @property
    def listeners(self):
        return self.node.listeners


def real_node(certificate_authority, strategies, **options):
    node = RealNode(certificate_authority, strategies, **options)
    return node, node.reactor


def test_the_node_closes_what_a_strategy_leaves_after_pod_removed(certificate_authority):
    node, reactor = real_node(certificate_authority, [GoawayOnStart()])
    (connection,) = connections = [FakeConnection(reactor)]
    listeners = node.listeners[POD.uid] = FakeListeners(POD, connections)
    removed = node.drain.pod_removed(POD)
    assert listeners.stopped == 1
    assert connection.drains == [DrainCall(0, False, None)]
    connection.end("abrupt")
    assert removed.called
    assert POD.uid not in node.listeners


def test_a_connection_the_strategy_ended_is_not_drained_again_after_pod_removed(certificate_authority):
    node, reactor = real_node(certificate_authority, [Immediate()])
    (connection,) = connections = [FakeConnection(reactor)]
    node.listeners[POD.uid] = FakeListeners(POD, connections)
    removed = node.drain.pod_removed(POD)
    assert not removed.called  # immediate waits until its aborted connections are gone
    connection.end("abrupt")
    assert removed.called
    assert connection.drains == [DrainCall(0, False, None)]


def test_a_removed_pods_certificate_stops_renewing_and_leaves_the_store(certificate_authority):
    node, reactor = real_node(certificate_authority, [GoawayOnStart()])
    node.certificates.get(POD.identity)
    renewals = len(reactor.getDelayedCalls())
    node.drain.pod_removed(POD)
    assert [c.identity for c in node.certificates.all()] == []
    assert len(reactor.getDelayedCalls()) == renewals - 1


def test_a_certificate_another_local_workload_shares_stays(certificate_authority):
    node, reactor = real_node(certificate_authority, [GoawayOnStart()], pods=(POD, OTHER_POD))
    assert POD.identity == OTHER_POD.identity
    node.certificates.get(POD.identity)
    node.drain.pod_removed(POD)
    assert [c.identity for c in node.certificates.all()] == [POD.identity]
    node.drain.pod_removed(OTHER_POD)
    assert node.certificates.all() == []


def test_the_node_drains_everything_with_the_time_left_after_proxy_stopping(certificate_authority):
    node, reactor = real_node(certificate_authority, [Gradual(rng=random.Random(1))], drain_timeout=10.0)
    connections = [FakeConnection(reactor, str(i)) for i in range(2)]
    node.listeners[POD.uid] = FakeListeners(POD, connections)
    drained = node.drain.begin_proxy_drain()
    reactor.advance(0)
    reactor.advance(4)  # the second GOAWAY is sent at 0.8 * 10 s / 2
    for connection in connections:
        assert connection.drains[-1] == DrainCall(4, True, 6.0)  # the node's own pass after the strategy's
    for connection in connections:
        connection.end()
    assert drained.called


def test_proxy_drain_ends_at_the_drain_deadline_even_if_a_strategy_never_completes(certificate_authority):
    node, reactor = real_node(certificate_authority, [Hanging()], drain_timeout=5.0)
    drained = node.drain.begin_proxy_drain()
    reactor.advance(5.0)
    assert drained.called


def test_pod_removal_ends_at_the_pod_drain_timeout_even_if_a_strategy_never_completes(certificate_authority):
    node, reactor = real_node(certificate_authority, [Hanging()], pod_drain_timeout=3.0)
    (connection,) = connections = [FakeConnection(reactor)]
    node.listeners[POD.uid] = FakeListeners(POD, connections)
    removed = node.drain.pod_removed(POD)
    reactor.advance(3.0)
    assert connection.drains == []  # the strategy's own deadline comes first
    reactor.advance(POD_DRAIN_GRACE)
    assert connection.drains == [DrainCall(3.0 + POD_DRAIN_GRACE, False, None)]
    connection.end("abrupt")
    assert removed.called


def test_a_second_signal_ends_the_proxy_drain_at_once_even_during_gradual(certificate_authority):
    node, reactor = real_node(certificate_authority, [Gradual(rng=random.Random(1))], drain_timeout=10.0)
    connections = [FakeConnection(reactor, str(i)) for i in range(4)]
    node.listeners[POD.uid] = FakeListeners(POD, connections)
    drained = node.drain.begin_proxy_drain()
    reactor.advance(0)
    reactor.advance(1)
    node.drain.stop_now()
    assert all(c.drains[-1].graceful is False for c in connections)
    for connection in connections:
        connection.end("abrupt")
    assert drained.called


# -- the pool's connect backoff ----------------------------------------------------------


class ScriptedConnects:
    """The pool's connect function: records when each attempt starts; the test fires them."""

    def __init__(self, clock):
        self.clock = clock
        self.attempts: list[tuple[float, PoolKey, defer.Deferred]] = []

    def __call__(self, key):
        attempt = defer.Deferred()
        self.attempts.append((self.clock.seconds(), key, attempt))
        return attempt

    def fail_last(self):
        self.attempts[-1][2].errback(ConnectionRefusedError("refused"))

    def succeed_last(self):
        connection = FakeConnection(self.clock)
        self.attempts[-1][2].callback(connection)
        return connection


class RecordingBackoff:
    """delay(n) = n / 10 s, recording each n asked for."""

    def __init__(self):
        self.asked: list[int] = []

    def delay(self, failures):
        self.asked.append(failures)
        return failures / 10


KEY = PoolKey(
    "spiffe://cluster.local/ns/default/sa/client",
    {"spiffe://cluster.local/ns/default/sa/echo"},
    ("10.0.2.1", 15008),
    "10.0.1.1",
)
OTHER_KEY = attr.evolve(KEY, destination=("10.0.2.2", 15008))


def open_tunnel(pool, key=KEY) -> list:
    outcome: list = []
    pool.open_tunnel(key, "10.0.2.1:8080").addBoth(outcome.append)
    return outcome


def wait_before_next_attempt(clock, connects, pool, key=KEY) -> tuple[float, list]:
    """Ask for a tunnel; returns how long the pool waited before it started connecting, and the outcome."""
    started, attempts = clock.seconds(), len(connects.attempts)
    outcome = open_tunnel(pool, key)
    if len(connects.attempts) > attempts:
        return 0.0, outcome
    wait = min(call.getTime() for call in clock.getDelayedCalls()) - started
    clock.advance(wait * 0.99)
    assert len(connects.attempts) == attempts, "connected before the backoff delay"
    clock.advance(wait * 0.02)
    assert len(connects.attempts) == attempts + 1, "no connect attempt after the backoff delay"
    return wait, outcome


def test_without_backoff_the_pool_reconnects_at_once(clock):
    connects = ScriptedConnects(clock)
    pool = ConnectionPool(clock, connects)
    for _ in range(3):
        assert wait_before_next_attempt(clock, connects, pool)[0] == 0
        connects.fail_last()
    assert wait_before_next_attempt(clock, connects, pool)[0] == 0


def test_after_n_consecutive_failures_the_next_connect_waits_delay_n(clock):
    connects = ScriptedConnects(clock)
    backoff = RecordingBackoff()
    pool = ConnectionPool(clock, connects)
    pool.connect_backoff = backoff

    wait, first = wait_before_next_attempt(clock, connects, pool)
    assert wait == 0 and backoff.asked == []  # no failure yet: no wait, backoff not asked
    connects.fail_last()
    assert first[0].check(ConnectionRefusedError)
    for failures in (1, 2, 3):
        wait, outcome = wait_before_next_attempt(clock, connects, pool)
        assert wait == pytest.approx(failures / 10)
        connects.fail_last()
        assert outcome[0].check(ConnectionRefusedError)  # the app sees the failure after the wait
    assert backoff.asked == [1, 2, 3]


def test_a_success_resets_the_backoff(clock):
    connects = ScriptedConnects(clock)
    backoff = RecordingBackoff()
    pool = ConnectionPool(clock, connects)
    pool.connect_backoff = backoff
    open_tunnel(pool)
    connects.fail_last()
    wait, outcome = wait_before_next_attempt(clock, connects, pool)
    assert wait == pytest.approx(0.1)
    connection = connects.succeed_last()
    assert not isinstance(outcome[0], Exception) and outcome[0].authority == "10.0.2.1:8080"
    connection.end("peer")  # the connection goes away; the next tunnel needs a new one

    assert wait_before_next_attempt(clock, connects, pool)[0] == 0
    assert backoff.asked == [1]


def test_backoff_is_per_key(clock):
    connects = ScriptedConnects(clock)
    pool = ConnectionPool(clock, connects)
    pool.connect_backoff = RecordingBackoff()
    open_tunnel(pool, KEY)
    connects.fail_last()
    assert wait_before_next_attempt(clock, connects, pool, OTHER_KEY)[0] == 0
    assert connects.attempts[-1][1] == OTHER_KEY


def test_the_exponential_backoff_drives_the_pool(clock):
    connects = ScriptedConnects(clock)
    pool = ConnectionPool(clock, connects)
    pool.connect_backoff = ExponentialBackoff(rng=random.Random(81))
    reference = random.Random(81)
    open_tunnel(pool)
    connects.fail_last()
    for failures in range(1, 9):
        wait, _ = wait_before_next_attempt(clock, connects, pool)
        assert wait == pytest.approx(min(1.0, 0.025 * 2 ** (failures - 1)) * (1 + reference.uniform(0, 0.5)))
        connects.fail_last()


def test_every_built_in_strategy_reads_as_its_name():
    for strategy in (Immediate(), GoawayOnStart(), LastMile(), ClientEvict(), Gradual()):
        assert repr(strategy) == f"<drain strategy {strategy.name}>"
