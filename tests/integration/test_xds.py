"""ztwisted nodes fed by the lab control plane over delta xDS, with certificates from its CA (real processes)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.integration.conftest import (
    CLIENT_IP,
    NET,
    NODE_A_CONTROL_IP,
    NODE_B_CONTROL_IP,
    SERVER_IP,
    SINK_IP,
    TWO_NODE_MESH,
)
from tests.integration.xds_support import deny_policy
from tests.support import EchoServer, mesh_workload, pod_uid, wait_until
from ztwisted.tools.control_plane import ControlPlaneProcess
from ztwisted.tools.harness import NodeProcess, Socks5Refused, socks5_connect

CONTROL_PLANE_IP = f"127.{NET}.0.50"
XDS_ADDRESS = f"https://{CONTROL_PLANE_IP}:15012"

SINK_ENTRY = mesh_workload("sink", SINK_IP, "node-b", uid=pod_uid("sink"))
# The two-node mesh, where a Deny policy selects sink: client -> echo is allowed, client -> sink denied.
MESH = (
    TWO_NODE_MESH.replace(SINK_ENTRY, SINK_ENTRY + '  authorizationPolicies: ["default/sink-deny-client"]\n')
    + "policies:\n"
    + deny_policy("sink-deny-client", "client")
)


def xds_node(
    tmp_path: Path, name: str, control_ip: str, control_plane: ControlPlaneProcess, *extra: str
) -> NodeProcess:
    return NodeProcess(
        tmp_path / name,
        name=name,
        control_ip=control_ip,
        node=name,
        extra_args=(
            "--xds-address",
            XDS_ADDRESS,
            "--xds-root-ca",
            str(control_plane.root_cert),
            "--ca-root-ca",
            str(control_plane.root_cert),
            *extra,
        ),
    )


def lab_control_plane(tmp_path: Path, mesh: Path, *extra: str) -> ControlPlaneProcess:
    return ControlPlaneProcess(
        tmp_path, mesh, listen=f"{CONTROL_PLANE_IP}:15012", api=f"{CONTROL_PLANE_IP}:15014", extra=extra
    )


def stop_all(*nodes: NodeProcess) -> None:
    for node in nodes:
        try:
            node.stop()
        except RuntimeError:
            node.kill()


def ready(node: NodeProcess) -> bool:
    return node.http("readiness", "/healthz/ready")[0] == 200


@pytest.fixture
def control_plane(tmp_path):
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(MESH)
    plane = lab_control_plane(tmp_path, mesh).start()
    yield plane
    plane.stop()


@pytest.fixture
def xds_nodes(tmp_path, control_plane):
    echo = EchoServer(SERVER_IP, 8080)
    b = xds_node(tmp_path, "node-b", NODE_B_CONTROL_IP, control_plane).start()
    a = xds_node(tmp_path, "node-a", NODE_A_CONTROL_IP, control_plane)
    try:
        a.start()
        wait_until(lambda: ready(a) and ready(b), timeout=20, what="both nodes ready")
        yield a, b
    finally:
        stop_all(a, b)
        echo.close()


def echo_once(node: NodeProcess, payload: bytes = b"hello through xDS") -> bytes:
    with socks5_connect(node.socks5, CLIENT_IP, "echo.default.svc.cluster.local", 80) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_nodes_learn_the_mesh_over_xds_and_enforce_its_policy(tmp_path, control_plane, xds_nodes):
    a, b = xds_nodes
    dump = a.config_dump()
    assert dump["config_source"] == XDS_ADDRESS
    assert sorted(w["name"] for w in dump["workloads"]) == ["client", "echo", "sink"]
    assert [w["name"] for w in dump["workloads"] if w["local"]] == ["client"]
    assert [p["name"] for p in dump["policies"]] == ["sink-deny-client"]
    assert dump["xds"]["connected"] and dump["xds"]["nacks"] == 0
    assert a.metric("istio_xds_message_total", url="type.googleapis.com/istio.workload.Address") >= 1
    assert a.metric("istio_xds_message_bytes_total", url="type.googleapis.com/istio.security.Authorization") > 0
    # allowed: client -> echo service; denied: client -> sink (Deny policy pushed over xDS)
    assert echo_once(a) == b"hello through xDS"
    with pytest.raises(Socks5Refused):
        socks5_connect(a.socks5, CLIENT_IP, SINK_IP, 8080)


def test_certificates_come_from_csrs_and_no_ca_key_is_on_the_node(tmp_path, control_plane, xds_nodes):
    a, b = xds_nodes
    echo_once(a)
    signed = {san for entry in control_plane.state()["signed"] for san in entry["sans"]}
    assert signed == {
        "spiffe://cluster.local/ns/default/sa/client",
        "spiffe://cluster.local/ns/default/sa/echo",
        "spiffe://cluster.local/ns/default/sa/sink",
    }
    identities = {c["identity"] for c in b.config_dump()["certificates"]}
    assert identities == {"spiffe://cluster.local/ns/default/sa/echo", "spiffe://cluster.local/ns/default/sa/sink"}
    for node in (a, b):
        for path in node.state_dir.rglob("*") if node.state_dir.exists() else []:
            if path.is_file():
                assert b"PRIVATE KEY" not in path.read_bytes(), path


def test_invalid_resource_is_nacked_and_the_last_good_state_serves(tmp_path, control_plane, xds_nodes):
    a, b = xds_nodes
    assert control_plane.api("POST", "/invalid")[0] == 200
    wait_until(lambda: a.config_dump()["xds"]["nacks"] >= 1, timeout=10, what="a NACK")
    nack = a.config_dump()["xds"]["last_nack"]
    assert "lab/invalid-address" in nack and "5 bytes is not an IPv4 (4) or IPv6 (16) address" in nack
    streams = control_plane.state()["streams"]
    assert any("5 bytes" in n["error"] for s in streams for n in s["nacks"])
    assert any("NACK" in e.get("message", "") and "lab/invalid-address" in e.get("message", "") for e in a.log_events())
    assert a.metric("ztwisted_xds_nacks_total", url="type.googleapis.com/istio.workload.Address") >= 1
    assert echo_once(a) == b"hello through xDS"
    assert ready(a)


def test_control_plane_restart_loses_no_tunnel_and_the_node_resyncs(tmp_path, control_plane, xds_nodes):
    a, b = xds_nodes
    sock = socks5_connect(a.socks5, CLIENT_IP, "echo.default.svc.cluster.local", 80)
    with sock:
        sock.sendall(b"before")
        assert sock.recv(100) == b"before"
        control_plane.stop()
        wait_until(lambda: not a.config_dump()["xds"]["connected"], timeout=10, what="the node to see the loss")
        assert echo_once(a, b"while down") == b"while down"
        # The mesh changes while the node is away: removing sink must reach it on resume.
        mesh = control_plane.mesh
        mesh.write_text(MESH.replace(SINK_ENTRY + '  authorizationPolicies: ["default/sink-deny-client"]\n', ""))
        control_plane.start()
        wait_until(lambda: a.config_dump()["xds"]["connected"], timeout=30, what="the node to reconnect")
        wait_until(
            lambda: "sink" not in [w["name"] for w in a.config_dump()["workloads"]],
            timeout=10,
            what="the removal to reach the node",
        )
        sock.sendall(b"after")
        assert sock.recv(100) == b"after"
    assert a.config_dump()["xds"]["streams_opened"] >= 2
    assert a.metric("istio_xds_connection_terminations_total", reason="Error") == 1  # the stream the kill cut


def test_renewal_keeps_connections(tmp_path):
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(MESH)
    plane = lab_control_plane(tmp_path, mesh, "--cert-ttl", "6").start()
    echo = EchoServer(SERVER_IP, 8080)
    b = xds_node(tmp_path, "node-b", NODE_B_CONTROL_IP, plane).start()
    a = xds_node(tmp_path, "node-a", NODE_A_CONTROL_IP, plane).start()
    try:
        wait_until(lambda: ready(a) and ready(b), timeout=20, what="both nodes ready")
        sock = socks5_connect(a.socks5, CLIENT_IP, "echo.default.svc.cluster.local", 80)
        with sock:
            sock.sendall(b"one")
            assert sock.recv(10) == b"one"
            first = {c["identity"]: c["serial"] for c in a.config_dump()["certificates"]}
            wait_until(
                lambda: {c["identity"]: c["serial"] for c in a.config_dump()["certificates"]} != first,
                timeout=15,
                what="a renewal",
            )
            sock.sendall(b"two")
            assert sock.recv(10) == b"two"
        assert echo_once(a) == b"hello through xDS"
    finally:
        stop_all(a, b)
        echo.close()
        plane.stop()


def test_ca_down_at_start_keeps_readiness_false(tmp_path):
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH)
    node = NodeProcess(
        tmp_path / "a",
        name="node-a",
        control_ip=NODE_A_CONTROL_IP,
        config=config,
        node="node-a",
        extra_args=("--ca-address", f"https://{CONTROL_PLANE_IP}:15012", "--ca-root-ca", "SYSTEM"),
    )
    node.start()
    try:
        wait_until(
            lambda: any(
                "cannot get a certificate for spiffe://cluster.local/ns/default/sa/client" in e.get("message", "")
                for e in node.log_events()
            ),
            timeout=15,
            what="the CA error log",
        )
        status, body = node.http("readiness", "/healthz/ready")
        assert status != 200
        assert b"certificate spiffe://cluster.local/ns/default/sa/client" in body
        time.sleep(0.5)
        assert not ready(node)
        # Its inbound port closes connections cleanly meanwhile: nothing to present yet.
        with socket.create_connection((CLIENT_IP, 15008), timeout=5) as sock:
            assert sock.recv(100) == b""
        wait_until(
            lambda: any(e.get("message", "").startswith("closing the connection from") for e in node.log_events()),
            timeout=5,
            what="the refusal in the log",
        )
        assert "Traceback" not in node.log_path.read_text()
    finally:
        node.stop()


def test_a_wrong_token_is_refused_with_a_clear_error_and_the_right_one_accepted(tmp_path):
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(MESH)
    plane = lab_control_plane(tmp_path, mesh, "--token", "lab-secret").start()
    token_file = tmp_path / "istio-token"
    token_file.write_text("lab-secret\n")
    good = xds_node(tmp_path, "node-a", NODE_A_CONTROL_IP, plane, "--auth-token", str(token_file))
    bad = xds_node(tmp_path, "node-b", NODE_B_CONTROL_IP, plane, "--auth-token", "not-the-secret")
    try:
        good.start()
        bad.start()
        wait_until(lambda: ready(good), timeout=20, what="the node with the right token ready")
        wait_until(
            lambda: any(
                "xDS stream" in e.get("message", "") and "bearer token is not the one" in e.get("message", "")
                for e in bad.log_events()
            ),
            timeout=20,
            what="the refusal in the log",
        )
        assert not ready(bad)
        assert "gRPC status 16" in bad.config_dump()["xds"]["last_error"]
        streams = [s for s in plane.state()["streams"] if s["node"]]
        assert streams and all(s["metadata"].get("clusterid") == "Kubernetes" for s in streams)
    finally:
        stop_all(good, bad)
        plane.stop()


def test_a_removal_over_xds_retires_pooled_connections_under_client_evict(tmp_path, control_plane):
    """Seed option 3 reacting to a real WDS removal: node-a learns over xDS that echo is gone.

    node-b keeps serving echo from a local config signed by the same CA (the control plane's plug-in
    layout), so what is measured is node-a's reaction alone, on the wire as node-b sees it.
    """
    from tests.integration.drain_support import LongTunnel

    echo = EchoServer(SERVER_IP, 8080)
    b = NodeProcess(
        tmp_path / "node-b",
        name="node-b",
        control_ip=NODE_B_CONTROL_IP,
        config=control_plane.mesh,
        node="node-b",
        extra_args=("--ca-dir", str(control_plane.state_dir / "ca")),
    )
    a = xds_node(tmp_path, "node-a", NODE_A_CONTROL_IP, control_plane, "--drain-strategy", "client-evict")
    try:
        b.start()
        a.start()
        wait_until(lambda: ready(a) and ready(b), timeout=20, what="both nodes ready")
        long_tunnel = LongTunnel(a.socks5, CLIENT_IP).start()
        wait_until(lambda: long_tunnel.received > 0, what="the long tunnel to carry data")
        (entry,) = a.config_dump()["pool"]
        assert (entry["usable"], entry["streams"]) == (True, 1)

        assert control_plane.api("DELETE", "/workloads/" + pod_uid("echo").replace("/", "%2F"))[0] == 200
        wait_until(
            lambda: a.metric("ztwisted_drain_events_total", strategy="client-evict", event="destination_removed") == 1,
            what="the removal to reach client-evict",
        )
        assert "echo" not in [w["name"] for w in a.config_dump()["workloads"]]
        (entry,) = a.config_dump()["pool"]
        assert (entry["usable"], entry["streams"]) == (False, 1), "retired: no new streams, the one in flight goes on"
        assert b.metric("ztwisted_hbone_connections_closed_total", direction="inbound") == 0
        assert long_tunnel.finish(), "the tunnel in flight finishes byte-exact"
        wait_until(lambda: a.config_dump()["pool"] == [], what="the retired connection to leave the pool")
        wait_until(
            lambda: b.metric("ztwisted_hbone_connections_closed_total", direction="inbound") == 1,
            what="node-b to see the connection end",
        )
        assert b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by="peer") == 1
    finally:
        stop_all(a, b)
        echo.close()


def test_a_pod_marked_unhealthy_over_xds_leaves_its_service_until_healthy_again(tmp_path, control_plane, xds_nodes):
    a, b = xds_nodes

    def refused() -> bool:
        try:
            echo_once(a)
        except Socks5Refused:
            return True
        return False

    assert control_plane.api("POST", "/workloads/echo/unhealthy")[0] == 200
    wait_until(refused, timeout=10, what="the service to have no healthy endpoint")
    assert control_plane.api("POST", "/workloads/echo/healthy")[0] == 200
    wait_until(lambda: not refused(), timeout=10, what="echo back in its service")
    status, body = control_plane.api("POST", "/workloads/nobody/unhealthy")
    assert status == 400 and "no workload named 'nobody'" in body["error"]
