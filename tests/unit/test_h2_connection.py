"""HBONEConnection driven over in-memory transports (twisted.test.iosim) with a fake clock."""

from __future__ import annotations

import weakref

import h2.connection
import pytest
from hpack import Decoder, NeverIndexedHeaderTuple
from hyperframe.frame import ContinuationFrame, DataFrame, GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame
from twisted.internet import defer, task
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.test import iosim

from ztwisted.h2.connection import H2Settings, HBONEConnection, StreamRefused, TunnelRefused, _h2_config
from ztwisted.h2.goaway import (
    CLIENT_PREFACE,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    MAX_STREAM_ID,
    FrameTooLarge,
    GoawayFilter,
    HeaderBlockTooLarge,
    encode_goaway,
    header_block_cap,
)
from ztwisted.hbone.outbound import tunnel_headers
from ztwisted.model import Workload
from ztwisted.splice import TCPEnd, splice

from .h2_support import RecordingEnd, accept_and_record, connected_end, parse_frames


class Pair:
    def __init__(self, handler=None, server_settings=None, client_settings=None):
        self.clock = task.Clock()
        self.requests = []

        def on_request(connection, stream):
            self.requests.append(stream)
            if handler is not None:
                handler(stream)

        self.client = HBONEConnection(client=True, clock=self.clock, settings=client_settings)
        self.server = HBONEConnection(
            client=False, clock=self.clock, on_tunnel_request=on_request, settings=server_settings
        )
        self.pump = iosim.connect(
            self.server,
            iosim.makeFakeServer(self.server),
            self.client,
            iosim.makeFakeClient(self.client),
            greet=False,
        )
        self.pump.flush()

    def flush(self):
        self.pump.flush()


def test_tunnel_carries_bytes_both_ways_and_half_close():
    pair = Pair(handler=accept_and_record)
    opened = pair.client.open_tunnel("127.0.0.1:8080", [("forwarded", 'for="127.0.0.2:1234"')])
    pair.flush()
    stream = opened.result if hasattr(opened, "result") else None
    assert stream is not None and stream.stream_id == 1
    server_stream = pair.requests[0]
    assert server_stream.headers[":authority"] == "127.0.0.1:8080"
    assert server_stream.headers["forwarded"] == 'for="127.0.0.2:1234"'
    app = RecordingEnd()
    stream.set_partner(app)
    stream.write(b"hello")
    stream.write_eof()
    pair.flush()
    assert server_stream.far.data == b"hello"
    assert server_stream.far.eof
    server_stream.write(b"world")
    server_stream.write_eof()
    pair.flush()
    assert app.data == b"world" and app.eof
    assert stream.finished.result == "closed"
    assert server_stream.finished.result == "closed"
    assert pair.client.streams == {} and pair.server.streams == {}


def test_refused_connect_status_reaches_client():
    pair = Pair(handler=lambda stream: stream.refuse(401))
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    failures = []
    opened.addErrback(failures.append)
    pair.flush()
    assert failures[0].check(TunnelRefused)
    assert failures[0].value.status == 401


def test_non_connect_request_gets_400():
    pair = Pair(handler=accept_and_record)
    stream_id = pair.client.h2.get_next_available_stream_id()
    pair.client.h2.send_headers(
        stream_id, [(":method", "GET"), (":scheme", "https"), (":path", "/"), (":authority", "x")], end_stream=True
    )
    pair.client.send_pending()
    events = []
    original = pair.client._handle_event
    pair.client._handle_event = lambda e: (events.append(e), original(e))
    pair.flush()
    statuses = [dict(e.headers)[":status"] for e in events if hasattr(e, "headers") and e.headers]
    assert statuses == ["400"]
    assert pair.requests == []


def test_slow_reader_closes_the_window_instead_of_buffering():
    pair = Pair(handler=accept_and_record, server_settings=H2Settings.server(stream_window=65535))
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    stream = opened.result
    app = RecordingEnd()
    stream.set_partner(app)
    server_stream = pair.requests[0]
    server_stream.far.pauseProducing = server_stream.pauseProducing  # keep wiring honest
    server_stream.pauseProducing()  # the local workload stopped reading
    for _ in range(100):
        stream.write(b"x" * 16384)
        pair.flush()
    delivered = len(server_stream.far.data)
    # Nothing beyond the first windows got through, and the client's app was paused.
    assert delivered <= 65535 + 65535
    assert app.paused
    server_stream.resumeProducing()
    for _ in range(200):
        pair.flush()
    assert len(server_stream.far.data) == 100 * 16384
    assert not app.paused


def test_bytes_a_reset_stream_left_unread_reopen_the_connection_window():
    # Streams whose app stopped reading and that were then reset must not take their unread
    # bytes out of the connection's window: a few of them would starve every other stream.
    window = 65535
    pair = Pair(
        handler=accept_and_record,
        server_settings=H2Settings.server(stream_window=window, connection_window=4 * window),
    )
    for _ in range(5):
        opened = pair.client.open_tunnel("127.0.0.1:8080")
        pair.flush()
        stream = opened.result
        stream.set_partner(RecordingEnd())
        server_stream = pair.requests[-1]
        server_stream.pauseProducing()  # the app stopped reading
        stream.write(b"x" * (2 * window))
        pair.flush()
        assert len(server_stream.far.data) == window  # a whole stream window, unacknowledged
        stream.abort()  # RST_STREAM CANCEL
        pair.flush()
    # (h2 sends a connection WINDOW_UPDATE once half the window is to be reopened)
    assert pair.client.h2.outbound_flow_control_window >= 2 * window
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    stream = opened.result
    stream.set_partner(RecordingEnd())
    stream.write(b"y" * (2 * window))
    for _ in range(20):
        pair.flush()
    assert len(pair.requests[-1].far.data) == 2 * window


def test_graceful_drain_sends_two_goaways_and_lets_streams_finish():
    pair = Pair(handler=accept_and_record)
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    stream = opened.result
    app = RecordingEnd()
    stream.set_partner(app)
    drained = pair.server.drain(graceful=True, deadline=30)
    pair.flush()
    assert pair.client.goaway_received is not None
    assert not pair.client.usable
    assert pair.server.goaway_sent_last_stream_id == 1
    # The stream in flight still carries data both ways.
    stream.write(b"late data")
    stream.write_eof()
    server_stream = pair.requests[0]
    server_stream.write(b"reply")
    server_stream.write_eof()
    pair.flush()
    assert server_stream.far.data == b"late data"
    assert app.data == b"reply"
    assert drained.called
    assert pair.server.ended_by == "drained"


def test_stream_above_last_stream_id_is_refused_and_retryable():
    pair = Pair(handler=accept_and_record)
    first = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    assert first.called
    # Server already decided: last stream 1. The client has not seen it yet.
    pair.server.shutdown.send_goaway(1)
    second = pair.client.open_tunnel("127.0.0.1:8080")
    failures = []
    second.addErrback(failures.append)
    pair.flush()
    assert failures and failures[0].check(StreamRefused)


def test_keepalive_closes_connection_without_ping_answer():
    clock = task.Clock()
    conn = HBONEConnection(client=True, clock=clock)
    transport = StringTransport()
    conn.makeConnection(transport)
    conn.handshakeCompleted()
    transport.clear()
    clock.advance(10)
    frames = parse_frames(transport.value())
    assert any(isinstance(f, PingFrame) and "ACK" not in f.flags for f in frames)
    clock.advance(19.9)
    assert not transport.disconnecting
    clock.advance(0.2)
    assert conn.ended_by == "keepalive-timeout"


def test_goaway_filter_cuts_goaway_out_of_any_fragmentation():
    ping = PingFrame(0)
    ping.opaque_data = b"12345678"
    rst = RstStreamFrame(1)
    rst.error_code = 8
    stream = CLIENT_PREFACE + ping.serialize() + encode_goaway(MAX_STREAM_ID, 0, b"bye") + rst.serialize()
    for size in (1, 2, 5, 9, 10, 17, len(stream)):
        filt = GoawayFilter(expect_client_preface=True, max_frame_size=16384, max_header_block=65536)
        passed, goaways = b"", []
        for i in range(0, len(stream), size):
            data, found = filt.feed(stream[i : i + size])
            passed += data
            goaways += found
        assert passed == CLIENT_PREFACE + ping.serialize() + rst.serialize()
        assert [(g.last_stream_id, g.debug_data) for g in goaways] == [(MAX_STREAM_ID, b"bye")]


def feed_in_pieces(filt: GoawayFilter, data: bytes, size: int) -> bytes:
    passed = b""
    for i in range(0, len(data), size):
        passed += filt.feed(data[i : i + size])[0]
    return passed


def data_frame(length: int) -> bytes:
    frame = DataFrame(1)
    frame.data = b"x" * length
    return frame.serialize()


@pytest.mark.parametrize("size", [1, 4, 9, 1000])
def test_goaway_filter_refuses_a_frame_over_the_maximum_size_from_its_header_alone(size):
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    assert feed_in_pieces(filt, data_frame(16384), size) == data_frame(16384)
    # Only the 9-byte header of a frame that claims 16 MiB: refused before any of its body is buffered.
    header = data_frame(16384 + 1)[:9]
    with pytest.raises(FrameTooLarge) as raised:
        feed_in_pieces(filt, header, size)
    assert (raised.value.kind, raised.value.error_code) == ("frame-size", FRAME_SIZE_ERROR)


def header_block(stream_id: int, sizes: list[int], end: bool = True) -> list[bytes]:
    """A header block in frames of the given sizes (HEADERS, then CONTINUATION); END_HEADERS on the last if ``end``."""
    frames = []
    for index, size in enumerate(sizes):
        flags = ["END_HEADERS"] if end and index == len(sizes) - 1 else []
        frame = HeadersFrame(stream_id, flags=flags) if index == 0 else ContinuationFrame(stream_id, flags=flags)
        frame.data = b"h" * size
        frames.append(frame.serialize())
    return frames


def test_goaway_filter_caps_a_header_block_across_continuation_frames():
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=40000)
    fits = b"".join(header_block(1, [16384, 16384, 7232]))
    assert filt.feed(fits)[0] == fits
    # A new block starts the count again; its third frame's header alone goes over the cap.
    first, second, third = header_block(3, [16384, 16384, 7233], end=False)
    assert filt.feed(first + second)[0] == first + second
    with pytest.raises(HeaderBlockTooLarge) as raised:
        filt.feed(third[:9])
    assert (raised.value.kind, raised.value.error_code) == ("header-block-size", ENHANCE_YOUR_CALM)


def test_header_block_cap_leaves_room_above_the_header_list_size():
    assert header_block_cap(65536) == 131072


def test_encode_goaway_is_a_valid_frame():
    frame = parse_frames(encode_goaway(7, 2, b"x"))[0]
    assert isinstance(frame, GoAwayFrame)
    assert (frame.last_stream_id, frame.error_code, frame.additional_data) == (7, 2, b"x")


class HalfCloseableStringTransport(StringTransport):
    write_closed = False

    def loseWriteConnection(self):
        self.write_closed = True


@pytest.mark.parametrize("clean", [True, False])
def test_tcp_end_forwards_reset_only_when_unclean(clean):
    end = TCPEnd()
    far = RecordingEnd()
    end.set_partner(far)
    transport = HalfCloseableStringTransport()
    end.makeConnection(transport)
    if clean:
        end.readConnectionLost()
        end.write_eof()
    from twisted.internet import error
    from twisted.python.failure import Failure

    end.connectionLost(Failure(error.ConnectionDone()))
    assert far.aborted is (not clean)


class ClosingTransport(StringTransport):
    """Records how the connection asked to be closed; the peer never answers close_notify."""

    aborted = False

    def abortConnection(self):
        self.aborted = True

    def unregisterProducer(self):
        self.producer = None


def drained_client(clock):
    conn = HBONEConnection(client=True, clock=clock)
    transport = ClosingTransport()
    conn.makeConnection(transport)
    conn.handshakeCompleted()
    gone = conn.drain(graceful=True)
    return conn, transport, gone


def test_graceful_close_gives_up_on_a_silent_peer_after_close_notify_wait():
    clock = task.Clock()
    conn, transport, _ = drained_client(clock)
    assert transport.disconnecting and not transport.aborted
    clock.advance(conn.settings.close_notify_wait - 0.01)
    assert not transport.aborted
    clock.advance(0.02)
    assert transport.aborted
    assert conn.ended_by == "drained"


def test_keepalive_abort_during_the_close_notify_wait_says_so():
    clock = task.Clock()
    conn = HBONEConnection(client=True, clock=clock, settings=H2Settings.client(close_notify_wait=60.0))
    transport = ClosingTransport()
    conn.makeConnection(transport)
    conn.handshakeCompleted()
    conn.drain(graceful=True)
    clock.advance(conn.settings.keepalive_interval)
    clock.advance(conn.settings.keepalive_timeout + 0.1)
    assert transport.aborted
    assert conn.ended_by == "keepalive-timeout"


def _end_cleanly(end: TCPEnd) -> None:
    end.writeConnectionLost()
    end.connectionLost(Failure(ConnectionDone()))


def test_a_finished_tunnel_is_freed_at_once_not_by_the_cyclic_garbage_collector(no_cyclic_gc):
    # Were a tunnel's ends, streams and transports left in reference cycles, each short
    # connection would wait for the cyclic collector, whose pauses grow with the heap.
    server_apps = []

    def splice_to_app(stream):
        server_apps.append(connected_end())
        stream.accept()
        splice(stream, server_apps[-1])

    pair = Pair(handler=splice_to_app)
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    client_app = connected_end()
    spliced = []
    splice(client_app, opened.result).addCallback(spliced.append)
    client_app.dataReceived(b"hello")
    client_app.readConnectionLost()
    pair.flush()
    server_app = server_apps[0]
    assert server_app.transport.value() == b"hello"
    server_app.readConnectionLost()
    pair.flush()
    _end_cleanly(client_app)
    _end_cleanly(server_app)
    assert spliced == [("closed", "closed")]
    assert pair.client.streams == {} and pair.server.streams == {}
    alive = [weakref.ref(o) for o in (client_app, opened.result, pair.requests[0], server_app)]
    alive += [weakref.ref(client_app.transport), weakref.ref(server_app.transport)]
    del opened, client_app, server_app, server_apps[:], pair.requests[:], splice_to_app
    assert [ref() for ref in alive] == [None] * len(alive)


def test_a_tunnel_no_longer_waited_for_is_reset_and_not_left_open_on_the_server():
    server_apps = []

    def splice_to_app(stream):  # as the inbound side does once the app connection is made
        server_apps.append(connected_end())
        stream.accept()
        splice(stream, server_apps[-1])

    pair = Pair(handler=splice_to_app)
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    failures = []
    opened.addErrback(failures.append)
    opened.cancel()  # e.g. the SOCKS5 client left while its tunnel was opening
    pair.flush()
    assert len(failures) == 1 and failures[0].check(defer.CancelledError)
    assert pair.requests[0].done
    assert server_apps[0].transport.disconnected, "the server's app connection is not kept"
    assert pair.client.streams == {} and pair.server.streams == {}
    assert pair.client.usable and pair.server.usable, "only the stream ends"
    # The server got the request and its reset in one read, and kept serving.
    again = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    assert again.result.stream_id == 3 and len(server_apps) == 2


@pytest.mark.parametrize("source", [("10.0.0.1", 40000), ("fd00::1", 40000)])
def test_the_headers_ztwisted_sends_are_the_bytes_h2_sends_after_normalizing_them(source):
    """h2 does not normalize ztwisted's outbound headers (lowercase names, no surrounding
    whitespace, no connection headers, credentials never indexed): all already true of them,
    so the frames on the wire are those h2's normalization would have produced."""
    workload = Workload(uid="u", name="client-1", namespace="shop", canonical_name="client", canonical_revision="v1")
    connect = [(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), *tunnel_headers(workload, source)]
    responses = [[(":status", "200")], [(":status", "503")]]

    def wire(normalize: bool) -> tuple[bytes, bytes]:
        client_config, server_config = _h2_config(client=True), _h2_config(client=False)
        client_config.normalize_outbound_headers = server_config.normalize_outbound_headers = normalize
        client = h2.connection.H2Connection(config=client_config)
        server = h2.connection.H2Connection(config=server_config)
        client.initiate_connection()
        server.initiate_connection()
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
        for stream_id, response in zip((1, 3), responses, strict=True):
            client.send_headers(stream_id, connect)
            server.receive_data(client.data_to_send())
            server.send_headers(stream_id, response)
        return client.data_to_send(), server.data_to_send()

    ours = _h2_config(client=True)
    assert not ours.normalize_outbound_headers
    assert ours.validate_inbound_headers, "what a peer sends is still checked"
    assert wire(normalize=False) == wire(normalize=True)


def test_header_literals_are_sent_without_huffman_coding_and_read_back_the_same():
    """The CONNECT's literals go out as they are (RFC 7541 leaves Huffman coding to the sender)."""
    conn = HBONEConnection(client=True, clock=task.Clock())
    transport = StringTransport()
    conn.makeConnection(transport)
    conn.handshakeCompleted()
    transport.clear()
    workload = Workload(uid="u", name="client-1", namespace="shop")
    headers = tunnel_headers(workload, ("10.0.0.1", 40000))
    conn.open_tunnel("10.0.0.2:8080", headers)
    (frame,) = [f for f in parse_frames(transport.value()) if isinstance(f, HeadersFrame)]
    assert b'for="10.0.0.1:40000"' in frame.data and b"10.0.0.2:8080" in frame.data
    decoded = Decoder().decode(frame.data, raw=False)
    assert decoded == [(":method", "CONNECT"), (":authority", "10.0.0.2:8080"), *headers]
    assert isinstance(decoded[2], NeverIndexedHeaderTuple), "forwarded stays out of the HPACK table"
