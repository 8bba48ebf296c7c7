"""GOAWAY handling of an HBONE connection: graceful drain, a received GOAWAY, the drain
deadline, and the GOAWAY that ends a connection after the peer's error.

A graceful drain on the server side follows RFC 9113 section 6.8: GOAWAY with
the last stream id 2^31-1 and a PING; once the PING is answered (or after
``goaway_ping_wait``), a second GOAWAY with the real last stream id; the
streams up to it finish, then TLS close_notify. A client that drains takes
no new streams and closes after its last one. The frames themselves are
encoded by :mod:`ztwisted.h2.goaway`, the one place that knows why h2 must
not see them.

After a protocol error or a flood, the peer learns why: a GOAWAY with the
error code, the streams reset locally, then TLS close_notify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import h2.errors
from twisted.logger import Logger

from ztwisted.h2.goaway import MAX_STREAM_ID, FrameLimitExceeded, ReceivedGoaway, encode_goaway
from ztwisted.h2.lifecycle import Timer
from ztwisted.h2.limits import limit_kind

if TYPE_CHECKING:
    from ztwisted.h2.connection import HBONEConnection


@attrs.define
class Shutdown:
    """The GOAWAY exchanges of one connection: graceful, or after an error.

    Owns the GOAWAY_PING_WAIT and DRAIN_DEADLINE timers."""

    connection: HBONEConnection
    #: the last GOAWAY the peer sent
    received: ReceivedGoaway | None = None
    #: the last stream id of the last GOAWAY we sent
    sent_last_stream_id: int | None = None

    log = Logger()

    def send_goaway(self, last_stream_id: int, error_code: int = 0) -> None:
        connection = self.connection
        connection.send_pending()
        self.sent_last_stream_id = last_stream_id
        connection.transport.write(encode_goaway(last_stream_id, error_code))

    def start(self) -> None:
        """Stop taking streams; on the server side, the first GOAWAY and its PING."""
        connection = self.connection
        connection.lifecycle.stop_taking_streams()
        if connection.client:
            self.close_when_idle()
            return
        self.send_goaway(MAX_STREAM_ID)
        connection.pings.send(self._second_goaway)
        connection.send_pending()
        connection.timers.start(Timer.GOAWAY_PING_WAIT, connection.settings.goaway_ping_wait, self._second_goaway)

    def _second_goaway(self) -> None:
        connection = self.connection
        # Not once the connection is closing already (TLS would drop the frame anyway).
        if self.sent_last_stream_id != MAX_STREAM_ID or not connection.lifecycle.winding_down:
            return
        connection.timers.cancel(Timer.GOAWAY_PING_WAIT)
        self.send_goaway(connection.h2.highest_inbound_stream_id)
        connection.lifecycle.last_stream_announced()
        self.close_when_idle()

    def goaway_received(self, goaway: ReceivedGoaway) -> None:
        connection = self.connection
        self.received = goaway
        self.log.info(
            "GOAWAY from {peer}: last stream {last}, error code {code}",
            peer=connection.peer_text(),
            last=goaway.last_stream_id,
            code=goaway.error_code,
        )
        if connection.client:
            for stream_id, stream in list(connection.streams.items()):
                if stream_id > goaway.last_stream_id:
                    # Not processed by the server: fail it as retryable.
                    stream.on_remote_reset(h2.errors.ErrorCodes.REFUSED_STREAM)
        connection.lifecycle.stop_taking_streams()
        self.close_when_idle()

    def close_when_idle(self) -> None:
        connection = self.connection
        if connection.lifecycle.winding_down and not connection.streams:
            connection.close_gracefully("drained")

    def set_deadline(self, seconds: float) -> None:
        """Keep the earliest of the deadlines asked for."""
        timers = self.connection.timers
        due = timers.due(Timer.DRAIN_DEADLINE)
        if due is not None and due <= timers.clock.seconds() + seconds:
            return
        timers.start(Timer.DRAIN_DEADLINE, seconds, self._deadline_reached)

    def _deadline_reached(self) -> None:
        connection = self.connection
        if not connection.lifecycle.connected_now:
            return
        self.log.info(
            "drain deadline reached with {count} streams open to {peer}: resetting them",
            count=len(connection.streams),
            peer=connection.peer_text(),
        )
        # The ending is decided now: resetting the last stream must not make it "drained".
        connection.lifecycle.decide_ending("drain-deadline")
        for stream in list(connection.streams.values()):
            stream.reset(h2.errors.ErrorCodes.CANCEL, outcome="drain-deadline")
        connection.close_gracefully("drain-deadline")

    def protocol_error(self, exc: Exception | FrameLimitExceeded) -> None:
        connection = self.connection
        kind = limit_kind(exc)
        self.log.warn(
            "HTTP/2 protocol error from {peer} ({kind}): {error}", peer=connection.peer_text(), kind=kind, error=exc
        )
        connection.limit_hit(kind, str(exc))
        code = getattr(exc, "error_code", None) or h2.errors.ErrorCodes.PROTOCOL_ERROR
        self.close_after_error(int(code), "protocol-error")

    def flood(self, kind: str, detail: str) -> None:
        connection = self.connection
        if connection.lifecycle.ending:
            return
        self.log.warn(
            "closing connection from {peer}: {kind} flood ({detail})",
            peer=connection.peer_text(),
            kind=kind,
            detail=detail,
        )
        connection.limit_hit(kind, detail)
        self.close_after_error(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, "flood")

    def close_after_error(self, error_code: int, ended_by: str) -> None:
        """End the connection so that the peer learns why: a GOAWAY with ``error_code``, the
        streams reset locally, then TLS close_notify; a peer that does not read is cut off
        after ``close_notify_wait``, as any close."""
        connection = self.connection
        # What h2 queued (its own GOAWAY, which it would track; the ACKs of a flood) is dropped.
        connection.h2.clear_outbound_data_buffer()
        self.send_goaway(connection.h2.highest_inbound_stream_id, error_code)
        connection.close_gracefully(ended_by)
        for stream in list(connection.streams.values()):
            # No RST_STREAM goes out once closing: the GOAWAY covers them all.
            stream.reset(h2.errors.ErrorCodes.CANCEL, outcome=ended_by)
