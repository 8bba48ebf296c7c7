"""Interop with Istio's real ztunnel, both ways: data, identities, policy (docs/interop.rst).

ztunnel runs dedicated to workload ``zpod`` in one network namespace,
``twistd ztunnel`` serves ``client`` and ``echo`` in another
(:mod:`tests.interop.ztunnel_pair`). Every byte an app sends must come back
exactly.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from tests.interop.conftest import describe_mismatch
from tests.interop.ztunnel.support import (
    APP_PORT,
    DENIED_PORT,
    ECHO_IP,
    ECHO_VIP,
    REPLY_AFTER_EOF_PORT,
    ZPOD_IP,
    ZPOD_VIP,
    ZTUNNEL_TEST_MARKS,
    ended_by,
    in_parallel,
    many,
    mesh_yaml,
    spiffe,
    through_ztunnel,
    through_ztwisted,
)
from tests.support import (
    accept_in_background,
    close_listener,
    echo_through,
    listening_socket,
    stream_and_hash,
    wait_until,
)
from ztwisted.tools.harness import Socks5Refused

pytestmark = ZTUNNEL_TEST_MARKS

BIG = 100 * 1024 * 1024
CONCURRENT = 200
SMALL = 16 * 1024

# Both directions: (name, open an app connection through the client proxy, server app's address).
ZTUNNEL_TO_ZTWISTED = "ztunnel->ztwisted"
ZTWISTED_TO_ZTUNNEL = "ztwisted->ztunnel"
DIRECTIONS = [ZTUNNEL_TO_ZTWISTED, ZTWISTED_TO_ZTUNNEL]


def connect(
    network, direction: str, port: int = APP_PORT, host: str | None = None, timeout: float = 30.0
) -> socket.socket:
    if direction == ZTUNNEL_TO_ZTWISTED:
        return through_ztunnel(network, host or ECHO_IP, port, timeout)
    return through_ztwisted(network, host or ZPOD_IP, port, timeout)


def server_syns(network, direction: str) -> int:
    """HBONE connections the client side's pool opened to the server side, so far."""
    return (network.ztw_syns if direction == ZTUNNEL_TO_ZTWISTED else network.zt_syns).count()


@pytest.fixture
def proxies(start_ztunnel, start_ztwisted):
    return start_ztunnel(), start_ztwisted()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_100_mb_each_way_byte_exact(network, proxies, direction):
    sock = connect(network, direction, timeout=120)
    with sock:
        sent, received, count = stream_and_hash(sock, BIG, timeout=120)
    assert count == BIG
    assert received == sent
    assert server_syns(network, direction) == 1
    # The server side named both ends alike (the workloads' workloadName and identities), and counted
    # every byte the client sent.
    ztunnel, ztwisted = proxies
    if direction == ZTUNNEL_TO_ZTWISTED:
        server, client_workload, server_workload = ztwisted, "zpod", "echo"
    else:
        server, client_workload, server_workload = ztunnel, "client", "zpod"
    labels = {
        "reporter": "destination",
        "source_workload": f"{client_workload}-deploy",
        "source_principal": spiffe(client_workload),
        "destination_workload": f"{server_workload}-deploy",
        "destination_principal": spiffe(server_workload),
        "connection_security_policy": "mutual_tls",
    }
    assert server.metric("istio_tcp_connections_opened_total", **labels) == 1
    assert server.metric("istio_tcp_received_bytes_total", **labels) == BIG


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_200_concurrent_tunnels(network, proxies, direction):
    sockets = many(lambda: connect(network, direction), CONCURRENT)
    payloads = [os.urandom(SMALL) for _ in sockets]
    results = in_parallel(lambda index: echo_through(sockets[index], payloads[index]), CONCURRENT)
    for sock in sockets:
        sock.close()
    wrong = [(i, r) for i, r in enumerate(results) if r != payloads[i]]
    assert not wrong, f"{len(wrong)} tunnels differ, the first #{wrong[0][0]}: " + (
        describe_mismatch(wrong[0][1], payloads[wrong[0][0]]) if isinstance(wrong[0][1], bytes) else repr(wrong[0][1])
    )
    # Each pool puts 100 streams on a connection (ztunnel's POOL_MAX_STREAMS_PER_CONNECTION, ztwisted's
    # own limit) before it opens another: 200 tunnels at once take two HBONE connections either way.
    assert server_syns(network, direction) == 2


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_half_close_carries_the_reply_after_the_request_fin(network, proxies, direction):
    request = os.urandom(SMALL)
    with connect(network, direction, REPLY_AFTER_EOF_PORT) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        reply, how = ended_by(sock)
    assert how == "eof"
    assert reply == request, describe_mismatch(reply, request)


WATCHER_PORT = 8082
# What an app sees when the app at the other end of its tunnel resets. ztwisted sends RST_STREAM for an
# app's reset and resets its app on RST_STREAM; ztunnel ends the stream cleanly for an app's reset and
# gives its app a FIN on RST_STREAM. So across ztunnel a reset arrives as EOF (docs/interop.rst).
EXPECTED_SERVER_APP_ENDING = {ZTUNNEL_TO_ZTWISTED: "eof", ZTWISTED_TO_ZTUNNEL: "eof"}
EXPECTED_CLIENT_APP_ENDING = {ZTUNNEL_TO_ZTWISTED: "eof", ZTWISTED_TO_ZTUNNEL: "eof"}


def ztwisted_outcomes(ztwisted, port: int) -> list[str]:
    """The ``outcome`` of ztwisted's access log lines for tunnels to ``port``."""
    return [
        e.get("outcome")
        for e in ztwisted.log_events()
        if e.get("message") == "connection complete" and str(e.get("dst.addr", "")).endswith(f":{port}")
    ]


class EndingWatcher:
    """A server app that reads its one connection until it ends and records how: "eof" or the error's name."""

    def __init__(self, ip: str, port: int):
        self.sock = listening_socket(ip, port, 4)
        self.received = 0
        self.how: str | None = None
        self.ended = threading.Event()
        accept_in_background(self.sock, self._watch)

    def _watch(self, conn: socket.socket) -> None:
        def read():
            with conn:
                try:
                    while data := conn.recv(65536):
                        self.received += len(data)
                    self.how = "eof"
                except OSError as e:
                    self.how = type(e).__name__ if type(e) is not OSError else f"OSError {e.errno}"
                self.ended.set()

        threading.Thread(target=read, daemon=True).start()

    def close(self) -> None:
        close_listener(self.sock)


def abort(sock: socket.socket) -> None:
    """Close with TCP RST (SO_LINGER 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_client_app_reset_ends_the_server_app_connection_and_spares_other_tunnels(network, proxies, direction):
    inside = network.in_ztw if direction == ZTUNNEL_TO_ZTWISTED else network.in_zt
    ip = ECHO_IP if direction == ZTUNNEL_TO_ZTWISTED else ZPOD_IP
    watcher = inside(lambda: EndingWatcher(ip, WATCHER_PORT))
    try:
        bystander = connect(network, direction)
        doomed = connect(network, direction, WATCHER_PORT)
        doomed.sendall(b"x" * SMALL)
        wait_until(lambda: watcher.received >= SMALL, 10, "the bytes before the reset at the server app")
        abort(doomed)
        ending = watcher.ended.wait(15) and watcher.how
        assert ending, "the server app's connection did not end after the client app's reset"
        payload = os.urandom(SMALL)
        with bystander:
            assert echo_through(bystander, payload) == payload
        assert ending == EXPECTED_SERVER_APP_ENDING[direction]
        ztwisted = proxies[1]
        expected = "closed" if direction == ZTUNNEL_TO_ZTWISTED else "reset"
        assert wait_until(lambda: ztwisted_outcomes(ztwisted, WATCHER_PORT), 10, "ztwisted's access log") == [expected]
    finally:
        watcher.close()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_server_app_reset_ends_the_client_app_connection(network, proxies, direction):
    """The server app reads a little, then resets: the client app's connection must end."""
    ip = ECHO_IP if direction == ZTUNNEL_TO_ZTWISTED else ZPOD_IP
    inside = network.in_ztw if direction == ZTUNNEL_TO_ZTWISTED else network.in_zt
    accepted = threading.Event()

    def on_connection(conn):
        conn.recv(4)
        accepted.set()
        abort(conn)

    listener = inside(lambda: listening_socket(ip, WATCHER_PORT, 16))
    accept_in_background(listener, on_connection)
    try:
        with connect(network, direction, WATCHER_PORT) as sock:
            sock.sendall(b"ping")
            assert accepted.wait(10), "the server app got no connection"
            _, how = ended_by(sock, timeout=15)
        assert how == EXPECTED_CLIENT_APP_ENDING[direction]
        ztwisted = proxies[1]
        expected = "reset" if direction == ZTUNNEL_TO_ZTWISTED else "closed"
        assert wait_until(lambda: ztwisted_outcomes(ztwisted, WATCHER_PORT), 10, "ztwisted's access log") == [expected]
    finally:
        close_listener(listener)


# -- identities and policy ------------------------------------------------------------------


def test_ztunnel_refuses_ztwisted_server_with_wrong_san(network, start_ztunnel, start_ztwisted):
    """ztunnel expects echo to be sa/echo-expected; ztwisted presents sa/echo."""
    ztunnel = start_ztunnel(mesh=mesh_yaml(echo_account="echo-expected"))
    ztwisted = start_ztwisted()
    with through_ztunnel(network, ECHO_IP, APP_PORT) as sock:
        sock.sendall(b"hello")
        data, how = ended_by(sock)
    assert data == b""
    # ztunnel answered SOCKS5 success before connecting; after the refused handshake it resets its app.
    assert how == "ConnectionResetError"
    assert network.echo_echo.connections == 0
    failures = wait_until(
        lambda: ztunnel.log_lines("error", spiffe("echo-expected")), 10, "ztunnel's log of the refusal"
    )
    assert failures
    assert ztwisted.metric("istio_tcp_connections_opened_total", reporter="destination") == 0


def test_ztwisted_refuses_ztunnel_server_with_wrong_san(network, start_ztunnel, start_ztwisted):
    """ztwisted expects zpod to be sa/zpod-expected; ztunnel presents sa/zpod."""
    start_ztunnel()
    ztwisted = start_ztwisted(mesh=mesh_yaml(zpod_account="zpod-expected"))
    with pytest.raises(Socks5Refused):
        through_ztwisted(network, ZPOD_IP, APP_PORT)
    assert network.zpod_echo.connections == 0
    assert any(
        event.get("message") == "connection complete" and "is not one of the expected" in event.get("error", "")
        for event in ztwisted.log_events()
    )


def test_ztwisted_policy_deny_reaches_ztunnel_client(network, start_ztunnel, start_ztwisted):
    """echo denies its port 9999: ztwisted answers 401; what ztunnel's app and ztunnel itself report."""
    ztunnel = start_ztunnel()
    ztwisted = start_ztwisted()
    with through_ztunnel(network, ECHO_IP, DENIED_PORT) as sock:
        sock.sendall(b"hello")
        data, how = ended_by(sock)
    assert data == b""
    # ztunnel's app: SOCKS5 success (ztunnel answers before it connects), then a reset.
    assert how == "ConnectionResetError"
    assert wait_until(
        lambda: ztunnel.log_lines("connection complete", 'error="http status: 401 Unauthorized"'),
        10,
        "ztunnel's access log of the 401",
    )
    assert any(event.get("error") == "denied by policy default/deny-9999" for event in ztwisted.log_events())
    # ztunnel counts it as a connection that failed to establish, flagged CONNECT.
    assert (
        ztunnel.metric(
            "istio_tcp_connections_failed_total",
            reporter="source",
            response_flags="CONNECT",
            destination_principal=spiffe("echo"),
        )
        == 1
    )


def test_service_vip_through_both(network, proxies):
    payload = os.urandom(SMALL)
    with through_ztunnel(network, ECHO_VIP, 80) as sock:
        assert echo_through(sock, payload) == payload
    with through_ztwisted(network, ZPOD_VIP, 80) as sock:
        assert echo_through(sock, payload) == payload
