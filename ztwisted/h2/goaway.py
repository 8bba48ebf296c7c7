"""GOAWAY handling that the ``h2`` library cannot do.

``h2`` moves the whole connection to CLOSED when it sends or receives a
GOAWAY (python-hyper/h2 issue #1181); every later frame of a stream still in
flight is then a protocol error. A graceful drain (RFC 9113 section 6.8) needs
those streams to run to completion, so GOAWAY frames never reach ``h2`` and
are never produced by it: incoming ones are cut out of the byte stream here,
outgoing ones are encoded here, and the connection keeps its own record of
the last stream id each side will process.

This module is the only place that knows about that limitation. Because its
filter is also the one place that sees every frame header as the bytes
arrive, it enforces the frame-level limits there too, before ``h2`` buffers a
frame whole: a frame longer than the advertised SETTINGS_MAX_FRAME_SIZE, and
a header block (HEADERS or PUSH_PROMISE and its CONTINUATION frames) longer
than a cap. For the same reason it cuts out the frames that
:mod:`~ztwisted.h2.lean_data` and :mod:`~ztwisted.h2.lean_streams` may take past
``h2`` (:meth:`GoawayFilter.segments`, :data:`LEAN_FRAME_KINDS`).
"""

from __future__ import annotations

import struct

import attr
from hyperframe.frame import GoAwayFrame

FRAME_HEADER_LENGTH = 9
DATA_FRAME_TYPE = 0x00
HEADERS_FRAME_TYPE = 0x01
PUSH_PROMISE_FRAME_TYPE = 0x05
RST_STREAM_FRAME_TYPE = 0x03
GOAWAY_FRAME_TYPE = 0x07
CONTINUATION_FRAME_TYPE = 0x09
END_STREAM_FLAG = 0x01
END_HEADERS_FLAG = 0x04
PADDED_FLAG = 0x08
PROTOCOL_ERROR = 0x1
FRAME_SIZE_ERROR = 0x6
ENHANCE_YOUR_CALM = 0xB
MAX_STREAM_ID = 2**31 - 1
#: a frame header: its 24-bit length (a high byte and the low 16 bits), type, flags and stream id
#: (with the reserved bit)
FRAME_HEADER = struct.Struct(">BHBBL")


def pack_frame_header(length: int, frame_type: int, flags: int, stream_id: int) -> bytes:
    """The 9 bytes that start a frame (:data:`FRAME_HEADER`), as the lean paths send them."""
    return FRAME_HEADER.pack(length >> 16, length & 0xFFFF, frame_type, flags, stream_id)


CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

Buffer = bytes | bytearray | memoryview
#: bytes for ``h2``, and the stream id of the one whole frame they are if a lean path may take it, else 0
#: (see :meth:`GoawayFilter.segments`); such a frame is not copied out of what was received (the read
#: itself, a view of it, or of the frame held)
Segment = tuple[Buffer, int]

#: the frames the lean paths may take, as ``type << 8 | flags``: DATA, with END_STREAM or without
#: (:mod:`~ztwisted.h2.lean_data`), HEADERS with END_HEADERS alone and RST_STREAM
#: (:mod:`~ztwisted.h2.lean_streams`)
LEAN_FRAME_KINDS = frozenset(
    {
        DATA_FRAME_TYPE << 8,
        DATA_FRAME_TYPE << 8 | END_STREAM_FLAG,
        HEADERS_FRAME_TYPE << 8 | END_HEADERS_FLAG,
        RST_STREAM_FRAME_TYPE << 8,
    }
)

# A GOAWAY carries at most a short debug text in practice; anything bigger is
# an attempt to make us buffer, so it is treated as a protocol violation.
MAX_GOAWAY_PAYLOAD = 16 * 1024


class FrameLimitExceeded(Exception):
    """The peer broke a frame-level limit: a connection error.

    ``kind`` names the limit in ``ztwisted_hbone_limit_hits_total``;
    ``error_code`` is the one the GOAWAY carries.
    """

    kind = "protocol-error"
    error_code = PROTOCOL_ERROR


class GoawayTooLarge(FrameLimitExceeded):
    """The peer sent a GOAWAY frame with an unreasonably large payload."""


class FrameTooLarge(FrameLimitExceeded):
    """A frame longer than the SETTINGS_MAX_FRAME_SIZE we advertised (RFC 9113 section 4.2)."""

    kind = "frame-size"
    error_code = FRAME_SIZE_ERROR


class HeaderBlockTooLarge(FrameLimitExceeded):
    """A header block (HEADERS or PUSH_PROMISE plus CONTINUATION frames) longer than the cap."""

    kind = "header-block-size"
    error_code = ENHANCE_YOUR_CALM


class EmptyFramesFlood(FrameLimitExceeded):
    """Empty HEADERS, CONTINUATION or DATA frames without END_STREAM, one after another.

    Each costs the receiver work and moves nothing (CVE-2019-9518, "empty frames
    flood"); as Envoy's ``max_consecutive_inbound_frames_with_empty_payload``
    (default 1), more than :data:`MAX_EMPTY_FRAMES_IN_A_ROW` in a row end the connection.
    """

    kind = "empty-frames"
    error_code = ENHANCE_YOUR_CALM


#: empty HEADERS/CONTINUATION/DATA frames without END_STREAM accepted in a row (Envoy's default)
MAX_EMPTY_FRAMES_IN_A_ROW = 1


def header_block_cap(max_header_list_size: int) -> int:
    """The longest header block accepted, from the advertised SETTINGS_MAX_HEADER_LIST_SIZE.

    An HPACK-encoded block is no longer than the header list it decodes to
    (a literal costs its strings plus a few octets, the list size counts 32
    octets more per field; an index costs one or two), so twice the list size
    leaves room for padding and a clumsy encoder and still stops a block that
    could only be refused once decoded.
    """
    return 2 * max_header_list_size


@attr.s(frozen=True, slots=True)
class ReceivedGoaway:
    last_stream_id: int = attr.ib()
    error_code: int = attr.ib()
    debug_data: bytes = attr.ib(default=b"")


def encode_goaway(last_stream_id: int, error_code: int = 0, debug_data: bytes = b"") -> bytes:
    frame = GoAwayFrame(stream_id=0)
    frame.last_stream_id = last_stream_id
    frame.error_code = error_code
    frame.additional_data = debug_data
    return frame.serialize()


class GoawayFilter:
    """Splits the received byte stream at frame boundaries and removes GOAWAY frames.

    Only frame headers are parsed; every other byte is passed on to ``h2``
    at once (a partial frame too: ``h2`` buffers it; only a frame to be cut out
    for a lean path, see :meth:`segments`, waits here until whole), so the cost is
    one header parse per frame. Each frame header is checked against
    ``max_frame_size``, the header block it belongs to against
    ``max_header_block``, and runs of empty frames against
    :data:`MAX_EMPTY_FRAMES_IN_A_ROW` (:class:`FrameLimitExceeded` is raised),
    so ``h2`` never buffers more than one frame of at most ``max_frame_size``
    bytes, and neither does this filter.
    """

    def __init__(self, expect_client_preface: bool, max_frame_size: int, max_header_block: int) -> None:
        self._preface_left = len(CLIENT_PREFACE) if expect_client_preface else 0
        self._max_frame_size = max_frame_size
        self._max_header_block = max_header_block
        self._skip = 0  # bytes of the current non-GOAWAY frame body still to pass on
        self._pending = b""  # an incomplete frame header, or an incomplete GOAWAY frame
        # A frame for a lean path held until whole (see segments), and how many bytes it still lacks. One
        # bytearray: a frame dribbled in tiny reads (a peer picks the TLS record size) costs
        # linear time and its own size, not an object per piece.
        self._held = bytearray()
        self._held_missing = 0
        self._held_stream_id = 0
        self._empty_frames_in_a_row = 0
        self._header_block = 0  # length of the header block so far
        self._in_header_block = False  # END_HEADERS not seen yet

    def feed(self, data: bytes) -> tuple[bytes, list[ReceivedGoaway]]:
        """Return the bytes for ``h2`` and the GOAWAY frames found in ``data``."""
        segments, goaways = self.segments(data, cut_out_frames=False)
        return b"".join(segment for segment, _ in segments), goaways

    def segments(self, data: bytes, cut_out_frames: bool = True) -> tuple[list[Segment], list[ReceivedGoaway]]:
        """The bytes of ``data`` for ``h2``, in order and in segments, and the GOAWAY frames found.

        Each segment is ``(bytes, lean_stream_id)``: with ``cut_out_frames``, each frame of :data:`LEAN_FRAME_KINDS`
        (outside a header block, where it is h2's error to raise, and not on stream 0, which h2 refuses at its
        header) is a segment of its own with its stream id (for :func:`~ztwisted.h2.lean_streams.receive`), held
        back until whole (as ``h2`` would buffer it) and not copied: ``data`` itself if it is just that frame (the
        usual read), else a ``memoryview`` of ``data`` or of the frame held, valid until the next call. The rest
        comes in runs with stream id 0.
        """
        segments, goaways = [], []  # list[Segment], list[ReceivedGoaway]
        position = start_of_run = 0
        if self._held_missing or self._pending or self._preface_left:
            data, position = self._continue_from_earlier_reads(data, segments)
        end = len(data)
        while position < end:
            if self._skip:
                step = min(self._skip, end - position)
                self._skip -= step
                position += step
                continue
            if end - position < FRAME_HEADER_LENGTH:
                break
            length_high, length_low, frame_type, flags, stream_id = FRAME_HEADER.unpack_from(data, position)
            length = length_high << 16 | length_low
            if frame_type != DATA_FRAME_TYPE or not 0 < length <= self._max_frame_size or self._empty_frames_in_a_row:
                # (not for the usual frame, DATA with bytes within the size after one with bytes: no limit to hit)
                self._check_limits(length, frame_type, flags)
            frame_end = position + FRAME_HEADER_LENGTH + length
            stream_id &= MAX_STREAM_ID  # without the reserved bit
            # Cut out whole (an incomplete one waits in _pending or _held): GOAWAY frames and, if asked, lean ones
            lean = (frame_type << 8 | flags) in LEAN_FRAME_KINDS
            cut_out = cut_out_frames and lean and not self._in_header_block and stream_id != 0
            if cut_out:
                if frame_end == end and position == 0:  # the usual read: this one frame, whole, as it came
                    return [*segments, (data, stream_id)], goaways
            elif frame_type != GOAWAY_FRAME_TYPE:
                self._skip = length
                position += FRAME_HEADER_LENGTH
                continue
            elif length > MAX_GOAWAY_PAYLOAD:
                raise GoawayTooLarge(f"GOAWAY frame of {length} bytes")
            elif frame_end > end:
                break
            if start_of_run < position:
                segments.append((bytes(data[start_of_run:position]), 0))
            if frame_end > end:
                self._held, self._held_missing = bytearray(memoryview(data)[position:end]), frame_end - end
                self._held_stream_id = stream_id
                return segments, goaways
            if cut_out:
                segments.append((memoryview(data)[position:frame_end], stream_id))  # the lean path copies the payload
            else:
                goaways.append(_decode_goaway_payload(bytes(data[position + FRAME_HEADER_LENGTH : frame_end])))
            position = start_of_run = frame_end
        if start_of_run < position:
            segments.append((bytes(data[start_of_run:position]), 0))
        if position < end:
            self._pending = bytes(data[position:])
        return segments, goaways

    def _continue_from_earlier_reads(self, data: Buffer, segments: list[Segment]) -> tuple[Buffer, int]:
        """``data`` after what earlier reads left (a held frame, the start of a frame), and
        where its first frame header is (after the client preface)."""
        if self._held_missing:
            data = self._complete_held_frame(data, segments)
        if self._pending:
            data = self._pending + data
            self._pending = b""
        preface = min(self._preface_left, len(data))
        self._preface_left -= preface
        return data, preface

    def _complete_held_frame(self, data: Buffer, segments: list[Segment]) -> Buffer:
        """Add ``data`` to the frame held; once whole, it is the first segment. Returns what follows it."""
        view = memoryview(data)
        taken = min(self._held_missing, len(view))
        self._held += view[:taken]
        self._held_missing -= taken
        if self._held_missing:
            return b""
        segments.append((memoryview(self._held), self._held_stream_id))
        self._held = bytearray()
        return view[taken:]

    def _check_limits(self, length: int, frame_type: int, flags: int) -> None:
        if length > self._max_frame_size:
            raise FrameTooLarge(
                f"frame of type {frame_type} with {length} bytes, over the maximum frame size {self._max_frame_size}"
            )
        if length == 0:
            self._count_empty_frame(frame_type, flags)
        elif self._empty_frames_in_a_row:
            self._empty_frames_in_a_row = 0  # a frame that carries something ends the run
        if frame_type in (HEADERS_FRAME_TYPE, PUSH_PROMISE_FRAME_TYPE) and not self._in_header_block:
            self._header_block = length
        elif frame_type == CONTINUATION_FRAME_TYPE and self._in_header_block:
            self._header_block += length
        else:
            # Any other frame inside a header block (a HEADERS frame too: it does not start a new
            # block) is h2's protocol error to raise; the block stays open, so nothing is cut out.
            return
        self._in_header_block = not flags & END_HEADERS_FLAG
        if self._header_block > self._max_header_block:
            raise HeaderBlockTooLarge(
                f"header block of {self._header_block} bytes so far, over the cap of {self._max_header_block}"
            )

    def _count_empty_frame(self, frame_type: int, flags: int) -> None:
        # Only called for frames without payload, so a frame of data costs one comparison.
        # END_STREAM is bit 0x1 of HEADERS and DATA; CONTINUATION has no such flag.
        counted = frame_type in (DATA_FRAME_TYPE, HEADERS_FRAME_TYPE, CONTINUATION_FRAME_TYPE) and (
            frame_type == CONTINUATION_FRAME_TYPE or not flags & END_STREAM_FLAG
        )
        if not counted:
            self._empty_frames_in_a_row = 0
            return
        self._empty_frames_in_a_row += 1
        if self._empty_frames_in_a_row > MAX_EMPTY_FRAMES_IN_A_ROW:
            raise EmptyFramesFlood(
                f"{self._empty_frames_in_a_row} empty frames without END_STREAM in a row (last of type {frame_type})"
            )


def _decode_goaway_payload(payload: bytes) -> ReceivedGoaway:
    if len(payload) < 8:
        # h2 would treat this as a FRAME_SIZE_ERROR; a peer that cannot encode
        # a GOAWAY is leaving anyway, so read it as "nothing more is processed".
        return ReceivedGoaway(last_stream_id=0, error_code=0x6)
    last_stream_id, error_code = struct.unpack("!LL", payload[:8])
    return ReceivedGoaway(last_stream_id & MAX_STREAM_ID, error_code, payload[8:])
