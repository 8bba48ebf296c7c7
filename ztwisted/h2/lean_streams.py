"""A lean path past ``h2`` for opening and ending CONNECT streams, as :mod:`~ztwisted.h2.lean_data` is for DATA.

A short tunnel costs each node four HEADERS-or-END_STREAM frames through
``h2``: ~100 µs per connection and node, most of it ``h2``'s generic
machinery (frame and ``Flags`` objects, the ``repr`` of each received frame
for a trace line, two state machines keyed by enums, a chain of generators
that validates received headers byte by byte, log calls). For the plain
cases of an established HBONE connection this module does what ``h2`` does,
with ``h2``'s own objects and bookkeeping: its streams and their state
machines, stream ID counters, open-stream counts (``h2`` forgets closed
streams when it counts them, so the counts are still asked of ``h2``), windows
and the connection-wide HPACK encoder and decoder. Everything else goes to
``h2`` unchanged.

Received HEADERS (:func:`take_headers_frame`, through
:func:`receive`): one whole frame with END_HEADERS and
neither END_STREAM, PADDED nor PRIORITY (no CONTINUATION), within ``h2``'s
maximum frame size, on an open connection with nothing buffered in ``h2``;
on the server a request opening a new client stream whose ID is above every
earlier one, within the concurrent-stream limit; on the client the response on
one of its open streams that has not had one. Its block is decoded with
``h2``'s decoder (which enforces the header-list size) and checked by
:func:`plain_request` or :func:`plain_response`, which accept only a header
list that ``h2``'s validation accepts unchanged: the expected pseudo-headers
first, each once, then names of visible ASCII but uppercase letters and
colons that are neither connection-specific, ``te``, ``host``, ``cookie`` nor
``content-length``, and printable ASCII values without surrounding
whitespace. Any other list goes to
``h2``'s own ``H2Stream.receive_headers``, which validates it (the block is
decoded by then: HPACK's state is the connection's, so it cannot go back to
``h2`` as bytes) and raises ``h2``'s ``ProtocolError``, after which, as
``receive_data`` does, ``h2`` queues its GOAWAY. Every other frame is ``h2``'s.

Received END_STREAM (an empty DATA frame with it, or the last with data) is
taken by :func:`~ztwisted.h2.lean_data.take_data_frame`.

Sent HEADERS (:func:`send_headers`): the CONNECT request opening the next
stream of a client, and the final response of a server (not informational)
to a request (its ``:status`` a ``str``); the headers are ztwisted's own (``str`` or
``bytes``, plain tuples or HPACK's header tuples, whose never-indexed kind is kept), and
``h2`` is configured to neither validate nor normalize sent headers (the HBONE
configuration). Encoded with ``h2``'s encoder and framed as ``h2``
frames them (CONTINUATION frames past the maximum frame size). Sent
END_STREAM (:func:`end_stream`): an empty DATA frame on a stream open for
sending. Otherwise both call ``h2``, which raises what it raises.

RST_STREAM, sent (:func:`reset_stream`) and received (:func:`take_rst_stream_frame`): on an
open connection, for a stream ``h2`` holds open or half-closed, which it closes; a received
frame must have its 4-byte body. A reset of a stream ``h2`` does not hold open (unknown, idle,
already closed: ``h2`` answers some with its own RST_STREAM or error) goes to ``h2``.

The one difference from ``h2`` alone is :mod:`~ztwisted.h2.lean_data`'s, and applies here too:
when the peer's SETTINGS ACK for our larger maximum frame size and a HEADERS or RST_STREAM
frame over 16 KiB arrive in one read, the frame is within the size the peer may send (RFC 9113
section 6.5.3) and is accepted, where ``h2`` alone would refuse it until the next read.

The gate is :mod:`~ztwisted.h2.lean_data`'s (checked ``h2`` releases) plus the
internals listed in :data:`H2_INTERNALS`: without them, everything goes to ``h2``.
"""

from __future__ import annotations

import re

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.stream
import h2.utilities
import hpack

from ztwisted.h2 import lean_data
from ztwisted.h2.goaway import (
    CONTINUATION_FRAME_TYPE,
    DATA_FRAME_TYPE,
    END_HEADERS_FLAG,
    END_STREAM_FLAG,
    FRAME_HEADER_LENGTH,
    HEADERS_FRAME_TYPE,
    RST_STREAM_FRAME_TYPE,
    Segment,
    pack_frame_header,
)
from ztwisted.h2.lean_data import STREAM_CLOSED, STREAM_HALF_CLOSED_LOCAL, STREAM_HALF_CLOSED_REMOTE, STREAM_OPEN

_SENT_END_STREAM = h2.stream.StreamClosedBy.SEND_END_STREAM
_SENT_RST_STREAM = h2.stream.StreamClosedBy.SEND_RST_STREAM
_RECEIVED_RST_STREAM = h2.stream.StreamClosedBy.RECV_RST_STREAM
# (states are Enums, whose hash is a Python call: compared by identity, never looked up)

#: what this module reads or calls in h2 beyond its public API (besides lean_data's)
H2_INTERNALS = (
    "H2Connection._begin_new_stream, highest_inbound_stream_id, highest_outbound_stream_id",
    "H2Connection.encoder, decoder, config",
    "h2.connection._decode_headers, h2.errors._error_code_from_int",
    "h2.utilities.CONNECTION_HEADERS, authority_from_headers, extract_method_header",
    "H2Stream.receive_headers, _authority, request_method, max_outbound_frame_size",
    "H2StreamStateMachine.client, headers_sent, headers_received, stream_closed_by",
)


def _h2_has_the_internals() -> bool:
    probe = h2.connection.H2Connection()
    stream = h2.stream.H2Stream(1, probe.config, 0, 0)
    machine = stream.state_machine
    return (
        all(hasattr(probe, name) for name in ("_begin_new_stream", "highest_inbound_stream_id", "decoder"))
        and hasattr(probe, "highest_outbound_stream_id")
        and callable(getattr(h2.connection, "_decode_headers", None))
        and callable(getattr(h2.errors, "_error_code_from_int", None))
        and isinstance(getattr(h2.utilities, "CONNECTION_HEADERS", None), frozenset)
        and callable(getattr(h2.utilities, "authority_from_headers", None))
        and callable(getattr(h2.utilities, "extract_method_header", None))
        and all(hasattr(stream, name) for name in ("receive_headers", "_authority", "request_method"))
        and hasattr(stream, "max_outbound_frame_size")
        and all(hasattr(machine, name) for name in ("client", "headers_sent", "headers_received", "stream_closed_by"))
    )


#: False if lean_data is off or this h2 lacks what this module uses: then every frame goes to h2
ENABLED = lean_data.ENABLED and _h2_has_the_internals()


def receive(h2conn: h2.connection.H2Connection, segments: list[Segment]) -> list[h2.events.Event]:
    """``h2``'s events for received bytes in :meth:`~ztwisted.h2.goaway.GoawayFilter.segments`, in order.

    Each whole frame cut out goes through :func:`~ztwisted.h2.lean_data.take_data_frame` (DATA),
    :func:`take_headers_frame` (HEADERS) or :func:`take_rst_stream_frame` if it takes it, everything
    else through ``h2.receive_data``.
    As with one ``receive_data`` call, an error in any segment raises before any event is handled.
    """
    events: list[h2.events.Event] = []
    for segment, lean_stream_id in segments:
        taken = None
        if lean_stream_id:
            frame_type = segment[3]
            if frame_type == DATA_FRAME_TYPE:
                taken = lean_data.take_data_frame(h2conn, segment, lean_stream_id)
            elif frame_type == HEADERS_FRAME_TYPE:
                taken = take_headers_frame(h2conn, segment, lean_stream_id)
            elif frame_type == RST_STREAM_FRAME_TYPE:
                taken = take_rst_stream_frame(h2conn, segment, lean_stream_id)
        events += h2conn.receive_data(bytes(segment)) if taken is None else taken
    return events


# -- received HEADERS -------------------------------------------------------------------------

#: a field name h2 accepts (RFC 9113 section 8.2.1): no controls, space, uppercase, colon, DEL or
#: non-ASCII; not empty
_PLAIN_NAME = re.compile(rb"[!-9;-@\[-~]+").fullmatch
#: a value h2 accepts (no NUL, CR or LF, no surrounding space or tab), narrowed to printable ASCII
#: and tab, so that it decodes the same in any header encoding; may be empty, as in h2
_PLAIN_VALUE = re.compile(rb"(?:[!-~](?:[\t -~]*[!-~])?)?").fullmatch
#: names h2 rejects (connection-specific, ``te`` other than "trailers") or treats apart (``host``
#: against ``:authority``, ``cookie`` joined, ``content-length`` counted): left to h2's checks
_NAMES_LEFT_TO_H2 = getattr(h2.utilities, "CONNECTION_HEADERS", frozenset()) | {
    b"te",
    b"host",
    b"cookie",
    b"content-length",
}
_CONNECT_PSEUDO_HEADERS = frozenset({b":method", b":authority"})
_RESPONSE_PSEUDO_HEADERS = frozenset({b":status"})
_FINAL_STATUS = re.compile(rb"[2-9][0-9][0-9]").fullmatch


def _plain_fields(headers: list, pseudo_names: frozenset) -> bool:
    """Whether ``headers`` are ``pseudo_names``, each once, then ordinary fields, all as h2 accepts them."""
    count = len(pseudo_names)
    if len(headers) < count or {header[0] for header in headers[:count]} != pseudo_names:
        return False
    for _name, value in headers[:count]:
        if _PLAIN_VALUE(value) is None:
            return False
    for name, value in headers[count:]:
        if _PLAIN_NAME(name) is None or name in _NAMES_LEFT_TO_H2 or _PLAIN_VALUE(value) is None:
            return False
    return True


def plain_request(headers: list) -> bool:
    """An ordinary CONNECT (``:method`` and ``:authority``, then ordinary fields) that h2 accepts as it is."""
    return _plain_fields(headers, _CONNECT_PSEUDO_HEADERS) and dict(headers[:2])[b":method"] == b"CONNECT"


def plain_response(headers: list) -> bool:
    """A final response (``:status`` 200-999, then ordinary fields) that h2 accepts as it is."""
    return _plain_fields(headers, _RESPONSE_PSEUDO_HEADERS) and _FINAL_STATUS(headers[0][1]) is not None


def take_headers_frame(h2conn: h2.connection.H2Connection, frame, stream_id: int) -> list[h2.events.Event] | None:
    """Receive one whole HEADERS frame (header included) on ``stream_id`` (its header's, without the
    reserved bit, as the filter read it) as ``h2`` would, or None: give it to ``h2``.

    Raises ``h2``'s ``ProtocolError`` for a header block it refuses, after ``h2`` queued its GOAWAY.
    """
    if not ENABLED or frame[4] != END_HEADERS_FLAG or not _receives_frames(h2conn, len(frame)):
        return None
    client = h2conn.config.client_side
    stream = h2conn.streams.get(stream_id)
    if client:
        machine = stream.state_machine if stream is not None else None
        if machine is None or machine.client is not True or machine.headers_received:
            return None
        if machine.state is not STREAM_OPEN and machine.state is not STREAM_HALF_CLOSED_LOCAL:
            return None
    elif stream is not None or not stream_id % 2 or stream_id <= h2conn.highest_inbound_stream_id:
        return None
    elif h2conn.open_inbound_streams + 1 > h2conn.local_settings.max_concurrent_streams:
        return None  # h2's TooManyStreamsError
    try:
        headers = h2.connection._decode_headers(h2conn.decoder, bytes(frame[FRAME_HEADER_LENGTH:]))
        if client:
            return (
                [_response_received(h2conn, stream, headers)]
                if plain_response(headers)
                else _by_h2(h2conn, stream, headers)
            )
        stream = h2conn._begin_new_stream(stream_id, h2.connection.AllowedStreamIDs.ODD)
        return (
            [_request_received(h2conn, stream, headers)] if plain_request(headers) else _by_h2(h2conn, stream, headers)
        )
    except h2.exceptions.ProtocolError as e:
        h2conn._terminate_connection(e.error_code)
        raise


def _receives_frames(h2conn: h2.connection.H2Connection, frame_length: int) -> bool:
    """The connection is open, the frame within h2's maximum size, and h2 has nothing buffered."""
    if not lean_data.connection_open(h2conn):
        return False
    buffered = h2conn.incoming_buffer
    return frame_length - FRAME_HEADER_LENGTH <= h2conn.max_inbound_frame_size and not (
        buffered._data or buffered._headers_buffer
    )


def _by_h2(h2conn: h2.connection.H2Connection, stream: h2.stream.H2Stream, headers: list) -> list[h2.events.Event]:
    """What is not plain: h2's own handling of the decoded block (it validates, and raises)."""
    _, events = stream.receive_headers(headers, False, h2conn.config.header_encoding)
    return events


def _text(h2conn: h2.connection.H2Connection, headers: list) -> list:
    """The headers as h2 hands them over: decoded with the configured encoding, tuple types kept."""
    encoding = h2conn.config.header_encoding
    if not isinstance(encoding, str):
        return list(headers)
    # tuple.__new__ is what HPACK's header tuples' own (Python) __new__ calls
    return [tuple.__new__(type(header), (header[0].decode(encoding), header[1].decode(encoding))) for header in headers]


def _request_received(h2conn, stream: h2.stream.H2Stream, headers: list) -> h2.events.RequestReceived:
    """h2's RECV_HEADERS on a new stream (IDLE to OPEN, ``request_received``), for a plain request."""
    machine = stream.state_machine
    machine.state = STREAM_OPEN
    machine.client = False
    machine.headers_received = True
    stream._expected_content_length = None  # no content-length: plain_request
    event = h2.events.RequestReceived(stream_id=stream.stream_id)
    event.headers = _text(h2conn, headers)
    return event


def _response_received(h2conn, stream: h2.stream.H2Stream, headers: list) -> h2.events.ResponseReceived:
    """h2's RECV_HEADERS on an open client stream (``response_received``), for a plain response."""
    stream.state_machine.headers_received = True
    # h2's _initialize_content_length: no content-length (plain_response), so none expected, but
    # nothing at all after a HEAD request
    stream._expected_content_length = 0 if stream.request_method == b"HEAD" else None
    event = h2.events.ResponseReceived(stream_id=stream.stream_id)
    event.headers = _text(h2conn, headers)
    return event


# -- sent HEADERS and END_STREAM -------------------------------------------------------------


def send_headers(h2conn: h2.connection.H2Connection, stream_id: int, headers: list, end_stream: bool = False) -> None:
    """``h2conn.send_headers(stream_id, headers, end_stream=end_stream)``, lean where it is plain (see above)."""
    if not (ENABLED and _sends_plain_headers(h2conn, stream_id, headers, end_stream)):
        h2conn.send_headers(stream_id, headers, end_stream=end_stream)
        return
    stream = h2conn.streams.get(stream_id)
    bytes_headers = _utf8_encoded(headers)
    if stream is None:
        stream = h2conn._begin_new_stream(stream_id, h2.connection.AllowedStreamIDs.ODD)
        machine = stream.state_machine
        machine.state = STREAM_OPEN  # IDLE, SEND_HEADERS: request_sent
        machine.client = True
        if stream._authority is None:
            stream._authority = h2.utilities.authority_from_headers(bytes_headers)
    else:
        machine = stream.state_machine
    machine.headers_sent = True
    stream.request_method = h2.utilities.extract_method_header(bytes_headers)
    if end_stream:
        _sent_end_stream(machine)
    block = h2conn.encoder.encode(bytes_headers)
    h2conn._data_to_send += _header_frames(block, stream_id, stream.max_outbound_frame_size, end_stream)


def _utf8_encoded(headers: list) -> list:
    """h2's ``utf8_encode_headers``: names and values as UTF-8 bytes, and an HPACK header tuple's type
    kept (ztwisted sends ``forwarded`` as a ``NeverIndexedHeaderTuple``: it must stay never indexed)."""
    encoded = []
    for header in headers:
        name, value = header
        name = name if isinstance(name, bytes) else name.encode("utf-8")
        value = value if isinstance(value, bytes) else value.encode("utf-8")
        encoded.append(header.__class__(name, value) if isinstance(header, hpack.HeaderTuple) else (name, value))
    return encoded


def _sends_plain_headers(h2conn: h2.connection.H2Connection, stream_id: int, headers: list, end_stream: bool) -> bool:
    """A client's CONNECT on its next stream, or a server's final response to an open request."""
    config = h2conn.config
    if config.validate_outbound_headers or config.normalize_outbound_headers or not headers:
        return False
    if not lean_data.connection_open(h2conn):
        return False
    stream = h2conn.streams.get(stream_id)
    if stream is None:
        return (
            config.client_side
            and not end_stream
            and stream_id % 2 == 1
            and h2conn.highest_outbound_stream_id < stream_id <= h2conn.HIGHEST_ALLOWED_STREAM_ID
            and headers[0][0] == ":method"
            and h2conn.open_outbound_streams + 1 <= h2conn.remote_settings.max_concurrent_streams
        )
    machine = stream.state_machine
    status = headers[0]
    return (
        machine.client is False
        and not machine.headers_sent
        and (machine.state is STREAM_OPEN or machine.state is STREAM_HALF_CLOSED_REMOTE)
        and status[0] == ":status"
        and isinstance(status[1], str)
        and not status[1].startswith("1")
    )


def _header_frames(block: bytes, stream_id: int, max_frame_size: int, end_stream: bool) -> bytes:
    """HEADERS then CONTINUATION frames carrying ``block``, cut as h2 cuts it."""
    pieces = [block[i : i + max_frame_size] for i in range(0, len(block), max_frame_size)]
    frames = []
    for index, piece in enumerate(pieces):
        frame_type = HEADERS_FRAME_TYPE if index == 0 else CONTINUATION_FRAME_TYPE
        flags = (END_STREAM_FLAG if end_stream and index == 0 else 0) | (
            END_HEADERS_FLAG if index == len(pieces) - 1 else 0
        )
        frames.append(pack_frame_header(len(piece), frame_type, flags, stream_id) + piece)
    return b"".join(frames)


def end_stream(h2conn: h2.connection.H2Connection, stream_id: int) -> None:
    """``h2conn.end_stream(stream_id)``: an empty DATA frame with END_STREAM, lean on an open
    connection for a stream ``h2`` holds open for sending."""
    stream = h2conn.streams.get(stream_id) if ENABLED else None
    stream_state = stream.state_machine.state if stream is not None else None
    if (
        stream_state is not STREAM_OPEN and stream_state is not STREAM_HALF_CLOSED_REMOTE
    ) or not lean_data.connection_open(h2conn):
        h2conn.end_stream(stream_id)
        return
    _sent_end_stream(stream.state_machine)
    h2conn._data_to_send += pack_frame_header(0, DATA_FRAME_TYPE, END_STREAM_FLAG, stream_id)


def _sent_end_stream(machine: h2.stream.H2StreamStateMachine) -> None:
    """h2's SEND_END_STREAM on an open stream: half-closed, or closed by us if the peer had ended."""
    if machine.state is STREAM_OPEN:
        machine.state = STREAM_HALF_CLOSED_LOCAL
    else:
        machine.state = STREAM_CLOSED
        machine.stream_closed_by = _SENT_END_STREAM


# -- RST_STREAM, sent and received --------------------------------------------------------------


def _resettable(h2conn: h2.connection.H2Connection, stream_id: int) -> h2.stream.H2Stream | None:
    """The stream, if the connection is open and h2 holds it open (OPEN or half-closed): h2 resets it
    without more ado; otherwise None (h2 decides: an unknown, idle or closed stream)."""
    if not lean_data.connection_open(h2conn):
        return None
    stream = h2conn.streams.get(stream_id)
    stream_state = stream.state_machine.state if stream is not None else None
    if (
        stream_state is STREAM_OPEN
        or stream_state is STREAM_HALF_CLOSED_LOCAL
        or stream_state is STREAM_HALF_CLOSED_REMOTE
    ):
        return stream
    return None


def reset_stream(h2conn: h2.connection.H2Connection, stream_id: int, error_code: int) -> None:
    """``h2conn.reset_stream(stream_id, error_code)``, lean for a stream h2 holds open (h2's SEND_RST_STREAM:
    closed, by us); otherwise h2's, which raises what it raises."""
    stream = _resettable(h2conn, stream_id) if ENABLED and 0 <= error_code <= 0xFFFFFFFF else None
    if stream is None:
        h2conn.reset_stream(stream_id, error_code)
        return
    machine = stream.state_machine
    machine.state = STREAM_CLOSED
    machine.stream_closed_by = _SENT_RST_STREAM
    h2conn._data_to_send += pack_frame_header(4, RST_STREAM_FRAME_TYPE, 0, stream_id) + int(error_code).to_bytes(
        4, "big"
    )


def take_rst_stream_frame(h2conn: h2.connection.H2Connection, frame, stream_id: int) -> list[h2.events.Event] | None:
    """Receive one whole RST_STREAM frame on ``stream_id`` (as for :func:`take_headers_frame`) as ``h2`` would (h2's RECV_RST_STREAM on a stream it holds open:
    closed by the peer, a ``StreamReset``), or None: give it to ``h2``."""
    if not ENABLED or len(frame) != FRAME_HEADER_LENGTH + 4 or not _receives_frames(h2conn, len(frame)):
        return None  # (a body of another length is h2's FRAME_SIZE_ERROR)
    stream = _resettable(h2conn, stream_id)
    if stream is None:
        return None
    machine = stream.state_machine
    machine.state = STREAM_CLOSED
    machine.stream_closed_by = _RECEIVED_RST_STREAM
    error_code = h2.errors._error_code_from_int(int.from_bytes(frame[FRAME_HEADER_LENGTH:], "big"))
    return [h2.events.StreamReset(stream_id=stream_id, error_code=error_code)]
