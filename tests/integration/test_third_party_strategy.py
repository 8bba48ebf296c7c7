"""A third-party drain strategy (examples/custom_strategy) in real twistd processes.

The example package is copied to a temporary folder and put on PYTHONPATH,
as ``pip install`` would put it on sys.path: Twisted then finds its
``twisted/plugins/`` module (a folder without ``__init__.py``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import CLIENT_IP, NET, NODE_A_CONTROL_IP, NODE_B_CONTROL_IP, SERVER_IP
from tests.support import mesh_workload, mesh_workloads, pod_uid, recv_all, wait_until
from ztwisted.tools.harness import NodeProcess, socks5_connect, twistd_command

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_strategy"
STRATEGY = "goaway-when-idle"
ECHO_UID = pod_uid("echo")
CLIENT2_IP = f"127.{NET}.2.2"

MESH = mesh_workloads(
    mesh_workload("client", CLIENT_IP, "node-a", uid=pod_uid("client")),
    mesh_workload("client2", CLIENT2_IP, "node-a", uid=pod_uid("client2")),
    mesh_workload("echo", SERVER_IP, "node-b", uid=ECHO_UID),
)


@pytest.fixture
def plugin_path(tmp_path) -> str:
    """PYTHONPATH with a copy of the example package (Twisted writes a dropin.cache beside the plugin)."""
    copy = tmp_path / "custom_strategy"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__", "dropin.cache", "tests"))
    return os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))


def twistd(args: list[str], cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        twistd_command() + ["-n", "--pidfile=", "ztunnel", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_drain_strategy_help_lists_the_third_party_strategy(tmp_path, plugin_path):
    listed = twistd(["--drain-strategy", "help"], tmp_path, plugin_path)
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
    assert set(lines) >= {STRATEGY, "immediate", "goaway-on-start", "last-mile", "client-evict", "gradual"}
    assert "once it carries no tunnel" in lines[STRATEGY]

    without = twistd(["--drain-strategy", "help"], tmp_path, None)
    assert without.returncode == 0 and STRATEGY not in without.stdout

    unknown = twistd(["--drain-strategy", "nonesuch"], tmp_path, plugin_path)
    assert unknown.returncode != 0
    assert (
        f"unknown drain strategy nonesuch; installed: client-evict, goaway-on-start, {STRATEGY},"
        in unknown.stdout + unknown.stderr
    )


def round_trip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(len(payload) - len(received))
        if not chunk:
            break
        received += chunk
    return received


def finish(sock: socket.socket, payload: bytes) -> bytes:
    """Send the last bytes and FIN; everything echoed until the echo app's FIN."""
    sock.sendall(payload)
    sock.shutdown(socket.SHUT_WR)
    return recv_all(sock)


def open_tunnel(node_a: NodeProcess, source_ip: str) -> socket.socket:
    sock = socks5_connect(node_a.socks5, source_ip, SERVER_IP, 8080)
    sock.settimeout(10)
    return sock


def pool_entries(node_a: NodeProcess) -> dict[str, dict]:
    """node-a's pooled connections to echo, by source IP."""
    return {
        entry["source_ip"]: entry
        for entry in node_a.config_dump()["pool"]
        if entry["destination"] == f"{SERVER_IP}:15008"
    }


def inbound_closed(node_b: NodeProcess, ended_by: str) -> float:
    return node_b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by=ended_by)


def graceful_closes(node_b: NodeProcess) -> float:
    # Whichever side sends close_notify first after the GOAWAY: both are a graceful end.
    return inbound_closed(node_b, "drained") + inbound_closed(node_b, "peer")


@pytest.fixture
def nodes(tmp_path, echo_app, plugin_path):
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH)
    state = tmp_path / "state"
    node_b = NodeProcess(
        tmp_path / "b",
        name="node-b",
        control_ip=NODE_B_CONTROL_IP,
        config=config,
        node="node-b",
        state_dir=state,
        extra_args=("--drain-strategy", f"{STRATEGY},immediate"),
        env={"PYTHONPATH": plugin_path},
    )
    node_a = NodeProcess(
        tmp_path / "a", name="node-a", control_ip=NODE_A_CONTROL_IP, config=config, node="node-a", state_dir=state
    )
    node_b.start()
    try:
        node_a.start()
    except BaseException:
        node_b.kill()
        raise
    yield node_a, node_b
    for node in (node_a, node_b):
        try:
            node.stop()
        except RuntimeError:
            node.kill()


def test_goaway_when_idle_composed_with_immediate_in_a_real_node(nodes):
    node_a, node_b = nodes
    assert any(f"drain strategies {STRATEGY},immediate" in e.get("message", "") for e in node_b.log_events())

    # client2 used echo once: its pooled connection is idle. client's tunnel stays open.
    with open_tunnel(node_a, CLIENT2_IP) as used_once:
        assert finish(used_once, b"once") == b"once"
    busy = open_tunnel(node_a, CLIENT_IP)
    first = os.urandom(50_000)
    assert round_trip(busy, first) == first
    wait_until(
        lambda: set(pool_entries(node_a)) == {CLIENT_IP, CLIENT2_IP}, timeout=10.0, what="both pooled connections"
    )

    status, body = node_b.http("admin", "/workloads/echo/terminating", method="POST")
    assert (status, body) == (200, f"pod terminating: {ECHO_UID}\n".encode())
    for strategy in (STRATEGY, "immediate"):
        assert node_b.metric("ztwisted_drain_events_total", strategy=strategy, event="pod_terminating") == 1

    # The idle connection got GOAWAY and closed gracefully; the busy one did not.
    wait_until(lambda: graceful_closes(node_b) == 1, timeout=10.0, what="the idle connection to close")
    wait_until(
        lambda: set(pool_entries(node_a)) == {CLIENT_IP}, timeout=10.0, what="client2's connection to leave the pool"
    )
    assert inbound_closed(node_b, "abrupt") == 0

    # The pod keeps serving, and the busy connection keeps carrying new tunnels: no new handshake.
    second = os.urandom(50_000)
    assert round_trip(busy, second) == second
    with open_tunnel(node_a, CLIENT_IP) as another:
        assert finish(another, b"multiplexed") == b"multiplexed"
    time.sleep(0.3)  # time for a GOAWAY that must not come
    assert node_a.metric("ztwisted_pool_connections_opened_total") == 2
    entry = pool_entries(node_a)[CLIENT_IP]
    assert entry["usable"] and not entry["goaway_received"]

    # Its last tunnel ends: now it gets GOAWAY, gracefully.
    last = os.urandom(10_000)
    assert finish(busy, last) == last
    busy.close()
    wait_until(
        lambda: graceful_closes(node_b) == 2, timeout=10.0, what="the busy connection to close after its last tunnel"
    )
    wait_until(lambda: pool_entries(node_a) == {}, timeout=10.0, what="the pool to be empty")
    assert inbound_closed(node_b, "abrupt") == 0

    # Pod removed: goaway-when-idle lets go, immediate closes what is left at once.
    late = open_tunnel(node_a, CLIENT_IP)
    assert round_trip(late, b"late") == b"late"
    assert node_a.metric("ztwisted_pool_connections_opened_total") == 3
    status, body = node_b.http("admin", "/workloads/echo", method="DELETE")
    assert (status, body) == (200, f"pod removed: {ECHO_UID}\n".encode())
    for strategy in (STRATEGY, "immediate"):
        assert node_b.metric("ztwisted_drain_events_total", strategy=strategy, event="pod_removed") == 1
    with late:
        try:
            assert late.recv(100) == b""
        except ConnectionResetError:
            pass
    wait_until(
        lambda: inbound_closed(node_b, "abrupt") == 1, timeout=10.0, what="the pod's last connection to be aborted"
    )
    assert node_b.metric("ztwisted_drain_event_failures_total") == 0
