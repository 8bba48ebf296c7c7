"""Bad input at every door: each gets a clear error, and the proxies keep serving.

The nodes are shared by the whole module on purpose: damage left by one bad
client would show up as a failed echo in the next test.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading
import time

import h2.config
import h2.connection
import h2.events
import pytest

from tests.integration.conftest import CLIENT_IP, NET, SERVER_IP, SINK_IP, TWO_NODE_MESH, TwoNodes
from tests.support import EchoServer, close_listener, echo_through, mesh_workload, pod_uid, recv_all
from ztwisted.ca import CertificateAuthority, IssuedCertificate, create_files
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import Socks5Refused, socks5_connect

pytestmark = pytest.mark.integration

# A workload of a node no ztwisted process runs: whoever listens on its 15008 is an impostor.
ELSEWHERE_IP = f"127.{NET}.4.1"
# An address that is no workload and no VIP at all.
OUTSIDE_IP = f"127.{NET}.9.9"
ECHO_HOST = "echo.default.svc.cluster.local"
CLIENT_ID = SpiffeId("cluster.local", "default", "client")
ECHO_ID = SpiffeId("cluster.local", "default", "echo")

ELSEWHERE_WORKLOAD = mesh_workload("elsewhere", ELSEWHERE_IP, "node-c", uid=pod_uid("elsewhere"))
# Appended to the `workloads` list, which ends where the top-level `services` starts.
MESH = TWO_NODE_MESH.replace("\nservices:\n", "\n" + ELSEWHERE_WORKLOAD + "services:\n", 1)
assert ELSEWHERE_WORKLOAD in MESH


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    echo = EchoServer(SERVER_IP, 8080)
    started = TwoNodes(tmp_path_factory.mktemp("bad-input"), MESH).start()
    started.ca = CertificateAuthority.load(started.a.state_dir / "ca")
    yield started
    started.stop()
    echo.close()


@pytest.fixture
def still_serving(nodes):
    """After the test: a normal echo still goes through both nodes."""
    yield nodes
    payload = os.urandom(100_000)
    with socks5_connect(nodes.a.socks5, CLIENT_IP, ECHO_HOST, 80) as sock:
        assert echo_through(sock, payload, timeout=10) == payload


def wait_for_log(node, predicate, since: int = 0, timeout: float = 5.0) -> dict:
    """The first JSON log event after the ``since``-th one that satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while True:
        events = node.log_events()[since:]
        for event in events:
            if predicate(event):
                return event
        if time.monotonic() > deadline:
            messages = "\n".join(e.get("message", "") for e in events[-20:])
            pytest.fail(f"{node.name} logged no matching event; last messages:\n{messages}")
        time.sleep(0.05)


def message_has(*fragments: str):
    return lambda event: all(f in event.get("message", "") for f in fragments)


# -- TLS clients -----------------------------------------------------------------


def client_context(tmp_path, issued: IssuedCertificate | None, roots_pem: bytes) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # identities are URI SANs; no DNS names, no SNI
    context.load_verify_locations(cadata=roots_pem.decode())
    context.set_alpn_protocols(["h2"])
    if issued is not None:
        cert_file, key_file = write_pem(tmp_path, issued)
        context.load_cert_chain(cert_file, key_file)
    return context


def write_pem(tmp_path, issued: IssuedCertificate) -> tuple[str, str]:
    name = str(issued.identity).replace("/", "_").replace(":", "")
    cert_file = tmp_path / f"{name}.crt"
    key_file = tmp_path / f"{name}.key"
    cert_file.write_bytes(issued.cert_pem + issued.chain_pem)
    key_file.write_bytes(issued.key_pem)
    return str(cert_file), str(key_file)


def tls_attempt(context: ssl.SSLContext, ip: str = SERVER_IP) -> str:
    """Handshake, then read: how the server ended it (TLS 1.3 reports client-cert refusals on the first read)."""
    raw = socket.create_connection((ip, 15008), timeout=5, source_address=(CLIENT_IP, 0))
    try:
        tls = context.wrap_socket(raw)
        # The server speaks first in HTTP/2 (its SETTINGS) if it accepted us.
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        data = tls.recv(65536)
        return "accepted" if data else "closed"
    except (ssl.SSLError, ConnectionError) as e:
        return f"refused: {e}"
    finally:
        raw.close()


def test_plain_tcp_garbage_to_the_hbone_port(nodes, still_serving):
    since = len(nodes.b.log_events())
    with socket.create_connection((SERVER_IP, 15008), timeout=5, source_address=(CLIENT_IP, 0)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: echo\r\n\r\n" + os.urandom(512))
        try:
            answer = recv_all(sock)
        except ConnectionResetError:
            answer = b""
    assert b"HTTP" not in answer  # no plaintext answer: at most a TLS alert
    event = wait_for_log(nodes.b, message_has("inbound TLS handshake to echo", "failed"), since)
    assert CLIENT_IP in event["message"]
    assert "http request" in event["message"]  # OpenSSL's words for plaintext HTTP on a TLS port


def test_tls_client_without_a_certificate(nodes, still_serving, tmp_path):
    since = len(nodes.b.log_events())
    context = client_context(tmp_path, None, nodes.ca.roots_pem)
    assert tls_attempt(context).startswith("refused")
    wait_for_log(nodes.b, message_has("inbound TLS handshake to echo", "peer did not return a certificate"), since)


def test_client_certificate_from_another_ca(nodes, still_serving, tmp_path):
    other_ca = create_files(tmp_path / "other-ca")
    since = len(nodes.b.log_events())
    context = client_context(tmp_path, other_ca.issue(CLIENT_ID), nodes.ca.roots_pem)
    assert tls_attempt(context).startswith("refused")
    event = wait_for_log(nodes.b, message_has("client certificate", "does not chain to the trusted roots"), since)
    assert event["level"] in ("warn", "error")


def test_client_certificate_from_another_trust_domain(nodes, still_serving, tmp_path):
    foreign = SpiffeId("other.example", "default", "client")
    since = len(nodes.b.log_events())
    context = client_context(tmp_path, nodes.ca.issue(foreign), nodes.ca.roots_pem)
    assert tls_attempt(context).startswith("refused")
    event = wait_for_log(
        nodes.b, message_has("client certificate", "no SPIFFE identity in trust domain 'cluster.local'"), since
    )
    assert str(foreign) in event["message"]


def test_client_certificate_in_the_trust_domain_is_accepted(nodes, tmp_path):
    """The control for the refusals above: the same client with a proper certificate gets in."""
    context = client_context(tmp_path, nodes.ca.issue(CLIENT_ID), nodes.ca.roots_pem)
    assert tls_attempt(context) == "accepted"


class ImpostorServer:
    """A TLS server on ELSEWHERE_IP:15008 presenting another workload's certificate."""

    def __init__(self, tmp_path, issued: IssuedCertificate):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.set_alpn_protocols(["h2"])
        context.load_cert_chain(*write_pem(tmp_path, issued))
        self.context = context
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ELSEWHERE_IP, 15008))
        self.sock.listen(8)
        self.handshakes: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(5)
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1024)
                    self.handshakes.append("completed")
            except (ssl.SSLError, OSError) as e:
                self.handshakes.append(f"failed: {e}")

    def close(self):
        close_listener(self.sock)


def test_server_with_the_wrong_identity_is_refused(nodes, still_serving, tmp_path):
    impostor = ImpostorServer(tmp_path, nodes.ca.issue(ECHO_ID))
    since = len(nodes.a.log_events())
    try:
        with pytest.raises(Socks5Refused) as refused:
            socks5_connect(nodes.a.socks5, CLIENT_IP, ELSEWHERE_IP, 8080)
        deadline = time.monotonic() + 5
        while not impostor.handshakes and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        impostor.close()
    assert refused.value.code != 0x00
    # The proxy did reach the impostor, and broke off the handshake.
    assert impostor.handshakes and impostor.handshakes[0].startswith("failed"), impostor.handshakes
    event = wait_for_log(
        nodes.a, message_has("server certificate identity", str(ECHO_ID), "is not one of the expected"), since
    )
    assert "spiffe://cluster.local/ns/default/sa/elsewhere" in event["message"]
    assert not nodes.a.config_dump()["pool"] or all(
        entry["destination"] != f"{ELSEWHERE_IP}:15008" for entry in nodes.a.config_dump()["pool"]
    )


# -- HTTP/2 requests with a proper client certificate ------------------------------


def h2_status(tmp_path, nodes, headers: list[tuple[str, str]]) -> tuple[int, bool]:
    """Send one request to SERVER_IP:15008 as the `client` workload: (status, stream ended)."""
    context = client_context(tmp_path, nodes.ca.issue(CLIENT_ID), nodes.ca.roots_pem)
    raw = socket.create_connection((SERVER_IP, 15008), timeout=5, source_address=(CLIENT_IP, 0))
    with context.wrap_socket(raw) as tls:
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.send_headers(1, headers)
        tls.sendall(conn.data_to_send())
        status, ended = None, False
        while not ended:
            data = tls.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[":status"])
                    ended = ended or event.stream_ended is not None
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    ended = True
            tls.sendall(conn.data_to_send())
        return status, ended


@pytest.mark.parametrize(
    "target",
    [f"{SINK_IP}:8080", f"{CLIENT_IP}:8080", f"{OUTSIDE_IP}:80", "echo.default.svc.cluster.local:80", "no-port"],
    ids=["other-local-workload", "workload-on-another-node", "not-in-the-mesh", "hostname", "no-port"],
)
def test_connect_to_an_address_not_served_here_is_400(nodes, still_serving, tmp_path, target):
    since = len(nodes.b.log_events())
    status, ended = h2_status(tmp_path, nodes, [(":method", "CONNECT"), (":authority", target)])
    assert (status, ended) == (400, True)
    event = wait_for_log(nodes.b, lambda e: e.get("scope") == "access" and e.get("dst.addr") == target, since)
    assert event["level"] == "error"
    assert event["src.identity"] == str(CLIENT_ID)
    assert "bad authority" in event["error"] or "is not a workload served here" in event["error"]


def test_get_instead_of_connect_is_400(nodes, still_serving, tmp_path):
    since = len(nodes.b.log_events())
    request = [(":method", "GET"), (":scheme", "https"), (":authority", f"{SERVER_IP}:8080"), (":path", "/")]
    assert h2_status(tmp_path, nodes, request) == (400, True)
    wait_for_log(nodes.b, message_has("refusing GET", "only CONNECT is served"), since)


def test_connect_to_the_served_workload_is_200(nodes, tmp_path):
    """The control for the 400s above."""
    status, ended = h2_status_open(tmp_path, nodes, f"{SERVER_IP}:8080")
    assert (status, ended) == (200, False)


def h2_status_open(tmp_path, nodes, authority: str) -> tuple[int | None, bool]:
    context = client_context(tmp_path, nodes.ca.issue(CLIENT_ID), nodes.ca.roots_pem)
    raw = socket.create_connection((SERVER_IP, 15008), timeout=5, source_address=(CLIENT_IP, 0))
    with context.wrap_socket(raw) as tls:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "CONNECT"), (":authority", authority)])
        tls.sendall(conn.data_to_send())
        while True:
            data = tls.recv(65536)
            assert data, "the server closed the connection instead of answering"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    return int(dict(event.headers)[":status"]), event.stream_ended is not None
            tls.sendall(conn.data_to_send())


# -- SOCKS5 --------------------------------------------------------------------------


def socks5_exchange(nodes, *messages: bytes, source_ip: str = CLIENT_IP) -> bytes:
    """Send ``messages`` (waiting for an answer after each but the last); everything the proxy sent, until it closed."""
    with socket.create_connection(nodes.a.socks5, timeout=5, source_address=(source_ip, 0)) as sock:
        answers = b""
        for i, message in enumerate(messages):
            sock.sendall(message)
            if i < len(messages) - 1:
                answers += sock.recv(2)
        return answers + recv_all(sock)


def reply_code(answer: bytes) -> int:
    assert answer[:2] == b"\x05\x00", f"greeting not accepted: {answer!r}"
    reply = answer[2:]
    assert len(reply) >= 4 and reply[0] == 5, f"no SOCKS5 reply: {answer!r}"
    return reply[1]


def connect_request(command: int, atyp: int, address: bytes, port: int, version: int = 5) -> bytes:
    return bytes([version, command, 0, atyp]) + address + struct.pack("!H", port)


def test_socks5_bad_version_in_greeting(nodes, still_serving):
    since = len(nodes.a.log_events())
    assert socks5_exchange(nodes, b"\x04\x01\x00\x50" + socket.inet_aton(SERVER_IP) + b"\x00") == b""
    wait_for_log(nodes.a, message_has("greeting has version 4, expected 5"), since)


@pytest.mark.parametrize(
    ("request_bytes", "expected_reply", "logged"),
    [
        (connect_request(1, 1, b"\x7f\x00\x00\x01", 80, version=4), 0x01, "request has version 4, expected 5"),
        (connect_request(1, 0x09, b"\x7f\x00\x00\x01", 80), 0x08, "unknown address type 0x09"),
        (connect_request(2, 1, b"\x7f\x00\x00\x01", 80), 0x07, "command 0x02 is not supported"),
        (connect_request(3, 1, b"\x7f\x00\x00\x01", 80), 0x07, "command 0x03 is not supported"),
    ],
    ids=["bad-version", "unknown-atyp", "bind", "udp-associate"],
)
def test_socks5_malformed_request(nodes, still_serving, request_bytes, expected_reply, logged):
    since = len(nodes.a.log_events())
    answer = socks5_exchange(nodes, b"\x05\x01\x00", request_bytes)
    assert reply_code(answer) == expected_reply
    wait_for_log(nodes.a, message_has(logged), since)


def test_socks5_from_an_address_that_is_no_local_workload(nodes, still_serving):
    since = len(nodes.a.log_events())
    with pytest.raises(Socks5Refused) as refused:
        socks5_connect(nodes.a.socks5, OUTSIDE_IP, ECHO_HOST, 80)
    assert refused.value.code == 0x02
    wait_for_log(nodes.a, message_has("refusing outbound connection from", OUTSIDE_IP, "no local workload"), since)


def test_socks5_workload_on_another_node_cannot_use_this_one(nodes, still_serving):
    """SERVER_IP is a workload, but node-b's, so node-a refuses it as a source."""
    with pytest.raises(Socks5Refused) as refused:
        socks5_connect(nodes.a.socks5, SERVER_IP, ECHO_HOST, 80)
    assert refused.value.code == 0x02


def test_socks5_hostname_no_service_has(nodes, still_serving):
    since = len(nodes.a.log_events())
    with pytest.raises(Socks5Refused) as refused:
        socks5_connect(nodes.a.socks5, CLIENT_IP, "nope.default.svc.cluster.local", 80)
    assert refused.value.code == 0x04
    wait_for_log(nodes.a, message_has("no service has the hostname", "nope.default.svc.cluster.local"), since)


def test_socks5_service_port_the_service_does_not_have(nodes, still_serving):
    since = len(nodes.a.log_events())
    with pytest.raises(Socks5Refused) as refused:
        socks5_connect(nodes.a.socks5, CLIENT_IP, ECHO_HOST, 81)
    assert refused.value.code == 0x04
    wait_for_log(nodes.a, message_has("service echo.default.svc.cluster.local has no port 81"), since)
