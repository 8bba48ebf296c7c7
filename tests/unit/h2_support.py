"""Shared pieces for the HBONEConnection unit tests: a recording far end and a frame decoder."""

from __future__ import annotations

from hyperframe.frame import Frame
from twisted.internet.testing import StringTransport

from ztwisted.h2.goaway import CLIENT_PREFACE
from ztwisted.splice import TCPEnd


class RecordingEnd:
    """The far side of a stream (the app's TCP connection): records what it gets."""

    def __init__(self):
        self.data = b""
        self.eof = False
        self.aborted = False
        self.paused = False

    def set_partner(self, partner):
        self.partner = partner

    def write(self, data):
        self.data += data

    def write_eof(self):
        self.eof = True

    def abort(self):
        self.aborted = True

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False

    def stopProducing(self):
        pass


class HalfCloseableTransport(StringTransport):
    """A StringTransport that records a half-close."""

    write_closed = False

    def loseWriteConnection(self) -> None:
        self.write_closed = True


def connected_end() -> TCPEnd:
    """A :class:`TCPEnd` on a :class:`HalfCloseableTransport` (an app's TCP connection)."""
    end = TCPEnd()
    end.makeConnection(HalfCloseableTransport())
    return end


def couple(stream) -> RecordingEnd:
    """Join a new RecordingEnd to ``stream`` as its far side; it is also kept as ``stream.far``."""
    far = RecordingEnd()
    stream.set_partner(far)
    far.set_partner(stream)
    stream.far = far
    return far


def accept_and_record(stream) -> None:
    """A tunnel-request handler: accept the stream and record what it delivers (``stream.far``)."""
    stream.accept()
    couple(stream)


def parse_frames(data: bytes) -> list[Frame]:
    """Decode written bytes (after an optional client preface) into whole HTTP/2 frames."""
    if data.startswith(CLIENT_PREFACE):
        data = data[len(CLIENT_PREFACE) :]
    frames = []
    view = memoryview(data)
    while view:
        assert len(view) >= 9, "a partial frame header was written"
        frame, length = Frame.parse_frame_header(view[:9])
        assert len(view) >= 9 + length, "a partial frame was written"
        frame.parse_body(view[9 : 9 + length])
        frames.append(frame)
        view = view[9 + length :]
    return frames
