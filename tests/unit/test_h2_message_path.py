"""The per-message path of an HBONE connection: what a message takes through a node, and the
guards around its shortcuts (a message sent at once by ``Stream.write``, the frame header read
by the GOAWAY filter)."""

from __future__ import annotations

from ztwisted.h2.goaway import GoawayFilter

from .h2_support import RecordingEnd, accept_and_record, couple
from .test_h2_connection import Pair


def _tunnels(pair: Pair, count: int) -> list:
    opened = [pair.client.open_tunnel("127.0.0.1:8080") for _ in range(count)]
    pair.flush()
    return [tunnel.result for tunnel in opened]


def test_a_message_waits_while_the_tls_transport_is_paused():
    """Sent at once only while the TLS transport takes writes: paused, the message waits and
    the stream's partner is paused; resumed, it goes out and the partner is resumed."""
    pair = Pair(handler=accept_and_record)
    (stream,) = _tunnels(pair, 1)
    app = couple(stream)
    pair.client.pauseProducing()  # the TLS transport's buffer is full
    stream.write(b"waits")
    pair.flush()
    assert pair.requests[0].far.data == b""
    assert app.paused
    pair.client.resumeProducing()
    pair.flush()
    assert pair.requests[0].far.data == b"waits"
    assert not app.paused


class _WritesToAnotherStreamWhenResumed(RecordingEnd):
    """A partner that, resumed, at once writes to another stream (before that stream was flushed)."""

    def __init__(self, other, data: bytes):
        super().__init__()
        self.other = other
        self.late = data

    def resumeProducing(self):
        super().resumeProducing()
        late, self.late = self.late, b""
        if late:
            self.other.write(late)


def test_a_message_written_while_earlier_data_waits_goes_after_it():
    """Resumed, the transport flushes stream after stream; a partner resumed by the first
    flush may write to a stream whose own waiting data is not flushed yet, with the windows
    open and the transport taking writes again: that message still goes after that data."""
    pair = Pair(handler=accept_and_record)
    first, second = _tunnels(pair, 2)
    first_app = _WritesToAnotherStreamWhenResumed(second, b" and then this")
    first.set_partner(first_app)
    first_app.set_partner(first)
    couple(second)
    pair.client.pauseProducing()
    first.write(b"one")  # waits, and pauses first_app
    second.write(b"this first")  # waits
    assert first_app.paused
    pair.client.resumeProducing()
    pair.flush()
    assert pair.requests[0].far.data == b"one"
    assert pair.requests[1].far.data == b"this first and then this"


def test_a_message_larger_than_a_frame_or_the_window_is_sent_as_the_windows_allow():
    """What one frame cannot carry (over the peer's maximum frame size, or the window left) is not
    sent at once: it waits and goes out in frames as the windows allow, in order."""
    pair = Pair(handler=accept_and_record)
    (stream,) = _tunnels(pair, 1)
    couple(stream)
    window = pair.client.h2.local_flow_control_window(stream.stream_id)
    message = bytes(range(256)) * ((window + 20_000) // 256)  # over the stream's whole window
    stream.write(message)
    stream.write(b"and the next one")
    pair.flush()
    assert pair.requests[0].far.data == message + b"and the next one"


def _data_frame_header(length: int, stream_id: int, flags: int = 0) -> bytes:
    return length.to_bytes(3, "big") + bytes([0, flags]) + stream_id.to_bytes(4, "big")


def test_a_data_frame_on_stream_0_is_passed_on_at_once_even_with_the_reserved_bit_set():
    """A DATA frame on stream 0 is h2's to refuse from its header: not held until whole for the
    lean path, also when the peer set the reserved bit of its stream id."""
    goaway_filter = GoawayFilter(expect_client_preface=False, max_frame_size=16384, max_header_block=65536)
    partial = _data_frame_header(10, 2**31) + b"12345"  # half of the payload
    segments, goaways = goaway_filter.segments(partial)
    assert segments == [(partial, 0)] and goaways == []
    held = _data_frame_header(10, 2**31 + 1) + b"12345"  # stream 1, reserved bit set: held
    assert goaway_filter.segments(b"67890" + held) == ([(b"67890", 0)], [])
    segments, _ = goaway_filter.segments(b"67890")
    assert [(bytes(segment), stream_id) for segment, stream_id in segments] == [(held + b"67890", 1)]
