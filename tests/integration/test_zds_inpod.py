"""Agent and client end to end over a real socket path, with real pod namespaces (``ip netns add ztw51-...``).

The pod manager here opens a listener inside each pod's namespace (as the
per-pod proxies do) so the test sees the namespace fd really work.
"""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor, task

from tests.integration.conftest import NET
from ztwisted.inpod.client import ZdsClient
from ztwisted.inpod.wire import WorkloadInfo
from ztwisted.metrics import Metrics
from ztwisted.netns import connect_socket, connecting_socket_in, listening_socket_in
from ztwisted.tools.agent import ZdsAgent
from ztwisted.tools.zds_testing import NamedNetns, RecordingPodManager, can_manage_netns

pytestmark = [pytest.mark.integration, pytest.mark.root]

POD_IP = f"127.{NET}.42.1"  # on each pod namespace's own loopback
HBONE_PORT = 15008


class ListeningManager(RecordingPodManager):
    """Opens POD_IP:15008 inside each added pod's namespace; closes it on removal."""

    def __init__(self):
        super().__init__(on_add=self._listen, on_remove=self._unlisten)
        self.ports = {}

    @defer.inlineCallbacks
    def _listen(self, uid, info, netns):
        sock = yield listening_socket_in(netns, POD_IP, HBONE_PORT, reuse_port=True, mark=1337)
        try:
            self.ports[uid] = reactor.adoptStreamPort(sock.fileno(), sock.family, protocol.Factory.forProtocol(Hello))
        finally:
            sock.close()

    def _unlisten(self, uid):
        port = self.ports.pop(uid, None)
        return port.stopListening() if port is not None else None

    @defer.inlineCallbacks
    def shutdown(self):
        for uid in list(self.ports):
            yield self._unlisten(uid)
        self.close()


class Hello(protocol.Protocol):
    def connectionMade(self):
        self.transport.write(b"hello from the pod's proxy\n")
        self.transport.loseConnection()


class Read(protocol.Protocol):
    def __init__(self):
        self.data = b""
        self.done = defer.Deferred()

    def dataReceived(self, data):
        self.data += data

    def connectionLost(self, reason):
        self.done.callback(self.data)


@pytest.fixture
def pods():
    reason = can_manage_netns()
    if reason:
        pytest.skip(f"in-pod end-to-end tests skipped: {reason}")
    made = []
    try:
        for _ in range(3):
            try:
                named = NamedNetns()
            except Exception as exc:
                pytest.skip(f"in-pod end-to-end tests skipped: `ip netns add` failed: {exc}")
            made.append(named)
            named.exec("ip", "addr", "add", f"{POD_IP}/32", "dev", "lo")
        yield made
    finally:
        for named in made:
            named.delete()


@pytest.fixture
def lab(tmp_path):
    """An agent, and a factory for clients (each with its own ListeningManager); all stopped at the end."""
    agent = ZdsAgent(reactor, str(tmp_path / "ztunnel.sock"))
    agent.start()
    clients = []

    def client():
        manager = ListeningManager()
        zds = ZdsClient(reactor, agent.socket_path, manager, Metrics())
        zds.startService()
        clients.append(zds)
        return zds

    yield agent, client
    for zds in clients:
        if zds.running:
            zds.stopService()
        zds.manager.shutdown()  # closes its listeners even when a test failed half way
    agent.stop()


def info(name):
    return WorkloadInfo(name, "default", name)


@defer.inlineCallbacks
def eventually(check, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        yield task.deferLater(reactor, 0.02, lambda: None)
    raise AssertionError(f"condition not met within {timeout} s: {check}")


@defer.inlineCallbacks
def greeting_inside(netns_path):
    """Connect to POD_IP:15008 from inside the pod's namespace; return what the listener says."""
    from ztwisted.netns import Netns

    with Netns.open(netns_path) as netns:
        sock = yield connecting_socket_in(netns, POD_IP)
    client = yield connect_socket(reactor, sock, (POD_IP, HBONE_PORT), protocol.Factory.forProtocol(Read), timeout=5)
    data = yield client.done.addTimeout(5, reactor)
    return data


def listeners_in(named):
    return named.exec("ss", "-Hltn", check=False).stdout.count(f"{POD_IP}:{HBONE_PORT}")


@pytest_twisted.inlineCallbacks
def test_agent_and_client_end_to_end(pods, lab):
    agent, make_client = lab
    pod_a, pod_b, _ = pods
    assert (yield agent.add_pod("uid-a", info("a"), pod_a.path)) == []  # recorded for the snapshot
    zds = make_client()
    yield eventually(zds.ready)
    assert zds.manager.running_pods() == {"uid-a"}
    assert listeners_in(pod_a) == 1
    assert (yield greeting_inside(pod_a.path)) == b"hello from the pod's proxy\n"

    (ack,) = yield agent.add_pod("uid-b", info("b"), pod_b.path)
    assert ack.ok and ack.latency is not None
    assert listeners_in(pod_b) == 1
    call = zds.manager.calls[-1]
    assert (call.uid, call.workload_info, call.netns_inode) == ("uid-b", info("b"), agent.pods["uid-b"].netns.inode)

    (ack,) = yield agent.delete_pod("uid-a")
    assert ack.ok
    assert listeners_in(pod_a) == 0  # the Del was acked after the pod's proxy was gone
    assert zds.manager.running_pods() == {"uid-b"}
    assert zds.ready()
    yield zds.manager.shutdown()


@pytest_twisted.inlineCallbacks
def test_failed_start_is_reported_to_the_agent_and_retried(pods, lab):
    agent, make_client = lab
    pod_a = pods[0]
    zds = make_client()
    zds.retry_interval = 0.2
    yield eventually(zds.ready)
    zds.manager.fail_starts["uid-a"] = 1
    (ack,) = yield agent.add_pod("uid-a", info("a"), pod_a.path)
    assert ack.outcome == "error" and "address in use" in ack.error
    assert not zds.ready() and zds.pending() == {"uid-a"}
    yield eventually(zds.ready)
    assert listeners_in(pod_a) == 1
    yield zds.manager.shutdown()


@pytest_twisted.inlineCallbacks
def test_upgrade_second_client_gets_the_snapshot_adds_go_to_it_dels_to_both(pods, lab):
    agent, make_client = lab
    pod_a, pod_b, pod_c = pods
    old = make_client()
    yield eventually(old.ready)
    yield agent.add_pod("uid-a", info("a"), pod_a.path)
    yield agent.add_pod("uid-b", info("b"), pod_b.path)
    assert old.manager.running_pods() == {"uid-a", "uid-b"}

    new = make_client()  # the upgraded proxy connects beside the old one
    yield eventually(new.ready)
    assert new.manager.running_pods() == {"uid-a", "uid-b"}
    assert listeners_in(pod_a) == 2 and listeners_in(pod_b) == 2  # SO_REUSEPORT, side by side
    assert len(agent.proxies) == 2

    (ack,) = yield agent.add_pod("uid-c", info("c"), pod_c.path)
    assert ack.ok and ack.proxy == agent.proxies[-1].number
    assert "uid-c" in new.manager.running_pods()
    assert "uid-c" not in old.manager.running_pods()
    assert listeners_in(pod_c) == 1

    acks = yield agent.delete_pod("uid-a")
    assert sorted(a.proxy for a in acks) == sorted(p.number for p in agent.proxies)
    assert all(a.ok for a in acks)
    assert "uid-a" not in old.manager.running_pods() and "uid-a" not in new.manager.running_pods()
    assert listeners_in(pod_a) == 0

    # The old proxy leaves (SIGTERM); the new one keeps serving alone.
    old.stopService()
    yield old.manager.shutdown()
    yield eventually(lambda: len(agent.proxies) == 1)
    assert listeners_in(pod_b) == 1
    assert (yield greeting_inside(pod_b.path)) == b"hello from the pod's proxy\n"
    (ack,) = yield agent.shutdown_starting("uid-b")
    assert ack.ok and new.manager.methods()[-1] == ("pod_terminating", "uid-b")
    yield new.manager.shutdown()


@pytest_twisted.inlineCallbacks
def test_agent_restart_reconciles(pods, lab, tmp_path):
    agent, make_client = lab
    pod_a, pod_b, _ = pods
    zds = make_client()
    yield eventually(zds.ready)
    yield agent.add_pod("uid-a", info("a"), pod_a.path)
    yield agent.add_pod("uid-b", info("b"), pod_b.path)
    # The agent restarts and, meanwhile, pod a went away.
    agent.stop()
    yield eventually(lambda: not zds.connected)
    assert not zds.ready()
    replacement = ZdsAgent(reactor, agent.socket_path)
    try:
        yield replacement.add_pod("uid-b", info("b"), pod_b.path)
        replacement.start()
        yield eventually(zds.ready, timeout=10)
        assert zds.manager.running_pods() == {"uid-b"}
        assert listeners_in(pod_a) == 0 and listeners_in(pod_b) == 1
        # Same pod, same namespace in the snapshot: the running proxy was kept, not restarted.
        assert [m for m, uid in zds.manager.methods() if uid == "uid-b"] == ["add_pod"]
    finally:
        zds.stopService()
        replacement.stop()
        yield zds.manager.shutdown()
