"""Real ztunnel and ztwisted, both fed by the lab control plane (xDS and CA), compared and talking to each other.

Topology, all in namespaces this test creates on a private bridge (the host is untouched):

- ``cp``: ``ztunnel-control-plane`` on 10.251.0.2:15012 (xDS + CA over TLS), its API on :15014;
- ``zt``: real ztunnel in dedicated mode for the workload ``ztpod`` (10.251.0.10), with its SOCKS5 port,
  XDS_ADDRESS/CA_ADDRESS pointing at the control plane and no FAKE_CA; the app ``ztpod`` echoes on :8080;
- ``tw``: a ztwisted node (``--xds-address``, certificates from the same CA) serving ``echo`` (.20),
  ``sink`` (.21), ``client`` (.22) and ``intruder`` (.23), echo apps on .20 and .21.

Policies come over xDS too: ``sink`` denies ``ztpod`` (enforced by ztwisted), ``ztpod`` denies
``intruder`` (enforced by ztunnel).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.inpod_support import (
    App,
    PodNetworkLab,
    cannot_build_pods,
    remove_leftover_namespaces,
    start_echo,
)
from tests.integration.xds_support import deny_policy, http_json, in_netns, socks_echo
from tests.support import wait_until
from ztwisted.tools.control_plane import ControlPlaneProcess
from ztwisted.tools.harness import NodeProcess, terminate

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFIX = "ztw35x-"
CP_IP, ZTPOD_IP = "10.251.0.2", "10.251.0.10"
ECHO_IP, SINK_IP, CLIENT_IP, INTRUDER_IP = "10.251.0.20", "10.251.0.21", "10.251.0.22", "10.251.0.23"
XDS = f"https://{CP_IP}:15012"
#: the control plane requires it on xDS and CA calls; ztunnel sends AUTH_TOKEN as a bearer token
TOKEN = "lab-service-account-token"


def workload(name: str, ip: str, node: str, extra: str = "") -> str:
    return (
        f"- uid: Kubernetes//v1/Pod/default/{name}\n  name: {name}\n  namespace: default\n"
        f'  serviceAccount: {name}\n  workloadIps: ["{ip}"]\n  protocol: HBONE\n  node: {node}\n{extra}'
    )


MESH = (
    "workloads:\n"
    + workload("ztpod", ZTPOD_IP, "node-z", '  authorizationPolicies: ["default/ztpod-deny-intruder"]\n')
    + workload("echo", ECHO_IP, "node-t")
    + workload("sink", SINK_IP, "node-t", '  authorizationPolicies: ["default/sink-deny-ztpod"]\n')
    + workload("client", CLIENT_IP, "node-t")
    + workload("intruder", INTRUDER_IP, "node-t")
    + "policies:\n"
    + deny_policy("ztpod-deny-intruder", "intruder")
    + deny_policy("sink-deny-ztpod", "ztpod")
)


def ztunnel_binary() -> str:
    found = subprocess.run(
        [sys.executable, "tests/peers/ztunnel_build.py", "--where"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    if found.returncode != 0 or not found.stdout.strip():
        pytest.skip("ztunnel is not built: python3 tests/peers/ztunnel_build.py")
    return found.stdout.strip().splitlines()[-1]


class NodeInNetns(NodeProcess):
    """A ztwisted node inside a namespace; its listeners on that namespace's loopback."""

    def __init__(self, netns: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.netns = netns

    def command(self) -> list[str]:
        return in_netns(self.netns, super().command())

    def http(self, listener: str, path: str, method: str = "GET"):
        port = {"admin": 15000, "metrics": 15020, "readiness": 15021}[listener]
        status, body = http_json(self.netns, f"http://{self.control_ip}:{port}{path}", method)
        return status, body if isinstance(body, (str, bytes)) else body

    def config_dump(self) -> dict:
        return self.http("admin", "/config_dump")[1]


@pytest.fixture
def lab(tmp_path):
    reason = cannot_build_pods()
    if reason:
        pytest.skip(reason)
    binary = ztunnel_binary()
    remove_leftover_namespaces(PREFIX)
    network = PodNetworkLab(PREFIX).build(
        [
            ("cp", CP_IP, "", "control-plane"),
            ("zt", ZTPOD_IP, "Kubernetes//v1/Pod/default/ztpod", "ztpod"),
            ("tw", ECHO_IP, "Kubernetes//v1/Pod/default/echo", "echo"),
        ]
    )
    tw = network.pods["tw"]
    for ip in (SINK_IP, CLIENT_IP, INTRUDER_IP):
        tw.run("ip", "addr", "add", f"{ip}/24", "dev", "eth0")
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(MESH)
    started = []
    try:
        plane = ControlPlaneProcess(
            tmp_path,
            mesh,
            listen=f"{CP_IP}:15012",
            api=f"{CP_IP}:15014",
            netns=network.pods["cp"].netns,
            extra=("--token", TOKEN),
        ).start()
        started.append(plane)
        apps = [start_echo(network.pods["zt"]), start_echo(tw), App(tw, "echo", SINK_IP, "8080")]
        assert apps[-1].read_event() == {"event": "listening"}
        started += apps
        ztunnel_log = open(tmp_path / "ztunnel.log", "ab")
        env = {
            "PATH": "/usr/bin:/bin",
            "XDS_ADDRESS": XDS,
            "CA_ADDRESS": XDS,
            "XDS_ROOT_CA": str(plane.root_cert),
            "CA_ROOT_CA": str(plane.root_cert),
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "default/ztpod/ztpod",
            "NODE_NAME": "node-z",
            "UNSTABLE_ENABLE_SOCKS5": "true",
            "POD_NAME": "ztunnel-z",
            "POD_NAMESPACE": "istio-system",
            "RUST_LOG": "info",
            "AUTH_TOKEN": TOKEN,
            "CLUSTER_ID": "lab-cluster",
            # In dedicated mode ztunnel would dial the app from the client's address (IP_TRANSPARENT), which
            # needs routing that sends the reply back through it; this lab has none.
            "ENABLE_ORIG_SRC": "false",
        }
        ztunnel = subprocess.Popen(
            in_netns(network.pods["zt"].netns, [binary]),
            env=env,
            cwd=tmp_path,
            stdout=ztunnel_log,
            stderr=subprocess.STDOUT,
        )
        node = NodeInNetns(
            tw.netns,
            tmp_path / "tw",
            name="node-t",
            control_ip="127.0.0.1",
            node="node-t",
            extra_args=(
                "--xds-address",
                XDS,
                "--xds-root-ca",
                str(plane.root_cert),
                "--ca-root-ca",
                str(plane.root_cert),
                "--auth-token",
                TOKEN,
                "--cluster-id",
                "lab-cluster",
            ),
        )
        node.start()
        started.append(node)
        zt_ns = network.pods["zt"].netns

        def ztunnel_ready():
            if ztunnel.poll() is not None:
                raise RuntimeError(f"ztunnel exited:\n{(tmp_path / 'ztunnel.log').read_text()[-3000:]}")
            try:
                return http_json(zt_ns, "http://127.0.0.1:15021/healthz/ready")[0] == 200
            except RuntimeError:
                return False

        wait_until(ztunnel_ready, timeout=30, what="ztunnel ready")
        wait_until(lambda: node.http("readiness", "/healthz/ready")[0] == 200, timeout=30, what="ztwisted ready")
        yield {
            "network": network,
            "plane": plane,
            "node": node,
            "zt_ns": zt_ns,
            "tw_ns": tw.netns,
            "ztunnel_log": tmp_path / "ztunnel.log",
        }
    finally:
        if "ztunnel" in locals():
            terminate(ztunnel)
        for item in reversed(started):
            if isinstance(item, NodeProcess):
                try:
                    item.stop()
                except RuntimeError:
                    item.kill()
            elif isinstance(item, App):
                item.kill()
            else:
                item.stop()
        network.destroy()


def test_ztunnel_and_ztwisted_serve_the_same_mesh_from_the_lab_control_plane(lab):
    _, ztunnel_dump = http_json(lab["zt_ns"], "http://127.0.0.1:15000/config_dump")
    ztwisted_dump = lab["node"].config_dump()

    def workloads(entries):
        return sorted((w["name"], tuple(w["workloadIps"])) for w in entries)

    assert workloads(ztunnel_dump["workloads"]) == workloads(ztwisted_dump["workloads"])
    assert len(ztunnel_dump["workloads"]) == 5
    assert sorted(f"{p['namespace']}/{p['name']}" for p in ztunnel_dump["policies"]) == sorted(
        f"{p['namespace']}/{p['name']}" for p in ztwisted_dump["policies"]
    )
    streams = lab["plane"].state()["streams"]
    nodes = {s["node"] for s in streams if s["open"]}
    assert "ztunnel~1.1.1.1~ztunnel-z.istio-system~istio-system.svc.cluster.local" in nodes
    assert all(not s["nacks"] for s in streams)
    # both sent the token (the control plane refuses calls without it) and the cluster id beside it
    assert {s["metadata"].get("clusterid") for s in streams if s["open"]} == {"lab-cluster"}
    assert {e["clusterid"] for e in lab["plane"].state()["signed"]} == {"lab-cluster"}


def test_traffic_both_ways_is_allowed_and_denied_by_policies_from_xds(lab):
    # ztunnel -> ztwisted: allowed to echo, denied by sink's policy (enforced by ztwisted)
    assert socks_echo(lab["zt_ns"], "127.0.0.1:15080", ZTPOD_IP, ECHO_IP, 8080) == {"ok": True, "error": ""}
    denied = socks_echo(lab["zt_ns"], "127.0.0.1:15080", ZTPOD_IP, SINK_IP, 8080)
    # ztunnel's SOCKS5 answers before the tunnel is up, so its client sees a reset; ztwisted says why
    assert not denied["ok"], denied
    assert any(
        e.get("error") == "denied by policy default/sink-deny-ztpod" and e.get("src.identity", "").endswith("/sa/ztpod")
        for e in lab["node"].log_events()
    )
    # ztwisted -> ztunnel: client allowed, intruder denied by ztpod's policy (enforced by ztunnel)
    assert socks_echo(lab["tw_ns"], "127.0.0.1:15080", CLIENT_IP, ZTPOD_IP, 8080) == {"ok": True, "error": ""}
    refused = socks_echo(lab["tw_ns"], "127.0.0.1:15080", INTRUDER_IP, ZTPOD_IP, 8080)
    assert not refused["ok"] and "refused" in refused["error"], refused
    # both got their certificates from the control plane's CA, by CSR, for their own identities
    signed = {san for entry in lab["plane"].state()["signed"] for san in entry["sans"]}
    assert {
        "spiffe://cluster.local/ns/default/sa/ztpod",
        "spiffe://cluster.local/ns/default/sa/client",
        "spiffe://cluster.local/ns/default/sa/echo",
        "spiffe://cluster.local/ns/default/sa/sink",
        "spiffe://cluster.local/ns/default/sa/intruder",
    } <= signed
