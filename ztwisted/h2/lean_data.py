"""A lean path past ``h2`` for the DATA frames of open streams, received and sent.

``h2`` spends ~10 µs on each DATA frame it receives (a frame object, its
``repr`` for a trace line nobody reads, the connection's and the stream's
state machines, an event) and several on each it sends. On a tunnel nearly
every frame is DATA, so this module does for the plainest of them exactly
what ``h2`` does, with ``h2``'s own bookkeeping, and nothing else.

Received (:func:`take_data_frame`, through :func:`~ztwisted.h2.lean_streams.receive`):

- the frame is complete, has no padding, and is not inside a header block
  (:meth:`~ztwisted.h2.goaway.GoawayFilter.segments` picks these out, as it
  sees every frame header anyway);
- it is no longer than ``h2``'s current maximum frame size;
- ``h2``'s connection is open and the stream is one ``h2`` holds in a state
  that receives DATA (open, or half-closed by us) and has received its
  headers (a client's stream, the response), and ``h2`` has no partial frame
  or header block buffered (so the byte order it sees is unchanged);
- the connection's and the stream's inbound windows are consumed with ``h2``'s
  window managers, which raise ``FlowControlError`` when a peer overruns a
  window (then, as ``h2`` would, ``h2`` queues its GOAWAY and closes before
  the error goes up), and the body length is counted against a
  content-length as ``h2`` does (on END_STREAM, it must match);
- with END_STREAM, the stream moves as ``h2``'s state machine moves it
  (half-closed by the peer, or closed by the peer's end if we had ended)
  and the events are ``h2``'s: ``DataReceived`` carrying ``StreamEnded``, then
  that ``StreamEnded``.

Anything else (padding, an unknown or closed stream, DATA
before the response, a connection ``h2`` considers closed) returns None, and the frame's bytes go
to ``h2`` unchanged, which checks and answers it as it always did. The result
is ``h2``'s own ``DataReceived`` event, so one handler serves both paths.

Acknowledged (:func:`acknowledge_received_data`): the bytes a stream's
partner took are handed back to both inbound windows as
``h2.acknowledge_received_data`` does, when neither window is due for a
WINDOW_UPDATE (h2 sends one once half a window was taken back): then h2
only adds them to each window's count, which is all this does. When an
update is due, or the stream is not open, the caller uses h2's.

Sent (:func:`send_data_frame`): a frame without padding or END_STREAM, on an
open connection and a stream ``h2`` holds in a state that sends DATA, within
the maximum frame size and both outbound windows: the windows are consumed
and the frame is queued in ``h2``'s send buffer, as ``h2.send_data`` does;
otherwise the caller uses ``send_data``. :func:`take_data_to_send` then takes
that buffer as it is, where ``h2.data_to_send`` would copy it.

One difference from ``h2`` alone is deliberate: the segments of a read are
fed one ``receive_data`` call each, and ``h2`` fixes its maximum frame size
at the start of each call. So when the peer's SETTINGS ACK for our 1 MiB
frame size and a DATA frame over 16 KiB arrive in one read, the frame is
accepted: the peer may send it as soon as it applied our settings (RFC 9113
section 6.5.3), and ``h2`` alone would refuse it until the next read.

This relies on attributes of ``h2`` 4.x that are not public API (listed in
:data:`H2_INTERNALS`) and copies what ``h2`` 4.4 checks; :data:`ENABLED` says
whether this ``h2`` is a release it was checked against and has them, and
otherwise every frame simply goes to ``h2``.
"""

from __future__ import annotations

import h2
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.stream

from ztwisted.h2.goaway import (
    DATA_FRAME_TYPE,
    END_STREAM_FLAG,
    FRAME_HEADER,
    FRAME_HEADER_LENGTH,
    PADDED_FLAG,
    Buffer,
)

#: the states in which h2 takes a DATA frame without changing state (a connection's state is an
#: Enum, whose hash is a Python call: compared by identity)
_CLIENT_OPEN = h2.connection.ConnectionState.CLIENT_OPEN
_SERVER_OPEN = h2.connection.ConnectionState.SERVER_OPEN
#: h2's stream states, for both lean modules (compared by identity where a path runs per frame)
STREAM_OPEN = h2.stream.StreamState.OPEN
STREAM_HALF_CLOSED_LOCAL = h2.stream.StreamState.HALF_CLOSED_LOCAL
STREAM_HALF_CLOSED_REMOTE = h2.stream.StreamState.HALF_CLOSED_REMOTE
STREAM_CLOSED = h2.stream.StreamState.CLOSED
_STREAM_RECEIVES_DATA = frozenset({STREAM_OPEN, STREAM_HALF_CLOSED_LOCAL})
_STREAM_SENDS_DATA = frozenset({STREAM_OPEN, STREAM_HALF_CLOSED_REMOTE})
#: the states of a stream h2 counts as open, whose windows it reopens (``H2Stream.open``)
_STREAM_OPEN = _STREAM_RECEIVES_DATA | _STREAM_SENDS_DATA


def connection_open(h2conn: h2.connection.H2Connection) -> bool:
    """Whether h2's connection is open (its state machine in CLIENT_OPEN or SERVER_OPEN). The
    per-frame DATA paths below test the two states inline: this is every frame's path."""
    state = h2conn.state_machine.state
    return state is _CLIENT_OPEN or state is _SERVER_OPEN


#: what this module reads or calls in h2 beyond its public API
H2_INTERNALS = (
    "H2Connection.state_machine.state",
    "H2Connection.incoming_buffer._data",
    "H2Connection.incoming_buffer._headers_buffer",
    "H2Connection._inbound_flow_control_window_manager",
    "H2Connection._terminate_connection",
    "H2Connection._data_to_send",
    "H2Stream.state_machine.state",
    "H2Stream.state_machine.headers_received",
    "H2Stream._inbound_window_manager",
    "H2Stream._track_content_length, _expected_content_length, _actual_content_length",
    "WindowManager.current_window_size, max_window_size, _bytes_processed (read and changed as h2 does)",
)


#: the h2 releases (major.minor) whose DATA handling this module was checked against, line by line;
#: another release may check something more, so it gets every frame until someone checks again
CHECKED_H2_RELEASES = ("4.4",)


def _h2_is_checked() -> bool:
    return ".".join(h2.__version__.split(".")[:2]) in CHECKED_H2_RELEASES


def _stream_counts_content_length() -> bool:
    stream = h2.stream.H2Stream(1, h2.config.H2Configuration(), 0, 0)
    return stream._expected_content_length is None and stream._actual_content_length == 0


def _h2_has_the_internals() -> bool:
    probe = h2.connection.H2Connection()
    try:
        h2.events.DataReceived(stream_id=1, data=b"", flow_controlled_length=0)  # h2 >= 4.2: keyword fields
    except TypeError:
        return False
    return (
        hasattr(probe, "state_machine")
        and hasattr(probe.incoming_buffer, "_data")
        and hasattr(probe.incoming_buffer, "_headers_buffer")
        and hasattr(probe, "_inbound_flow_control_window_manager")
        and hasattr(probe, "_terminate_connection")
        and isinstance(getattr(probe, "_data_to_send", None), bytearray)
        and hasattr(h2.stream.H2Stream, "_track_content_length")
        and _stream_counts_content_length()
        and hasattr(h2.stream.H2StreamStateMachine(1), "headers_received")
        and hasattr(probe._inbound_flow_control_window_manager, "_bytes_processed")
    )


#: False if this h2 is not a checked release or lacks what :func:`take_data_frame` uses:
#: then every frame goes to h2
ENABLED = _h2_is_checked() and _h2_has_the_internals()


def take_data_frame(h2conn: h2.connection.H2Connection, frame: Buffer, stream_id: int) -> list[h2.events.Event] | None:
    """Receive one whole DATA frame (header included) on ``stream_id`` (its header's, without the
    reserved bit) as ``h2`` would, or None: give it to ``h2``.

    Raises ``h2``'s ``FlowControlError`` or ``InvalidBodyLengthError`` (both ``ProtocolError``) when the
    frame overruns a window or a content-length, after ``h2`` queued its GOAWAY, as ``receive_data`` does.
    """
    length = len(frame) - FRAME_HEADER_LENGTH
    connection_state = h2conn.state_machine.state
    flags = frame[4]
    if (
        flags & PADDED_FLAG
        or length > h2conn.max_inbound_frame_size
        or (connection_state is not _CLIENT_OPEN and connection_state is not _SERVER_OPEN)
    ):
        return None
    buffered = h2conn.incoming_buffer
    if buffered._data or buffered._headers_buffer:
        return None
    stream = h2conn.streams.get(stream_id)
    if stream is None:
        return None
    machine = stream.state_machine
    if machine.state not in _STREAM_RECEIVES_DATA or not machine.headers_received:
        return None  # (DATA before the response is h2's protocol error)
    try:
        # h2's WindowManager.window_consumed, for the connection's window, then the stream's
        for window in (h2conn._inbound_flow_control_window_manager, stream._inbound_window_manager):
            window.current_window_size -= length
            if window.current_window_size < 0:
                raise h2.exceptions.FlowControlError("Flow control window shrunk below 0")
        if stream._expected_content_length is None:  # a tunnel: h2 only counts what came
            stream._actual_content_length += length
        else:
            stream._track_content_length(length, bool(flags & END_STREAM_FLAG))
    except h2.exceptions.ProtocolError as e:
        h2conn._terminate_connection(e.error_code)
        raise
    # The payload copied once: a slice of bytes is bytes already, one of a view is copied by bytes()
    received = h2.events.DataReceived(
        stream_id=stream_id, data=bytes(frame[FRAME_HEADER_LENGTH:]), flow_controlled_length=length
    )
    if not flags & END_STREAM_FLAG:
        return [received]
    received.stream_ended = _end_received(machine)
    return [received, received.stream_ended]


def _end_received(machine: h2.stream.H2StreamStateMachine) -> h2.events.StreamEnded:
    """h2's RECV_END_STREAM on a stream that receives DATA (``stream_half_closed``, ``stream_ended``)."""
    if machine.state is STREAM_OPEN:
        machine.state = STREAM_HALF_CLOSED_REMOTE
    else:
        machine.state = STREAM_CLOSED
        machine.stream_closed_by = h2.stream.StreamClosedBy.RECV_END_STREAM
    return h2.events.StreamEnded(stream_id=machine.stream_id)


def send_data_frame(h2conn: h2.connection.H2Connection, stream_id: int, data: bytes) -> bool:
    """Queue one DATA frame (no padding, no END_STREAM) exactly as ``h2.send_data`` would, or
    return False: then ``send_data`` must be called (and raises what it raises).

    Taken only on an open connection, for a stream ``h2`` holds in a state that sends DATA
    (open, or half-closed by the peer), and within the maximum frame size and both
    outbound windows, which are consumed as ``h2`` consumes them.
    """
    if not ENABLED:
        return False
    size = len(data)
    connection_state = h2conn.state_machine.state
    if size > h2conn.max_outbound_frame_size or (
        connection_state is not _CLIENT_OPEN and connection_state is not _SERVER_OPEN
    ):
        return False
    stream = h2conn.streams.get(stream_id)
    if stream is None or stream.state_machine.state not in _STREAM_SENDS_DATA:
        return False
    if size > h2conn.outbound_flow_control_window or size > stream.outbound_flow_control_window:
        return False
    h2conn.outbound_flow_control_window -= size
    stream.outbound_flow_control_window -= size
    # pack_frame_header's bytes, packed inline: this is every message's path
    h2conn._data_to_send += FRAME_HEADER.pack(size >> 16, size & 0xFFFF, DATA_FRAME_TYPE, 0, stream_id)  # no flags
    h2conn._data_to_send += data
    return True


def send_window(h2conn: h2.connection.H2Connection, stream_id: int) -> int:
    """``h2.local_flow_control_window(stream_id)``: how much the outbound windows let the stream send
    (without h2's lookup, which raises for a stream it does not hold: then h2's is called)."""
    stream = h2conn.streams.get(stream_id) if ENABLED else None
    if stream is None:
        return h2conn.local_flow_control_window(stream_id)
    return min(h2conn.outbound_flow_control_window, stream.outbound_flow_control_window)


def acknowledge_received_data(h2conn: h2.connection.H2Connection, size: int, stream_id: int) -> bool:
    """Hand ``size`` bytes received on ``stream_id`` back to the inbound windows exactly as
    ``h2.acknowledge_received_data`` would, when that sends nothing; or return False: then the
    caller must call ``h2.acknowledge_received_data`` (a WINDOW_UPDATE is due, or the stream is
    not open).
    """
    if not ENABLED or size < 0:
        return False
    stream = h2conn.streams.get(stream_id)
    if stream is None or stream.state_machine.state not in _STREAM_OPEN:
        return False
    windows = (h2conn._inbound_flow_control_window_manager, stream._inbound_window_manager)
    for window in windows:
        # Whether h2's window manager (``WindowManager._maybe_update_window``) asks for a
        # WINDOW_UPDATE once ``size`` more bytes were processed.
        processed = window._bytes_processed + size
        if processed >= window.max_window_size // 2 or (
            window.current_window_size == 0 and processed > min(1024, window.max_window_size // 4)
        ):
            return False
    for window in windows:
        window._bytes_processed += size
    return True


def take_data_to_send(h2conn: h2.connection.H2Connection) -> bytes | bytearray:
    """What ``h2`` queued to send, as ``h2.data_to_send()`` returns it, but without copying it:
    ``h2``'s own ``bytearray`` is handed over (and replaced by an empty one), so a DATA frame
    queued by :func:`send_data_frame` is copied once, into that buffer, and not again out of it.
    ``h2`` never touches the result again.
    """
    if not ENABLED:
        return h2conn.data_to_send()
    queued = h2conn._data_to_send
    if not queued:
        return b""
    h2conn._data_to_send = bytearray()
    return queued
