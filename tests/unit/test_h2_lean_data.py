"""The lean path for DATA frames (ztwisted.h2.lean_data) against h2 itself.

Two server-side ``h2`` connections get the same hyperframe-encoded bytes: one
through ``h2`` alone, one as :class:`~ztwisted.h2.connection.HBONEConnection`
feeds it (GOAWAY filter segments, :func:`lean_streams.receive`: whole DATA frames
to :func:`take_data_frame` first). Their events, their answers and their errors must be the same.
"""

from __future__ import annotations

import tracemalloc

import h2
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import pytest
from hyperframe.frame import ContinuationFrame, DataFrame, GoAwayFrame, HeadersFrame, RstStreamFrame, SettingsFrame

from ztwisted.h2 import lean_data, lean_streams
from ztwisted.h2.goaway import (
    CLIENT_PREFACE,
    EmptyFramesFlood,
    FrameTooLarge,
    GoawayFilter,
    ReceivedGoaway,
    encode_goaway,
)
from ztwisted.h2.lean_data import take_data_frame

from .h2_support import parse_frames

CONNECT = [(":method", "CONNECT"), (":authority", "127.0.0.1:8080")]


def test_this_h2_has_what_the_lean_path_needs():
    # Without it every frame would silently take the slow path: say so when h2 changes.
    assert lean_data.ENABLED


class Server:
    """A server-side h2 connection with stream 1 open (CONNECT answered 200), fed as HBONEConnection feeds it."""

    def __init__(self, lean: bool):
        self.lean = lean
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.filter = GoawayFilter(expect_client_preface=True, max_frame_size=16384, max_header_block=65536)
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer.initiate_connection()
        self.h2.initiate_connection()
        self.feed(peer.data_to_send())
        peer.receive_data(self.h2.data_to_send())
        peer.send_headers(1, CONNECT)
        self.feed(peer.data_to_send())
        self.h2.send_headers(1, [(":status", "200")])
        peer.receive_data(self.h2.data_to_send())

    def feed(self, data: bytes) -> list[h2.events.Event]:
        segments, _ = self.filter.segments(data, cut_out_frames=self.lean)
        return lean_streams.receive(self.h2, segments)

    @property
    def taken(self) -> int:
        """How many DATA frames the lean path took."""
        return TAKEN.get(id(self.h2), 0)


TAKEN: dict[int, int] = {}


@pytest.fixture(autouse=True)
def count_what_the_lean_path_takes(monkeypatch):
    take = lean_data.take_data_frame

    def counting(h2conn, frame, stream_id):
        events = take(h2conn, frame, stream_id)
        if events is not None:
            TAKEN[id(h2conn)] = TAKEN.get(id(h2conn), 0) + 1
        return events

    TAKEN.clear()
    monkeypatch.setattr(lean_data, "take_data_frame", counting)


def describe(events: list[h2.events.Event]) -> list[tuple]:
    return [
        (
            type(e).__name__,
            getattr(e, "stream_id", None),
            getattr(e, "data", None),
            getattr(e, "flow_controlled_length", None),
            getattr(e, "stream_ended", None) is not None,
        )
        for e in events
    ]


def data(payload: bytes, stream_id: int = 1, flags=(), pad_length: int = 0) -> bytes:
    frame = DataFrame(stream_id, data=payload, flags=flags)
    if pad_length:
        frame.flags.add("PADDED")
        frame.pad_length = pad_length
    return frame.serialize()


def both(chunks: list[bytes]) -> tuple[Server, list, list]:
    """Feed the same chunks to an h2-only and a lean server, acknowledging all data as it comes.

    Returns the lean server and, per server, its events and what it sent after each chunk.
    """
    plain, lean = Server(lean=False), Server(lean=True)
    results = []
    for server in (plain, lean):
        events, answers = [], []
        for chunk in chunks:
            new = server.feed(chunk)
            for event in new:
                if isinstance(event, h2.events.DataReceived):
                    server.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            events += new
            answers.append(server.h2.data_to_send())
        results.append((events, answers))
    return lean, results[0], results[1]


def test_data_frames_give_the_same_events_windows_and_acknowledgements_as_h2():
    chunks = [
        data(b"a" * 100) + data(b"b" * 16384),
        data(b""),
        data(b"padded", pad_length=10) + data(b"c" * 16000),
        data(b"d" * 3000)[:2000],  # in pieces: held back until whole
        data(b"d" * 3000)[2000:] + data(b"e" * 700),
        data(b"last", flags=["END_STREAM"]),
    ]
    lean, (plain_events, plain_answers), (lean_events, lean_answers) = both(chunks)
    assert lean.taken == 7  # a, b, the empty one, c, d, e and the last (END_STREAM): not the padded one
    assert describe(lean_events) == describe(plain_events)
    assert b"".join(e.data for e in lean_events if isinstance(e, h2.events.DataReceived)) == (
        b"a" * 100 + b"b" * 16384 + b"padded" + b"c" * 16000 + b"d" * 3000 + b"e" * 700 + b"last"
    )
    # The same windows: the same WINDOW_UPDATEs at the same moments (h2 sends one at half a window).
    assert lean_answers == plain_answers
    updates = [(f.stream_id, f.window_increment) for f in parse_frames(b"".join(lean_answers))]
    assert [stream_id for stream_id, _ in updates] == [0, 1]  # the test reached a WINDOW_UPDATE of each


@pytest.mark.parametrize("connection_window", [0, 1_000_000])
def test_a_frame_overrunning_a_window_is_h2s_flow_control_error(connection_window):
    """The connection's window (65,535 bytes), or with a larger one the stream's: the 4th 16 KiB frame overruns it."""
    outcomes = []
    for server in (Server(lean=False), Server(lean=True)):
        if connection_window:
            server.h2.increment_flow_control_window(connection_window)
            server.h2.data_to_send()
        frames = [data(b"x" * 16384) for _ in range(4)]
        for frame in frames[:3]:
            server.feed(frame)
        with pytest.raises(h2.exceptions.FlowControlError):
            server.feed(frames[3])
        outcomes.append(server.h2.data_to_send())
    plain_out, lean_out = outcomes
    assert lean_out == plain_out  # h2's GOAWAY, FLOW_CONTROL_ERROR
    (goaway,) = parse_frames(lean_out)
    assert isinstance(goaway, GoAwayFrame) and goaway.error_code == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR


def test_content_length_is_still_counted():
    """A CONNECT with a content-length (odd, but a peer may send it): h2's check still fires."""
    outcomes = []
    for lean in (False, True):
        server = Server(lean=lean)
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        headers = HeadersFrame(3, flags=["END_HEADERS"])
        headers.data = peer.encoder.encode([*CONNECT, ("content-length", "10")])
        server.feed(headers.serialize())
        server.h2.send_headers(3, [(":status", "200")])
        server.h2.data_to_send()
        server.feed(data(b"x" * 10, stream_id=3))
        with pytest.raises(h2.exceptions.InvalidBodyLengthError):
            server.feed(data(b"y", stream_id=3))
        outcomes.append((server.taken, server.h2.data_to_send()))
    assert outcomes[1][0] == 1 and outcomes[1][1] == outcomes[0][1]


def test_a_tunnel_without_content_length_counts_what_came_as_h2_does():
    counted = []
    for server in (Server(lean=False), Server(lean=True)):
        server.feed(data(b"a" * 100) + data(b"b" * 900))
        server.feed(data(b"c", flags=["END_STREAM"]))  # END_STREAM, where a content-length is compared
        counted.append((server.taken, server.h2.streams[1]._actual_content_length))
    assert counted == [(0, 1001), (3, 1001)]


def test_frames_the_lean_path_leaves_to_h2():
    server = Server(lean=True)
    oversized = DataFrame(1, data=b"x" * 16385).serialize()  # over h2's maximum frame size
    assert take_data_frame(server.h2, oversized, 1) is None
    assert take_data_frame(server.h2, data(b"x", stream_id=3), 3) is None  # a stream h2 does not have
    # A partial frame buffered in h2: what follows must reach h2 after it.
    server.h2.receive_data(data(b"y" * 10)[:5])
    assert take_data_frame(server.h2, data(b"x"), 1) is None
    server.h2.receive_data(data(b"y" * 10)[5:])
    assert take_data_frame(server.h2, data(b"x"), 1) is not None
    # A stream the peer ended, or that was reset: h2 decides what that is.
    server.feed(data(b"", flags=["END_STREAM"]))
    assert take_data_frame(server.h2, data(b"x"), 1) is None
    server = Server(lean=True)
    server.feed(RstStreamFrame(1, error_code=h2.errors.ErrorCodes.CANCEL).serialize())
    assert take_data_frame(server.h2, data(b"x"), 1) is None


def test_filter_cuts_out_only_whole_unpadded_data_frames():
    settings = SettingsFrame(0).serialize()
    plain = data(b"p" * 50)
    padded = data(b"q", pad_length=4)
    last = data(b"r", flags=["END_STREAM"])
    open_block = HeadersFrame(5, data=b"\x82").serialize()  # no END_HEADERS: a CONTINUATION must follow
    split = data(b"s" * 40)
    chunk = settings + plain + padded + encode_goaway(1) + last + plain + split[:20]
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    segments, goaways = filt.segments(chunk)
    assert segments == [(settings, 0), (plain, 1), (padded, 0), (last, 1), (plain, 1)]
    assert [g.last_stream_id for g in goaways] == [1]
    # The DATA frame in pieces is held back until whole (as h2 would buffer it), then cut out.
    segments, _ = filt.segments(split[20:] + open_block + plain)
    assert segments == [(split, 1), (open_block + plain, 0)]  # inside a header block: h2's error to raise
    # feed() is the same bytes, joined, for whoever wants no lean path.
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    assert filt.feed(chunk) == (settings + plain + padded + last + plain + split[:20], goaways)


class Client:
    """A client-side h2 connection with stream 1 open (its CONNECT answered 200); ``peer_settings``
    and ``peer_window_increment``: what the server announces, and adds to the connection's window."""

    def __init__(self, peer_settings: dict | None = None, peer_window_increment: int = 0):
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        peer.initiate_connection()
        if peer_settings:
            peer.update_settings(peer_settings)
        if peer_window_increment:
            peer.increment_flow_control_window(peer_window_increment)
        peer.receive_data(self.h2.data_to_send())
        self.h2.receive_data(peer.data_to_send())
        self.h2.send_headers(1, CONNECT)
        peer.receive_data(self.h2.data_to_send())
        peer.send_headers(1, [(":status", "200")])
        self.h2.receive_data(peer.data_to_send())
        self.h2.data_to_send()


def test_sent_data_frames_longer_than_64_kib_are_the_bytes_h2_makes():
    # A frame length takes 3 bytes: the high one is used from 64 KiB on (a peer allowing 1 MiB frames).
    settings = {h2.settings.SettingCodes.MAX_FRAME_SIZE: 2**20, h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**20}
    plain, lean = Client(settings, 2**20), Client(settings, 2**20)
    chunk = bytes(range(256)) * 1024  # 256 KiB
    plain.h2.send_data(1, chunk)
    assert lean_data.send_data_frame(lean.h2, 1, chunk)
    assert lean.h2.data_to_send() == plain.h2.data_to_send()


def test_sent_data_frames_are_the_bytes_and_windows_h2_makes():
    plain, lean = Client(), Client()
    for chunk in (b"a" * 10, b"b" * 16384, b"c" * 16384, b"d" * 16384, b"e" * 16373):
        plain.h2.send_data(1, chunk)
        assert lean_data.send_data_frame(lean.h2, 1, chunk)
        assert lean.h2.local_flow_control_window(1) == plain.h2.local_flow_control_window(1)
        assert lean_data.send_window(lean.h2, 1) == plain.h2.local_flow_control_window(1)
    assert lean.h2.data_to_send() == plain.h2.data_to_send()
    assert lean.h2.local_flow_control_window(1) == 65535 - 10 - 3 * 16384 - 16373 == 0
    # Over the window, over the frame size, on a stream h2 does not hold or has ended:
    # not taken; h2's send_data raises what it raises.
    assert not lean_data.send_data_frame(lean.h2, 1, b"x")
    with pytest.raises(h2.exceptions.FlowControlError):
        lean.h2.send_data(1, b"x")
    client = Client()
    with pytest.raises(h2.exceptions.NoSuchStreamError):  # a stream h2 does not hold: h2's answer
        lean_data.send_window(client.h2, 3)
    assert not lean_data.send_data_frame(client.h2, 1, b"x" * 16385)
    assert not lean_data.send_data_frame(client.h2, 3, b"x")
    client.h2.end_stream(1)
    assert not lean_data.send_data_frame(client.h2, 1, b"x")
    with pytest.raises(h2.exceptions.ProtocolError):
        client.h2.send_data(1, b"x")


def test_a_data_frame_in_many_pieces_is_held_as_pieces_until_whole():
    frame = data(bytes(range(256)) * 4)
    after = SettingsFrame(0).serialize() + encode_goaway(3)
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    for i in range(len(frame) - 1):
        assert filt.segments(frame[i : i + 1]) == ([], [])
    segments, goaways = filt.segments(frame[-1:] + after)
    assert segments == [(frame, 1), (SettingsFrame(0).serialize(), 0)]
    assert [g.last_stream_id for g in goaways] == [3]


def test_data_before_the_response_is_left_to_h2_which_refuses_it():
    """A server that sends DATA on a tunnel before answering the CONNECT breaks the protocol."""
    outcomes = []
    for lean in (False, True):
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        client.initiate_connection()
        peer.initiate_connection()
        peer.receive_data(client.data_to_send())
        client.receive_data(peer.data_to_send())
        client.send_headers(1, CONNECT)
        client.data_to_send()
        filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
        segments, _ = filt.segments(data(b"too early"), cut_out_frames=lean)
        assert take_data_frame(client, segments[0][0], 1) is None
        with pytest.raises(h2.exceptions.ProtocolError):
            lean_streams.receive(client, segments)
        outcomes.append(client.data_to_send())
    assert outcomes[0] == outcomes[1] and parse_frames(outcomes[1])[0].error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR


def test_only_a_checked_h2_release_gets_the_lean_path(monkeypatch):
    # A release the module was not checked against may check more than it copies.
    monkeypatch.setattr(h2, "__version__", "4.5.0")
    assert not lean_data._h2_is_checked()
    monkeypatch.setattr(h2, "__version__", "4.4.9")
    assert lean_data._h2_is_checked()


def test_a_data_frame_dribbled_byte_by_byte_is_held_in_about_its_own_size():
    """A peer picks the TLS record size: holding a piece per record cost ~22x the frame."""
    frame = data(b"d" * 65536)
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=1 << 20, max_header_block=65536)
    tracemalloc.start()
    try:
        for i in range(len(frame) - 1):
            filt.segments(frame[i : i + 1])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2 * len(frame)
    assert filt.segments(frame[-1:]) == ([(frame, 1)], [])


def test_data_on_stream_0_goes_to_h2_which_refuses_it_at_its_header():
    """Not held until whole: h2 sees the header at once, and nothing after it in the read is handled."""
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=1 << 20, max_header_block=65536)
    on_stream_0 = (
        (1000).to_bytes(3, "big") + b"\x00\x00" + (0).to_bytes(4, "big") + b"z" * 1000
    )  # hyperframe refuses it
    segments, _ = filt.segments(on_stream_0[:100])
    assert segments == [(on_stream_0[:100], 0)]
    for lean in (False, True):
        server = Server(lean=lean)
        with pytest.raises(h2.exceptions.ProtocolError):
            server.feed(SettingsFrame(0).serialize() + on_stream_0[:9])


def test_a_settings_ack_then_a_big_data_frame_in_one_read():
    """The documented difference: the ACK of our larger frame size applies before the DATA frame."""
    big = data(b"b" * 20000)
    for lean, accepted in ((False, False), (True, True)):
        server = Server(lean=lean)
        server.h2.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: 1 << 20})
        server.h2.data_to_send()
        server.filter = GoawayFilter(expect_client_preface=False, max_frame_size=1 << 20, max_header_block=65536)
        ack = SettingsFrame(0, flags=["ACK"]).serialize()
        if accepted:
            events = server.feed(ack + big)
            assert [len(e.data) for e in events if isinstance(e, h2.events.DataReceived)] == [20000]
        else:
            with pytest.raises(h2.exceptions.FrameTooLargeError):
                server.feed(ack + big)


def test_empty_frames_in_a_row_are_a_flood():
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    empty = data(b"")
    # One empty frame, or empty frames with something in between, or END_STREAM: fine.
    filt.segments(empty + data(b"x") + empty + SettingsFrame(0).serialize() + empty + data(b"", flags=["END_STREAM"]))
    with pytest.raises(EmptyFramesFlood) as raised:
        filt.segments(empty + empty)
    assert (raised.value.kind, raised.value.error_code) == ("empty-frames", 0xB)
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    with pytest.raises(EmptyFramesFlood):
        filt.segments(HeadersFrame(3).serialize() + ContinuationFrame(3).serialize())


def test_data_frames_with_bytes_still_end_a_run_of_empty_frames_and_still_have_a_size_limit():
    # The filter skips its limit checks for DATA frames that carry bytes within the size after a
    # frame that did too; one after an empty frame, or over the size, is still checked.
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=100, max_header_block=65536)
    empty = data(b"")
    segments, _ = filt.segments((empty + data(b"x") + data(b"y")) * 3 + empty)
    assert len(segments) == 10  # every one a plain DATA frame of its own
    with pytest.raises(EmptyFramesFlood):
        filt.segments(empty)
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=100, max_header_block=65536)
    filt.segments(data(b"z" * 100))
    with pytest.raises(FrameTooLarge):
        filt.segments(data(b"z" * 101))


def window_counts(server: Server) -> tuple:
    """What h2 keeps of the inbound windows: the connection's, and stream 1's while h2 holds it."""
    managers = [server.h2._inbound_flow_control_window_manager]
    if 1 in server.h2.streams:
        managers.append(server.h2.streams[1]._inbound_window_manager)
    return tuple((m.current_window_size, m.max_window_size, m._bytes_processed) for m in managers)


def test_acknowledged_data_gives_the_same_windows_and_window_updates_as_h2():
    # Both windows emptied (65,535 bytes), then taken back in steps of 500 bytes: h2 sends a
    # WINDOW_UPDATE after 1,024 bytes of an empty window, then after half a window; the stream
    # is then reset, after which only the connection's window is reopened.
    frames = data(b"x" * 16384) * 3 + data(b"x" * 16383)
    plain, lean = Server(lean=False), Server(lean=True)
    for server in (plain, lean):
        server.feed(frames)
        server.h2.data_to_send()
    assert window_counts(lean) == window_counts(plain) == ((0, 65535, 0), (0, 65535, 0))
    taken = left_to_h2 = 0
    for step in range(131):
        if step == 100:
            for server in (plain, lean):
                server.h2.reset_stream(1)
            assert lean.h2.data_to_send() == plain.h2.data_to_send()
        plain.h2.acknowledge_received_data(500, 1)
        if lean_data.acknowledge_received_data(lean.h2, 500, 1):
            taken += 1
        else:
            left_to_h2 += 1
            lean.h2.acknowledge_received_data(500, 1)
        assert lean.h2.data_to_send() == plain.h2.data_to_send(), f"step {step}"
        assert window_counts(lean) == window_counts(plain), f"step {step}"
    assert taken > 90 and left_to_h2 > 30  # the reset stream: every acknowledgement is h2's


def test_an_acknowledgement_that_reaches_exactly_half_a_window_is_left_to_h2():
    # h2 sends a WINDOW_UPDATE once half a window (rounded down) was taken back, not only past
    # it; the windows are not empty here, so the rule for an empty window plays no part.
    plain, lean = Server(lean=False), Server(lean=True)
    for server in (plain, lean):
        server.feed(data(b"x" * 16384) * 2 + data(b"x" * 7232))  # 40,000 of the 65,535 bytes
        server.h2.data_to_send()
    half = 65535 // 2
    for size, lean_takes_it in ((half - 1, True), (1, False)):
        plain.h2.acknowledge_received_data(size, 1)
        assert lean_data.acknowledge_received_data(lean.h2, size, 1) is lean_takes_it
        if not lean_takes_it:
            lean.h2.acknowledge_received_data(size, 1)
        assert lean.h2.data_to_send() == plain.h2.data_to_send()
        assert window_counts(lean) == window_counts(plain)


def test_acknowledgements_h2_must_check_are_left_to_it():
    server = Server(lean=True)
    server.feed(data(b"x" * 100))
    assert not lean_data.acknowledge_received_data(server.h2, 100, 3)  # a stream h2 does not hold
    assert not lean_data.acknowledge_received_data(server.h2, -1, 1)  # h2 refuses it
    with pytest.raises(ValueError):
        server.h2.acknowledge_received_data(-1, 1)
    assert lean_data.acknowledge_received_data(server.h2, 100, 1)


def test_a_read_that_is_one_whole_lean_frame_is_its_own_segment_uncopied():
    """The usual read on an established stream: the read itself is the segment, with its stream id
    (without the reserved bit); a read with anything more, or a frame that is not cut out, is split."""
    filt = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    frame = data(b"m" * 64, stream_id=7)
    segments, goaways = filt.segments(frame)
    assert goaways == [] and len(segments) == 1 and segments[0][0] is frame and segments[0][1] == 7
    reserved = bytearray(data(b"r", stream_id=7))
    reserved[5] |= 0x80
    assert filt.segments(bytes(reserved)) == ([(bytes(reserved), 7)], [])
    last = data(b"l", stream_id=7, flags=["END_STREAM"])
    assert filt.segments(last)[0][0][0] is last
    # Not one whole lean frame: the usual splitting, views of the read.
    assert filt.segments(frame + frame) == ([(frame, 7), (frame, 7)], [])
    assert filt.segments(frame + frame[:5]) == ([(frame, 7)], [])  # the rest of the header waits
    assert filt.segments(frame[5:]) == ([(frame, 7)], [])
    assert filt.segments(frame[:20]) == ([], [])  # the rest of the frame: held, then whole
    assert filt.segments(frame[20:]) == ([(frame, 7)], [])
    assert filt.segments(frame[:20]) == ([], [])  # the rest, then one whole frame: two segments
    assert filt.segments(frame[20:] + frame) == ([(frame, 7), (frame, 7)], [])
    padded = data(b"p", stream_id=7, pad_length=2)
    on_stream_0 = bytes([0, 0, 1, 0, 0, 0, 0, 0, 0]) + b"x"
    assert filt.segments(padded) == ([(padded, 0)], [])  # a run for h2
    assert filt.segments(on_stream_0) == ([(on_stream_0, 0)], [])
    assert filt.segments(encode_goaway(5)) == ([], [ReceivedGoaway(5, 0)])
    assert filt.segments(frame, cut_out_frames=False) == ([(frame, 0)], [])
    # After the client preface, and inside a header block (h2's error to raise): not cut out.
    filt = GoawayFilter(expect_client_preface=True, max_frame_size=16384, max_header_block=65536)
    assert filt.segments(CLIENT_PREFACE + frame) == ([(CLIENT_PREFACE, 0), (frame, 7)], [])
    open_block = HeadersFrame(5, data=b"\x82").serialize()
    assert filt.segments(open_block) == ([(open_block, 0)], [])
    assert filt.segments(frame) == ([(frame, 0)], [])


def test_a_whole_read_and_a_held_frame_give_h2s_events():
    """take_data_frame copies the payload out of the read itself, a view of it, or the frame held."""
    chunks = [data(b"a" * 64), data(b"b" * 64) + data(b"c" * 64), data(b"d" * 64)[:30], data(b"d" * 64)[30:]]
    lean, (plain_events, plain_answers), (lean_events, lean_answers) = both(chunks)
    assert describe(lean_events) == describe(plain_events) and lean_answers == plain_answers
    assert lean.taken == 4 and all(type(e.data) is bytes for e in lean_events)
