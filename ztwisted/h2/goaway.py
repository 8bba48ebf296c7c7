"""GOAWAY handling that the ``h2`` library cannot do.

``h2`` moves the whole connection to CLOSED when it sends or receives a
GOAWAY (python-hyper/h2 issue #1181); every later frame of a stream still in
flight is then a protocol error. A graceful drain (RFC 9113 section 6.8) needs
those streams to run to completion, so GOAWAY frames never reach ``h2`` and
are never produced by it: incoming ones are cut out of the byte stream here,
outgoing ones are encoded here, and the connection keeps its own record of
the last stream id each side will process.

This module is the only place that knows about that limitation.
"""

from __future__ import annotations

import struct

import attr
from hyperframe.frame import GoAwayFrame

FRAME_HEADER_LENGTH = 9
GOAWAY_FRAME_TYPE = 0x07
MAX_STREAM_ID = 2**31 - 1
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# A GOAWAY carries at most a short debug text in practice; anything bigger is
# an attempt to make us buffer, so it is treated as a protocol violation.
MAX_GOAWAY_PAYLOAD = 16 * 1024


class GoawayTooLarge(Exception):
    """The peer sent a GOAWAY frame with an unreasonably large payload."""


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
    at once (a partial frame too: ``h2`` buffers it), so the cost is one
    header parse per frame.
    """

    def __init__(self, expect_client_preface: bool) -> None:
        self._preface_left = len(CLIENT_PREFACE) if expect_client_preface else 0
        self._skip = 0  # bytes of the current non-GOAWAY frame body still to pass on
        self._pending = b""  # an incomplete frame header, or an incomplete GOAWAY frame

    def feed(self, data: bytes) -> tuple[bytes, list[ReceivedGoaway]]:
        """Return the bytes for ``h2`` and the GOAWAY frames found in ``data``."""
        if self._pending:
            data = self._pending + data
            self._pending = b""
        passed: list[bytes] = []
        goaways: list[ReceivedGoaway] = []
        view = memoryview(data)
        position = 0
        end = len(data)
        if self._preface_left:
            taken = min(self._preface_left, end)
            passed.append(view[:taken])
            self._preface_left -= taken
            position = taken
        start_of_run = position
        while position < end:
            if self._skip:
                step = min(self._skip, end - position)
                self._skip -= step
                position += step
                continue
            if end - position < FRAME_HEADER_LENGTH:
                break
            length = int.from_bytes(view[position : position + 3], "big")
            frame_type = view[position + 3]
            if frame_type != GOAWAY_FRAME_TYPE:
                self._skip = length
                position += FRAME_HEADER_LENGTH
                continue
            if length > MAX_GOAWAY_PAYLOAD:
                raise GoawayTooLarge(f"GOAWAY frame of {length} bytes")
            if end - position < FRAME_HEADER_LENGTH + length:
                break
            passed.append(view[start_of_run:position])
            payload = bytes(view[position + FRAME_HEADER_LENGTH : position + FRAME_HEADER_LENGTH + length])
            goaways.append(_decode_goaway_payload(payload))
            position += FRAME_HEADER_LENGTH + length
            start_of_run = position
        passed.append(view[start_of_run:position])
        if position < end:
            self._pending = bytes(view[position:])
        return b"".join(passed), goaways


def _decode_goaway_payload(payload: bytes) -> ReceivedGoaway:
    if len(payload) < 8:
        # h2 would treat this as a FRAME_SIZE_ERROR; a peer that cannot encode
        # a GOAWAY is leaving anyway, so read it as "nothing more is processed".
        return ReceivedGoaway(last_stream_id=0, error_code=0x6)
    last_stream_id, error_code = struct.unpack("!LL", payload[:8])
    return ReceivedGoaway(last_stream_id & MAX_STREAM_ID, error_code, payload[8:])
