"""One CONNECT stream of an HBONE connection, seen from the proxy as one end of a pipe."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import h2.connection
import h2.errors
from twisted.internet import defer
from zope.interface import implementer

from ztwisted.h2 import lean_data, lean_streams
from ztwisted.h2.settings import ConnectionGone, StreamRefused, TunnelError, TunnelRefused
from ztwisted.interfaces import IPipeEnd

if TYPE_CHECKING:
    from ztwisted.h2.connection import HBONEConnection


@implementer(IPipeEnd)
class Stream:
    """One CONNECT stream, seen from the proxy as one end of a pipe.

    Three sets of methods: :class:`~ztwisted.interfaces.IPipeEnd` for the
    partner, :meth:`accept` / :meth:`refuse` / :meth:`reset` for whoever
    answers the CONNECT, and the ``on_*`` and :meth:`flush` methods the
    connection calls when h2 reports an event for this stream. The stream in
    turn uses the connection's :class:`~ztwisted.h2.flow.FlowControl` and its
    stream-facing methods (``send_headers``, ``reset_stream``,
    ``stream_finished``, ``send_pending``).
    """

    def __init__(self, connection: HBONEConnection, stream_id: int, headers: dict[str, str]):
        self.connection = connection
        self.stream_id = stream_id
        self.headers = headers
        self.partner = None
        self.finished: defer.Deferred = defer.Deferred()
        self.response: defer.Deferred = defer.Deferred(canceller=self._cancel_opening if connection.client else None)
        self.bytes_received = 0
        self.bytes_sent = 0
        self._outbound: deque[bytes] = deque()
        self._outbound_size = 0
        self._eof_pending = False
        self._local_closed = False
        self.remote_closed = False
        self._early_data: list[bytes] = []
        self._early_eof = False
        self._acks_paused = False
        self._unacked = 0
        self._partner_paused = False
        self._done = False
        if not connection.client:
            # Only the client waits for the answer to its CONNECT.
            self.response.addErrback(lambda failure: None)

    # -- IPipeEnd: what the partner asks of us --------------------------------

    def set_partner(self, partner) -> None:
        self.partner = partner
        early, self._early_data = self._early_data, []
        for data in early:
            partner.write(data)
        if self._early_eof:
            partner.write_eof()
        if self._outbound_size:
            partner.pauseProducing()
            self._partner_paused = True
        # Early data was held unacknowledged until now: acknowledge it, and what follows.
        self.resumeProducing()

    def write(self, data: bytes) -> None:
        if self._done or self._local_closed or not data:
            return
        connection = self.connection
        if (
            not self._outbound
            and not connection.flow.transport_paused
            and lean_data.send_data_frame(connection.h2, self.stream_id, data)
        ):
            # The usual message: nothing waits before it, and the windows and the frame size
            # take it whole, so it went out as one frame, as flow.send and flush would send it.
            # (With nothing waiting, the partner is not paused, and no END_STREAM is pending.)
            self.bytes_sent += len(data)
            connection.send_pending()
            return
        self._outbound.append(data)
        self._outbound_size += len(data)
        connection.flow.send(self)

    def write_eof(self) -> None:
        if self._done or self._local_closed:
            return
        self._eof_pending = True
        self.connection.flow.send(self)

    def abort(self) -> None:
        self.reset(h2.errors.ErrorCodes.CANCEL)

    def pauseProducing(self) -> None:
        self._acks_paused = True

    def resumeProducing(self) -> None:
        self._acks_paused = False
        if self._unacked:
            unacked, self._unacked = self._unacked, 0
            self.connection.flow.acknowledge(self, unacked)

    def stopProducing(self) -> None:
        # Twisted calls this when the partner's transport goes away, clean or
        # not; the partner aborts us explicitly when it was not clean.
        pass

    # -- server side: answering the CONNECT ------------------------------------

    def accept(self) -> None:
        """Answer 200: the tunnel is open."""
        self._answer(200, end_stream=False)

    def refuse(self, status: int) -> None:
        """Answer an error status and end the stream."""
        self._answer(status, end_stream=True)

    def _answer(self, status: int, end_stream: bool) -> None:
        if self._done or self.response.called:
            return
        if not self.connection.send_headers(self, [(":status", str(status))], end_stream=end_stream):
            # The client reset the stream in the read that brought its request, and h2 has
            # closed it: there is nothing to answer. It ends here; the reset, handled next, is
            # then for a stream already gone.
            if self.partner is not None:
                self.partner.abort()
            self._finish("reset")
            return
        if end_stream:
            self._local_closed = True
            self.response.errback(TunnelRefused(status))
            if self.remote_closed:
                self._finish("refused")
            else:
                # The client may still send; we will not read it.
                self.reset(h2.errors.ErrorCodes.NO_ERROR)
        else:
            self.response.callback(self)
        self.connection.send_pending()

    def _cancel_opening(self, response: defer.Deferred) -> None:
        # Whoever waited for the tunnel is gone (a SOCKS5 client that left while it opened,
        # say). The CONNECT went out: left alone, the server would open the tunnel to its app
        # and keep it open. Reset it.
        response.errback(defer.CancelledError(f"tunnel on stream {self.stream_id} no longer wanted"))
        self.reset(h2.errors.ErrorCodes.CANCEL)

    def reset(self, code: int = h2.errors.ErrorCodes.CANCEL, outcome: str = "reset") -> None:
        """Send RST_STREAM, reset the partner too, and forget the stream."""
        if self._done:
            return
        self.connection.reset_stream(self, code)
        if self.partner is not None:
            self.partner.abort()
        self._finish(outcome)

    # -- what the connection tells us ---------------------------------------

    def on_data(self, data: bytes, flow_controlled_length: int) -> None:
        self.bytes_received += len(data)
        if self.partner is None:
            # Not acknowledged yet: the peer's window bounds this buffer.
            self._early_data.append(data)
            self._unacked += flow_controlled_length
            self._acks_paused = True
            return
        self.partner.write(data)
        if self._acks_paused:
            self._unacked += flow_controlled_length
        else:
            self.connection.flow.acknowledge(self, flow_controlled_length)

    def on_remote_end(self) -> None:
        self.remote_closed = True
        if self.partner is None:
            self._early_eof = True
        else:
            self.partner.write_eof()
        self._maybe_closed()

    def on_remote_reset(self, error_code: int) -> None:
        if not self.response.called:
            if error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                self.response.errback(StreamRefused(f"stream {self.stream_id} refused by the server"))
            else:
                self.response.errback(
                    TunnelError(f"stream {self.stream_id} reset by the peer (error code {error_code})")
                )
        if self.partner is not None:
            self.partner.abort()
        self._finish("reset")

    def on_response(self, headers: dict[str, str]) -> None:
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        self.headers.update(headers)
        if status == 200:
            self.response.callback(self)
        else:
            self.response.errback(TunnelRefused(status))
            if not self._done:
                self.reset(h2.errors.ErrorCodes.CANCEL)

    def on_connection_lost(self, reason, ended_by: str | None) -> None:
        if not self.response.called:
            self.response.errback(
                ConnectionGone(f"HTTP/2 connection lost before the tunnel opened: {reason.getErrorMessage()}")
            )
        if self.partner is not None:
            self.partner.abort()
        # How the HBONE connection ended says how this tunnel did (abrupt, keepalive-timeout, ...).
        self._finish(ended_by or "connection lost")

    def flush(self, h2conn: h2.connection.H2Connection) -> None:
        """Send buffered data as far as the windows allow."""
        while self._outbound:
            window = min(lean_data.send_window(h2conn, self.stream_id), h2conn.max_outbound_frame_size)
            if window <= 0:
                break
            chunk = self._outbound[0]
            if len(chunk) <= window:
                self._outbound.popleft()
            else:
                # Views, not slices: a 256 KiB read sent in 16 KiB frames would otherwise copy
                # its rest again for every frame.
                view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
                self._outbound[0] = view[window:]
                chunk = view[:window]
            if not lean_data.send_data_frame(h2conn, self.stream_id, chunk):
                h2conn.send_data(self.stream_id, bytes(chunk))
            self._outbound_size -= len(chunk)
            self.bytes_sent += len(chunk)
        if self._outbound_size == 0 and self._eof_pending:
            self._eof_pending = False
            self._local_closed = True
            lean_streams.end_stream(h2conn, self.stream_id)
        if self._outbound_size or self._partner_paused:  # else apply_backpressure has nothing to do
            self.apply_backpressure()
        if self._local_closed:
            self._maybe_closed()

    def apply_backpressure(self) -> None:
        """Pause the partner while data waits here, resume it once all went out."""
        if self.partner is None:
            return
        if self._outbound_size and not self._partner_paused:
            self._partner_paused = True
            self.partner.pauseProducing()
        elif not self._outbound_size and self._partner_paused:
            self._partner_paused = False
            self.partner.resumeProducing()

    def _maybe_closed(self) -> None:
        if self._local_closed and self.remote_closed:
            self._finish("closed")

    def _finish(self, outcome: str) -> None:
        if self._done:
            return
        self._done = True
        self._outbound.clear()
        self._outbound_size = 0
        unread, self._unacked = self._unacked, 0
        self.connection.flow.release(self, unread)
        self.connection.stream_finished(self)
        if not self.response.called:
            self.response.errback(TunnelError(f"stream ended before the tunnel opened ({outcome})"))
        # The answered response holds this stream as its result: a reference cycle, freed only
        # by the cyclic garbage collector. Nobody waits on it once the stream is done, and what
        # still asks whether it was answered finds it was.
        self.response = defer.succeed(None)
        self.finished.callback(outcome)

    @property
    def done(self) -> bool:
        return self._done
