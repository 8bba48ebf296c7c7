"""HBONEConnection frame by frame: we play the peer with ``h2`` and decode what our side writes.

Our side writes into a StringTransport standing in for the TLS transport; its
bytes are decoded with hyperframe, so every test states the exact frames and
their order. The peer is a second ``h2`` connection, except that GOAWAY frames
never reach it (``h2`` would close its whole state machine, the very problem
ztwisted works around) and misbehaving peers are made by hand.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from twisted.internet import error, task
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from ztwisted.h2.connection import H2Settings, HBONEConnection, StreamRefused
from ztwisted.h2.goaway import CLIENT_PREFACE, MAX_STREAM_ID, encode_goaway

from .h2_support import accept_and_record, couple, parse_frames

NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
PROTOCOL_ERROR = h2.errors.ErrorCodes.PROTOCOL_ERROR
REFUSED_STREAM = h2.errors.ErrorCodes.REFUSED_STREAM
CANCEL = h2.errors.ErrorCodes.CANCEL
ENHANCE_YOUR_CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
FRAME_SIZE_ERROR = h2.errors.ErrorCodes.FRAME_SIZE_ERROR
AUTHORITY = "127.0.0.1:8080"


# -- the fake TLS transport and the frames written to it ------------------------------


class FakeTLSTransport(StringTransport):
    """The TLS transport as the connection sees it; records how it was closed."""

    negotiatedProtocol = b"h2"

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def loseConnection(self):
        self.calls.append("loseConnection")
        super().loseConnection()

    def abortConnection(self):
        self.calls.append("abortConnection")
        self.disconnected = True
        self.disconnecting = True

    def unregisterProducer(self):
        # As TLSMemoryBIOProtocol: tolerated without a producer.
        self.calls.append("unregisterProducer")
        self.producer = None
        self.streaming = None

    @property
    def closed_cleanly(self) -> bool:
        return "loseConnection" in self.calls and "abortConnection" not in self.calls


def describe(frame: Frame) -> tuple:
    """A frame as a short tuple, for exact comparisons."""
    if isinstance(frame, GoAwayFrame):
        return ("GOAWAY", frame.last_stream_id, frame.error_code)
    if isinstance(frame, PingFrame):
        return ("PING-ACK" if "ACK" in frame.flags else "PING",)
    if isinstance(frame, RstStreamFrame):
        return ("RST_STREAM", frame.stream_id, frame.error_code)
    if isinstance(frame, DataFrame):
        return ("DATA", frame.stream_id, bytes(frame.data), "END_STREAM" in frame.flags)
    if isinstance(frame, HeadersFrame):
        return ("HEADERS", frame.stream_id, "END_STREAM" in frame.flags)
    if isinstance(frame, WindowUpdateFrame):
        return ("WINDOW_UPDATE", frame.stream_id)
    if isinstance(frame, SettingsFrame):
        return ("SETTINGS-ACK",) if "ACK" in frame.flags else ("SETTINGS",)
    return (type(frame).__name__, frame.stream_id)


def kinds(frames: list[Frame]) -> list[tuple]:
    return [describe(f) for f in frames]


class Link:
    """Our HBONEConnection on a fake transport, with an ``h2`` peer we drive by hand."""

    def __init__(
        self, *, client: bool, settings: H2Settings | None = None, handler=accept_and_record, handshake: bool = True
    ):
        self.clock = task.Clock()
        self.requests = []
        self.limits: list[str] = []

        def on_request(connection, stream):
            self.requests.append(stream)
            if handler is not None:
                handler(stream)

        self.conn = HBONEConnection(
            client=client, clock=self.clock, settings=settings, on_tunnel_request=None if client else on_request
        )
        self.conn.on_limit = lambda kind, detail: self.limits.append(kind)
        self.transport = FakeTLSTransport()
        self.peer = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=not client, header_encoding="utf-8")
        )
        self.peer_events: list = []
        #: every frame our side wrote, in order
        self.written: list[Frame] = []
        self.conn.makeConnection(self.transport)
        self.peer.initiate_connection()
        self.settle()
        if handshake:
            self.conn.handshakeCompleted()

    # -- moving bytes ---------------------------------------------------------------

    def from_ours(self) -> list[Frame]:
        """Decode what our side wrote since last time; hand all but GOAWAY to the peer."""
        raw = self.transport.value()
        self.transport.clear()
        frames = parse_frames(raw)
        self.written += frames
        for_peer = (CLIENT_PREFACE if raw.startswith(CLIENT_PREFACE) else b"") + b"".join(
            f.serialize() for f in frames if not isinstance(f, GoAwayFrame)
        )
        if for_peer:
            self.peer_events += self.peer.receive_data(for_peer)
        return frames

    def to_ours(self, extra: bytes = b"") -> None:
        """Deliver what the peer has to send (plus ``extra`` raw bytes) to our side."""
        data = self.peer.data_to_send() + extra
        if data:
            self.conn.dataReceived(data)

    def settle(self) -> list[Frame]:
        """Exchange until both sides are quiet; the frames our side wrote meanwhile."""
        frames = []
        while True:
            frames += self.from_ours()
            pending = self.peer.data_to_send()
            if not pending:
                return frames
            self.conn.dataReceived(pending)

    def advance(self, seconds: float, step: float = 1.0) -> None:
        """Let time pass with an attentive peer (keepalive PINGs are answered)."""
        while seconds > 1e-9:
            delta = min(step, seconds)
            self.clock.advance(delta)
            seconds -= delta
            if not self.transport.disconnecting:
                self.settle()

    def lose(self) -> None:
        """The transport reports the connection gone, as the reactor would after a close."""
        reason = error.ConnectionAborted() if "abortConnection" in self.transport.calls else error.ConnectionDone()
        self.conn.connectionLost(Failure(reason))

    # -- the peer's moves ---------------------------------------------------------

    def peer_connect(self, authority: str = AUTHORITY) -> int:
        stream_id = self.peer.get_next_available_stream_id()
        self.peer.send_headers(stream_id, [(":method", "CONNECT"), (":authority", authority)])
        return stream_id

    def peer_open_tunnel(self) -> tuple[int, object]:
        """Server side: the peer opens a tunnel our side accepts; (stream id, our stream)."""
        stream_id = self.peer_connect()
        self.settle()
        ours = self.conn.streams[stream_id]
        assert ours.response.called
        return stream_id, ours

    def peer_data_for(self, stream_id: int) -> bytes:
        return b"".join(
            e.data for e in self.peer_events if isinstance(e, h2.events.DataReceived) and e.stream_id == stream_id
        )

    def peer_saw_end(self, stream_id: int) -> bool:
        return any(isinstance(e, h2.events.StreamEnded) and e.stream_id == stream_id for e in self.peer_events)

    def ours_open_tunnel(self):
        """Client side: our side opens a tunnel the peer answers 200; our stream."""
        opened = self.conn.open_tunnel(AUTHORITY)
        self.from_ours()
        request = [e for e in self.peer_events if isinstance(e, h2.events.RequestReceived)][-1]
        self.peer.send_headers(request.stream_id, [(":status", "200")])
        self.settle()
        stream = opened.result
        couple(stream)
        return stream


def goaway(last_stream_id: int, error_code: int = 0) -> bytes:
    return encode_goaway(last_stream_id, error_code)


# -- server side: graceful drain -------------------------------------------------


def test_graceful_drain_frames_in_order_and_streams_finish_both_ways():
    link = Link(client=False)
    first, first_ours = link.peer_open_tunnel()
    drained = link.conn.drain(graceful=True)

    assert kinds(link.from_ours()) == [("GOAWAY", MAX_STREAM_ID, NO_ERROR), ("PING",)]
    # The peer opens a stream before it answers the PING: the first GOAWAY cannot stop that one.
    ping_ack = link.peer.data_to_send()
    second = link.peer_connect()
    link.to_ours()
    assert [s.stream_id for s in link.requests] == [first, second]
    assert kinds(link.from_ours()) == [("HEADERS", second, False)]
    link.to_ours(ping_ack)
    assert kinds(link.from_ours()) == [("GOAWAY", second, NO_ERROR)]
    assert link.conn.goaway_sent_last_stream_id == second

    # Above the real last stream id: refused, never offered to the tunnel handler.
    third = link.peer_connect()
    link.to_ours()
    assert kinds(link.from_ours()) == [("RST_STREAM", third, REFUSED_STREAM)]
    assert len(link.requests) == 2

    # The streams in flight carry data both ways, half-close included.
    second_ours = link.conn.streams[second]
    link.peer.send_data(first, b"request one", end_stream=True)
    link.to_ours()
    assert first_ours.far.data == b"request one" and first_ours.far.eof
    first_ours.write(b"reply one")
    first_ours.write_eof()
    assert kinds(link.from_ours()) == [("DATA", first, b"reply one", False), ("DATA", first, b"", True)]
    assert link.peer_data_for(first) == b"reply one" and link.peer_saw_end(first)
    assert first_ours.finished.result == "closed"
    assert link.transport.calls == []

    second_ours.write(b"reply two first")
    second_ours.write_eof()
    link.settle()
    assert link.transport.calls == []  # the peer has not ended stream two yet
    link.peer.send_data(second, b"request two", end_stream=True)
    link.to_ours()
    assert second_ours.far.data == b"request two" and second_ours.far.eof
    assert link.peer_data_for(second) == b"reply two first"

    # Last stream done: close_notify (loseConnection without a producer), never an abort.
    assert link.transport.calls == ["unregisterProducer", "loseConnection"]
    assert link.conn.ended_by == "drained"
    assert not drained.called  # not before the connection is gone
    link.lose()
    assert drained.result == "drained"
    assert [describe(f) for f in link.written if isinstance(f, GoAwayFrame)] == [
        ("GOAWAY", MAX_STREAM_ID, NO_ERROR),
        ("GOAWAY", second, NO_ERROR),
    ]


def test_graceful_drain_without_streams_closes_after_the_ping():
    link = Link(client=False)
    drained = link.conn.drain()
    frames = link.settle()
    assert kinds(frames) == [("GOAWAY", MAX_STREAM_ID, NO_ERROR), ("PING",), ("GOAWAY", 0, NO_ERROR)]
    assert link.transport.calls == ["unregisterProducer", "loseConnection"]
    link.lose()
    assert drained.result == "drained"


def test_unanswered_ping_sends_second_goaway_after_ping_wait():
    settings = H2Settings.server(goaway_ping_wait=2.0)
    link = Link(client=False, settings=settings)
    stream_id, _ = link.peer_open_tunnel()
    link.conn.drain()
    assert kinds(link.from_ours()) == [("GOAWAY", MAX_STREAM_ID, NO_ERROR), ("PING",)]
    link.peer.data_to_send()  # the peer's PING ACK is lost
    link.clock.advance(1.99)
    assert link.from_ours() == []
    link.clock.advance(0.02)
    assert kinds(link.from_ours()) == [("GOAWAY", stream_id, NO_ERROR)]
    # A late answer changes nothing: there is exactly one more GOAWAY.
    link.peer.ping(b"late-ack")  # any traffic; the late ACK itself is gone
    link.settle()
    assert [f for f in link.written if isinstance(f, GoAwayFrame)][-1].last_stream_id == stream_id
    assert len([f for f in link.written if isinstance(f, GoAwayFrame)]) == 2
    assert link.transport.calls == []  # the stream is still open


def test_drain_deadline_cancels_remaining_streams_then_closes():
    link = Link(client=False)
    one, one_ours = link.peer_open_tunnel()
    three, three_ours = link.peer_open_tunnel()
    drained = link.conn.drain(graceful=True, deadline=25)
    link.settle()
    link.advance(24)  # keepalive PINGs at 10 and 20 are answered; none is due at 25
    assert link.transport.calls == []
    link.clock.advance(1.5)
    assert kinds(link.from_ours()) == [("RST_STREAM", one, CANCEL), ("RST_STREAM", three, CANCEL)]
    assert "loseConnection" in link.transport.calls and "abortConnection" not in link.transport.calls
    assert link.conn.ended_by == "drain-deadline"
    assert one_ours.finished.result == "drain-deadline" and three_ours.finished.result == "drain-deadline"
    assert not drained.called
    link.lose()
    assert drained.result == "drain-deadline"


def test_drain_deadline_resets_the_app_side_of_each_stream():
    link = Link(client=False)
    _, ours = link.peer_open_tunnel()
    link.conn.drain(graceful=True, deadline=5)
    link.settle()
    link.clock.advance(5)
    link.lose()
    assert ours.far.aborted


# -- abrupt ---------------------------------------------------------------------


def test_abrupt_drain_aborts_without_goaway():
    link = Link(client=False)
    _, ours = link.peer_open_tunnel()
    drained = link.conn.drain(graceful=False)
    assert link.transport.calls == ["abortConnection"]
    assert link.from_ours() == []
    assert link.conn.ended_by == "abrupt"
    assert not drained.called
    link.lose()
    assert drained.result == "abrupt"
    assert ours.far.aborted


# -- client side: a GOAWAY received ------------------------------------------------


def test_client_keeps_streams_up_to_last_stream_id_and_refuses_the_rest():
    link = Link(client=True)
    stream = link.ours_open_tunnel()
    assert stream.stream_id == 1
    unanswered = link.conn.open_tunnel(AUTHORITY)
    link.from_ours()
    failures = []
    unanswered.addErrback(failures.append)

    link.to_ours(goaway(1))
    assert failures and failures[0].check(StreamRefused)
    assert link.conn.goaway_received.last_stream_id == 1
    assert not link.conn.usable and link.conn.available_streams == 0
    assert link.conn.open_tunnel(AUTHORITY).addErrback(failures.append) is not None
    assert failures[-1].check(StreamRefused)
    assert link.from_ours() == []  # no new HEADERS went out

    # Stream 1 runs to completion, both directions and half-close.
    stream.write(b"up")
    stream.write_eof()
    assert kinds(link.from_ours()) == [("DATA", 1, b"up", False), ("DATA", 1, b"", True)]
    assert link.peer_data_for(1) == b"up" and link.peer_saw_end(1)
    assert link.transport.calls == []
    link.peer.send_data(1, b"down", end_stream=True)
    link.to_ours()
    assert stream.far.data == b"down" and stream.far.eof
    assert stream.finished.result == "closed"
    assert link.transport.closed_cleanly
    assert link.conn.ended_by == "drained"


def test_client_goaway_without_streams_closes_at_once():
    link = Link(client=True)
    link.to_ours(goaway(0))
    assert link.transport.closed_cleanly


def test_refused_stream_reset_before_the_answer_is_retryable():
    link = Link(client=True)
    opened = link.conn.open_tunnel(AUTHORITY)
    link.from_ours()
    link.peer.reset_stream(1, REFUSED_STREAM)
    failures = []
    opened.addErrback(failures.append)
    link.to_ours()
    assert failures and failures[0].check(StreamRefused)
    assert link.conn.usable  # only that stream was refused


# -- the GOAWAY filter: h2 never sees GOAWAY ----------------------------------------


@pytest.mark.parametrize("client", [True, False])
def test_h2_state_stays_open_after_goaway_received(client):
    link = Link(client=client)
    if client:
        stream = link.ours_open_tunnel()
        peer_stream_id = stream.stream_id
    else:
        peer_stream_id, stream = link.peer_open_tunnel()
    link.to_ours(goaway(peer_stream_id))
    assert link.conn.goaway_received is not None
    assert link.conn.h2.state_machine.state != h2.connection.ConnectionState.CLOSED
    link.peer.send_data(peer_stream_id, b"after goaway")
    link.to_ours()
    assert stream.far.data == b"after goaway"
    stream.write(b"answer")
    link.from_ours()
    assert link.peer_data_for(peer_stream_id) == b"answer"
    assert link.transport.calls == []


# -- keepalive -----------------------------------------------------------------


@pytest.mark.parametrize("client", [True, False])
def test_keepalive_pings_every_interval_while_idle(client):
    link = Link(client=client, settings=H2Settings(keepalive_interval=10, keepalive_timeout=20, idle_timeout=1000))
    link.clock.advance(9.9)
    assert link.from_ours() == []
    link.clock.advance(0.1)
    for _ in range(4):
        assert kinds(link.from_ours()) == [("PING",)]
        link.to_ours()  # answered at once
        assert link.from_ours() == []
        link.clock.advance(9.9)
        assert link.from_ours() == []
        link.clock.advance(0.1)
    assert link.transport.calls == []


def test_received_frames_postpone_the_keepalive_ping():
    link = Link(client=True, settings=H2Settings.client(keepalive_interval=10))
    link.clock.advance(6)
    link.peer.ping(b"peerping")
    link.settle()  # our side answers: a frame received
    link.clock.advance(6)
    assert link.from_ours() == []
    link.clock.advance(3.9)
    assert link.from_ours() == []
    link.clock.advance(0.2)
    assert kinds(link.from_ours()) == [("PING",)]


def test_frames_that_keep_coming_keep_the_keepalive_quiet_on_one_timer():
    # Reads only note the time; the one KEEPALIVE timer, firing, waits for the rest of the interval.
    link = Link(client=True, settings=H2Settings.client(keepalive_interval=10, keepalive_timeout=20))
    timers_before = len(link.clock.getDelayedCalls())
    for _ in range(10):  # 60 s, a frame every 6 s
        link.clock.advance(6)
        link.peer.ping(b"peerping")
        assert ("PING",) not in kinds(link.settle())
        assert len(link.clock.getDelayedCalls()) == timers_before
    link.clock.advance(9.9)
    assert link.from_ours() == []
    link.clock.advance(0.1)
    assert kinds(link.from_ours()) == [("PING",)], "10 s after the last frame"


def test_after_an_answered_ping_the_next_comes_an_interval_after_the_answer():
    link = Link(client=True, settings=H2Settings.client(keepalive_interval=10, keepalive_timeout=20))
    link.clock.advance(10)
    assert kinds(link.from_ours()) == [("PING",)]
    link.clock.advance(3)
    link.to_ours()  # the ACK, 3 s late
    link.clock.advance(9.9)
    assert link.from_ours() == []
    link.clock.advance(0.1)
    assert kinds(link.from_ours()) == [("PING",)]
    assert link.transport.calls == []


def test_a_quiet_peer_gets_one_ping_and_then_the_timeout():
    # The KEEPALIVE timer still fires while a PING waits for its answer: it sends no second one.
    link = Link(client=True, settings=H2Settings.client(keepalive_interval=10, keepalive_timeout=25))
    link.clock.advance(10)
    assert kinds(link.from_ours()) == [("PING",)]
    link.peer.data_to_send()  # the peer is frozen
    link.clock.advance(20)
    assert link.from_ours() == [] and link.transport.calls == []
    link.clock.advance(5)
    assert link.transport.calls == ["abortConnection"]
    assert link.conn.ended_by == "keepalive-timeout"


@pytest.mark.parametrize("setting", ["keepalive_interval", "keepalive_timeout"])
@pytest.mark.parametrize("seconds", [0, -1.0])
def test_keepalive_times_must_be_positive(setting, seconds):
    # A KEEPALIVE timer that re-arms for the rest of a zero interval would fire every turn.
    with pytest.raises(ValueError, match=setting):
        H2Settings.client(**{setting: seconds})


def test_keepalive_timeout_aborts_and_resets_the_streams():
    link = Link(client=True, settings=H2Settings.client(keepalive_interval=10, keepalive_timeout=20))
    stream = link.ours_open_tunnel()
    link.clock.advance(10)
    assert kinds(link.from_ours()) == [("PING",)]
    link.peer.data_to_send()  # the peer is frozen: the ACK never comes
    link.clock.advance(19.9)
    assert link.transport.calls == []
    link.clock.advance(0.2)
    assert link.transport.calls == ["abortConnection"]
    assert link.conn.ended_by == "keepalive-timeout"
    link.lose()
    assert stream.far.aborted
    assert link.conn.closed.result == "keepalive-timeout"


# -- limits against abusive peers ----------------------------------------------------


def assert_closed_after_goaway(link: Link, ended_by: str) -> None:
    """The GOAWAY written last, then a close that lets it reach the peer (TLS close_notify);
    TCP is cut only if the peer has not closed within ``close_notify_wait``."""
    assert link.transport.calls == ["unregisterProducer", "loseConnection"]
    assert link.transport.value() == b"", "nothing may follow the GOAWAY"
    link.clock.advance(link.conn.settings.close_notify_wait)
    assert link.transport.calls[-1] == "abortConnection"
    link.lose()
    assert link.conn.ended_by == ended_by


def test_ping_flood_while_the_transport_is_paused_is_cut_off():
    link = Link(client=False, settings=H2Settings.server(max_unread_control_bytes=1000))
    link.conn.pauseProducing()  # the TLS transport's buffer is full: the peer does not read
    ack_size = 9 + 8
    allowed = 1000 // ack_size
    for i in range(allowed):
        link.peer.ping(i.to_bytes(8, "big"))
        link.to_ours()
    assert kinds(link.from_ours()) == [("PING-ACK",)] * allowed
    assert link.transport.calls == [] and link.limits == []
    link.peer.ping(b"one-more")
    link.to_ours()
    assert kinds(link.from_ours()) == [("GOAWAY", 0, ENHANCE_YOUR_CALM)]
    assert link.limits == ["control-frame"]
    assert_closed_after_goaway(link, "flood")


def test_settings_flood_is_cut_off_while_the_transport_still_takes_writes():
    link = Link(client=False, settings=H2Settings.server(max_peer_control_frames_per_second=50), handler=None)
    # The peer does not read, but its socket buffers are large: the transport is never paused.
    # Its first SETTINGS frame, in the handshake, counts too.
    for _ in range(49):
        link.to_ours(SettingsFrame(0).serialize())
    assert link.limits == [] and link.transport.calls == []
    link.to_ours(SettingsFrame(0).serialize())
    assert link.limits == ["control-frame"]
    frames = kinds(link.from_ours())
    assert frames[-1] == ("GOAWAY", 0, ENHANCE_YOUR_CALM)
    assert_closed_after_goaway(link, "flood")


def test_settings_and_pings_below_the_rate_are_no_flood():
    link = Link(client=False, settings=H2Settings.server(max_peer_control_frames_per_second=50), handler=None)
    for _ in range(4):
        for i in range(24):  # and the handshake's SETTINGS in the first second
            link.to_ours(SettingsFrame(0).serialize())
            link.peer.ping(i.to_bytes(8, "big"))
            link.to_ours()
        link.clock.advance(1.0)
    assert link.limits == [] and link.transport.calls == []
    assert kinds(link.from_ours()).count(("SETTINGS-ACK",)) == 96


def test_a_frame_over_the_maximum_frame_size_is_refused_from_its_header():
    link = Link(client=False, settings=H2Settings.server(max_frame_size=16384), handler=None)
    stream_id = link.peer_connect()
    link.to_ours()
    link.from_ours()
    # A DATA frame header that claims 16 MiB, and no body yet: h2 would buffer it all first.
    huge = DataFrame(stream_id)
    huge.data = b"x" * (16 * 1024 * 1024)
    link.conn.dataReceived(huge.serialize()[: 9 + 100])
    assert link.limits == ["frame-size"]
    assert kinds(link.from_ours()) == [("GOAWAY", stream_id, FRAME_SIZE_ERROR)]
    assert_closed_after_goaway(link, "protocol-error")
    assert link.requests[0].done
    assert link.conn.h2.incoming_buffer._data == b""


def test_a_header_block_over_the_cap_is_refused_before_its_continuations_arrive():
    link = Link(
        client=False, settings=H2Settings.server(max_frame_size=65536, max_header_list_size=16384), handler=None
    )
    block = hpack.Encoder().encode([(":method", "CONNECT"), (":authority", AUTHORITY)])
    headers = HeadersFrame(1)
    headers.data = block
    filler = ContinuationFrame(1)
    filler.data = b"\0" * 40000  # never decoded: the cap (2 x 16 KiB) is hit first
    link.conn.dataReceived(headers.serialize())
    link.conn.dataReceived(filler.serialize()[:9])
    assert link.limits == ["header-block-size"]
    assert kinds(link.from_ours()) == [("GOAWAY", 0, ENHANCE_YOUR_CALM)]
    assert_closed_after_goaway(link, "protocol-error")
    assert link.requests == []


def test_a_header_block_within_the_cap_is_served():
    link = Link(client=False, settings=H2Settings.server(max_header_list_size=16384), handler=None)
    link.peer.max_outbound_frame_size = 4096  # the peer splits its block into HEADERS + CONTINUATION
    stream_id = link.peer.get_next_available_stream_id()
    link.peer.send_headers(stream_id, [(":method", "CONNECT"), (":authority", AUTHORITY), ("x-big", "v" * 10000)])
    link.to_ours()
    assert link.limits == [] and [s.stream_id for s in link.requests] == [stream_id]


def test_pings_from_a_peer_that_reads_are_no_flood():
    link = Link(client=False, settings=H2Settings.server(max_unread_control_bytes=1000))
    for _ in range(5):
        link.conn.pauseProducing()
        for i in range(50):
            link.peer.ping(i.to_bytes(8, "big"))
            link.to_ours()
        link.conn.resumeProducing()  # the peer read: the count starts again
    assert link.limits == [] and link.transport.calls == []
    assert kinds(link.from_ours()) == [("PING-ACK",)] * 250


def open_and_reset(link: Link, count: int) -> None:
    for _ in range(count):
        stream_id = link.peer_connect()
        link.peer.reset_stream(stream_id, CANCEL)
        link.to_ours()


def test_rapid_reset_is_cut_off():
    link = Link(client=False, settings=H2Settings.server(max_peer_resets_per_second=5), handler=None)
    open_and_reset(link, 5)
    link.clock.advance(1.0)
    open_and_reset(link, 5)  # a new second: still within the limit
    assert link.limits == [] and link.transport.calls == []
    link.clock.advance(0.5)
    open_and_reset(link, 1)
    assert link.limits == ["rapid-reset"]
    goaways = [describe(f) for f in link.from_ours() if isinstance(f, GoAwayFrame)]
    assert goaways == [("GOAWAY", 21, ENHANCE_YOUR_CALM)]
    assert_closed_after_goaway(link, "flood")


def test_rapid_reset_in_one_chunk_counts_once():
    link = Link(client=False, settings=H2Settings.server(max_peer_resets_per_second=5), handler=None)
    for _ in range(20):
        stream_id = link.peer_connect()
        link.peer.reset_stream(stream_id, CANCEL)
    link.to_ours()
    assert link.limits == ["rapid-reset"]
    assert len([f for f in link.from_ours() if isinstance(f, GoAwayFrame)]) == 1
    assert_closed_after_goaway(link, "flood")


def test_peer_ignoring_max_concurrent_streams_gets_the_extra_stream_refused():
    link = Link(client=False, settings=H2Settings.server(max_concurrent_streams=2))
    assert link.peer.remote_settings.max_concurrent_streams == 2
    # The peer ignores what we announced.
    link.peer.remote_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 100
    link.peer.remote_settings.acknowledge()
    first = link.peer_connect()
    link.peer_connect()
    link.to_ours()
    assert len(link.requests) == 2 and link.limits == []
    link.from_ours()
    third = link.peer_connect()
    link.to_ours()
    # RFC 9113 section 5.1.2: a stream error, not a connection error.
    assert link.limits == ["max-concurrent-streams"]
    assert kinds(link.from_ours()) == [("RST_STREAM", third, REFUSED_STREAM)]
    assert link.transport.calls == []
    assert link.conn.ended_by is None
    # The streams within the limit go on, and a stream is accepted again once one ended.
    link.requests[0].write(b"still here")
    assert [f.data for f in link.from_ours() if isinstance(f, DataFrame) and f.stream_id == first] == [b"still here"]
    link.requests[0].reset()
    link.from_ours()
    fourth = link.peer_connect()
    link.to_ours()
    assert link.requests[-1].stream_id == fourth and not link.requests[-1].done


def test_oversized_header_list_is_a_connection_error():
    link = Link(client=False, settings=H2Settings.server(max_header_list_size=4096), handler=None)
    headers = [(":method", "CONNECT"), (":authority", AUTHORITY)]
    link.peer.send_headers(1, headers + [("x-fits", "a" * 3000)])
    link.to_ours()
    assert len(link.requests) == 1 and link.limits == []
    link.peer.send_headers(3, headers + [("x-too-big", "b" * 5000)])
    link.to_ours()
    assert link.limits == ["header-list-size"]
    frames = kinds(link.from_ours())
    assert frames[-1][0] == "GOAWAY" and frames[-1][2] == ENHANCE_YOUR_CALM
    assert_closed_after_goaway(link, "protocol-error")
    assert len(link.requests) == 1


def test_handshake_timeout_aborts():
    link = Link(client=False, settings=H2Settings.server(handshake_timeout=10), handshake=False)
    link.advance(9.5, step=0.5)
    assert link.transport.calls == [] and link.limits == []
    link.clock.advance(0.6)
    assert link.transport.calls == ["abortConnection"]
    assert link.limits == ["handshake-timeout"]
    link.lose()
    assert link.conn.ended_by == "handshake-timeout"
    assert link.conn.ready.called  # errback'd with the loss
    link.conn.ready.addErrback(lambda failure: None)


def test_completed_handshake_cancels_the_handshake_timer():
    link = Link(client=False, settings=H2Settings.server(handshake_timeout=10, idle_timeout=1000))
    link.advance(30)
    assert link.transport.calls == [] and link.limits == []


def test_idle_server_connection_is_closed_cleanly():
    link = Link(client=False, settings=H2Settings.server(idle_timeout=60))
    link.advance(59.5, step=0.5)  # keepalive PINGs are answered meanwhile
    assert link.transport.calls == []
    link.clock.advance(0.6)
    assert link.transport.calls == ["unregisterProducer", "loseConnection"]
    assert link.limits == ["idle-timeout"]
    link.lose()
    assert link.conn.ended_by == "idle-timeout"


def test_a_stream_cancels_the_idle_timeout():
    link = Link(client=False, settings=H2Settings.server(idle_timeout=60))
    link.advance(30)
    _, ours = link.peer_open_tunnel()
    ours.write(b"x")
    link.advance(60)
    assert link.transport.calls == [] and link.limits == []


# -- backpressure: received data is acknowledged only when the partner takes it ---------


def window_updates(frames: list[Frame], stream_id: int) -> list[int]:
    return [f.window_increment for f in frames if isinstance(f, WindowUpdateFrame) and f.stream_id == stream_id]


@pytest.mark.parametrize("paused", [False, True])
def test_data_for_a_paused_partner_is_not_acknowledged_until_resumed(paused):
    settings = H2Settings.server(stream_window=65535, connection_window=65536)
    link = Link(client=False, settings=settings)
    stream_id, ours = link.peer_open_tunnel()
    if paused:
        ours.pauseProducing()  # the app stopped reading
    link.peer.send_data(stream_id, b"z" * 16000)
    link.peer.send_data(stream_id, b"z" * 16000)
    link.peer.send_data(stream_id, b"z" * 8000)
    link.to_ours()
    frames = link.from_ours()
    assert len(ours.far.data) == 40000  # handed on either way
    if not paused:
        assert sum(window_updates(frames, stream_id)) == 40000
        return
    assert window_updates(frames, stream_id) == [] and window_updates(frames, 0) == []
    ours.resumeProducing()
    frames = link.from_ours()
    assert window_updates(frames, stream_id) == [40000]
    assert sum(window_updates(frames, 0)) == 40000


def test_data_overrunning_the_stream_window_is_a_flow_control_error():
    """Whole DATA frames take the lean path (ztwisted.h2.lean_data): h2's windows still hold."""
    link = Link(client=False, settings=H2Settings.server(stream_window=65535, connection_window=1_000_000))
    stream_id, ours = link.peer_open_tunnel()
    ours.pauseProducing()  # the app stopped reading: nothing is acknowledged
    link.from_ours()
    frames = [DataFrame(stream_id, data=b"x" * 16384).serialize() for _ in range(4)]
    link.to_ours(b"".join(frames[:3]))
    assert len(ours.far.data) == 3 * 16384 and link.limits == []
    link.to_ours(frames[3])  # 65,536 bytes in a 65,535-byte window: the peer ignored it
    assert link.limits == ["protocol-error"]
    assert kinds(link.from_ours()) == [("GOAWAY", stream_id, h2.errors.ErrorCodes.FLOW_CONTROL_ERROR)]
    assert_closed_after_goaway(link, "protocol-error")
    assert len(ours.far.data) == 3 * 16384 and ours.done


def test_a_request_reset_in_the_read_of_a_later_request_is_refused_without_ending_the_connection():
    # Stream 3 is refused at once (as a denied policy or a non-CONNECT request is), but the
    # peer's HEADERS for stream 5 in the same read made h2 forget the reset stream 3: h2 then
    # takes our answer on 3 for a new stream of ours, with too low an ID. Only stream 3 ends.
    link = Link(client=False, handler=lambda s: s.refuse(503) if s.stream_id == 3 else accept_and_record(s))
    link.peer_open_tunnel()  # stream 1: the connection is open
    reset = link.peer_connect()
    link.peer.reset_stream(reset, CANCEL)
    later = link.peer_connect()
    link.to_ours()
    assert (reset, later) == (3, 5)
    assert link.limits == [] and link.transport.calls == []
    assert link.conn.usable and sorted(link.conn.streams) == [1, 5]
    assert not [f for f in link.from_ours() if getattr(f, "stream_id", 0) == reset]


def test_a_header_value_that_is_not_utf8_ends_the_connection_with_a_protocol_error():
    # RFC 9113 allows any octet above 0x7f in a value; h2 decodes values as UTF-8 and raises
    # UnicodeDecodeError, which must end the connection as any protocol error, not escape.
    link = Link(client=False)
    link.peer_open_tunnel()
    stream_id = link.peer.get_next_available_stream_id()
    link.peer.send_headers(stream_id, [(b":method", b"CONNECT"), (b":authority", AUTHORITY.encode()), (b"x", b"\xff")])
    link.to_ours()
    assert link.limits == ["protocol-error"]
    assert kinds(link.from_ours()) == [("GOAWAY", stream_id, PROTOCOL_ERROR)]
    assert_closed_after_goaway(link, "protocol-error")
