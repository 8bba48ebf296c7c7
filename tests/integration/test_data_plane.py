"""The data plane end to end: two real twistd nodes, apps talking through SOCKS5 and HBONE."""

from __future__ import annotations

import errno
import math
import os
import socket
import struct
import threading
import time

import pytest

from tests.integration.conftest import CLIENT_IP, SERVER_IP, SINK_IP
from tests.support import ReplyAfterEofServer, echo_through, recv_all, stream_and_hash
from ztwisted.tools.harness import socks5_connect

pytestmark = pytest.mark.integration

ECHO_HOST = "echo.default.svc.cluster.local"
MiB = 1024 * 1024


def connect(nodes, host: str = ECHO_HOST, port: int = 80) -> socket.socket:
    return socks5_connect(nodes.a.socks5, CLIENT_IP, host, port)


def assert_echo_works(nodes, size: int = 50_000) -> None:
    payload = os.urandom(size)
    with connect(nodes) as sock:
        assert echo_through(sock, payload, timeout=10) == payload


@pytest.mark.parametrize(
    ("host", "port"), [(ECHO_HOST, 80), (SERVER_IP, 8080)], ids=["service-hostname", "workload-ip"]
)
def test_echo_is_byte_exact(two_nodes, host, port):
    payload = os.urandom(1_000_003)
    with socks5_connect(two_nodes.a.socks5, CLIENT_IP, host, port) as sock:
        assert echo_through(sock, payload) == payload
    pool = two_nodes.a.config_dump()["pool"]
    assert [entry["destination"] for entry in pool] == [f"{SERVER_IP}:15008"]


def test_100_mb_through_one_tunnel(two_nodes):
    total = 100 * MiB
    with connect(two_nodes) as sock:
        sent, received, count = stream_and_hash(sock, total, timeout=60)
    assert count == total
    assert received == sent
    assert len(two_nodes.a.config_dump()["pool"]) == 1


def test_200_concurrent_connections_share_few_hbone_connections(two_nodes):
    count = 200
    opened_before = two_nodes.a.metric("istio_tcp_connections_opened_total", reporter="source")
    payloads = [os.urandom(20_000 + i) for i in range(count)]
    results: list[bytes | BaseException | None] = [None] * count
    start = threading.Barrier(count)

    def client(i: int) -> None:
        try:
            start.wait(timeout=30)
            with connect(two_nodes) as sock:
                results[i] = echo_through(sock, payloads[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    failures = [(i, r) for i, r in enumerate(results) if not isinstance(r, bytes)]
    assert not failures, f"{len(failures)} connections failed, first: {failures[0]}"
    wrong = [i for i, r in enumerate(results) if r != payloads[i]]
    assert not wrong, f"{len(wrong)} connections echoed wrong bytes"

    pool = two_nodes.a.config_dump()["pool"]
    print(f"pool after {count} concurrent tunnels: {len(pool)} HBONE connections")
    assert 1 <= len(pool) <= math.ceil(count / 100) + 1, pool
    assert {entry["destination"] for entry in pool} == {f"{SERVER_IP}:15008"}
    opened = two_nodes.a.metric("istio_tcp_connections_opened_total", reporter="source") - opened_before
    assert opened >= count


def test_half_close_still_receives_the_reply_then_eof(two_nodes):
    replier = ReplyAfterEofServer(SERVER_IP, 8081)
    try:
        payload = os.urandom(2 * MiB + 17)
        with socks5_connect(two_nodes.a.socks5, CLIENT_IP, SERVER_IP, 8081) as sock:
            sock.settimeout(20)
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            # Every reply byte is sent by the app after it saw our FIN.
            assert recv_all(sock) == payload
            assert sock.recv(1) == b""  # still EOF, not a reset
    finally:
        replier.close()
    assert_echo_works(two_nodes)


def test_client_reset_mid_stream_ends_the_app_connection(two_nodes, echo_app):
    ended_before = len(echo_app.outcomes)
    sock = connect(two_nodes)
    sock.settimeout(10)
    sock.sendall(os.urandom(4 * MiB))
    assert len(sock.recv(65536)) > 0  # the tunnel is carrying data both ways
    # SO_LINGER 0: close() sends RST while unread echo is still queued.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()

    outcomes = echo_app.wait_for_outcomes(ended_before + 1, timeout=10)
    assert len(outcomes) > ended_before, "the echo app's connection did not end after the client's RST"
    assert outcomes[ended_before] in ("ConnectionResetError", "BrokenPipeError"), outcomes
    assert_echo_works(two_nodes)
    assert len(echo_app.wait_for_outcomes(ended_before + 2, timeout=5)) == ended_before + 2


def test_slow_reader_backpressure_bounds_proxy_memory(two_nodes, sink_app):
    assert_echo_works(two_nodes)  # warm up: pool connection, certificates, code paths
    baseline = {node.name: node.rss_bytes() for node in (two_nodes.a, two_nodes.b)}

    sock = socks5_connect(two_nodes.a.socks5, CLIENT_IP, SINK_IP, 8080)
    sock.setblocking(False)
    chunk = os.urandom(256 * 1024)
    written = 0
    last_progress = time.monotonic()
    limit = 200 * MiB
    while written < limit and time.monotonic() - last_progress < 2.0:
        try:
            sent = sock.send(chunk)
        except BlockingIOError:
            time.sleep(0.02)
            continue
        except OSError as e:
            pytest.fail(f"writing to the sink failed after {written} bytes: {errno.errorcode.get(e.errno, e)}")
        written += sent
        last_progress = time.monotonic()
    assert written < limit, "200 MB went into a reader that never reads: backpressure did not hold"

    growth = {node.name: node.rss_bytes() - baseline[node.name] for node in (two_nodes.a, two_nodes.b)}
    for name, grew in growth.items():
        assert grew < 64 * MiB, f"{name} RSS grew {grew / MiB:.1f} MiB for {written / MiB:.1f} MiB written"

    sock.close()
    sink_app.close()
    assert_echo_works(two_nodes)
