"""Node.js's own ``http2`` module as the HBONE peer of a real ztwisted node."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.interop.conftest import (
    APP_PORT,
    BEYOND_WINDOW,
    CLIENT_ID,
    ECHO_ID,
    HBONE_PORT,
    PAYLOAD_SIZE,
    PEER_CLIENT_ID,
    PEER_CLIENT_IP,
    PEER_SERVER_DESTINATIONS,
    PEER_SERVER_ID,
    PEER_SERVER_IP,
    ZT_CLIENT_IP,
    ZT_ECHO_IP,
    assert_peer_client_counted,
    describe_mismatch,
    echo_through,
    identity,
    lockstep_echo,
    recv_exact,
    wait_for_metric,
)
from tests.interop.peers import PeerCredentials, tls_config
from ztwisted.ca import create_files
from ztwisted.tools.harness import Socks5Refused, socks5_connect

pytestmark = pytest.mark.interop

CLIENT_TIMEOUT = 30.0
MAX_STREAM_ID = 2**31 - 1


class NodeClientRun:
    """A Node.js HBONE client aimed at ztwisted's inbound of workload ``echo``."""

    def __init__(
        self, node_peer, tmp_path, credentials: PeerCredentials, *, authority: str, name="node-client", **options
    ):
        self.payload = os.urandom(options.pop("payload_size", PAYLOAD_SIZE))
        payload_path = tmp_path / f"{name}-payload.bin"
        payload_path.write_bytes(self.payload)
        self.output = tmp_path / f"{name}-received.bin"
        config = {
            **tls_config(credentials),
            "connect": {"host": ZT_ECHO_IP, "port": HBONE_PORT},
            "localAddress": PEER_CLIENT_IP,
            "authority": authority,
            "expectServerIdentity": str(ECHO_ID),
            "payload": str(payload_path),
            "output": str(self.output),
            "timeoutMs": int((CLIENT_TIMEOUT - 5) * 1000),
            **options,
        }
        self.peer = node_peer(name, "client", config)

    def wait(self) -> int:
        return self.peer.wait(CLIENT_TIMEOUT)

    def received(self, index: int = 0) -> bytes:
        return self.output.with_name(f"{self.output.name}.{index}").read_bytes()


def echo_authority() -> str:
    return f"{ZT_ECHO_IP}:{APP_PORT}"


@pytest.fixture
def intermediate_ca(tmp_path):
    """A plug-in CA whose signing certificate is an intermediate: peers trust only the root."""
    return create_files(tmp_path / "plug-in-ca", intermediate=True)


# -- Node.js as HBONE client, ztwisted's inbound as server ---------------------------------


def test_node_client_tunnels_through_inbound_byte_exact(ztwisted_node, zt_echo_app, node_peer, credentials, tmp_path):
    run = NodeClientRun(node_peer, tmp_path, credentials(PEER_CLIENT_ID), authority=echo_authority())
    assert run.wait() == 0, f"Node.js client failed: {run.peer.events('error')}"
    assert run.received() == run.payload, describe_mismatch(run.received(), run.payload)

    connected = run.peer.events("connected")[0]
    assert connected["alpn"] == "h2"
    assert connected["tlsVersion"] == "TLSv1.3"
    assert connected["serverIdentities"] == [str(ECHO_ID)]
    assert [t["status"] for t in run.peer.events("done")[0]["tunnels"]] == [200]

    # ztwisted identified the Node.js peer by its certificate and its source address.
    assert_peer_client_counted(ztwisted_node)


def test_node_client_multiplexes_tunnels_on_one_connection(
    ztwisted_node, zt_echo_app, node_peer, credentials, tmp_path
):
    tunnels = 8
    run = NodeClientRun(node_peer, tmp_path, credentials(PEER_CLIENT_ID), authority=echo_authority(), tunnels=tunnels)
    assert run.wait() == 0, f"Node.js client failed: {run.peer.events('error')}"
    for index in range(tunnels):
        assert run.received(index) == run.payload, (
            f"tunnel {index}: {describe_mismatch(run.received(index), run.payload)}"
        )
    results = run.peer.events("done")[0]["tunnels"]
    assert len({r["streamId"] for r in results}) == tunnels
    assert len(run.peer.events("connected")) == 1
    assert zt_echo_app.connections == tunnels


def test_node_client_with_intermediate_ca_chain(
    start_ztwisted, intermediate_ca, zt_echo_app, node_peer, credentials, tmp_path
):
    start_ztwisted("--ca-dir", str(tmp_path / "plug-in-ca"))
    run = NodeClientRun(
        node_peer, tmp_path, credentials(PEER_CLIENT_ID, issuer=intermediate_ca), authority=echo_authority()
    )
    assert run.wait() == 0, f"Node.js client failed: {run.peer.events('error')}"
    assert run.received() == run.payload, describe_mismatch(run.received(), run.payload)


def test_node_client_connect_to_address_not_served_gets_400(
    ztwisted_node, zt_echo_app, node_peer, credentials, tmp_path
):
    run = NodeClientRun(node_peer, tmp_path, credentials(PEER_CLIENT_ID), authority=f"{PEER_SERVER_IP}:{APP_PORT}")
    assert run.wait() == 1
    assert [e["status"] for e in run.peer.events("response")] == [400]
    assert zt_echo_app.connections == 0


def test_node_client_with_certificate_from_another_ca_is_refused(
    ztwisted_node, zt_echo_app, node_peer, credentials, tmp_path
):
    foreign_ca = create_files(tmp_path / "foreign-ca", intermediate=False, organization="elsewhere")
    foreign = credentials(PEER_CLIENT_ID, issuer=foreign_ca)
    # Trust ztwisted's roots, so only ztwisted's verification of the client can fail.
    ours = credentials(identity("bystander"))
    mixed = PeerCredentials(foreign.identity, foreign.private_key, foreign.cert_chain, ours.roots)
    run = NodeClientRun(node_peer, tmp_path, mixed, authority=echo_authority())
    assert run.wait() == 1
    assert not run.peer.events("response"), "ztwisted answered a CONNECT from an untrusted client"
    assert zt_echo_app.connections == 0
    assert ztwisted_node.metric("ztwisted_tls_handshake_failures_total", reason="inbound") >= 1


def test_node_client_reset_ends_only_its_tunnel(ztwisted_node, zt_echo_app, node_peer, credentials, tmp_path):
    run = NodeClientRun(
        node_peer, tmp_path, credentials(PEER_CLIENT_ID), authority=echo_authority(), tunnels=2, resetTunnels=[0]
    )
    assert run.wait() == 0, f"Node.js client failed: {run.peer.events('error')}"
    reset, _completed = run.peer.events("done")[0]["tunnels"]
    assert reset["reset"] is True
    assert run.received(1) == run.payload, describe_mismatch(run.received(1), run.payload)
    # ztwisted ended both app connections, and logged the reset one as such.
    closed = wait_for_metric(
        ztwisted_node, "istio_tcp_connections_closed_total", 2, reporter="destination", destination_workload="echo"
    )
    assert closed == 2
    errors = [
        e.get("error") for e in ztwisted_node.log_events() if e.get("direction") == "inbound" and "bytes_sent" in e
    ]
    assert len(errors) == 2 and errors.count(None) == 1, errors
    assert "reset" in next(e for e in errors if e is not None)


def test_node_client_stream_finishes_while_ztwisted_drains(
    start_ztwisted, zt_echo_app, node_peer, credentials, tmp_path
):
    node = start_ztwisted("--drain-timeout", "15")
    run = NodeClientRun(
        node_peer, tmp_path, credentials(PEER_CLIENT_ID), authority=echo_authority(), holdAfterBytes=PAYLOAD_SIZE // 4
    )
    run.peer.wait_for_event("holding", timeout=10)
    node.process.send_signal(signal.SIGTERM)
    # RFC 9113 6.8: GOAWAY(2^31-1), then, after the PING round trip, the real last stream id.
    run.peer.wait_for_event("goaway", timeout=5)
    run.peer.send_line()
    assert run.wait() == 0, f"Node.js client failed during the drain: {run.peer.events('error')}"
    assert run.received() == run.payload, describe_mismatch(run.received(), run.payload)
    goaways = [(g["errorCode"], g["lastStreamID"]) for g in run.peer.events("goaway")]
    assert goaways[0] == (0, MAX_STREAM_ID) and goaways[-1] == (0, 1), goaways
    try:
        status = node.process.wait(10)
    except subprocess.TimeoutExpired:
        pytest.fail("ztwisted did not exit within 10 s after its last stream finished")
    # twistd re-raises the signal that stopped it, so SIGTERM is a clean exit.
    assert status in (0, -signal.SIGTERM)


@pytest.mark.parametrize(
    "early_bytes",
    [
        pytest.param(0, id="after-200"),
        pytest.param(1024, id="early-data"),
    ],
)
def test_node_client_lockstep_exchange_beyond_stream_window(
    ztwisted_node, zt_echo_app, node_peer, credentials, tmp_path, early_bytes
):
    # Lockstep: each 16 KiB chunk waits for its echo, so the app's socket never
    # backs up and only WINDOW_UPDATEs keep the stream going.
    run = NodeClientRun(
        node_peer,
        tmp_path,
        credentials(PEER_CLIENT_ID),
        authority=echo_authority(),
        payload_size=BEYOND_WINDOW,
        earlyBytes=early_bytes,
        chunkSize=16 * 1024,
        lockstep=True,
        timeoutMs=12_000,
    )
    assert run.wait() == 0, f"Node.js client failed: {run.peer.events('error')}"
    assert run.received() == run.payload, describe_mismatch(run.received(), run.payload)


# -- ztwisted's outbound as client, Node.js as HBONE server ----------------------------------


def start_node_server(node_peer, credentials, server_identity=PEER_SERVER_ID, issuer=None, **options):
    """A Node.js HBONE server for workload ``peer-server``, forwarding to its app."""
    return node_peer(
        "node-server",
        "server",
        {
            **tls_config(credentials(server_identity, issuer=issuer)),
            "listen": {"host": PEER_SERVER_IP, "port": HBONE_PORT},
            "allowedTargets": [f"{PEER_SERVER_IP}:{APP_PORT}"],
            **options,
        },
    )


@pytest.mark.parametrize("destination", PEER_SERVER_DESTINATIONS)
def test_outbound_to_node_server_byte_exact(ztwisted_node, peer_echo_app, node_peer, credentials, destination):
    server = start_node_server(node_peer, credentials)
    payload = os.urandom(PAYLOAD_SIZE)
    with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, *destination) as sock:
        received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)

    [request] = server.events("request")
    assert request["method"] == "CONNECT"
    assert request["authority"] == f"{PEER_SERVER_IP}:{APP_PORT}"
    # RFC 9113 8.5: a CONNECT carries neither :scheme nor :path.
    assert ":scheme" not in request["headers"] and ":path" not in request["headers"]
    assert request["peerIdentities"] == [str(CLIENT_ID)]
    assert request["alpn"] == "h2"
    assert request["tlsVersion"] == "TLSv1.3"
    assert request["source"].startswith(f"{ZT_CLIENT_IP}:")
    assert request["headers"]["forwarded"].startswith(f'for="{ZT_CLIENT_IP}:')


def test_outbound_to_node_server_with_intermediate_ca_chain(
    start_ztwisted, intermediate_ca, peer_echo_app, node_peer, credentials, tmp_path
):
    node = start_ztwisted("--ca-dir", str(tmp_path / "plug-in-ca"))
    server = start_node_server(node_peer, credentials, issuer=intermediate_ca)
    payload = os.urandom(PAYLOAD_SIZE)
    with socks5_connect(node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT) as sock:
        received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)
    assert [r["peerIdentities"] for r in server.events("request")] == [[str(CLIENT_ID)]]


def test_outbound_uses_new_connection_after_node_server_goaway(ztwisted_node, peer_echo_app, node_peer, credentials):
    server = start_node_server(node_peer, credentials, goawayAfterResponse=True)
    first_payload, second_payload = os.urandom(PAYLOAD_SIZE), os.urandom(PAYLOAD_SIZE)
    with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT) as first:
        server.wait_for_event("goaway_sent", timeout=5)
        # The first tunnel is still open; its connection must not get the second one.
        with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT) as second:
            assert echo_through(second, second_payload) == second_payload
        received = echo_through(first, first_payload)
    assert received == first_payload, describe_mismatch(received, first_payload)

    requests = server.events("request")
    assert len(requests) == 2
    assert requests[0]["source"] != requests[1]["source"], "both tunnels went over the connection that got GOAWAY"
    assert len(server.events("session")) == 2


def test_outbound_server_first_banner_then_lockstep_beyond_window(ztwisted_node, peer_echo_app, node_peer, credentials):
    banner = b"220 peer-server ready\r\n"
    start_node_server(node_peer, credentials, banner=banner.decode())
    payload = os.urandom(BEYOND_WINDOW)
    with socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT) as sock:
        assert recv_exact(sock, len(banner)) == banner
        lockstep_echo(sock, payload)


def test_outbound_refuses_when_node_server_answers_503(ztwisted_node, node_peer, credentials):
    # No peer_echo_app: the Node.js server cannot reach the app and answers 503.
    server = start_node_server(node_peer, credentials)
    with pytest.raises(Socks5Refused) as refused:
        socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT).close()
    assert refused.value.code == 0x05  # connection refused
    assert len(server.events("upstream_error")) == 1


def test_outbound_refuses_node_server_with_wrong_identity(ztwisted_node, peer_echo_app, node_peer, credentials):
    server = start_node_server(node_peer, credentials, server_identity=identity("impostor"))
    with pytest.raises(Socks5Refused):
        socks5_connect(ztwisted_node.socks5, ZT_CLIENT_IP, PEER_SERVER_IP, APP_PORT).close()
    assert not server.events("request"), "ztwisted sent a CONNECT to a server with the wrong identity"
    assert peer_echo_app.connections == 0
