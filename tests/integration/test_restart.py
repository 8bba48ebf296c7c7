"""Restart without loss: a second process shares the ports (SO_REUSEPORT), then the first drains.

Short SOCKS5 connections (each a byte-exact 1-64 KB echo) and one long
streaming tunnel run through node-a while node-b, then node-a, is restarted
three times. The last test shows the kernel behaviour the proxy relies on
for connections still waiting in the old listener's accept queue:
``net.ipv4.tcp_migrate_req``.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.integration.conftest import CLIENT_IP
from tests.integration.drain_support import ECHO_HOST, Nodes, restart_under_load, wait_exit
from tests.support import recv_all

pytestmark = pytest.mark.integration

MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")
ROUNDS = 3


@pytest.fixture
def nodes(tmp_path, echo_app):
    pair = Nodes(tmp_path)
    pair.start()
    yield pair
    pair.stop()


def assert_no_loss(result, rounds: int) -> None:
    assert result.failures == [], f"{len(result.failures)} failures, first ones: {result.failures[:5]}"
    assert result.connections_failed == 0
    assert result.connections_made >= 20 * rounds, f"only {result.connections_made} short connections were made"
    assert result.long_tunnels_exact == result.long_tunnels == rounds
    assert len(result.old_exit_statuses) == rounds, "every old process exited"
    # twistd re-raises the SIGTERM that stopped it (app._exitWithSignal) once the drain is over.
    assert set(result.old_exit_statuses) == {-signal.SIGTERM}


def test_restarting_the_server_side_node_loses_nothing(nodes):
    def successor(round_number: int):
        process = nodes.node_b(workdir=f"b{round_number + 1}")
        nodes.extra.append(process)
        return process

    nodes.b, result = restart_under_load(nodes.b, successor, lambda: nodes.a.socks5, CLIENT_IP, rounds=ROUNDS)
    assert_no_loss(result, ROUNDS)
    assert nodes.b.metric("istio_tcp_connections_opened_total") > 0, "the last successor carried traffic"
    if MIGRATE_REQ.exists() and _is_root():
        assert MIGRATE_REQ.read_text().strip() == "1", "the proxy sets net.ipv4.tcp_migrate_req=1 when it may"


def test_restarting_the_socks5_side_node_loses_nothing(nodes):
    def successor(round_number: int):
        process = nodes.node_a(workdir=f"a{round_number + 1}")
        nodes.extra.append(process)
        return process

    nodes.a, result = restart_under_load(nodes.a, successor, lambda: nodes.a.socks5, CLIENT_IP, rounds=ROUNDS)
    assert_no_loss(result, ROUNDS)
    assert nodes.a.metric("istio_tcp_connections_opened_total") > 0, "the last successor carried traffic"


def test_a_socks5_client_accepted_before_sigterm_is_carried_to_its_end(nodes):
    with socket.create_connection(nodes.a.socks5, source_address=(CLIENT_IP, 0), timeout=10) as sock:
        sock.sendall(b"\x05\x01\x00")
        assert sock.recv(2) == b"\x05\x00", "greeting answered: the old process accepted this client"
        nodes.a.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        host = ECHO_HOST.encode()
        sock.sendall(b"\x05\x01\x00\x03" + bytes([len(host)]) + host + struct.pack("!H", 80))
        reply = sock.recv(10)
        assert reply[:2] == b"\x05\x00", f"SOCKS5 reply {reply!r}"
        sent = b""
        for _ in range(10):  # a client that takes its time, well within the 5 s drain deadline
            chunk = os.urandom(1000)
            sock.sendall(chunk)
            sent += chunk
            time.sleep(0.1)
        sock.shutdown(socket.SHUT_WR)
        assert recv_all(sock) == sent
    assert wait_exit(nodes.a, 10) == -signal.SIGTERM


# -- the kernel behaviour behind it -------------------------------------------------------

# Run in a network namespace of its own, so setting the sysctl there touches nothing else.
# Two SO_REUSEPORT listeners; the one in a child process that is stopped (SIGSTOP) never
# accepts, so the connections hashed to it pile up in its accept queue; then that process is
# killed, which closes its listener. With tcp_migrate_req=1 the kernel moves those queued
# connections to the other listener; with 0 it resets them.
EXPERIMENT = textwrap.dedent(
    """
    import os, signal, socket, subprocess, sys, time

    setting = sys.argv[1]
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with open("/proc/sys/net/ipv4/tcp_migrate_req", "w") as f:
        f.write(setting)

    def listener(port=0):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    survivor = listener()
    port = survivor.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\\n"
        f"s.bind(('127.0.0.1', {port})); s.listen(64)\\n"
        "print('listening', flush=True); time.sleep(60)\\n"
    )], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "listening"
    os.kill(child.pid, signal.SIGSTOP)

    clients = []
    for i in range(40):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        clients.append(c)
    time.sleep(0.2)  # handshakes done: every client sits in one of the two accept queues

    survivor.setblocking(False)
    accepted_before = []
    while True:
        try:
            accepted_before.append(survivor.accept()[0])
        except BlockingIOError:
            break

    os.kill(child.pid, signal.SIGKILL)  # closes the stopped process's listener
    child.wait()
    time.sleep(0.2)

    accepted_after = []
    while True:
        try:
            accepted_after.append(survivor.accept()[0])
        except BlockingIOError:
            break

    for c in clients:
        try:
            c.sendall(b"x")
        except OSError:
            pass
    time.sleep(0.2)
    served = reset = 0
    for c in clients:
        # A live connection took the byte and stays silent; a reset one reports it.
        c.setblocking(False)
        try:
            if c.recv(1) == b"":
                reset += 1
        except BlockingIOError:
            served += 1
        except (ConnectionResetError, BrokenPipeError):
            reset += 1
    print(len(accepted_before), len(accepted_after), served, reset)
    """
)


def _is_root() -> bool:
    return os.geteuid() == 0


def run_experiment(setting: str) -> tuple[int, int, int, int]:
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", EXPERIMENT, setting], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    before, after, served, reset = map(int, done.stdout.split())
    return before, after, served, reset


@pytest.mark.root
def test_tcp_migrate_req_moves_queued_connections_to_the_other_listener():
    if not _is_root() or not MIGRATE_REQ.exists():
        pytest.skip("needs root and a kernel with net.ipv4.tcp_migrate_req (Linux 5.14+)")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {probe.stderr.decode().strip()}")

    before, after, served, reset = run_experiment("1")
    assert before > 0 and after > 0, "connections were queued on both listeners"
    assert before + after == 40, "with tcp_migrate_req=1 the survivor accepts every queued connection"
    assert (served, reset) == (40, 0)

    before, after, served, reset = run_experiment("0")
    assert before > 0
    assert after == 0, "with tcp_migrate_req=0 nothing moves"
    assert before + reset == 40 and reset > 0, "the stopped listener's queued connections are reset"
