"""Abusive HTTP/2 peers against a real node: a raw hyperframe client with a valid mesh certificate.

Each flood must end with node-b closing that connection (counted in
``ztwisted_hbone_limit_hits_total``), node-b's memory staying bounded and
ordinary traffic through node-a still flowing.
"""

from __future__ import annotations

import os
import socket
import ssl
import time

import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.integration.conftest import CLIENT_IP, SERVER_IP
from tests.support import echo_through
from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import socks5_connect

pytestmark = pytest.mark.integration

CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ECHO_HOST = "echo.default.svc.cluster.local"
CANCEL = 0x8
RSS_GROWTH_LIMIT = 50 * 1024 * 1024
LIMIT_METRIC = "ztwisted_hbone_limit_hits_total"


def client_context(two_nodes, tmp_path) -> ssl.SSLContext:
    """TLS as a mesh client: a certificate for the `client` workload from the nodes' dev CA."""
    ca = CertificateAuthority.load_or_create_dev(two_nodes.b.state_dir)
    issued = ca.issue(SpiffeId("cluster.local", "default", "client"))
    cert_file, key_file = tmp_path / "client.crt", tmp_path / "client.key"
    cert_file.write_bytes(issued.cert_pem + issued.chain_pem)
    key_file.write_bytes(issued.key_pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # identities are URI SANs; HBONE sends no SNI
    context.load_verify_locations(cadata=issued.roots_pem.decode())
    context.load_cert_chain(str(cert_file), str(key_file))
    context.set_alpn_protocols(["h2"])
    return context


class RawClient:
    """An HTTP/2 client made of hyperframe frames, free to misbehave."""

    def __init__(self, context: ssl.SSLContext, receive_buffer: int | None = None):
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receive_buffer is not None:
            # Set before connecting so the advertised TCP window stays small.
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        raw.settimeout(10)
        raw.bind((CLIENT_IP, 0))
        raw.connect((SERVER_IP, 15008))
        self.sock = context.wrap_socket(raw)
        assert self.sock.selected_alpn_protocol() == "h2"
        self.encoder = hpack.Encoder()
        self.next_stream_id = 1
        self._buffer = b""
        settings = SettingsFrame(0)
        self.sock.sendall(CLIENT_PREFACE + settings.serialize())
        # The server speaks first: its SETTINGS, which we acknowledge as a good client would.
        while True:
            frame = self.read_frame()
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                break
        self.sock.sendall(SettingsFrame(0, flags=["ACK"]).serialize())

    def read_frame(self) -> Frame:
        header = self._read_exact(9)
        frame, length = Frame.parse_frame_header(memoryview(header))
        frame.parse_body(memoryview(self._read_exact(length)))
        return frame

    def _read_exact(self, size: int) -> bytes:
        while len(self._buffer) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def headers_frames(self, headers, max_frame: int = 16384, huffman: bool = True) -> tuple[int, bytes]:
        """A new stream's request headers, split into HEADERS + CONTINUATION frames as needed."""
        stream_id = self.next_stream_id
        self.next_stream_id += 2
        block = self.encoder.encode(headers, huffman=huffman)
        chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)] or [b""]
        frames = []
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            flags = ["END_HEADERS"] if last else []
            frame = HeadersFrame(stream_id, flags=flags) if index == 0 else ContinuationFrame(stream_id, flags=flags)
            frame.data = chunk
            frames.append(frame.serialize())
        return stream_id, b"".join(frames)

    def connect_request(self, **extra: str) -> tuple[int, bytes]:
        return self.headers_frames([(":method", "CONNECT"), (":authority", f"{SERVER_IP}:8080"), *extra.items()])

    def wait_closed(self, timeout: float) -> str:
        """Read (and drop) whatever comes until the server closes; how it ended."""
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not self.sock.recv(1 << 20):
                    return "closed"
        except (ssl.SSLError, OSError) as e:
            if isinstance(e, TimeoutError):
                return "still open"
            return f"reset ({type(e).__name__})"
        return "still open"

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def limit_hits(node, kind: str) -> float:
    return node.metric(LIMIT_METRIC, direction="inbound", kind=kind)


def wait_for_limit_hit(node, kind: str, before: float, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        hits = limit_hits(node, kind)
        if hits > before or time.monotonic() > deadline:
            return hits
        time.sleep(0.1)


def assert_still_serving(nodes) -> None:
    payload = os.urandom(200_000)
    with socks5_connect(nodes.a.socks5, CLIENT_IP, ECHO_HOST, 80) as sock:
        assert echo_through(sock, payload, timeout=15) == payload


@pytest.fixture
def warm(two_nodes):
    """The nodes after one ordinary tunnel, so later RSS growth is the flood's."""
    assert_still_serving(two_nodes)
    return two_nodes


def test_ping_flood_without_reading_is_cut_off(warm, tmp_path):
    nodes = warm
    rss_before = nodes.b.rss_bytes()
    hits_before = limit_hits(nodes.b, "control-frame")
    client = RawClient(client_context(nodes, tmp_path), receive_buffer=8192)
    pings = b"".join(_ping(i) for i in range(4096))
    sent = 0
    deadline = time.monotonic() + 30
    try:
        # Never read: every PING ACK the server writes piles up on its side.
        while time.monotonic() < deadline:
            client.sock.sendall(pings)
            sent += len(pings)
    except (ssl.SSLError, OSError):
        pass
    try:
        assert client.wait_closed(20) != "still open", f"the flood went on: {sent} bytes of PINGs sent"
    finally:
        client.close()
    assert wait_for_limit_hit(nodes.b, "control-frame", hits_before) > hits_before
    assert nodes.b.rss_bytes() - rss_before < RSS_GROWTH_LIMIT
    assert_still_serving(nodes)


def _ping(i: int) -> bytes:
    frame = PingFrame(0)
    frame.opaque_data = i.to_bytes(8, "big")
    return frame.serialize()


def test_rapid_reset_is_cut_off(warm, tmp_path):
    nodes = warm
    rss_before = nodes.b.rss_bytes()
    hits_before = limit_hits(nodes.b, "rapid-reset")
    client = RawClient(client_context(nodes, tmp_path))
    try:
        try:
            for _ in range(20):
                batch = []
                for _ in range(100):
                    stream_id, headers = client.connect_request()
                    rst = RstStreamFrame(stream_id)
                    rst.error_code = CANCEL
                    batch.append(headers + rst.serialize())
                client.sock.sendall(b"".join(batch))
        except (ssl.SSLError, OSError):
            pass
        assert client.wait_closed(20) != "still open"
    finally:
        client.close()
    assert wait_for_limit_hit(nodes.b, "rapid-reset", hits_before) > hits_before
    assert nodes.b.rss_bytes() - rss_before < RSS_GROWTH_LIMIT
    assert_still_serving(nodes)


def test_streams_reset_before_the_workload_answers_leave_no_connection_behind(two_nodes, echo_app, tmp_path):
    client = RawClient(client_context(two_nodes, tmp_path))
    try:
        batch = []
        for _ in range(10):  # well below the rapid-reset limit
            stream_id, headers = client.connect_request()
            rst = RstStreamFrame(stream_id)
            rst.error_code = CANCEL
            batch.append(headers + rst.serialize())
        client.sock.sendall(b"".join(batch))
        deadline = time.monotonic() + 10
        while echo_app.connections < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.close()  # even the end of the HBONE connection must not leave them behind
    # Whatever reached the workload must be closed again.
    outcomes = echo_app.wait_for_outcomes(echo_app.connections, timeout=5)
    assert len(outcomes) == echo_app.connections, (
        f"{echo_app.connections - len(outcomes)} of {echo_app.connections} connections to the workload left open"
    )


def test_oversized_headers_are_cut_off(warm, tmp_path):
    nodes = warm
    rss_before = nodes.b.rss_bytes()
    hits_before = limit_hits(nodes.b, "header-list-size")
    client = RawClient(client_context(nodes, tmp_path))
    try:
        # 100 KB of headers, beyond the 64 KiB list limit; no Huffman, so the block is that big too.
        block_headers = [(":method", "CONNECT"), (":authority", f"{SERVER_IP}:8080")]
        block_headers += [(f"x-filler-{i}", "v" * 1000) for i in range(100)]
        _, frames = client.headers_frames(block_headers, huffman=False)
        assert len(frames) > 64 * 1024
        try:
            client.sock.sendall(frames)
        except (ssl.SSLError, OSError):
            pass
        assert client.wait_closed(20) != "still open"
    finally:
        client.close()
    assert wait_for_limit_hit(nodes.b, "header-list-size", hits_before) > hits_before
    assert nodes.b.rss_bytes() - rss_before < RSS_GROWTH_LIMIT
    assert_still_serving(nodes)


def test_the_raw_client_is_a_good_client_when_it_behaves(warm, tmp_path):
    """The control: the same client, well behaved, gets its tunnel (so the floods above prove the limits)."""
    client = RawClient(client_context(warm, tmp_path))
    try:
        stream_id, headers = client.connect_request()
        client.sock.sendall(headers)
        while True:
            frame = client.read_frame()
            if isinstance(frame, HeadersFrame) and frame.stream_id == stream_id:
                break
        status = dict(hpack.Decoder().decode(frame.data))[":status"]
        assert status == "200"
    finally:
        client.close()
