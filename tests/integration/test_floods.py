"""Abusive HTTP/2 peers against a real node: a raw hyperframe client with a valid mesh certificate.

Each flood must end with node-b closing that connection (counted in
``ztwisted_hbone_limit_hits_total``), node-b's memory staying bounded and
ordinary traffic through node-a still flowing.
"""

from __future__ import annotations

import os
import ssl
import time

import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from tests.integration.conftest import CLIENT_IP, SERVER_IP
from tests.integration.raw_h2 import RawClient, client_context
from tests.support import echo_through
from ztwisted.tools.harness import socks5_connect

pytestmark = pytest.mark.integration

ECHO_HOST = "echo.default.svc.cluster.local"
CANCEL = 0x8
FRAME_SIZE_ERROR = 0x6
ENHANCE_YOUR_CALM = 0xB
RSS_GROWTH_LIMIT = 50 * 1024 * 1024
MiB = 1024 * 1024
# Growth below what one oversized frame would have cost: before the frame limits, the tests
# below grew node-b by 61 MiB (4 x 16 MiB DATA) and 79 MiB (2 x 40 MiB header blocks).
ONE_CLAIMED_FRAME = 16 * MiB
LIMIT_METRIC = "ztwisted_hbone_limit_hits_total"


def assert_told_to_calm_down_and_closed(client: RawClient) -> None:
    """The node's GOAWAY reached the client with ENHANCE_YOUR_CALM, and the connection then ended."""
    goaway = client.read_goaway(20)
    assert goaway is not None and goaway.error_code == ENHANCE_YOUR_CALM, goaway
    assert client.wait_closed(20) != "still open"


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
        assert_told_to_calm_down_and_closed(client)
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
        send_ignoring_close(client, frames)
        assert_told_to_calm_down_and_closed(client)
    finally:
        client.close()
    assert wait_for_limit_hit(nodes.b, "header-list-size", hits_before) > hits_before
    assert nodes.b.rss_bytes() - rss_before < RSS_GROWTH_LIMIT
    assert_still_serving(nodes)


def send_ignoring_close(client: RawClient, data: bytes) -> None:
    """Send what the node may stop reading halfway: it closes the connection on a limit."""
    try:
        client.sock.sendall(data)
    except (ssl.SSLError, OSError):
        pass


def test_settings_flood_is_cut_off_before_the_transport_pauses(warm, tmp_path):
    nodes = warm
    hits_before = limit_hits(nodes.b, "control-frame")
    client = RawClient(client_context(nodes, tmp_path))
    try:
        # 20000 SETTINGS frames at once: their 180 KB of ACKs fit in the socket buffers,
        # so the node's transport never pauses and only a rate can see the flood.
        send_ignoring_close(client, SettingsFrame(0).serialize() * 20_000)
        assert_told_to_calm_down_and_closed(client)
    finally:
        client.close()
    assert wait_for_limit_hit(nodes.b, "control-frame", hits_before) > hits_before
    assert_still_serving(nodes)


def assert_refused_unbuffered(nodes, tmp_path, kind: str, error_code: int, connections: int, oversized) -> None:
    """``connections`` clients each send ``oversized(client)``: each gets GOAWAY ``error_code``,
    node-b counts ``kind`` once per client and grows by less than one claimed frame."""
    rss_before = nodes.b.rss_bytes()
    hits_before = limit_hits(nodes.b, kind)
    context = client_context(nodes, tmp_path)
    clients = [RawClient(context) for _ in range(connections)]
    try:
        for client in clients:
            send_ignoring_close(client, oversized(client))
        for client in clients:
            goaway = client.read_goaway(10)
            assert goaway is not None and goaway.error_code == error_code, goaway
    finally:
        for client in clients:
            client.close()
    assert wait_for_limit_hit(nodes.b, kind, hits_before + connections - 1) == hits_before + connections
    assert nodes.b.rss_bytes() - rss_before < ONE_CLAIMED_FRAME
    assert_still_serving(nodes)


def test_frames_over_the_maximum_frame_size_are_refused_before_they_are_buffered(warm, tmp_path):
    """DATA frames that claim 16 MiB (the advertised maximum is 1 MiB), their bodies sent all but
    the last byte: a node that waited for whole frames would hold 16 MiB per connection."""

    def data_claiming_16_mib(client: RawClient) -> bytes:
        stream_id, headers = client.connect_request()
        claim = DataFrame(stream_id)
        claim.data = b"x" * (16 * MiB - 1)
        return headers + claim.serialize()[:-1]

    assert_refused_unbuffered(warm, tmp_path, "frame-size", FRAME_SIZE_ERROR, 4, data_claiming_16_mib)


def test_a_header_block_over_the_cap_is_refused_before_it_is_buffered(warm, tmp_path):
    """HEADERS and 40 CONTINUATION frames of 1 MiB (each within the maximum frame size), never
    ended: a node that waited for END_HEADERS would hold 40 MiB per connection."""

    def endless_header_block(client: RawClient) -> bytes:
        headers = HeadersFrame(client.next_stream_id)  # no END_HEADERS: the block goes on
        headers.data = client.encoder.encode([(":method", "CONNECT"), (":authority", f"{SERVER_IP}:8080")])
        filler = ContinuationFrame(client.next_stream_id)
        filler.data = b"\0" * MiB
        return headers.serialize() + filler.serialize() * 40

    assert_refused_unbuffered(warm, tmp_path, "header-block-size", ENHANCE_YOUR_CALM, 2, endless_header_block)


def test_empty_data_frames_in_a_row_are_refused_as_a_flood(warm, tmp_path):
    """CVE-2019-9518: empty DATA frames without END_STREAM cost the node work and move nothing."""

    def empty_frames(client: RawClient) -> bytes:
        stream_id, headers = client.connect_request()
        return headers + DataFrame(stream_id).serialize() * 10000

    assert_refused_unbuffered(warm, tmp_path, "empty-frames", ENHANCE_YOUR_CALM, 2, empty_frames)


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
