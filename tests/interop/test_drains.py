"""Graceful drains between ztwisted and real HBONE peers (Envoy, Node.js ``http2``), both ways.

A tunnel is put in flight (its first quarter echoed), the peer or ztwisted
drains, and the rest must come back byte-exact; then the next tunnel must
succeed on a fresh connection to a successor on the same address: a second
Envoy sharing the port, a restarted Node.js server, a new ztwisted process.

Every process is started from the test's main thread: Envoy 1.40 got SIGTERM
when the thread that started it ended.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.interop.conftest import (
    APP_PORT,
    HBONE_PORT,
    PAYLOAD_SIZE,
    PEER_CLIENT_ID,
    PEER_SERVER_ID,
    PEER_SERVER_IP,
    TRUST_DOMAIN,
    ZT_CLIENT_IP,
    ZT_ECHO_IP,
    describe_mismatch,
    echo_through,
    recv_exact,
    wait_for_metric,
)
from tests.interop.peers import EnvoyPeer, NodePeer, tls_config
from tests.interop.test_envoy import connect_app_to_envoy, start_envoy_client
from tests.interop.test_node_http2 import NodeClientRun
from ztwisted.tools.harness import NodeProcess, socks5_connect

pytestmark = pytest.mark.interop

MAX_STREAM_ID = 2**31 - 1
DRAINING_ADMIN_PORT = 9911
REPLACEMENT_ADMIN_PORT = 9912
# Envoy's graceful drain: GOAWAY at the first answer after the drain starts
# (immediate strategy), the listener closed after this many seconds.
ENVOY_DRAIN_SECONDS = 2
# Tunnels pause in the middle while the test drains and restarts peers.
TUNNEL_TIMEOUT = 30.0
SMALL_PAYLOAD = 64 * 1024
HEAD = PAYLOAD_SIZE // 4


# -- helpers ---------------------------------------------------------------------------


def wait_until(condition: Callable[[], object], timeout: float, what: str | Callable[[], str]):
    """``condition()``'s first truthy value; after ``timeout`` seconds, fails saying ``what`` (or ``what()``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what() if callable(what) else what}: not within {timeout} s")
        time.sleep(0.05)


def goaways_logged(node: NodeProcess) -> list[str]:
    return [e["message"] for e in node.log_events() if e.get("message", "").startswith("GOAWAY from ")]


def pool(node: NodeProcess) -> list[dict]:
    return node.config_dump()["pool"]


def tunnel_through(node: NodeProcess) -> socket.socket:
    """A SOCKS5 tunnel from ztwisted's ``client`` to the peer-served ``peer-server`` app."""
    sock = socks5_connect(node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT)
    sock.settimeout(TUNNEL_TIMEOUT)
    return sock


def echo_head(sock: socket.socket, payload: bytes, size: int = HEAD) -> bytes:
    """Send the first ``size`` bytes and read their echo: the tunnel is now in flight."""
    sock.sendall(payload[:size])
    return recv_exact(sock, size)


def finish_echo(sock: socket.socket, payload: bytes, head: bytes) -> None:
    """Send the rest of ``payload`` and half-close; everything must come back byte-exact."""
    received = head + echo_through(sock, payload[len(head) :])
    assert received == payload, describe_mismatch(received, payload)


def small_echo(sock: socket.socket) -> None:
    payload = os.urandom(SMALL_PAYLOAD)
    received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)


def start_envoy_server(envoy_peer, credentials, name: str, admin_port: int) -> EnvoyPeer:
    """Envoy terminating HBONE for ``peer-server``; drains with the immediate strategy."""
    issued = credentials(PEER_SERVER_ID)
    return envoy_peer(
        name,
        "server",
        admin_port,
        extra_args=("--drain-time-s", str(ENVOY_DRAIN_SECONDS), "--drain-strategy", "immediate"),
        listen_ip=PEER_SERVER_IP,
        listen_port=HBONE_PORT,
        trust_domain=TRUST_DOMAIN,
        target_authority=f"{PEER_SERVER_IP}:{APP_PORT}",
        app_ip=PEER_SERVER_IP,
        app_port=APP_PORT,
        cert_chain=str(issued.cert_chain),
        private_key=str(issued.private_key),
        roots=str(issued.roots),
    )


def start_node_server(node_peer, credentials, name: str, **options) -> NodePeer:
    return node_peer(
        name,
        "server",
        {
            **tls_config(credentials(PEER_SERVER_ID)),
            "listen": {"host": PEER_SERVER_IP, "port": HBONE_PORT},
            "allowedTargets": [f"{PEER_SERVER_IP}:{APP_PORT}"],
            **options,
        },
    )


def envoy_stat(envoy: EnvoyPeer, name: str) -> int:
    stats = envoy.stats(name)
    if name not in stats:
        pytest.fail(f"{envoy.name} has no stat {name!r}; it has {sorted(stats)}")
    return stats[name]


def nonzero_stats(envoy: EnvoyPeer, prefix: str) -> dict[str, int]:
    return {name: value for name, value in envoy.stats(prefix).items() if value}


# -- ztwisted's outbound, the peer drains ----------------------------------------------------


def test_outbound_tunnel_finishes_while_envoy_server_drains(ztwisted_node, peer_echo_app, envoy_peer, credentials):
    draining = start_envoy_server(envoy_peer, credentials, "envoy-server", DRAINING_ADMIN_PORT)
    payload = os.urandom(PAYLOAD_SIZE)
    with tunnel_through(ztwisted_node) as in_flight:
        head = echo_head(in_flight, payload)
        status, body = draining.admin_post("/drain_listeners?graceful")
        assert status == 200, f"drain_listeners answered {status}: {body}"
        # Envoy's HTTP/2 drain sends no GOAWAY on its own: it sends one on a
        # connection when it answers the next request there. This tunnel still
        # goes over the pooled connection and gets through.
        with tunnel_through(ztwisted_node) as answered_while_draining:
            small_echo(answered_while_draining)
        wait_until(lambda: goaways_logged(ztwisted_node), 10, "ztwisted logged no GOAWAY from the draining Envoy")
        assert [c["usable"] for c in pool(ztwisted_node)] == [False]

        # The replacement shares the address (SO_REUSEPORT) while the draining
        # Envoy still listens; once that one closes its listener, a new
        # connection can only reach the replacement.
        replacement = start_envoy_server(envoy_peer, credentials, "envoy-server-2", REPLACEMENT_ADMIN_PORT)
        wait_until(
            lambda: envoy_stat(draining, "listener_manager.listener_stopped") >= 1,
            ENVOY_DRAIN_SECONDS + 10,
            "the draining Envoy did not stop its listener",
        )
        with tunnel_through(ztwisted_node) as after_goaway:
            small_echo(after_goaway)
        assert ztwisted_node.metric("ztwisted_pool_connections_opened_total") == 2
        assert [c["usable"] for c in pool(ztwisted_node)] == [False, True]

        finish_echo(in_flight, payload, head)

    sizes = sorted(e["bytes_received"] for e in draining.access_log(count=2))
    assert sizes == [SMALL_PAYLOAD, PAYLOAD_SIZE]
    assert {e["response_flags"] for e in draining.access_log(count=2)} == {"-"}
    assert [e["bytes_received"] for e in replacement.access_log()] == [SMALL_PAYLOAD]
    assert envoy_stat(draining, "http.hbone_in.downstream_cx_drain_close") == 1
    # With its last stream done, the drained connection closes cleanly (ztwisted
    # closes it at once; Envoy would after its own drain timeout).
    wait_until(
        lambda: envoy_stat(draining, "http.hbone_in.downstream_cx_destroy") == 1,
        10,
        "the drained connection to Envoy did not close",
    )
    wait_until(lambda: len(pool(ztwisted_node)) == 1, 10, "ztwisted kept the drained connection in its pool")
    assert [c["usable"] for c in pool(ztwisted_node)] == [True]
    closed = "ztwisted_hbone_connections_closed_total"
    assert ztwisted_node.metric(closed, direction="outbound") == 1
    clean = sum(ztwisted_node.metric(closed, direction="outbound", ended_by=ending) for ending in ("drained", "peer"))
    assert clean == 1, f"the drained connection did not end cleanly: {ztwisted_node.metrics()}"


def test_outbound_tunnel_finishes_while_node_server_closes(ztwisted_node, peer_echo_app, node_peer, credentials):
    closing = start_node_server(node_peer, credentials, "node-server", closeOnStdin=True)
    payload = os.urandom(PAYLOAD_SIZE)
    with tunnel_through(ztwisted_node) as in_flight:
        head = echo_head(in_flight, payload)
        closing.send_line("close")
        assert closing.wait_for_event("server_closing", timeout=5)["sessions"] == 1
        wait_until(
            lambda: goaways_logged(ztwisted_node), 10, "ztwisted logged no GOAWAY from the closing Node.js server"
        )
        assert goaways_logged(ztwisted_node)[0].endswith("last stream 1, error code 0")
        assert [c["usable"] for c in pool(ztwisted_node)] == [False]

        # The closed server no longer listens; the next tunnel needs its successor.
        restarted = start_node_server(node_peer, credentials, "node-server-restarted")
        with tunnel_through(ztwisted_node) as after_goaway:
            small_echo(after_goaway)
        assert ztwisted_node.metric("ztwisted_pool_connections_opened_total") == 2

        finish_echo(in_flight, payload, head)

    # The last session ended once its stream was done: server.close() completes.
    closing.wait_for_event("server_closed", timeout=10)
    assert not closing.events("session_error") and not closing.events("stream_error")
    assert [e["rstCode"] for e in closing.events("stream_closed")] == [0]
    assert len(closing.events("request")) == 1
    assert len(restarted.events("request")) == 1
    wait_until(lambda: len(pool(ztwisted_node)) == 1, 10, "ztwisted kept the closed server's connection in its pool")
    assert [c["usable"] for c in pool(ztwisted_node)] == [True]


# -- ztwisted's inbound drains, the peers are clients -----------------------------------------


def test_inbound_drain_lets_node_and_envoy_tunnels_finish_then_restart(
    start_ztwisted, zt_echo_app, node_peer, envoy_peer, credentials, tmp_path
):
    node = start_ztwisted("--drain-timeout", "15")
    node_client = NodeClientRun(
        node_peer,
        tmp_path,
        credentials(PEER_CLIENT_ID),
        authority=f"{ZT_ECHO_IP}:{APP_PORT}",
        holdAfterBytes=HEAD,
        awaitServerClose=True,
    )
    node_client.peer.wait_for_event("holding", timeout=10)
    envoy = start_envoy_client(envoy_peer, credentials)
    envoy_payload = os.urandom(PAYLOAD_SIZE)
    with connect_app_to_envoy() as app:
        app.settimeout(TUNNEL_TIMEOUT)
        head = echo_head(app, envoy_payload)
        assert wait_for_metric(node, "istio_tcp_connections_opened_total", 2, reporter="destination") == 2

        node.process.send_signal(signal.SIGTERM)
        node_client.peer.wait_for_event("goaway", timeout=10)
        wait_until(
            lambda: envoy_stat(envoy, "cluster.hbone.upstream_cx_close_notify") >= 1,
            10,
            "Envoy counted no GOAWAY from the draining ztwisted",
        )

        node_client.peer.send_line()
        finish_echo(app, envoy_payload, head)

    assert node_client.wait() == 0, f"Node.js client failed during the drain: {node_client.peer.events('error')}"
    assert node_client.received() == node_client.payload, describe_mismatch(node_client.received(), node_client.payload)
    goaways = [(g["errorCode"], g["lastStreamID"]) for g in node_client.peer.events("goaway")]
    assert goaways[0] == (0, MAX_STREAM_ID) and goaways[-1] == (0, 1), goaways
    ended = node_client.peer.wait_for_event("connection_ended", timeout=5)
    assert ended["clean"], f"the TLS connection did not end cleanly: {ended}"
    assert ended["closeNotify"], f"ztwisted closed TCP without TLS close_notify first: {ended}"

    [entry] = envoy.access_log()
    assert entry["response_flags"] == "-"
    assert entry["bytes_sent"] == PAYLOAD_SIZE and entry["bytes_received"] == PAYLOAD_SIZE
    # Envoy's pool closes a connection that got GOAWAY itself once its last
    # stream ends, from inside the callback for that END_STREAM; Envoy 1.40
    # counts that as upstream_cx_destroy_local plus upstream_cx_protocol_error
    # (it does the same after a Node.js server's graceful GOAWAY), so neither is
    # asserted. What matters: the connection is gone and no request was cut.
    wait_until(
        lambda: envoy_stat(envoy, "cluster.hbone.upstream_cx_destroy") == 1,
        10,
        lambda: f"Envoy's connection to the draining ztwisted did not close: {nonzero_stats(envoy, 'cluster.hbone.')}",
    )
    assert envoy_stat(envoy, "cluster.hbone.upstream_cx_close_notify") == 1
    assert envoy_stat(envoy, "cluster.hbone.upstream_cx_destroy_remote_with_active_rq") == 0
    assert envoy_stat(envoy, "cluster.hbone.upstream_cx_destroy_local_with_active_rq") == 0
    assert envoy_stat(envoy, "cluster.hbone.upstream_rq_rx_reset") == 0

    try:
        status = node.process.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail("ztwisted did not exit within 10 s after its last streams finished")
    # twistd re-raises the signal that stopped it, so SIGTERM is a clean exit.
    assert status in (0, -signal.SIGTERM)

    restarted = start_ztwisted(process_name="node-z-restarted")
    node_client_again = NodeClientRun(
        node_peer, tmp_path, credentials(PEER_CLIENT_ID), authority=f"{ZT_ECHO_IP}:{APP_PORT}", name="node-client-again"
    )
    assert node_client_again.wait() == 0, (
        f"Node.js client failed after the restart: {node_client_again.peer.events('error')}"
    )
    assert node_client_again.received() == node_client_again.payload
    with connect_app_to_envoy() as app:
        app.settimeout(TUNNEL_TIMEOUT)
        small_echo(app)
    assert envoy_stat(envoy, "cluster.hbone.upstream_cx_total") == 2
    assert wait_for_metric(restarted, "istio_tcp_connections_opened_total", 2, reporter="destination") == 2
