"""ZdsAgent's rules, checked with hand-driven proxies over a real socket path."""

from __future__ import annotations

import os

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from ztwisted.inpod import wire
from ztwisted.inpod.seqpacket import connect_seqpacket
from ztwisted.inpod.wire import AddWorkload, DelWorkload, KeepWorkload, ShutdownStarting, SnapshotSent, WorkloadInfo
from ztwisted.tools.agent import ZdsAgent
from ztwisted.tools.zds_testing import DatagramPeer

INFO = WorkloadInfo("web-1", "shop", "web")
OWN_NETNS = "/proc/self/ns/net"


class FakeProxy:
    """A proxy under the test's control: sends the hello, returns requests, acks on demand."""

    def __init__(self, path, hello=True):
        self.peer = DatagramPeer(reactor, connect_seqpacket(path), name="proxy")
        if hello:
            self.peer.send(wire.encode_hello())

    @defer.inlineCallbacks
    def next_request(self, timeout=5.0):
        payload, fds, _ = yield self.peer.next(timeout)
        request = wire.decode_request(payload)
        inodes = [os.fstat(fd).st_ino for fd in fds]
        for fd in fds:
            os.close(fd)
        return request, inodes

    def ack(self, error=""):
        self.peer.send(wire.encode_ack(error))

    @defer.inlineCallbacks
    def answer(self, count, error=""):
        """Ack the next ``count`` requests; return them."""
        seen = []
        for _ in range(count):
            request, inodes = yield self.next_request()
            seen.append((request, inodes))
            self.ack(error)
        return seen

    @defer.inlineCallbacks
    def nothing_within(self, seconds):
        try:
            got = yield self.peer.next(seconds)
        except defer.TimeoutError:
            return
        raise AssertionError(f"unexpected datagram {got!r}")

    def close(self):
        self.peer.close()


@pytest.fixture
def make_agent(tmp_path):
    agents, proxies = [], []

    def make(**options):
        agent = ZdsAgent(reactor, str(tmp_path / "zds.sock"), **options)
        agent.start()
        agents.append(agent)
        return agent

    def proxy(agent, hello=True):
        p = FakeProxy(agent.socket_path, hello)
        proxies.append(p)
        return p

    make.proxy = proxy
    yield make
    for p in proxies:
        p.close()
    for agent in agents:
        agent.stop()


@defer.inlineCallbacks
def connected(agent, count):
    for _ in range(200):
        if len([p for p in agent.proxies if p.hello_version]) >= count:
            return
        yield deferLater(0.01)
    raise AssertionError(f"expected {count} proxies, have {agent.status()['proxies']}")


def deferLater(seconds):
    from twisted.internet import task

    return task.deferLater(reactor, seconds, lambda: None)


@pytest_twisted.inlineCallbacks
def test_snapshot_goes_to_a_newly_connected_proxy(make_agent):
    agent = make_agent()
    assert (yield agent.add_pod("pod-a", INFO, OWN_NETNS)) == []  # nobody connected yet
    assert (yield agent.keep_pod("pod-b")) == []
    proxy = make_agent.proxy(agent)
    seen = yield proxy.answer(3)
    own = os.stat(OWN_NETNS).st_ino
    assert seen == [(AddWorkload("pod-a", INFO), [own]), (KeepWorkload("pod-b"), []), (SnapshotSent(), [])]
    yield deferLater(0.05)
    (status,) = agent.status()["proxies"]
    assert status["snapshot_complete"] and status["hello_version"] == 1
    assert [pod["uid"] for pod in agent.status()["pods"]] == ["pod-a", "pod-b"]


@pytest_twisted.inlineCallbacks
def test_a_proxy_without_hello_is_dropped(make_agent):
    agent = make_agent(hello_timeout=0.2)
    proxy = make_agent.proxy(agent, hello=False)
    yield proxy.peer.lost.addTimeout(5, reactor)
    assert agent.proxies == []


@pytest_twisted.inlineCallbacks
def test_a_bad_hello_is_dropped(make_agent):
    agent = make_agent()
    proxy = make_agent.proxy(agent, hello=False)
    proxy.peer.send(b"\xff\xff")
    yield proxy.peer.lost.addTimeout(5, reactor)
    assert agent.proxies == []


@pytest_twisted.inlineCallbacks
def test_one_request_at_a_time_with_latency(make_agent):
    agent = make_agent()
    proxy = make_agent.proxy(agent)
    yield proxy.answer(1)  # the (empty) snapshot
    deleted = agent.delete_pod("pod-a")
    terminating = agent.shutdown_starting("pod-b")
    request, _ = yield proxy.next_request()
    assert request == DelWorkload("pod-a")
    yield proxy.nothing_within(0.2)  # the second waits for the first Ack
    proxy.ack()
    request, _ = yield proxy.next_request()
    assert request == ShutdownStarting("pod-b")
    proxy.ack("no such pod")
    (first,) = yield deleted
    (second,) = yield terminating
    assert first.ok and first.latency >= 0.2
    assert second.to_json()["error"] == "no such pod" and second.outcome == "error"


@pytest_twisted.inlineCallbacks
def test_ack_timeout_and_a_late_ack_is_not_taken_for_the_next(make_agent):
    agent = make_agent(ack_timeout=0.2)
    proxy = make_agent.proxy(agent)
    yield proxy.answer(1)
    (result,) = yield agent.delete_pod("slow")
    assert result.outcome == "timeout" and result.error == "no Ack within 0.2 s"
    yield proxy.next_request()  # the Del
    second = agent.delete_pod("next")
    proxy.ack()  # the late Ack for "slow"
    request, _ = yield proxy.next_request()
    assert request == DelWorkload("next")
    yield deferLater(0.05)
    assert not second.called
    proxy.ack("the real answer")
    (result,) = yield second
    assert result.error == "the real answer"
    (late,) = agent.status()["proxies"][0]["late_acks"]
    assert late["uid"] == "slow" and late["latency_ms"] >= 200


@pytest_twisted.inlineCallbacks
def test_snapshot_ack_timeout_drops_the_connection(make_agent):
    agent = make_agent(ack_timeout=0.2)
    yield agent.add_pod("pod-a", INFO, OWN_NETNS)
    proxy = make_agent.proxy(agent)
    yield proxy.next_request()  # never acked
    yield proxy.peer.lost.addTimeout(5, reactor)


@pytest_twisted.inlineCallbacks
def test_adds_go_to_the_newest_proxy_dels_to_all(make_agent):
    agent = make_agent()
    old = make_agent.proxy(agent)
    yield old.answer(1)
    yield connected(agent, 1)
    new = make_agent.proxy(agent)
    yield new.answer(1)
    yield connected(agent, 2)
    added = agent.add_pod("pod-a", INFO, OWN_NETNS)
    seen = yield new.answer(1)
    assert seen[0][0] == AddWorkload("pod-a", INFO)
    (result,) = yield added
    assert result.proxy == agent.proxies[-1].number
    yield old.nothing_within(0.1)
    deleted = agent.delete_pod("pod-a")
    assert (yield old.answer(1))[0][0] == DelWorkload("pod-a")
    assert (yield new.answer(1))[0][0] == DelWorkload("pod-a")
    results = yield deleted
    assert sorted(r.proxy for r in results) == sorted(p.number for p in agent.proxies)
    assert all(r.ok for r in results)


@pytest_twisted.inlineCallbacks
def test_manual_snapshot_waits_for_snapshot_end(make_agent):
    agent = make_agent(manual_snapshot=True)
    yield agent.add_pod("pod-a", INFO, OWN_NETNS)
    proxy = make_agent.proxy(agent)
    assert (yield proxy.answer(1))[0][0] == AddWorkload("pod-a", INFO)
    yield proxy.nothing_within(0.1)
    kept = agent.keep_pod("pod-b")
    assert (yield proxy.answer(1))[0][0] == KeepWorkload("pod-b")
    yield kept
    ended = agent.snapshot_end()
    assert (yield proxy.answer(1))[0][0] == SnapshotSent()
    (result,) = yield ended
    assert result.ok and agent.status()["proxies"][0]["snapshot_complete"]


@pytest_twisted.inlineCallbacks
def test_a_proxy_that_goes_away_mid_request(make_agent):
    agent = make_agent()
    proxy = make_agent.proxy(agent)
    yield proxy.answer(1)
    deleted = agent.delete_pod("pod-a")
    yield proxy.next_request()
    proxy.close()
    (result,) = yield deleted
    assert result.outcome == "disconnected"
    yield deferLater(0.05)
    assert agent.proxies == []


@pytest_twisted.inlineCallbacks
def test_an_unsolicited_ack_drops_the_proxy(make_agent):
    agent = make_agent()
    proxy = make_agent.proxy(agent)
    yield proxy.answer(1)
    proxy.ack()
    yield proxy.peer.lost.addTimeout(5, reactor)


def test_add_refuses_a_path_that_is_not_a_netns(make_agent, tmp_path):
    agent = make_agent()
    plain = tmp_path / "not-a-netns"
    plain.write_text("")
    with pytest.raises(ValueError, match="not a network namespace"):
        agent.add_pod("pod-a", INFO, str(plain))
    assert agent.pods == {}


@pytest_twisted.inlineCallbacks
def test_queued_add_keeps_its_netns_after_the_pod_is_deleted(make_agent):
    # The agent closes its fd on delete; the Add queued before must still carry one.
    agent = make_agent()
    proxy = make_agent.proxy(agent)
    yield proxy.answer(1)
    blocker = agent.shutdown_starting("x")
    added = agent.add_pod("pod-a", INFO, OWN_NETNS)
    deleted = agent.delete_pod("pod-a")
    seen = yield proxy.answer(3)
    assert [type(r) for r, _ in seen] == [ShutdownStarting, AddWorkload, DelWorkload]
    assert seen[1][1] == [os.stat(OWN_NETNS).st_ino]
    yield defer.gatherResults([blocker, added, deleted])
