"""Reloading the config file of a running node, and refusing a bad one at start."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time

import pytest

from tests.integration.conftest import NET
from tests.support import (
    EchoServer,
    can_connect,
    close_listener,
    listening_socket,
    mesh_workload,
    mesh_workloads,
    recv_all,
    wait_until,
)
from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import NodeProcess, socks5_connect, twistd_command

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
    config.write_text(
        mesh_workloads(workload("first", FIRST_IP)).replace("protocol: HBONE", "protocol: HBONE\n  colour: blue")
    )
    wait_until(lambda: node.metric("ztwisted_config_reload_errors_total") == 2, what="the second reload error")
    wait_until(
        lambda: rejection(node, f"{config}: workloads[0].colour: unknown key"), what="the unknown-key error in the log"
    )

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
        ('workloads:\n- name: w\n  workloadIps: ["{ip}"]\n  colour: blue\n', "workloads[0].colour: unknown key"),
        ("workloads: [\n  - name: w\n", "line 2, column 3: invalid YAML"),
    ],
    ids=["unknown-key", "invalid-yaml"],
)
def test_invalid_config_at_start_fails_fast(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.format(ip=FIRST_IP))
    started = time.monotonic()
    result = subprocess.run(
        twistd_command()
        + [
            "-n",
            "--pidfile=",
            "ztunnel",
            "--config",
            str(bad),
            "--state-dir",
            str(tmp_path / "state"),
            f"--admin=tcp:15000:interface={CONTROL_IP}",
            f"--socks5=tcp:15080:interface={CONTROL_IP}",
            f"--outbound=tcp:15001:interface={CONTROL_IP}",
            f"--metrics=tcp:15020:interface={CONTROL_IP}",
            f"--readiness=tcp:15021:interface={CONTROL_IP}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 10
    output = result.stdout + result.stderr
    assert f"{bad}: {expected}" in output


THIRD_IP = f"127.{NET}.5.3"
APP_PORT = 8080


def both() -> str:
    return mesh_workloads(workload("first", FIRST_IP), workload("second", SECOND_IP))


def apply(node, text: str, reloads: int) -> None:
    """Write ``text`` and wait until the node counted ``reloads`` reloads in all."""
    node.config.write_text(text)
    wait_until(lambda: node.metric("ztwisted_config_reloads_total") == reloads, what=f"reload number {reloads}")


def still_open(tls: ssl.SSLSocket) -> bool:
    """Whether the server has neither closed nor reset ``tls`` (reads whatever it sent meanwhile)."""
    tls.settimeout(0.3)
    try:
        while tls.recv(65536):
            pass
        return False
    except TimeoutError:
        return True
    except (ssl.SSLError, OSError):
        return False


def readiness(node) -> tuple[int, bytes]:
    return node.http("readiness", "/healthz/ready")


def test_a_workload_removed_and_added_back_is_served_again(reloading_node):
    node = reloading_node
    app = EchoServer(FIRST_IP, APP_PORT)
    try:
        apply(node, both(), 1)
        assert socks5_echo(node, SECOND_IP, FIRST_IP) == b"before"

        apply(node, mesh_workloads(workload("first", FIRST_IP)), 2)
        wait_until(lambda: not can_connect(SECOND_IP), what=f"the listener on {SECOND_IP}:15008 to close")

        apply(node, both(), 3)
        wait_until(lambda: can_connect(SECOND_IP), what=f"a listener on {SECOND_IP}:15008 again")
        assert local_workloads(node) == {"first", "second"}
        assert socks5_echo(node, SECOND_IP, FIRST_IP, b"after") == b"after"
        assert readiness(node) == (200, b"ready\n")
    finally:
        app.close()


def socks5_echo(node, source_ip: str, destination_ip: str, payload: bytes = b"before") -> bytes:
    with socks5_connect(node.socks5, source_ip, destination_ip, APP_PORT) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        return recv_all(sock)


def test_an_empty_file_is_an_error_that_keeps_the_last_good_configuration(reloading_node):
    node = reloading_node
    established = hbone_client(node, FIRST_IP)

    node.config.write_text("")
    wait_until(lambda: node.metric("ztwisted_config_reload_errors_total") == 1, what="the empty file to be rejected")
    error = rejection(node, f"{node.config}: (file): no YAML document")
    assert error is not None and error["level"] == "error"
    assert can_connect(FIRST_IP) and still_open(established)
    assert local_workloads(node) == {"first"}
    assert readiness(node) == (200, b"ready\n")
    assert node.metric("ztwisted_config_reloads_total") == 0
    established.close()

    # A valid document without workloads is a real change, applied as such.
    apply(node, "workloads: []\n", 1)
    wait_until(lambda: not can_connect(FIRST_IP), what=f"the listener on {FIRST_IP}:15008 to close")
    assert local_workloads(node) == set()
    assert readiness(node) == (200, b"ready\n")

    apply(node, mesh_workloads(workload("first", FIRST_IP)), 2)
    wait_until(lambda: can_connect(FIRST_IP), what=f"a listener on {FIRST_IP}:15008 again")


@pytest.mark.parametrize(
    "first_part", ["", mesh_workloads(workload("first", FIRST_IP))], ids=["nothing", "first-workload"]
)
def test_a_writer_that_truncates_and_writes_slowly_is_read_once_it_closes_the_file(reloading_node, first_part):
    node = reloading_node
    apply(node, both(), 1)
    established = hbone_client(node, SECOND_IP)
    whole = both()
    assert whole.startswith(first_part)

    with open(node.config, "w") as writer:  # truncates: the file is empty, then partial, until closed
        writer.write(first_part)
        writer.flush()
        time.sleep(0.6)  # well past the 0.1 s reload delay, well before the 2 s a silent writer gets
        assert still_open(established), "a partial file was applied"
        writer.write(whole[len(first_part) :])

    time.sleep(0.5)
    assert still_open(established) and can_connect(SECOND_IP)
    assert node.metric("ztwisted_config_reloads_total") == 1
    assert node.metric("ztwisted_config_reload_errors_total") == 0
    established.close()


def test_readiness_names_a_workload_whose_listeners_cannot_open(reloading_node):
    node = reloading_node
    blocker = listening_socket(THIRD_IP, 15008, backlog=1)  # no SO_REUSEPORT: the node cannot share it
    try:
        apply(node, mesh_workloads(workload("first", FIRST_IP), workload("third", THIRD_IP)), 1)
        status, body = wait_until(lambda: (r := readiness(node))[0] != 200 and r, what="readiness to fail")
        assert status == 500
        assert b"listeners of default/third" in body
        assert can_connect(FIRST_IP)
        (logged,) = [event["message"] for event in node.log_events() if event["level"] == "error"]
        assert logged.startswith("workload default/third is not served (host): ")
        assert logged.endswith(f"cannot listen on {THIRD_IP}:15008: Address already in use")
    finally:
        close_listener(blocker)
    # The file no longer asks for it: ready again.
    apply(node, mesh_workloads(workload("first", FIRST_IP)), 2)
    wait_until(lambda: readiness(node) == (200, b"ready\n"), what="readiness once the workload is gone")
