"""``ztunnel-agent serve`` as a real process, driven by its CLI subcommands, with an in-process ZdsClient."""

from __future__ import annotations

import json
import os
import sys

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor, task
from twisted.internet.utils import getProcessOutputAndValue

from tests.integration.conftest import NET
from ztwisted.inpod.client import ZdsClient
from ztwisted.inpod.wire import WorkloadInfo
from ztwisted.tools.agent import _control_address
from ztwisted.tools.zds_testing import NamedNetns, RecordingPodManager, can_manage_netns

pytestmark = pytest.mark.integration

CONTROL_IP = f"127.{NET}.41.1"
AGENT = [sys.executable, "-m", "ztwisted.tools.agent"]


class AgentProcess(protocol.ProcessProtocol):
    def __init__(self):
        self.out = b""
        self.err = b""
        self.listening = defer.Deferred()
        self.ended = defer.Deferred()

    def outReceived(self, data):
        self.out += data
        if not self.listening.called and b"\n" in self.out:
            self.listening.callback(json.loads(self.out.split(b"\n", 1)[0]))

    def errReceived(self, data):
        self.err += data

    def processEnded(self, reason):
        if not self.listening.called:
            self.listening.errback(RuntimeError(f"ztunnel-agent exited early: {self.err.decode()[-2000:]}"))
        self.ended.callback(reason.value.exitCode)


@pytest.fixture
def agent_process(tmp_path):
    proto = AgentProcess()
    socket_path = str(tmp_path / "ztunnel.sock")
    transport = reactor.spawnProcess(
        proto,
        sys.executable,
        [*AGENT, "serve", "--socket", socket_path, "--control", f"tcp:0:interface={CONTROL_IP}", "--ack-timeout", "5"],
        env=dict(os.environ),
    )
    yield proto, socket_path
    if not proto.ended.called:
        transport.signalProcess("TERM")


@defer.inlineCallbacks
def cli(control, *args):
    out, err, code = yield getProcessOutputAndValue(
        sys.executable, [*AGENT[1:], *args, "--control", control], env=dict(os.environ)
    )
    return (json.loads(out) if out.strip() else None), err.decode(), code


@defer.inlineCallbacks
def eventually(check, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        yield task.deferLater(reactor, 0.02, lambda: None)
    raise AssertionError(f"condition not met within {timeout} s")


@pytest.fixture
def pod_netns_path():
    """A real named pod namespace when root, else this machine's own namespace file."""
    if can_manage_netns() is None:
        try:
            named = NamedNetns()
        except Exception:
            yield "/proc/1/ns/net"
            return
        yield named.path
        named.delete()
    else:
        yield "/proc/1/ns/net"


@pytest_twisted.inlineCallbacks
def test_cli_drives_a_served_agent_and_prints_acks(agent_process, pod_netns_path):
    proto, socket_path = agent_process
    ready = yield proto.listening.addTimeout(20, reactor)
    assert ready["socket"] == socket_path
    control = ready["control"]
    assert control.startswith("tcp:") and CONTROL_IP in control

    manager = RecordingPodManager()
    zds = ZdsClient(reactor, socket_path, manager)
    zds.startService()
    try:
        yield eventually(zds.ready)

        reply, _, code = yield cli(
            control,
            "add",
            "--uid",
            "uid-a",
            "--name",
            "a",
            "--namespace",
            "default",
            "--service-account",
            "sa-a",
            "--netns",
            pod_netns_path,
        )
        assert code == 0, reply
        (ack,) = reply["acks"]
        assert ack["ok"] and ack["request"] == "add" and ack["uid"] == "uid-a"
        assert isinstance(ack["latency_ms"], float)
        assert manager.calls[-1].workload_info == WorkloadInfo("a", "default", "sa-a")
        assert manager.calls[-1].netns_inode == os.stat(pod_netns_path).st_ino

        status, _, code = yield cli(control, "status")
        assert code == 0
        assert [p["uid"] for p in status["pods"]] == ["uid-a"]
        assert status["pods"][0]["netns"] == pod_netns_path
        (proxy,) = status["proxies"]
        assert proxy["snapshot_complete"] and proxy["hello_version"] == 1

        reply, _, code = yield cli(control, "shutdown-starting", "--uid", "uid-a")
        assert code == 0 and reply["acks"][0]["ok"]
        assert manager.methods()[-1] == ("pod_terminating", "uid-a")

        # Not valid after the snapshot: the CLI shows the error Ack and exits 1; the client reconnects.
        reply, _, code = yield cli(control, "snapshot-end")
        assert code == 1
        assert reply["acks"][0]["error"] == "a second SnapshotSent on the same connection"
        yield eventually(lambda: zds.sessions_started == 2 and zds.ready())
        assert manager.running_pods() == {"uid-a"}  # kept through the reconnect (it was in the snapshot)

        reply, _, code = yield cli(control, "delete", "--uid", "uid-a")
        assert code == 0 and reply["acks"][0]["ok"]
        assert manager.running_pods() == set()
    finally:
        zds.stopService()
        manager.close()


@pytest_twisted.inlineCallbacks
def test_cli_reports_bad_input_and_an_unreachable_agent(agent_process, tmp_path):
    proto, _ = agent_process
    ready = yield proto.listening.addTimeout(20, reactor)
    control = ready["control"]
    plain = tmp_path / "plain-file"
    plain.write_text("")
    reply, _, code = yield cli(
        control,
        "add",
        "--uid",
        "u",
        "--name",
        "n",
        "--namespace",
        "ns",
        "--service-account",
        "sa",
        "--netns",
        str(plain),
    )
    assert code == 2
    assert "is not a network namespace" in reply["error"]

    reply, _, code = yield cli(control, "delete", "--uid", "u")
    assert code == 0 and reply["acks"] == [] and reply["note"] == "no proxy connected"

    host, port = _control_address(control)[1:]
    _, err, code = yield cli(f"tcp:{port + 1 if port < 65535 else port - 1}:interface={host}", "status")
    assert code == 2 and "cannot reach the agent's control API" in err


def test_control_address_forms():
    assert _control_address("tcp:15099:interface=127.0.0.1") == ("tcp", "127.0.0.1", 15099)
    assert _control_address("tcp:port=80:interface=\\:\\:1") == ("tcp", "::1", 80)
    assert _control_address("http://[::1]:80") == ("tcp", "::1", 80)
    assert _control_address("tcp:80") == ("tcp", "127.0.0.1", 80)
    assert _control_address("unix:/run/agent.sock") == ("unix", "/run/agent.sock", 0)
    assert _control_address("http://127.0.0.2:8080/") == ("tcp", "127.0.0.2", 8080)
    with pytest.raises(ValueError, match="expected tcp:PORT"):
        _control_address("ssl:443")
