"""ZdsClient's state machine over real SEQPACKET socketpairs, on the real reactor, with a recording manager."""

from __future__ import annotations

import array
import errno
import os
import socket

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from ztwisted.inpod import wire
from ztwisted.inpod.client import ZdsClient
from ztwisted.inpod.wire import AddWorkload, DelWorkload, KeepWorkload, ShutdownStarting, SnapshotSent, WorkloadInfo
from ztwisted.metrics import Metrics
from ztwisted.netns import Netns
from ztwisted.tools.zds_testing import DatagramPeer, RecordingPodManager, unshared_netns

INFO = WorkloadInfo("web-1", "shop", "web")
RETRY = 0.2


def add(uid, info=INFO):
    return wire.encode_request(AddWorkload(uid, info))


def netns_fds(inode):
    """How many fds of this process refer to the namespace ``inode``."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == f"net:[{inode}]":
                count += 1
        except OSError:
            pass
    return count


class Harness:
    """A ZdsClient whose every connection is one end of a socketpair; the other end is a DatagramPeer."""

    def __init__(self, manager=None, retry_interval=RETRY, backoff=(0.01, 0.05)):
        self.manager = manager or RecordingPodManager()
        self.metrics = Metrics()
        self.agents = defer.DeferredQueue()
        self.peers = []
        self.client = ZdsClient(
            reactor,
            "/nonexistent/zds.sock",
            self.manager,
            self.metrics,
            backoff,
            retry_interval=retry_interval,
            connector=self._connect,
        )

    def _connect(self, path):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        peer = DatagramPeer(reactor, theirs, name="agent")
        self.peers.append(peer)
        self.agents.put(peer)
        return ours

    @defer.inlineCallbacks
    def next_agent(self):
        """The agent end of the next connection, after checking the client's hello."""
        agent = yield self.agents.get().addTimeout(5, reactor)
        payload, fds, flags = yield agent.next()
        assert (payload, fds, flags) == (b"\x08\x01", [], 0)
        return agent

    @defer.inlineCallbacks
    def start(self):
        self.client.startService()
        agent = yield self.next_agent()
        return agent

    def stop(self):
        if self.client.running:
            self.client.stopService()
        for peer in self.peers:
            peer.close()
        self.manager.close()

    def metric(self, name, **labels):
        return self.metrics.sample(name, labels) or 0.0


@defer.inlineCallbacks
def request(agent, payload, fds=(), timeout=5.0):
    """Send one request; return the decoded Ack."""
    agent.send(payload, fds)
    reply, reply_fds, flags = yield agent.next(timeout)
    assert reply_fds == [] and flags == 0
    return wire.decode_response(reply)


@defer.inlineCallbacks
def no_datagram_within(agent, seconds):
    try:
        got = yield agent.next(seconds)
    except defer.TimeoutError:
        return
    raise AssertionError(f"unexpected datagram {got!r}")


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.stop()


@pytest.fixture
def own_netns():
    ns = Netns.current()
    yield ns
    ns.close()


@pytest.fixture
def other_netns():
    ns = unshared_netns()
    if ns is None:
        pytest.skip("cannot create a second network namespace here (needs root or user namespaces)")
    yield ns
    ns.close()


@defer.inlineCallbacks
def complete_snapshot(agent, own_netns, *uids):
    for uid in uids:
        assert (yield request(agent, add(uid), [own_netns.fileno()])).ok
    assert (yield request(agent, wire.encode_request(SnapshotSent()))).ok


# -- the happy path -----------------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_snapshot_adds_keeps_and_becomes_ready(harness, own_netns):
    agent = yield harness.start()
    assert not harness.client.ready()
    ack = yield request(agent, add("pod-a"), [own_netns.fileno()])
    assert ack.ok
    call = harness.manager.calls[0]
    assert (call.method, call.uid, call.workload_info, call.netns_inode) == ("add_pod", "pod-a", INFO, own_netns.inode)
    assert (yield request(agent, wire.encode_request(KeepWorkload("pod-b")))).ok
    assert not harness.client.ready()  # the snapshot is not complete yet
    assert (yield request(agent, wire.encode_request(SnapshotSent()))).ok
    assert harness.client.ready()
    assert harness.manager.running_pods() == {"pod-a"}
    assert harness.metric("workload_manager_proxies_started_total") == 1
    assert harness.metric("workload_manager_active_proxy_count") == 1
    assert harness.client.status()["running"] == ["pod-a"]


@pytest_twisted.inlineCallbacks
def test_the_manager_owns_the_netns_it_was_given(harness, own_netns):
    agent = yield harness.start()
    before = netns_fds(own_netns.inode)
    yield complete_snapshot(agent, own_netns, "pod-a")
    assert netns_fds(own_netns.inode) == before + 1  # held by the manager's Netns
    netns = harness.manager.pods["pod-a"][1]
    netns.check()
    assert (yield request(agent, wire.encode_request(DelWorkload("pod-a")))).ok
    assert netns.closed
    assert netns_fds(own_netns.inode) == before


@pytest_twisted.inlineCallbacks
def test_del_after_the_snapshot_is_acked_only_when_the_pod_is_drained(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    harness.manager.hold_removals = True
    agent.send(wire.encode_request(DelWorkload("pod-a")))
    yield no_datagram_within(agent, 0.2)
    assert harness.manager.running_pods() == set()
    harness.manager.held["pod-a"].callback(None)
    reply, _, _ = yield agent.next()
    assert wire.decode_response(reply).ok
    assert harness.metric("workload_manager_proxies_stopped_total") == 1


@pytest_twisted.inlineCallbacks
def test_a_failed_removal_is_an_error_ack_with_its_message(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    harness.manager.hold_removals = True
    agent.send(wire.encode_request(DelWorkload("pod-a")))
    yield no_datagram_within(agent, 0.05)
    harness.manager.held["pod-a"].errback(RuntimeError("drain deadline passed with 3 connections"))
    reply, _, _ = yield agent.next()
    assert wire.decode_response(reply).error == "drain deadline passed with 3 connections"
    assert harness.client.connected


@pytest_twisted.inlineCallbacks
def test_del_of_an_unknown_pod_is_acked(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns)
    assert (yield request(agent, wire.encode_request(DelWorkload("nobody")))).ok
    assert harness.manager.methods() == []


@pytest_twisted.inlineCallbacks
def test_del_before_the_snapshot_only_leaves_the_pod_out_of_it(harness, own_netns):
    agent = yield harness.start()
    assert (yield request(agent, add("pod-a"), [own_netns.fileno()])).ok
    assert (yield request(agent, add("pod-b"), [own_netns.fileno()])).ok
    assert (yield request(agent, wire.encode_request(DelWorkload("pod-a")))).ok
    assert ("remove_pod", "pod-a") not in harness.manager.methods()
    assert (yield request(agent, wire.encode_request(SnapshotSent()))).ok
    assert ("remove_pod", "pod-a") in harness.manager.methods()  # at reconcile
    assert harness.manager.running_pods() == {"pod-b"}


@pytest_twisted.inlineCallbacks
def test_shutdown_starting_reaches_the_manager_and_is_acked_after_it(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    harness.manager.hold_terminating = True
    agent.send(wire.encode_request(ShutdownStarting("pod-a")))
    yield no_datagram_within(agent, 0.1)
    assert harness.manager.methods()[-1] == ("pod_terminating", "pod-a")
    assert harness.manager.running_pods() == {"pod-a"}  # still serving
    harness.manager.held["pod-a"].callback(None)
    reply, _, _ = yield agent.next()
    assert wire.decode_response(reply).ok


@pytest_twisted.inlineCallbacks
def test_repeated_add_with_the_same_netns_changes_nothing(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    before = netns_fds(own_netns.inode)
    same = Netns.current()  # a different fd for the same namespace
    try:
        assert (yield request(agent, add("pod-a"), [same.fileno()])).ok
    finally:
        same.close()
    assert [m for m, _ in harness.manager.methods()] == ["add_pod"]
    assert netns_fds(own_netns.inode) == before  # the duplicate the client received was closed


@pytest_twisted.inlineCallbacks
def test_repeated_add_with_a_new_netns_replaces_the_proxy(harness, own_netns, other_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    assert (yield request(agent, add("pod-a"), [other_netns.fileno()])).ok
    assert harness.manager.methods() == [("add_pod", "pod-a"), ("remove_pod", "pod-a"), ("add_pod", "pod-a")]
    assert harness.manager.calls[-1].netns_inode == other_netns.inode
    assert harness.manager.running_pods() == {"pod-a"}


@pytest_twisted.inlineCallbacks
def test_a_replaced_proxy_starts_only_after_the_old_one_is_removed(harness, own_netns, other_netns):
    # The old proxy's removal closes whatever the node holds under the uid; started
    # earlier, the new proxy's listeners and network would be closed with it.
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    harness.manager.hold_removals = True
    agent.send(add("pod-a"), [other_netns.fileno()])
    yield no_datagram_within(agent, 0.2)
    assert harness.manager.methods() == [("add_pod", "pod-a"), ("remove_pod", "pod-a")]
    assert not harness.client.ready(), "the pod has no proxy while the old one goes"
    harness.manager.held["pod-a"].callback(None)
    reply, _, _ = yield agent.next()
    assert wire.decode_response(reply).ok
    assert harness.manager.methods()[-1] == ("add_pod", "pod-a")
    assert harness.manager.calls[-1].netns_inode == other_netns.inode
    assert harness.manager.running_pods() == {"pod-a"}


@pytest_twisted.inlineCallbacks
def test_requests_are_handled_one_at_a_time_in_order(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a", "pod-b")
    harness.manager.hold_removals = True
    agent.send(wire.encode_request(DelWorkload("pod-a")))
    agent.send(wire.encode_request(DelWorkload("pod-b")))
    yield no_datagram_within(agent, 0.1)
    assert harness.manager.methods()[-1] == ("remove_pod", "pod-a")  # pod-b waits its turn
    harness.manager.held["pod-a"].errback(RuntimeError("first"))
    reply, _, _ = yield agent.next()
    assert wire.decode_response(reply).error == "first"
    yield task.deferLater(reactor, 0.01, lambda: None)
    harness.manager.held["pod-b"].callback(None)
    reply, _, _ = yield agent.next()
    assert wire.decode_response(reply).ok


@pytest_twisted.inlineCallbacks
def test_a_burst_of_requests_is_answered_in_order_without_recursion(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    harness.manager.hold_removals = True
    agent.send(wire.encode_request(DelWorkload("pod-a")))  # held: everything below queues up
    count = 3000  # more than Python's recursion limit, were queued jobs chained recursively
    for i in range(count):
        agent.send(wire.encode_request(ShutdownStarting(f"pod-{i}")))
    yield no_datagram_within(agent, 0.3)
    harness.manager.held["pod-a"].callback(None)
    for _ in range(count + 1):
        reply, _, _ = yield agent.next()
        assert wire.decode_response(reply).ok
    assert [uid for _, uid in harness.manager.methods()][2:] == [f"pod-{i}" for i in range(count)]


# -- failed pod starts ----------------------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_failed_start_is_an_error_ack_then_retried_until_it_works(harness, own_netns):
    harness.manager.fail_starts["pod-a"] = 2
    agent = yield harness.start()
    ack = yield request(agent, add("pod-a"), [own_netns.fileno()])
    assert ack.error == "cannot start the proxy for pod-a: address in use"
    assert harness.client.connected
    assert (yield request(agent, wire.encode_request(SnapshotSent()))).ok
    assert harness.client.pending() == {"pod-a"}
    assert not harness.client.ready()  # a pod is pending
    assert harness.metric("workload_manager_pending_proxy_count") == 1
    assert harness.metric("ztwisted_zds_pod_start_failures_total") == 1
    for _ in range(100):
        yield task.deferLater(reactor, 0.05, lambda: None)
        if harness.manager.running_pods():
            break
    assert [m for m, _ in harness.manager.methods()] == ["add_pod"] * 3
    assert harness.manager.running_pods() == {"pod-a"}
    assert harness.client.pending() == set()
    assert harness.client.ready()
    assert harness.metric("workload_manager_pending_proxy_count") == 0
    yield no_datagram_within(agent, 0.05)  # retries are not acked again


@pytest_twisted.inlineCallbacks
def test_del_of_a_pending_pod_stops_its_retries(harness, own_netns):
    harness.manager.fail_starts["pod-a"] = 100
    agent = yield harness.start()
    before = netns_fds(own_netns.inode)
    assert not (yield request(agent, add("pod-a"), [own_netns.fileno()])).ok
    assert (yield request(agent, wire.encode_request(SnapshotSent()))).ok
    assert (yield request(agent, wire.encode_request(DelWorkload("pod-a")))).ok
    assert harness.client.pending() == set()
    assert harness.client.ready()
    assert netns_fds(own_netns.inode) == before  # the pending netns was closed
    calls = len(harness.manager.calls)
    yield task.deferLater(reactor, RETRY * 2.5, lambda: None)
    assert len(harness.manager.calls) == calls


# -- reconnecting and reconciling ----------------------------------------------------------------


@pytest_twisted.inlineCallbacks
def test_reconnect_reconciles_pods_missing_from_the_new_snapshot(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a", "pod-b")
    agent.close()  # the node agent restarts
    agent2 = yield harness.next_agent()
    assert not harness.client.ready()
    assert harness.manager.running_pods() == {"pod-a", "pod-b"}  # still serving meanwhile
    assert (yield request(agent2, add("pod-b"), [own_netns.fileno()])).ok
    assert (yield request(agent2, wire.encode_request(SnapshotSent()))).ok
    assert harness.manager.running_pods() == {"pod-b"}
    assert harness.manager.methods()[-1] == ("remove_pod", "pod-a")
    assert harness.client.ready()
    assert harness.client.sessions_started == 2


@pytest_twisted.inlineCallbacks
def test_keep_in_a_new_snapshot_keeps_a_running_pod(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    agent.close()
    agent2 = yield harness.next_agent()
    assert (yield request(agent2, wire.encode_request(KeepWorkload("pod-a")))).ok
    assert (yield request(agent2, wire.encode_request(SnapshotSent()))).ok
    assert harness.manager.running_pods() == {"pod-a"}
    assert ("remove_pod", "pod-a") not in harness.manager.methods()


def test_reconnect_backoff_doubles_from_10ms_to_15s():
    clock = task.Clock()
    attempts = []

    def refused(path):
        attempts.append(clock.seconds())
        raise ConnectionRefusedError(errno.ECONNREFUSED, f"cannot connect to {path}: Connection refused")

    client = ZdsClient(clock, "/run/zds.sock", RecordingPodManager(), connector=refused)
    client.startService()
    for _ in range(20):
        (call,) = clock.getDelayedCalls()
        clock.advance(call.getTime() - clock.seconds())
    client.stopService()
    gaps = [round(b - a, 6) for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[:12] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 15.0]
    assert set(gaps[12:]) == {15.0}
    count = len(attempts)
    clock.advance(60)
    assert len(attempts) == count  # stopped: no more attempts


@pytest_twisted.inlineCallbacks
def test_stop_closes_the_connection_and_does_not_reconnect(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    harness.client.stopService()
    yield agent.lost.addTimeout(5, reactor)
    yield task.deferLater(reactor, 0.1, lambda: None)
    assert len(harness.peers) == 1
    assert not harness.client.ready()
    assert harness.manager.running_pods() == {"pod-a"}  # stopping pods is the proxy-stopping event's job


# -- protocol violations: error Ack, reconnect, counted, other pods untouched ----------------


def _fds(count, netns):
    return [netns.fileno()] * count


VIOLATIONS = {
    "missing_fd": (lambda ns: (add("pod-x"), []), "without a network namespace fd"),
    "unexpected_fd": (
        lambda ns: (wire.encode_request(KeepWorkload("pod-x")), _fds(1, ns)),
        "keep request carries an fd",
    ),
    "too_many_fds": (lambda ns: (add("pod-x"), _fds(2, ns)), "expected at most 1 fd with a message, got 2"),
    "control_truncated": (lambda ns: (add("pod-x"), _fds(30, ns)), "truncated ancillary data"),
    "truncated": (lambda ns: (add("p" * 2000), _fds(1, ns)), "truncated message"),
    "unknown_message": (lambda ns: (bytes.fromhex("22 00"), []), "unknown field number 4"),
    "empty_message": (lambda ns: (b"", []), "no payload"),
    "decode_error": (lambda ns: (b"\xff\xff\xff", []), "cannot decode WorkloadRequest"),
    "missing_workload_info": (
        lambda ns: (bytes.fromhex("0a 07 0a 05") + b"pod-x", _fds(1, ns)),
        "without workload_info",
    ),
    "missing_uid": (lambda ns: (wire.encode_request(DelWorkload("")), []), "del request without a uid"),
}


@pytest.mark.parametrize("reason", sorted(VIOLATIONS))
@pytest_twisted.inlineCallbacks
def test_protocol_violation(harness, own_netns, reason):
    make, text = VIOLATIONS[reason]
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    fds_before = netns_fds(own_netns.inode)
    payload, fds = make(own_netns)
    ack = yield request(agent, payload, fds)
    assert text in ack.error
    yield agent.lost.addTimeout(5, reactor)  # the client hung up
    assert netns_fds(own_netns.inode) == fds_before  # every fd it received was closed
    assert harness.metric("ztwisted_zds_protocol_errors_total", reason=reason) == 1
    agent2 = yield harness.next_agent()  # ... and came back
    assert harness.manager.running_pods() == {"pod-a"}  # the other pod kept serving
    yield complete_snapshot(agent2, own_netns, "pod-a")
    assert harness.manager.running_pods() == {"pod-a"}
    assert harness.client.ready()


@pytest_twisted.inlineCallbacks
def test_fd_that_is_not_a_netns(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    mount_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    try:
        ack = yield request(agent, add("pod-x"), [mount_ns])
    finally:
        os.close(mount_ns)
    assert "is a mount namespace, not a network namespace" in ack.error
    yield agent.lost.addTimeout(5, reactor)
    assert harness.metric("ztwisted_zds_protocol_errors_total", reason="not_a_netns") == 1
    assert "pod-x" not in [uid for _, uid in harness.manager.methods()]
    yield harness.next_agent()


@pytest_twisted.inlineCallbacks
def test_keep_after_the_snapshot(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    ack = yield request(agent, wire.encode_request(KeepWorkload("pod-a")))
    assert ack.error == "keep for uid 'pod-a' after the snapshot was complete"
    yield agent.lost.addTimeout(5, reactor)
    assert harness.metric("ztwisted_zds_protocol_errors_total", reason="keep_after_snapshot") == 1
    yield harness.next_agent()
    assert harness.manager.running_pods() == {"pod-a"}


@pytest_twisted.inlineCallbacks
def test_second_snapshot_sent(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    ack = yield request(agent, wire.encode_request(SnapshotSent()))
    assert ack.error == "a second SnapshotSent on the same connection"
    yield agent.lost.addTimeout(5, reactor)
    assert harness.metric("ztwisted_zds_protocol_errors_total", reason="duplicate_snapshot") == 1
    yield harness.next_agent()


@pytest_twisted.inlineCallbacks
def test_requests_queued_behind_a_violation_are_dropped_not_acked(harness, own_netns):
    agent = yield harness.start()
    yield complete_snapshot(agent, own_netns, "pod-a")
    before = netns_fds(own_netns.inode)
    agent.send(b"\xff")
    agent.send(add("pod-z"), [own_netns.fileno()])
    reply, _, _ = yield agent.next()
    assert "cannot decode" in wire.decode_response(reply).error
    yield agent.lost.addTimeout(5, reactor)
    assert agent.received.pending == []  # exactly one Ack
    assert "pod-z" not in harness.manager.running_pods()
    yield task.deferLater(reactor, 0.05, lambda: None)
    assert netns_fds(own_netns.inode) == before  # pod-z's fd was closed, not leaked
    yield harness.next_agent()


@pytest_twisted.inlineCallbacks
def test_violation_before_the_snapshot_and_readiness(harness, own_netns):
    agent = yield harness.start()
    ack = yield request(agent, add("pod-a"), [])
    assert not ack.ok
    agent2 = yield harness.next_agent()
    assert not harness.client.ready()
    yield complete_snapshot(agent2, own_netns, "pod-a")
    assert harness.client.ready()


def test_constructor_rejects_a_bad_backoff():
    with pytest.raises(ValueError, match="backoff"):
        ZdsClient(reactor, "/x", RecordingPodManager(), backoff=(1.0, 0.5))


def test_sendable_fd_array_helper_is_consistent():
    # Guard for the tests above: the C int size the kernel uses for SCM_RIGHTS.
    assert array.array("i").itemsize == 4
