"""HBONE keepalive against a peer that stops answering: node-b frozen with SIGSTOP.

node-a (the client side) runs with a 1 s keepalive interval and a 2 s
timeout; when node-b freezes, the kernel still acknowledges TCP, so only the
PING that goes unanswered can tell node-a that the connection is dead.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from tests.integration.conftest import CLIENT_IP, TwoNodes
from ztwisted.tools.harness import NodeProcess, socks5_connect

pytestmark = pytest.mark.integration

ECHO_HOST = "echo.default.svc.cluster.local"
KEEPALIVE_ARGS = ("--keepalive-interval", "1", "--keepalive-timeout", "2")
# interval + timeout is 3 s; this only keeps a broken build from hanging the run.
GIVE_UP_AFTER = 30.0


class FreezableNodes(TwoNodes):
    """TwoNodes with a short keepalive on node-a, and node-b that can be frozen."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path)
        a = self.a
        self.a = NodeProcess(
            a.workdir,
            name=a.name,
            control_ip=a.control_ip,
            config=a.config,
            node=a.node,
            state_dir=a.state_dir,
            extra_args=KEEPALIVE_ARGS,
        )
        self.b_frozen = False

    def freeze_b(self) -> None:
        os.kill(self.b.process.pid, signal.SIGSTOP)
        self.b_frozen = True

    def thaw_b(self) -> None:
        if self.b_frozen:
            os.kill(self.b.process.pid, signal.SIGCONT)
            self.b_frozen = False


@pytest.fixture
def nodes(tmp_path, echo_app):
    started = FreezableNodes(tmp_path).start()
    try:
        yield started
    finally:
        started.thaw_b()  # a stopped process cannot handle SIGTERM
        started.stop()


def open_tunnel(nodes) -> socket.socket:
    """An app connection through node-a and node-b to the echo app, proven to work."""
    sock = socks5_connect(nodes.a.socks5, CLIENT_IP, ECHO_HOST, 80)
    sock.sendall(b"hello")
    received = b""
    sock.settimeout(10)
    while len(received) < 5:
        chunk = sock.recv(5 - len(received))
        assert chunk, "the echo tunnel closed before the freeze"
        received += chunk
    assert received == b"hello"
    return sock


def wait_for_end(sock: socket.socket, timeout: float) -> str:
    """How the app's connection ended: 'closed', 'reset', or 'open' when it did not end in time."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "open"
    return "closed" if not data else f"data {data!r}"


def test_app_sees_the_connection_end_when_the_peer_node_freezes(nodes):
    sock = open_tunnel(nodes)
    with sock:
        nodes.freeze_b()
        frozen_at = time.monotonic()
        outcome = wait_for_end(sock, GIVE_UP_AFTER)
        waited = time.monotonic() - frozen_at
    assert outcome in ("reset", "closed"), f"the app's connection was still {outcome} after {waited:.1f} s"
    assert any("no PING answer" in event.get("message", "") for event in nodes.a.log_events())
    # node-b comes back; node-a serves new tunnels (on a new connection).
    nodes.thaw_b()
    with open_tunnel(nodes):
        pass


def test_keepalive_timeout_is_counted_on_the_client_node(nodes):
    sock = open_tunnel(nodes)
    with sock:
        nodes.freeze_b()
        assert wait_for_end(sock, GIVE_UP_AFTER) in ("reset", "closed")
    metric = "ztwisted_hbone_connections_closed_total"
    deadline = time.monotonic() + 5
    while nodes.a.metric(metric, direction="outbound", ended_by="keepalive-timeout") < 1:
        if time.monotonic() > deadline:
            counted = {
                line for line in nodes.a.metrics().splitlines() if line.startswith(metric) and "outbound" in line
            }
            pytest.fail(f"no keepalive-timeout counted on node-a; closed connections: {sorted(counted)}")
        time.sleep(0.1)
