"""Reloading the config file of a running node, and refusing a bad one at start."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time

import pytest

from tests.integration.conftest import NET
from tests.support import can_connect, mesh_workload, mesh_workloads, wait_until
from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import NodeProcess, twistd_command

pytestmark = pytest.mark.integration

FIRST_IP = f"127.{NET}.5.1"
SECOND_IP = f"127.{NET}.5.2"
CONTROL_IP = f"127.{NET}.5.254"


def workload(name: str, ip: str) -> str:
    return mesh_workload(name, ip, "node-r")


@pytest.fixture
def reloading_node(tmp_path):
    config = tmp_path / "mesh.yaml"
    config.write_text(mesh_workloads(workload("first", FIRST_IP)))
    node = NodeProcess(tmp_path / "node", name="node-r", control_ip=CONTROL_IP, config=config, node="node-r")
    node.start()
    yield node
    try:
        node.stop()
    except RuntimeError:
        node.kill()


def local_workloads(node) -> set[str]:
    return {w["name"] for w in node.config_dump()["workloads"] if w["local"]}


def test_reload_adds_and_removes_listeners_and_survives_bad_files(reloading_node):
    node = reloading_node
    config = node.config
    assert can_connect(FIRST_IP)
    assert not can_connect(SECOND_IP)

    # A new workload on this node: its HBONE listener appears.
    config.write_text(mesh_workloads(workload("first", FIRST_IP), workload("second", SECOND_IP)))
    wait_until(lambda: can_connect(SECOND_IP), what=f"a listener on {SECOND_IP}:15008")
    assert local_workloads(node) == {"first", "second"}
    assert node.metric("ztwisted_config_reloads_total") == 1

    # Invalid YAML: rejected with file and position, counted, nothing changes.
    config.write_text("workloads: [\n  - name: broken\n")
    wait_until(lambda: node.metric("ztwisted_config_reload_errors_total") == 1, what="the reload error count")
    error = wait_until(lambda: rejection(node, f"{config}: line "), what="the YAML error in the log")
    assert error["level"] == "error"
    assert "invalid YAML" in error["message"]

    # An unknown key: rejected with file, path to the field and message.
    config.write_text(mesh_workloads(workload("first", FIRST_IP)).replace("protocol: HBONE", "protocol: HBONE\n  colour: blue"))
    wait_until(lambda: node.metric("ztwisted_config_reload_errors_total") == 2, what="the second reload error")
    wait_until(lambda: rejection(node, f"{config}: workloads[0].colour: unknown key"), what="the unknown-key error in the log")

    # Still serving with the last good configuration.
    assert node.http("readiness", "/healthz/ready") == (200, b"ready\n")
    assert local_workloads(node) == {"first", "second"}
    assert can_connect(FIRST_IP) and can_connect(SECOND_IP)
    assert node.metric("ztwisted_config_reloads_total") == 1

    # The workload goes away: so do its listener and its connections (at once, as ztunnel).
    established = hbone_client(node, SECOND_IP)
    config.write_text(mesh_workloads(workload("first", FIRST_IP)))
    wait_until(lambda: not can_connect(SECOND_IP), what=f"the listener on {SECOND_IP}:15008 to close")
    established.settimeout(5)
    try:
        while established.recv(65536):
            pass  # the server's SETTINGS, then the end
    except (ssl.SSLError, ConnectionError):
        pass
    established.close()
    assert local_workloads(node) == {"first"}
    assert can_connect(FIRST_IP)
    assert node.metric("ztwisted_config_reloads_total") == 2
    assert node.metric("ztwisted_config_reload_errors_total") == 2


def hbone_client(node, ip: str) -> ssl.SSLSocket:
    """A TLS connection to ``ip``:15008 with a proper certificate, handshake done."""
    ca = CertificateAuthority.load(node.state_dir / "ca")
    issued = ca.issue(SpiffeId("cluster.local", "default", "first"))
    cert_file, key_file = node.workdir / "client.crt", node.workdir / "client.key"
    cert_file.write_bytes(issued.cert_pem + issued.chain_pem)
    key_file.write_bytes(issued.key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=issued.roots_pem.decode())
    context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(["h2"])
    tls = context.wrap_socket(socket.create_connection((ip, 15008), timeout=5))
    tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    assert tls.recv(65536), "the HBONE listener did not answer a proper client"
    return tls


def rejection(node, fragment: str) -> dict | None:
    for event in node.log_events():
        message = event.get("message", "")
        if "configuration change rejected" in message and fragment in message:
            return event
    return None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("workloads:\n- name: w\n  workloadIps: [\"{ip}\"]\n  colour: blue\n", "workloads[0].colour: unknown key"),
        ("workloads: [\n  - name: w\n", "line 2, column 3: invalid YAML"),
    ],
    ids=["unknown-key", "invalid-yaml"],
)
def test_invalid_config_at_start_fails_fast(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.format(ip=FIRST_IP))
    started = time.monotonic()
    result = subprocess.run(
        twistd_command() + ["-n", "--pidfile=", "ztunnel", "--config", str(bad), "--state-dir", str(tmp_path / "state"),
                            f"--admin=tcp:15000:interface={CONTROL_IP}", f"--socks5=tcp:15080:interface={CONTROL_IP}",
                            f"--outbound=tcp:15001:interface={CONTROL_IP}", f"--metrics=tcp:15020:interface={CONTROL_IP}",
                            f"--readiness=tcp:15021:interface={CONTROL_IP}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 10
    output = result.stdout + result.stderr
    assert f"{bad}: {expected}" in output
