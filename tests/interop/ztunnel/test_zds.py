"""ZDS, the node agent's protocol, between ztwisted and real ztunnel, both ways.

1. ztwisted's ``ztunnel-agent`` drives ztunnel in in-pod mode (``PROXY_MODE=shared``,
   ``INPOD_UDS``): the snapshot, Add, Del and their Acks; ztunnel opens its listeners
   inside each pod's namespace, and an app in a pod that ztwisted serves reaches an app
   in a pod that ztunnel serves, through HBONE. Then what ztunnel does with ztwisted's
   ShutdownStarting extension.
2. ztunnel's own node agent, ``examples/inpodserver``, drives ``twistd ztunnel --inpod``:
   its Add (for a uid the configuration does not have) is accepted and the pod captured,
   also after inpodserver exits (it does once its Add is acknowledged).

Pods are namespaces on a bridge (``tests/integration/inpod_support``); ztunnel runs in a
namespace of its own (its admin ports), and enters the pods' namespaces from there, as
in a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.inpod_support import (
    APP_PORT,
    PACKET_MARK,
    AgentProcess,
    InpodNode,
    PodNetworkLab,
    acks_ok,
    cannot_build_pods,
    control_ip,
    roundtrip,
    start_echo,
)
from tests.support import wait_until
from ztwisted.tools.harness import NodeProcess, terminate
from ztwisted.tools.lab.ztunnel_peer import ZtunnelPeer

pytestmark = [pytest.mark.interop, pytest.mark.root]

NET = int(os.environ.get("ZTWISTED_TEST_NET", "0"))
PREFIX = f"ztw{NET}zds-"
WAIT = 15.0
POD_A_IP, POD_B_IP, POD_C_IP = "10.251.0.2", "10.251.0.3", "10.251.0.4"
PODS = [
    ("a", POD_A_IP, "uid-pod-a", "pod-a"),
    ("b", POD_B_IP, "uid-pod-b", "pod-b"),
    ("c", POD_C_IP, "uid-pod-c", "pod-c"),
]
POD_PORTS = {15001, 15006, 15008}
ZTWISTED_NODE, ZTUNNEL_NODE = "node-1", "zt-node"


def workload_entry(pod, node: str) -> str:
    # trustDomain and services spelled out: ztunnel's local config needs them (docs/configuration.rst).
    return (
        f"- {{uid: {pod.uid}, name: {pod.name}, namespace: {pod.namespace}, serviceAccount: {pod.service_account},"
        f' trustDomain: cluster.local, workloadIps: ["{pod.ip}"], protocol: HBONE, node: {node},'
        f" services: {{}}}}\n"
    )


def listening_ports(pod) -> set[int]:
    return {port for _address, port in pod.listening_ports()}


@pytest.fixture
def lab():
    reason = cannot_build_pods()
    if reason:
        pytest.fail(f"ZDS interop with ztunnel needs pods: {reason}", pytrace=False)
    subprocess.run(
        ["sh", "-c", f"for n in $(ip netns list | grep -o '^{PREFIX}[^ ]*'); do ip netns del $n; done"],
        capture_output=True,
    )
    network = PodNetworkLab(PREFIX)
    try:
        network.build(PODS)
        zt = f"{PREFIX}zt"  # ztunnel's own namespace: its admin, metrics and readiness ports
        network.ip("netns", "add", zt)
        network.created.append(zt)
        network.ip("-n", zt, "link", "set", "lo", "up")
        network.ztunnel_netns = zt
        yield network
    finally:
        network.destroy()


@pytest.fixture
def cleanup():
    """Things with a ``stop()`` (or ``kill()``) to end after the test, last started first."""
    started = []
    yield started
    for thing in reversed(started):
        try:
            thing.stop()
        except Exception:  # noqa: BLE001 - the next ones must still stop
            if hasattr(thing, "kill"):
                thing.kill()


def start_ztunnel_inpod(lab, tmp_path, install, mesh: Path, socket_path: Path, cleanup) -> ZtunnelPeer:
    ztunnel = ZtunnelPeer(
        "ztunnel",
        netns=lab.ztunnel_netns,
        config=mesh,
        workdir=tmp_path / "ztunnel",
        workload=None,
        install=install,
        # As root, ztunnel would connect to the app from the client's address (IP_TRANSPARENT); the pods
        # here have no routing rules that bring the app's answers back to it.
        env={
            "PROXY_MODE": "shared",
            "INPOD_UDS": str(socket_path),
            "ENABLE_ORIG_SRC": "false",
            "NODE_NAME": ZTUNNEL_NODE,
        },
    )
    cleanup.append(ztunnel)
    return ztunnel.start(timeout=60)


def test_ztwisted_agent_drives_real_ztunnel_snapshot_add_del_and_shutdown_starting(
    lab, tmp_path, ztunnel_install, pki, cleanup
):
    pod_a, pod_b, pod_c = (lab.pods[p] for p in "abc")
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(
        "workloads:\n"
        + workload_entry(pod_a, ZTWISTED_NODE)
        + workload_entry(pod_b, ZTUNNEL_NODE)
        + workload_entry(pod_c, ZTUNNEL_NODE)
    )
    socket_path = tmp_path / "zt-agent.sock"
    agent = AgentProcess(tmp_path, "agent-zt", socket_path, control_ip(NET, 5), manual_snapshot=False).start()
    cleanup.append(agent)

    # The snapshot: pod B is known to the agent before ztunnel connects.
    code, reply = agent.add(pod_b)
    assert code == 0 and reply["acks"] == [], reply  # no proxy yet: kept for the snapshot
    ztunnel = start_ztunnel_inpod(lab, tmp_path, ztunnel_install, mesh, socket_path, cleanup)  # ready: snapshot done
    (proxy,) = agent.status()["proxies"]
    assert proxy["hello_version"] == 1 and not proxy["busy"], proxy
    wait_until(lambda: listening_ports(pod_b) >= POD_PORTS, timeout=WAIT, what="ztunnel's listeners in pod B")

    # Add after the snapshot, acknowledged with success; ztunnel listens in pod C.
    code, reply = agent.add(pod_c)
    assert code == 0 and acks_ok(reply), reply
    wait_until(lambda: listening_ports(pod_c) >= POD_PORTS, timeout=WAIT, what="ztunnel's listeners in pod C")

    # Traffic: an app in pod A (served by ztwisted in in-pod mode) reaches pod B's app through ztunnel.
    echo_b = start_echo(pod_b, APP_PORT)
    cleanup.append(echo_b)
    pod_a.redirect_outbound(PACKET_MARK)
    node1 = InpodNode(tmp_path, 1, NET, config=mesh, state_dir=tmp_path / "state", extra_args=("--ca-dir", str(pki)))
    cleanup.append(node1)
    node1.start()
    wait_until(lambda: node1.agent.proxies_said_hello(1), timeout=WAIT, what="ztwisted to say hello to its agent")
    code, reply = node1.agent.add(pod_a)
    assert code == 0 and acks_ok(reply), reply
    code, reply = node1.agent.call("snapshot-end")
    assert code == 200 and acks_ok(reply), reply
    report = roundtrip(pod_a, POD_B_IP, APP_PORT, 200_000)
    assert report["exact"], report
    assert ztunnel.metric("istio_tcp_connections_opened_total", reporter="destination") == 1

    # Del: acknowledged with success once ztunnel stopped pod C's proxy; its listeners are gone.
    code, reply = agent.cli("delete", "--uid", pod_c.uid)
    assert code == 0 and acks_ok(reply), reply
    wait_until(lambda: not listening_ports(pod_c) & POD_PORTS, timeout=WAIT, what="pod C's listeners to close")

    # ztwisted's extension: ztunnel does not know WorkloadRequest field 1191. It reads a request without
    # a payload, answers with an error Ack, drops the connection and connects again; the agent sends
    # it the snapshot again and pod B is still served.
    code, reply = agent.cli("shutdown-starting", "--uid", pod_b.uid)
    (ack,) = reply["acks"]
    assert code == 1 and not ack["ok"], reply
    assert "failure to read message" in ack["error"] and "no payload" in ack["error"], ack
    wait_until(lambda: ztunnel.log_lines("failed to read message"), timeout=WAIT, what="ztunnel's log of it")
    wait_until(
        lambda: agent.status()["proxies"] and agent.status()["proxies"][-1]["hello_version"] == 1 and ztunnel.ready(),
        timeout=WAIT,
        what="ztunnel to reconnect to the agent",
    )
    assert ztunnel.running
    report = roundtrip(pod_a, POD_B_IP, APP_PORT, 50_000)
    assert report["exact"], report
    print(
        json.dumps(
            {
                "shutdown_starting_reply": reply,
                "ztunnel_log": ztunnel.log_lines("failed to read message") + ztunnel.log_lines("process stream ended"),
            },
            indent=1,
        )
    )


def test_ztunnels_inpodserver_drives_ztwisted_in_pod_mode(lab, tmp_path, ztunnel_install, cleanup):
    """``examples/inpodserver``: hello, an empty snapshot, then one Add (uid ``uid-0``, the pod's
    name, namespace and service account from ``PROXY_WORKLOAD_INFO``) with the netns of the
    namespace named on its command line. ztwisted matches the pod to its configuration by name,
    namespace and service account (the uid differs, as ztunnel's do), and captures its traffic."""
    pod_b = lab.pods["b"]
    outside = lab.pods["c"]  # a client on the bridge, outside the mesh
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("workloads:\n" + workload_entry(pod_b, ZTWISTED_NODE))
    socket_path = tmp_path / "inpodserver.sock"
    server = subprocess.Popen(
        [str(ztunnel_install.inpodserver), pod_b.netns],
        env={**os.environ, "INPOD_UDS": str(socket_path), "PROXY_WORKLOAD_INFO": f"default/{pod_b.name}/{pod_b.name}"},
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "inpodserver.log", "wb"),
    )
    cleanup.append(_Process(server))
    wait_until(socket_path.exists, timeout=WAIT, what="inpodserver to listen")
    node = NodeProcess(
        tmp_path / "ztwisted",
        name="ztwisted",
        control_ip=control_ip(NET, 1),
        config=mesh,
        node=ZTWISTED_NODE,
        state_dir=tmp_path / "state",
        extra_args=("--inpod-uds", str(socket_path)),
    )
    cleanup.append(node)
    node.start()

    # inpodserver exits once its Add is acknowledged (with success: it fails otherwise).
    assert server.wait(WAIT) == 0, (tmp_path / "inpodserver.log").read_text()
    assert [
        e for e in node.log_events() if e.get("message", "").startswith("proxy for pod uid-0 (default/pod-b) started")
    ]
    wait_until(lambda: listening_ports(pod_b) >= POD_PORTS, timeout=WAIT, what="ztwisted's listeners in pod B")
    # The agent is gone: ztwisted reports not ready and reconnects, and keeps serving the pod meanwhile.
    assert node.http("readiness", "/healthz/ready")[0] == 500
    (served,) = [w for w in node.config_dump()["workloads"] if w["uid"] == "uid-0"]
    assert served["workloadIps"] == [POD_B_IP] and served["identity"] == "spiffe://cluster.local/ns/default/sa/pod-b"
    assert node.config_dump()["inpod"]["running"] == ["uid-0"]

    echo_b = start_echo(pod_b, APP_PORT)
    cleanup.append(echo_b)
    pod_b.redirect_inbound()
    report = roundtrip(outside, POD_B_IP, APP_PORT, 100_000)
    assert report["exact"], report
    (inbound,) = wait_until(
        lambda: [e for e in node.log_events() if e.get("scope") == "access" and e.get("direction") == "inbound"],
        timeout=WAIT,
        what="ztwisted's access log of the captured connection",
    )
    assert inbound["dst.workload"] == "pod-b" and inbound["src.addr"].startswith(f"{POD_C_IP}:"), inbound


class _Process:
    def __init__(self, process: subprocess.Popen):
        self.process = process

    def stop(self) -> None:
        terminate(self.process, timeout=5)
