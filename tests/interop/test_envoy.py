"""Envoy as the HBONE peer of a real ztwisted node (as Istio's waypoints and gateways are)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from tests.interop.conftest import (
    APP_PORT,
    BANNER,
    BEYOND_WINDOW,
    CLIENT_ID,
    ECHO_ID,
    ENVOY_APP_PORT,
    HBONE_PORT,
    PAYLOAD_SIZE,
    PEER_CLIENT_ID,
    PEER_CLIENT_IP,
    PEER_SERVER_DESTINATIONS,
    PEER_SERVER_ID,
    PEER_SERVER_IP,
    TRUST_DOMAIN,
    ZT_CLIENT_IP,
    ZT_ECHO_IP,
    assert_peer_client_counted,
    describe_mismatch,
    echo_through,
    lockstep_echo,
    recv_exact,
    wait_for_metric,
)
from tests.interop.peers import EnvoyPeer, PeerFailed
from ztwisted.tools.harness import Socks5Refused, socks5_connect

pytestmark = pytest.mark.interop

CLIENT_ADMIN_PORT = 9901
SERVER_ADMIN_PORT = 9902
# Longer than Envoy's keepalive interval (1 s) plus its timeout (2 s).
IDLE_SECONDS = 3.5


def credential_values(credentials) -> dict:
    return {
        "cert_chain": str(credentials.cert_chain),
        "private_key": str(credentials.private_key),
        "roots": str(credentials.roots),
    }


def start_envoy_client(envoy_peer, credentials) -> EnvoyPeer:
    """Envoy tunnelling app connections to ``echo`` through ztwisted's inbound."""
    return envoy_peer(
        "envoy-client",
        "client",
        CLIENT_ADMIN_PORT,
        listen_ip=PEER_CLIENT_IP,
        listen_port=ENVOY_APP_PORT,
        target_authority=f"{ZT_ECHO_IP}:{APP_PORT}",
        hbone_ip=ZT_ECHO_IP,
        hbone_port=HBONE_PORT,
        source_ip=PEER_CLIENT_IP,
        expect_server_identity=str(ECHO_ID),
        **credential_values(credentials(PEER_CLIENT_ID)),
    )


def start_envoy_server(envoy_peer, credentials) -> EnvoyPeer:
    """Envoy serving HBONE for ``peer-server``, in front of its echo app."""
    return envoy_peer(
        "envoy-server",
        "server",
        SERVER_ADMIN_PORT,
        listen_ip=PEER_SERVER_IP,
        listen_port=HBONE_PORT,
        trust_domain=TRUST_DOMAIN,
        target_authority=f"{PEER_SERVER_IP}:{APP_PORT}",
        app_ip=PEER_SERVER_IP,
        app_port=APP_PORT,
        **credential_values(credentials(PEER_SERVER_ID)),
    )


def connect_app_to_envoy() -> socket.socket:
    return socket.create_connection((PEER_CLIENT_IP, ENVOY_APP_PORT), timeout=10, source_address=(PEER_CLIENT_IP, 0))


def stat(envoy: EnvoyPeer, name: str) -> int:
    stats = envoy.stats(name)
    if name not in stats:
        raise PeerFailed(f"{envoy.name} has no stat {name!r}; it has {sorted(stats)}")
    return stats[name]


def wait_for_stat(envoy: EnvoyPeer, name: str, minimum: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        value = stat(envoy, name)
        if value >= minimum or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


# -- Envoy as HBONE client (tcp_proxy tunneling), ztwisted's inbound as server -------------


def test_envoy_client_tunnels_through_inbound_byte_exact(ztwisted_node, zt_echo_app, envoy_peer, credentials):
    envoy = start_envoy_client(envoy_peer, credentials)
    payload = os.urandom(PAYLOAD_SIZE)
    with connect_app_to_envoy() as sock:
        received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)

    [entry] = envoy.access_log()
    assert entry["upstream_peer_uri_san"] == str(ECHO_ID)
    assert entry["upstream_host"] == f"{ZT_ECHO_IP}:{HBONE_PORT}"
    assert entry["bytes_sent"] == PAYLOAD_SIZE and entry["bytes_received"] == PAYLOAD_SIZE
    assert stat(envoy, "cluster.hbone.upstream_cx_total") == 1

    assert_peer_client_counted(ztwisted_node)


def test_envoy_client_multiplexes_concurrent_tunnels(ztwisted_node, zt_echo_app, envoy_peer, credentials):
    envoy = start_envoy_client(envoy_peer, credentials)
    tunnels = 8
    payloads = [os.urandom(PAYLOAD_SIZE) for _ in range(tunnels)]
    results: dict[int, bytes | Exception] = {}

    def run(index: int) -> None:
        try:
            with connect_app_to_envoy() as sock:
                results[index] = echo_through(sock, payloads[index])
        except Exception as e:  # noqa: BLE001 -- reported below
            results[index] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(tunnels)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for index in range(tunnels):
        assert results.get(index) == payloads[index], f"tunnel {index}: " + (
            describe_mismatch(results[index], payloads[index])
            if isinstance(results.get(index), bytes)
            else repr(results.get(index))
        )
    # Envoy's HTTP/2 pool put every tunnel on one connection to ztwisted.
    assert stat(envoy, "cluster.hbone.upstream_cx_total") == 1
    assert zt_echo_app.connections == tunnels


def test_envoy_client_to_server_first_app_then_lockstep_beyond_window(
    ztwisted_node, zt_banner_app, envoy_peer, credentials
):
    start_envoy_client(envoy_peer, credentials)
    with connect_app_to_envoy() as sock:
        # The app speaks first: its bytes cross ztwisted's inbound right behind the 200.
        assert recv_exact(sock, len(BANNER)) == BANNER
        # More than ztwisted's 4 MiB stream window, never much in flight.
        lockstep_echo(sock, os.urandom(BEYOND_WINDOW))


def test_envoy_client_idle_tunnel_survives_keepalive_pings(ztwisted_node, zt_echo_app, envoy_peer, credentials):
    envoy = start_envoy_client(envoy_peer, credentials)
    payload = os.urandom(PAYLOAD_SIZE)
    with connect_app_to_envoy() as sock:
        received = echo_through(
            sock, payload, pause_at=PAYLOAD_SIZE // 2, during_pause=lambda: time.sleep(IDLE_SECONDS)
        )
    assert received == payload, describe_mismatch(received, payload)
    # Envoy PINGed every second during the pause; ztwisted answered every one.
    assert stat(envoy, "cluster.hbone.http2.keepalive_timeout") == 0
    assert stat(envoy, "cluster.hbone.upstream_cx_total") == 1


def test_envoy_client_stream_finishes_while_ztwisted_drains(start_ztwisted, zt_echo_app, envoy_peer, credentials):
    node = start_ztwisted("--drain-timeout", "15")
    envoy = start_envoy_client(envoy_peer, credentials)
    payload = os.urandom(PAYLOAD_SIZE)

    def drain_node():
        # Envoy opens its tunnel when the app connects; drain only once ztwisted carries it.
        if wait_for_metric(node, "istio_tcp_connections_opened_total", 1, reporter="destination") != 1:
            raise AssertionError("ztwisted did not open the tunnel from Envoy within 5 s")
        node.process.send_signal(signal.SIGTERM)
        # Envoy counts the GOAWAY that tells it to open no new streams.
        if wait_for_stat(envoy, "cluster.hbone.upstream_cx_close_notify", 1) < 1:
            raise AssertionError("Envoy saw no GOAWAY within 5 s of SIGTERM to ztwisted")

    with connect_app_to_envoy() as sock:
        received = echo_through(sock, payload, pause_at=PAYLOAD_SIZE // 4, during_pause=drain_node)
    assert received == payload, describe_mismatch(received, payload)
    [entry] = envoy.access_log()
    assert entry["response_flags"] == "-"
    try:
        status = node.process.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail("ztwisted did not exit within 10 s after its last stream finished")
    # twistd re-raises the signal that stopped it, so SIGTERM is a clean exit.
    assert status in (0, -signal.SIGTERM)


# -- ztwisted's outbound as client, Envoy terminating CONNECT as HBONE server ----------------


@pytest.mark.parametrize("destination", PEER_SERVER_DESTINATIONS)
def test_outbound_to_envoy_server_byte_exact(ztwisted_node, peer_echo_app, envoy_peer, credentials, destination):
    envoy = start_envoy_server(envoy_peer, credentials)
    payload = os.urandom(PAYLOAD_SIZE)
    with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, *destination) as sock:
        received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)

    [entry] = envoy.access_log()
    assert entry["method"] == "CONNECT"
    assert entry["authority"] == f"{PEER_SERVER_IP}:{APP_PORT}"
    assert entry["protocol"] == "HTTP/2"
    assert entry["response_code"] == 200
    assert entry["downstream_peer_uri_san"] == str(CLIENT_ID)
    assert entry["downstream_remote_address"].startswith(f"{ZT_CLIENT_IP}:")
    assert entry["forwarded"].startswith(f'for="{ZT_CLIENT_IP}:')
    assert entry["bytes_received"] == PAYLOAD_SIZE and entry["bytes_sent"] == PAYLOAD_SIZE


def test_outbound_idle_tunnel_to_envoy_server_survives_keepalive_pings(
    ztwisted_node, peer_echo_app, envoy_peer, credentials
):
    envoy = start_envoy_server(envoy_peer, credentials)
    payload = os.urandom(PAYLOAD_SIZE)
    with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT) as sock:
        received = echo_through(
            sock, payload, pause_at=PAYLOAD_SIZE // 2, during_pause=lambda: time.sleep(IDLE_SECONDS)
        )
    assert received == payload, describe_mismatch(received, payload)
    assert stat(envoy, "http2.keepalive_timeout") == 0
    assert stat(envoy, "http.hbone_in.downstream_cx_total") == 1


def test_outbound_refusal_by_envoy_server_leaves_connection_usable(
    ztwisted_node, peer_echo_app, envoy_peer, credentials
):
    envoy = start_envoy_server(envoy_peer, credentials)
    # Envoy routes only its workload's app port; any other authority gets 404.
    with pytest.raises(Socks5Refused) as refused:
        socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT + 1).close()
    assert refused.value.code == 0x05  # connection refused
    payload = os.urandom(PAYLOAD_SIZE)
    with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT) as sock:
        received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)

    entries = envoy.access_log(count=2)
    assert [(e["authority"], e["response_code"]) for e in entries] == [
        (f"{PEER_SERVER_IP}:{APP_PORT + 1}", 404),
        (f"{PEER_SERVER_IP}:{APP_PORT}", 200),
    ]
    # Both tunnels went over the one pooled HTTP/2 connection.
    assert stat(envoy, "http.hbone_in.downstream_cx_total") == 1
