"""The lab's request/response protocol, spoken by its client and server apps.

A request is ``!I`` length (of what follows), ``!Q`` request id, ``!H``
think time in milliseconds (how long the server waits before answering, so
requests are in flight when lifecycle events happen), then the payload. The
response is ``!I`` length, ``!Q`` the same request id, ``!B`` length of the
server's name, the name, then the payload echoed. The name tells the lab
which pod answered.
"""

from __future__ import annotations

import socket
import struct
import time

import attr

REQUEST_HEAD = struct.Struct("!IQH")
RESPONSE_HEAD = struct.Struct("!IQB")
LENGTH = struct.Struct("!I")
#: frames larger than this are a protocol error, not a request
MAX_FRAME = 1 << 20


class ProtocolError(Exception):
    """The peer sent something that is not a lab frame."""


class ClosedEarly(ConnectionError):
    """The peer closed the connection before a whole frame arrived."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"connection closed after {got} of {wanted} bytes of a frame")
        self.got = got
        self.wanted = wanted


@attr.s(frozen=True)
class Request:
    request_id: int = attr.ib()
    think_ms: int = attr.ib()
    payload: bytes = attr.ib(repr=lambda p: f"<{len(p)} bytes>")


@attr.s(frozen=True)
class Response:
    request_id: int = attr.ib()
    server: str = attr.ib()
    payload: bytes = attr.ib(repr=lambda p: f"<{len(p)} bytes>")


def encode_request(request: Request) -> bytes:
    body_length = REQUEST_HEAD.size - LENGTH.size + len(request.payload)
    return REQUEST_HEAD.pack(body_length, request.request_id, request.think_ms) + request.payload


def encode_response(response: Response) -> bytes:
    name = response.server.encode()
    body_length = RESPONSE_HEAD.size - LENGTH.size + len(name) + len(response.payload)
    return RESPONSE_HEAD.pack(body_length, response.request_id, len(name)) + name + response.payload


class FrameReader:
    """Reads whole frames from a blocking socket; remembers when the first byte of the current frame came."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.first_byte_at: float | None = None

    def _exact(self, size: int, already: int = 0, total: int | None = None) -> bytes:
        chunks = []
        got = 0
        while got < size:
            chunk = self.sock.recv(min(size - got, 262144))
            if not chunk:
                raise ClosedEarly(already + got, total or size)
            if self.first_byte_at is None:
                self.first_byte_at = time.monotonic()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def read_frame(self, *, eof_ok: bool = False) -> bytes | None:
        """The next frame (length field included); None on EOF before its first byte if ``eof_ok``."""
        self.first_byte_at = None
        first = self.sock.recv(LENGTH.size)
        if not first:
            if eof_ok:
                return None
            raise ClosedEarly(0, LENGTH.size)
        self.first_byte_at = time.monotonic()
        head = (
            first
            if len(first) == LENGTH.size
            else first + self._exact(LENGTH.size - len(first), len(first), LENGTH.size)
        )
        (length,) = LENGTH.unpack(head)
        if length > MAX_FRAME:
            raise ProtocolError(f"frame of {length} bytes is larger than the {MAX_FRAME} allowed")
        return head + self._exact(length, LENGTH.size, LENGTH.size + length)


def read_request(reader: FrameReader) -> Request | None:
    """The next request, or None when the client closed between requests."""
    frame = reader.read_frame(eof_ok=True)
    if frame is None:
        return None
    if len(frame) < REQUEST_HEAD.size:
        raise ProtocolError(f"request frame of {len(frame)} bytes is shorter than its header")
    _, request_id, think_ms = REQUEST_HEAD.unpack_from(frame)
    return Request(request_id, think_ms, frame[REQUEST_HEAD.size :])


def read_response(reader: FrameReader) -> Response:
    frame = reader.read_frame()
    if len(frame) < RESPONSE_HEAD.size:
        raise ProtocolError(f"response frame of {len(frame)} bytes is shorter than its header")
    _, request_id, name_length = RESPONSE_HEAD.unpack_from(frame)
    name_end = RESPONSE_HEAD.size + name_length
    if len(frame) < name_end:
        raise ProtocolError("response frame ends inside the server name")
    return Response(request_id, frame[RESPONSE_HEAD.size : name_end].decode("utf-8", "replace"), frame[name_end:])
