"""One HTTP/2 connection carrying HBONE tunnels, for both the client and the server side.

The protocol sits inside a ``TLSMemoryBIOProtocol``. Each CONNECT stream is an
:class:`~ztwisted.interfaces.IPipeEnd`: data goes out as fast as the HTTP/2
flow-control windows allow and the TLS transport accepts, and received data
is acknowledged to the peer only while the stream's partner takes it, so a
slow reader closes the window instead of growing a buffer.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable

import attr
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame
from twisted.internet import defer, error
from twisted.internet.interfaces import IHandshakeListener, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from zope.interface import implementer

from ztwisted.h2.goaway import (
    MAX_STREAM_ID,
    FrameLimitExceeded,
    GoawayFilter,
    ReceivedGoaway,
    encode_goaway,
    header_block_cap,
)
from ztwisted.interfaces import IPipeEnd

MiB = 1024 * 1024
KiB = 1024


def _short_raw_data_repr(data) -> str:
    """hyperframe's payload repr, without hex-encoding the whole payload first."""
    if not data:
        return "None"
    text = bytes(data[:11]).hex()
    return "<hex:" + (text[:20] + "..." if len(text) > 20 else text) + ">"


# h2 builds repr(frame) for a trace log line on every frame it receives, logged
# or not, and hyperframe's repr hex-encodes a whole DATA payload to show 20
# characters of it: a sixth of the proxy's CPU in bulk transfers.
hyperframe.frame._raw_data_repr = _short_raw_data_repr


@attr.s(frozen=True)
class H2Settings:
    """HTTP/2 settings and timers; the defaults are ztunnel's."""

    stream_window: int = attr.ib(default=4 * MiB)
    connection_window: int = attr.ib(default=16 * MiB)
    max_frame_size: int = attr.ib(default=1 * MiB)
    max_concurrent_streams: int = attr.ib(default=200)
    max_header_list_size: int = attr.ib(default=64 * KiB)
    # A received frame over max_frame_size, or a header block over
    # goaway.header_block_cap(max_header_list_size), ends the connection as it arrives.
    keepalive_interval: float = attr.ib(default=10.0)
    keepalive_timeout: float = attr.ib(default=20.0)
    #: how long a graceful close waits for the PING that follows the first GOAWAY
    goaway_ping_wait: float = attr.ib(default=1.0)
    #: after sending close_notify, how long to wait for the peer's before closing TCP anyway
    #: (also the bound on delivering the GOAWAY that ends a connection after an error)
    close_notify_wait: float = attr.ib(default=1.0)
    #: a TLS handshake that has not completed by then is aborted
    handshake_timeout: float = attr.ib(default=10.0)
    #: a server connection that opens no stream for this long is closed
    idle_timeout: float = attr.ib(default=60.0)
    #: control frames (PING/SETTINGS ACKs, resets, ...) written while the peer does
    #: not read, before the connection counts as a flood
    max_unread_control_bytes: int = attr.ib(default=1 * MiB)
    #: streams the peer may reset per second before it counts as a rapid-reset flood
    max_peer_resets_per_second: int = attr.ib(default=200)
    #: PING and SETTINGS frames (each makes us write an ACK) the peer may send per second,
    #: read or not, before it counts as a control-frame flood
    max_peer_control_frames_per_second: int = attr.ib(default=1000)

    @classmethod
    def server(cls, **overrides) -> H2Settings:
        return cls(**overrides)

    @classmethod
    def client(cls, **overrides) -> H2Settings:
        overrides.setdefault("max_header_list_size", 16 * KiB)
        overrides.setdefault("max_concurrent_streams", 100)
        return cls(**overrides)


class TunnelError(Exception):
    """A CONNECT stream did not open."""


class TunnelRefused(TunnelError):
    """The server answered the CONNECT with a status other than 200."""

    def __init__(self, status: int):
        super().__init__(f"CONNECT answered with HTTP status {status}")
        self.status = status


class StreamRefused(TunnelError):
    """The server did not process the stream (GOAWAY or REFUSED_STREAM): safe to retry."""


class ConnectionGone(TunnelError):
    """The HTTP/2 connection ended before the tunnel opened."""


#: How a connection ended (``HBONEConnection.ended_by``, the value ``closed`` fires with).
ENDINGS = (
    "drained",  # graceful: every stream finished, then TLS close_notify
    "drain-deadline",  # graceful drain ran out of time: streams reset, then closed
    "abrupt",  # closed at once on request, no GOAWAY, no close_notify
    "peer",  # the peer closed the connection
    "lost",  # the transport failed
    "keepalive-timeout",
    "handshake-timeout",
    "idle-timeout",
    "protocol-error",
    "flood",  # control-frame flood or rapid reset
)


@implementer(IPipeEnd)
class Stream:
    """One CONNECT stream, seen from the proxy as one end of a pipe."""

    def __init__(self, connection: HBONEConnection, stream_id: int, headers: dict[str, str]):
        self.connection = connection
        self.stream_id = stream_id
        self.headers = headers
        self.partner = None
        self.finished: defer.Deferred = defer.Deferred()
        self.response: defer.Deferred = defer.Deferred()
        self.bytes_received = 0
        self.bytes_sent = 0
        self._outbound: deque[bytes] = deque()
        self._outbound_size = 0
        self._eof_pending = False
        self._local_closed = False
        self._remote_closed = False
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
        self._outbound.append(data)
        self._outbound_size += len(data)
        self.connection._send_stream_data(self)

    def write_eof(self) -> None:
        if self._done or self._local_closed:
            return
        self._eof_pending = True
        self.connection._send_stream_data(self)

    def abort(self) -> None:
        self.reset(h2.errors.ErrorCodes.CANCEL)

    def pauseProducing(self) -> None:
        self._acks_paused = True

    def resumeProducing(self) -> None:
        self._acks_paused = False
        if self._unacked:
            unacked, self._unacked = self._unacked, 0
            self.connection._acknowledge(self, unacked)

    def stopProducing(self) -> None:
        # Twisted calls this when the partner's transport goes away, clean or
        # not; the partner aborts us explicitly when it was not clean.
        pass

    # -- server side: answering the CONNECT ------------------------------------

    def accept(self) -> None:
        """Answer 200: the tunnel is open."""
        self.connection._respond(self, 200, end_stream=False)

    def refuse(self, status: int) -> None:
        """Answer an error status and end the stream."""
        self.connection._respond(self, status, end_stream=True)

    def reset(self, code: int = h2.errors.ErrorCodes.CANCEL, outcome: str = "reset") -> None:
        """Send RST_STREAM, reset the partner too, and forget the stream."""
        if self._done:
            return
        self.connection._reset_stream(self, code)
        if self.partner is not None:
            self.partner.abort()
        self._finish(outcome)

    # -- what the connection tells us ---------------------------------------

    def _data_received(self, data: bytes, flow_controlled_length: int) -> None:
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
            self.connection._acknowledge(self, flow_controlled_length)

    def _remote_ended(self) -> None:
        self._remote_closed = True
        if self.partner is None:
            self._early_eof = True
        else:
            self.partner.write_eof()
        self._maybe_closed()

    def _remote_reset(self, error_code: int) -> None:
        if not self.response.called:
            if error_code == h2.errors.ErrorCodes.REFUSED_STREAM:
                self.response.errback(StreamRefused(f"stream {self.stream_id} refused by the server"))
            else:
                self.response.errback(TunnelError(f"stream {self.stream_id} reset by the peer (error code {error_code})"))
        if self.partner is not None:
            self.partner.abort()
        self._finish("reset")

    def _connection_lost(self, reason) -> None:
        if not self.response.called:
            self.response.errback(ConnectionGone(f"HTTP/2 connection lost before the tunnel opened: {reason.getErrorMessage()}"))
        if self.partner is not None:
            self.partner.abort()
        # How the HBONE connection ended says how this tunnel did (abrupt, keepalive-timeout, ...).
        self._finish(self.connection.ended_by or "connection lost")

    def _flush(self, h2conn: h2.connection.H2Connection) -> None:
        """Send buffered data as far as the windows allow; called by the connection."""
        while self._outbound:
            window = min(h2conn.local_flow_control_window(self.stream_id), h2conn.max_outbound_frame_size)
            if window <= 0:
                break
            chunk = self._outbound[0]
            if len(chunk) <= window:
                self._outbound.popleft()
            else:
                self._outbound[0] = chunk[window:]
                chunk = chunk[:window]
            h2conn.send_data(self.stream_id, chunk)
            self._outbound_size -= len(chunk)
            self.bytes_sent += len(chunk)
        if self._outbound_size == 0 and self._eof_pending:
            self._eof_pending = False
            self._local_closed = True
            h2conn.end_stream(self.stream_id)
        self._apply_backpressure()
        self._maybe_closed()

    def _apply_backpressure(self) -> None:
        if self.partner is None:
            return
        if self._outbound_size and not self._partner_paused:
            self._partner_paused = True
            self.partner.pauseProducing()
        elif not self._outbound_size and self._partner_paused:
            self._partner_paused = False
            self.partner.resumeProducing()

    def _maybe_closed(self) -> None:
        if self._local_closed and self._remote_closed:
            self._finish("closed")

    def _finish(self, outcome: str) -> None:
        if self._done:
            return
        self._done = True
        self._outbound.clear()
        self._outbound_size = 0
        self.connection._stream_finished(self)
        if not self.response.called:
            self.response.errback(TunnelError(f"stream ended before the tunnel opened ({outcome})"))
        self.finished.callback(outcome)

    @property
    def done(self) -> bool:
        return self._done


@implementer(IHandshakeListener, IPushProducer)
class HBONEConnection(Protocol):
    """HTTP/2 over TLS for HBONE, client or server side.

    Server side: ``on_tunnel_request(connection, stream)`` is called for
    each CONNECT; it answers with ``stream.accept()`` or ``stream.refuse()``.
    Client side: :meth:`open_tunnel`.
    """

    log = Logger()

    def __init__(
        self,
        *,
        client: bool,
        clock,
        settings: H2Settings | None = None,
        on_tunnel_request: Callable[[HBONEConnection, Stream], None] | None = None,
        get_peer_identity: Callable[[object], object] | None = None,
    ):
        self.client = client
        self.clock = clock
        self.settings = settings or (H2Settings.client() if client else H2Settings.server())
        self.on_tunnel_request = on_tunnel_request
        self._get_peer_identity = get_peer_identity
        self.h2 = h2.connection.H2Connection(
            config=h2.config.H2Configuration(
                client_side=client,
                header_encoding="utf-8",
                validate_inbound_headers=True,
            )
        )
        self._goaway_filter = GoawayFilter(
            expect_client_preface=not client,
            max_frame_size=self.settings.max_frame_size,
            max_header_block=header_block_cap(self.settings.max_header_list_size),
        )
        self.streams: dict[int, Stream] = {}
        self.peer_identity = None
        self.ready: defer.Deferred = defer.Deferred()
        self.closed: defer.Deferred = defer.Deferred()
        self.goaway_received: ReceivedGoaway | None = None
        self.goaway_sent_last_stream_id: int | None = None
        self._draining = False
        self._drain_timer = None
        self._transport_paused = False
        self._keepalive_timer = None
        self._ping_timeout = None
        self._ping_wait_timer = None
        self._pending_pings: dict[bytes, Callable[[], None]] = {}
        self._connected = False
        #: set once this side started to close the transport: nothing more is processed
        self._closing = False
        self._aborted = False
        self._handshake_timer = None
        self._idle_timer = None
        self._close_notify_timer = None
        self._unread_control_bytes = 0
        self._peer_resets = _PerSecond(self.settings.max_peer_resets_per_second)
        self._peer_control_frames = _PerSecond(self.settings.max_peer_control_frames_per_second)
        #: one of :data:`ENDINGS`, set when the connection starts to end
        self.ended_by: str | None = None
        #: called with (kind, detail) when the peer trips a limit, for metrics
        self.on_limit: Callable[[str, str], None] | None = None

    # -- Protocol ---------------------------------------------------------------

    def connectionMade(self) -> None:
        self._connected = True
        s = self.settings
        self.h2.initiate_connection()
        if not self.client:
            self._let_h2_accept_any_number_of_streams()
        self.h2.update_settings(
            {
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: s.stream_window,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: s.max_frame_size,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: s.max_concurrent_streams,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: s.max_header_list_size,
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
            }
        )
        self.h2.increment_flow_control_window(s.connection_window - 65535)
        self._flush_h2()
        self.transport.registerProducer(self, True)
        self._restart_keepalive()
        self._handshake_timer = self.clock.callLater(self.settings.handshake_timeout, self._handshake_timed_out)

    def handshakeCompleted(self) -> None:
        protocol = getattr(self.transport, "negotiatedProtocol", None)
        if protocol not in (b"h2", None):
            self.log.warn("peer negotiated ALPN {alpn!r}, not h2", alpn=protocol)
            self.abort_connection("protocol-error")
            return
        _cancel(self._handshake_timer)
        if self._get_peer_identity is not None:
            self.peer_identity = self._get_peer_identity(self.transport)
        if not self.client:
            self._idle_timer = self.clock.callLater(self.settings.idle_timeout, self._idle_timed_out)
        if not self.ready.called:
            self.ready.callback(self)

    def dataReceived(self, data: bytes) -> None:
        if self._closing:
            # Closing: whatever the peer still sends is not processed (a flood stays cut off).
            return
        self._restart_keepalive()
        try:
            data, goaways = self._goaway_filter.feed(data)
            events = self.h2.receive_data(data) if data else []
        except (h2.exceptions.ProtocolError, FrameLimitExceeded) as e:
            self._protocol_error(e)
            return
        for event in events:
            self._handle_event(event)
            if self._closing:
                return
        for goaway in goaways:
            self._goaway_received(goaway)
        self._flush_h2()

    def connectionLost(self, reason=None) -> None:
        self._connected = False
        for timer in (
            self._keepalive_timer,
            self._ping_timeout,
            self._drain_timer,
            self._ping_wait_timer,
            self._handshake_timer,
            self._idle_timer,
            self._close_notify_timer,
        ):
            _cancel(timer)
        if not self.ready.called:
            self.ready.errback(reason)
        for stream in list(self.streams.values()):
            stream._connection_lost(reason)
        if self.ended_by is None:
            self.ended_by = "peer" if reason is None or reason.check(error.ConnectionDone) else "lost"
        self.closed.callback(self.ended_by)

    # -- IPushProducer: the TLS transport's write buffer --------------------------

    def pauseProducing(self) -> None:
        self._transport_paused = True

    def resumeProducing(self) -> None:
        self._transport_paused = False
        self._unread_control_bytes = 0
        for stream in list(self.streams.values()):
            stream._flush(self.h2)
        self._flush_h2()

    def stopProducing(self) -> None:
        pass

    # -- client API -----------------------------------------------------------

    @property
    def available_streams(self) -> int:
        """How many more tunnels this (client) connection may carry now."""
        if not self._connected or self.goaway_received is not None or self._draining:
            return 0
        limit = min(self.settings.max_concurrent_streams, self.h2.remote_settings.max_concurrent_streams)
        return max(0, limit - len(self.streams))

    @property
    def usable(self) -> bool:
        return self._connected and self.goaway_received is None and not self._draining

    def open_tunnel(self, authority: str, headers: Iterable[tuple[str, str]] = ()) -> defer.Deferred:
        """Send a CONNECT; fires with the :class:`Stream` when the server answers 200."""
        if not self.usable:
            return defer.fail(StreamRefused("connection no longer takes new streams"))
        stream_id = self.h2.get_next_available_stream_id()
        request = [(":method", "CONNECT"), (":authority", authority), *headers]
        self.h2.send_headers(stream_id, request)
        stream = Stream(self, stream_id, dict(request))
        self.streams[stream_id] = stream
        self._flush_h2()
        return stream.response

    # -- graceful and abrupt close ----------------------------------------------

    def drain(self, graceful: bool = True, deadline: float | None = None) -> defer.Deferred:
        """End this connection; fires when it is gone.

        Graceful on the server side: GOAWAY(2^31-1) and a PING, then GOAWAY
        with the real last stream id once the PING is answered; the streams
        up to it finish, then TLS close_notify. On the client side: no new
        streams, close_notify after the last one. ``deadline`` (seconds)
        bounds the wait; what is left then is reset.
        """
        if not self._connected:
            return defer.succeed(self.ended_by)
        closed = defer.Deferred()
        self.closed.addBoth(lambda r: (closed.callback(r), r)[1])
        if not graceful:
            self.abort_connection("abrupt")
            return closed
        if deadline is not None:
            self._set_drain_deadline(deadline)
        if self._draining:
            return closed
        self._draining = True
        if self.client:
            self._close_when_idle()
        else:
            self._send_goaway(MAX_STREAM_ID)
            self._ping(self._second_goaway)
            self._ping_wait_timer = self.clock.callLater(self.settings.goaway_ping_wait, self._second_goaway)
        return closed

    def _set_drain_deadline(self, seconds: float) -> None:
        """Keep the earliest of the deadlines asked for."""
        if self._drain_timer is not None and self._drain_timer.active():
            if self._drain_timer.getTime() <= self.clock.seconds() + seconds:
                return
            self._drain_timer.cancel()
        self._drain_timer = self.clock.callLater(seconds, self._drain_deadline)

    def abort_connection(self, ended_by: str) -> None:
        """Close without close_notify; every stream is reset. ``ended_by``: one of :data:`ENDINGS`.

        It overrides the ending of a graceful close still waiting for the peer's close_notify.
        """
        if not self._aborted:
            self.ended_by = ended_by
        self._abort()

    def _abort(self) -> None:
        self._closing = True
        if self._connected and not self._aborted:
            self._aborted = True
            self.transport.abortConnection()

    def _second_goaway(self) -> None:
        if self.goaway_sent_last_stream_id != MAX_STREAM_ID or not self._connected:
            return
        if self._ping_wait_timer is not None and self._ping_wait_timer.active():
            self._ping_wait_timer.cancel()
        self._send_goaway(self.h2.highest_inbound_stream_id)
        self._close_when_idle()

    def _drain_deadline(self) -> None:
        if self._connected:
            self.log.info(
                "drain deadline reached with {count} streams open to {peer}: resetting them",
                count=len(self.streams),
                peer=self._peer_text(),
            )
            if self.ended_by is None:
                self.ended_by = "drain-deadline"
            for stream in list(self.streams.values()):
                stream.reset(h2.errors.ErrorCodes.CANCEL, outcome="drain-deadline")
            self._close_with_close_notify()

    def _close_when_idle(self) -> None:
        if self._draining and not self.streams and self._connected:
            if self.ended_by is None:
                self.ended_by = "drained"
            self._close_with_close_notify()

    def _close_with_close_notify(self) -> None:
        if self._closing:
            return
        self._flush_h2()
        self._closing = True
        # TLSMemoryBIOProtocol sends close_notify only once no producer is registered.
        self.transport.unregisterProducer()
        self.transport.loseConnection()
        # It then waits for the peer's close_notify before closing TCP; a peer that is
        # gone would keep the connection until keepalive noticed.
        self._close_notify_timer = self.clock.callLater(self.settings.close_notify_wait, self._abort)

    def _send_goaway(self, last_stream_id: int, error_code: int = 0) -> None:
        self._flush_h2()
        self.goaway_sent_last_stream_id = last_stream_id
        self.transport.write(encode_goaway(last_stream_id, error_code))

    def _goaway_received(self, goaway: ReceivedGoaway) -> None:
        self.goaway_received = goaway
        self.log.info(
            "GOAWAY from {peer}: last stream {last}, error code {code}",
            peer=self._peer_text(),
            last=goaway.last_stream_id,
            code=goaway.error_code,
        )
        if self.client:
            for stream_id, stream in list(self.streams.items()):
                if stream_id > goaway.last_stream_id:
                    # Not processed by the server: fail it as retryable.
                    stream._remote_reset(h2.errors.ErrorCodes.REFUSED_STREAM)
        self._draining = True
        self._close_when_idle()

    def _protocol_error(self, exc: Exception) -> None:
        kind = _limit_kind(exc)
        self.log.warn(
            "HTTP/2 protocol error from {peer} ({kind}): {error}", peer=self._peer_text(), kind=kind, error=exc
        )
        self._limit_hit(kind, str(exc))
        code = getattr(exc, "error_code", None) or h2.errors.ErrorCodes.PROTOCOL_ERROR
        self._close_after_goaway(int(code), "protocol-error")

    def _flood(self, kind: str, detail: str) -> None:
        if self._closing:
            return
        self.log.warn("closing connection from {peer}: {kind} flood ({detail})", peer=self._peer_text(), kind=kind, detail=detail)
        self._limit_hit(kind, detail)
        self._close_after_goaway(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, "flood")

    def _close_after_goaway(self, error_code: int, ended_by: str) -> None:
        """End the connection after an error so that the peer learns why: a GOAWAY with
        ``error_code``, the streams reset locally, then TLS close_notify; a peer that does
        not read is cut off after ``close_notify_wait``, as any close."""
        # What h2 queued (its own GOAWAY, which it would track; the ACKs of a flood) is dropped.
        self.h2.clear_outbound_data_buffer()
        self._send_goaway(self.h2.highest_inbound_stream_id, error_code)
        self.ended_by = ended_by
        self._close_with_close_notify()
        for stream in list(self.streams.values()):
            # No RST_STREAM goes out once closing: the GOAWAY covers them all.
            stream.reset(h2.errors.ErrorCodes.CANCEL, outcome=ended_by)

    def _limit_hit(self, kind: str, detail: str) -> None:
        if self.on_limit is not None:
            self.on_limit(kind, detail)

    def _handshake_timed_out(self) -> None:
        self.log.info(
            "TLS handshake with {peer} not done after {timeout} s: closing", peer=self._peer_text(), timeout=self.settings.handshake_timeout
        )
        self._limit_hit("handshake-timeout", "")
        self.abort_connection("handshake-timeout")

    def _idle_timed_out(self) -> None:
        self.log.info("connection from {peer} opened no stream in {timeout} s: closing", peer=self._peer_text(), timeout=self.settings.idle_timeout)
        self._limit_hit("idle-timeout", "")
        self.ended_by = "idle-timeout"
        self._close_with_close_notify()

    def _count_peer_reset(self) -> None:
        if self._peer_resets.exceeded(self.clock.seconds()):
            self._flood("rapid-reset", f"more than {self.settings.max_peer_resets_per_second} stream resets in a second")

    def _count_peer_control_frame(self, what: str) -> None:
        # The unread-bytes bound only works once the transport pauses, which a peer
        # with large socket buffers delays for seconds of full CPU; a rate does not wait.
        if self._peer_control_frames.exceeded(self.clock.seconds()):
            limit = self.settings.max_peer_control_frames_per_second
            self._flood("control-frame", f"more than {limit} PING and SETTINGS frames in a second (last: {what})")

    # -- keepalive ------------------------------------------------------------

    def _restart_keepalive(self) -> None:
        if self._keepalive_timer is not None and self._keepalive_timer.active():
            self._keepalive_timer.reset(self.settings.keepalive_interval)
        else:
            self._keepalive_timer = self.clock.callLater(self.settings.keepalive_interval, self._keepalive_ping)

    def _keepalive_ping(self) -> None:
        if not self._connected or (self._ping_timeout is not None and self._ping_timeout.active()):
            return
        self._ping(self._keepalive_answered)
        self._ping_timeout = self.clock.callLater(self.settings.keepalive_timeout, self._keepalive_failed)
        self._flush_h2()

    def _keepalive_answered(self) -> None:
        if self._ping_timeout is not None and self._ping_timeout.active():
            self._ping_timeout.cancel()

    def _keepalive_failed(self) -> None:
        self.log.warn(
            "no PING answer from {peer} within {timeout} s: closing the connection",
            peer=self._peer_text(),
            timeout=self.settings.keepalive_timeout,
        )
        self.abort_connection("keepalive-timeout")

    def _ping(self, on_answer: Callable[[], None]) -> None:
        opaque = os.urandom(8)
        self._pending_pings[opaque] = on_answer
        self.h2.ping(opaque)
        self._flush_h2()

    # -- events ---------------------------------------------------------------

    def _handle_event(self, event) -> None:
        if isinstance(event, h2.events.DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is None:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                stream._data_received(event.data, event.flow_controlled_length)
            if event.stream_ended is not None and stream is not None:
                stream._remote_ended()
        elif isinstance(event, h2.events.RequestReceived):
            self._request_received(event)
            if event.stream_ended is not None:
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream._remote_ended()
        elif isinstance(event, h2.events.ResponseReceived):
            self._response_received(event)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None and not stream._remote_closed:
                stream._remote_ended()
        elif isinstance(event, h2.events.StreamReset):
            if event.remote_reset:
                self._count_peer_reset()
                if self._closing:
                    return
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream._remote_reset(event.error_code)
        elif isinstance(event, h2.events.WindowUpdated):
            if event.stream_id == 0:
                targets = list(self.streams.values())
            else:
                stream = self.streams.get(event.stream_id)
                targets = [stream] if stream is not None else []
            if not self._transport_paused:
                for stream in targets:
                    stream._flush(self.h2)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            self._count_peer_control_frame("SETTINGS")
            if self._closing:
                return
            # A larger INITIAL_WINDOW_SIZE opens every stream's window without
            # any WINDOW_UPDATE frame: buffered data must go out now.
            if not self._transport_paused:
                for stream in list(self.streams.values()):
                    stream._flush(self.h2)
        elif isinstance(event, h2.events.PingReceived):
            self._count_peer_control_frame("PING")
        elif isinstance(event, h2.events.PingAckReceived):
            on_answer = self._pending_pings.pop(event.ping_data, None)
            if on_answer is not None:
                on_answer()
        elif isinstance(event, h2.events.ConnectionTerminated):
            # Only reached if h2 itself ends the connection; GOAWAY frames are filtered.
            self.abort_connection("protocol-error")
        elif isinstance(event, h2.events.SettingsAcknowledged):
            if not self.client:
                self._let_h2_accept_any_number_of_streams()
        elif isinstance(event, h2.events.TrailersReceived):
            pass

    def _let_h2_accept_any_number_of_streams(self) -> None:
        """h2 treats a stream beyond MAX_CONCURRENT_STREAMS as a connection error, raised
        before the header block is decoded; RFC 9113 section 5.1.2 wants a stream error,
        which :meth:`_request_received` applies. So h2's own copy of the setting stays at
        the maximum; what we announce to the peer is unchanged. Only call this with no
        other local setting waiting for the peer's ACK."""
        local = self.h2.local_settings
        local[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 2**31 - 1
        local.acknowledge()

    def _request_received(self, event) -> None:
        _cancel(self._idle_timer)
        headers = dict(event.headers)
        over_limit = len(self.streams) >= self.settings.max_concurrent_streams
        stream = Stream(self, event.stream_id, headers)
        self.streams[event.stream_id] = stream
        if over_limit:
            self.log.info(
                "refusing stream {id} from {peer}: {limit} streams are open already",
                id=event.stream_id,
                peer=self._peer_text(),
                limit=self.settings.max_concurrent_streams,
            )
            self._limit_hit("max-concurrent-streams", f"stream {event.stream_id}")
            stream.reset(h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if self.goaway_sent_last_stream_id is not None and event.stream_id > self.goaway_sent_last_stream_id:
            stream.reset(h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if headers.get(":method") != "CONNECT":
            self.log.info(
                "refusing {method} from {peer}: only CONNECT is served", method=headers.get(":method"), peer=self._peer_text()
            )
            stream.refuse(400)
            return
        if self.on_tunnel_request is None:
            stream.refuse(400)
            return
        try:
            self.on_tunnel_request(self, stream)
        except Exception:
            self.log.failure("tunnel request handler failed")
            if not stream.response.called:
                stream.refuse(503)

    def _response_received(self, event) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            return
        headers = dict(event.headers)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        stream.headers.update(headers)
        if status == 200:
            stream.response.callback(stream)
        else:
            stream.response.errback(TunnelRefused(status))
            if not stream.done:
                stream.reset(h2.errors.ErrorCodes.CANCEL)

    # -- used by streams --------------------------------------------------------

    def _respond(self, stream: Stream, status: int, end_stream: bool) -> None:
        if stream.done or stream.response.called:
            return
        self.h2.send_headers(stream.stream_id, [(":status", str(status))], end_stream=end_stream)
        if end_stream:
            stream._local_closed = True
            stream.response.errback(TunnelRefused(status))
            if stream._remote_closed:
                stream._finish("refused")
            else:
                # The client may still send; we will not read it.
                stream.reset(h2.errors.ErrorCodes.NO_ERROR)
        else:
            stream.response.callback(stream)
        self._flush_h2()

    def _send_stream_data(self, stream: Stream) -> None:
        if self._transport_paused:
            stream._apply_backpressure()
            return
        stream._flush(self.h2)
        self._flush_h2()

    def _acknowledge(self, stream: Stream, size: int) -> None:
        if not self._connected or stream.done:
            return
        try:
            self.h2.acknowledge_received_data(size, stream.stream_id)
        except h2.exceptions.StreamClosedError:
            return
        self._flush_h2()

    def _reset_stream(self, stream: Stream, code: int) -> None:
        if not self._connected:
            return
        try:
            self.h2.reset_stream(stream.stream_id, code)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self._flush_h2()

    def _stream_finished(self, stream: Stream) -> None:
        self.streams.pop(stream.stream_id, None)
        self._close_when_idle()
        if self.stream_finished_hook is not None:
            self.stream_finished_hook(self)

    stream_finished_hook: Callable[[HBONEConnection], None] | None = None

    def _flush_h2(self) -> None:
        data = self.h2.data_to_send()
        if data and self._connected and not self._closing:
            if self._transport_paused:
                # Stream data is never written while paused: this is control
                # traffic the peer provokes but does not read.
                self._unread_control_bytes += len(data)
                if self._unread_control_bytes > self.settings.max_unread_control_bytes:
                    self._flood("control-frame", f"{self._unread_control_bytes} bytes of control frames unread")
                    return
            self.transport.write(data)

    def _peer_text(self) -> str:
        if self.peer_identity is not None:
            return str(self.peer_identity)
        try:
            peer = self.transport.getPeer()
            return f"{peer.host}:{peer.port}"
        except Exception:
            return "unknown peer"


def _cancel(timer) -> None:
    if timer is not None and timer.active():
        timer.cancel()


@attr.s
class _PerSecond:
    """Counts events in one-second windows against a limit."""

    limit: int = attr.ib()
    _window_start: float = attr.ib(default=0.0)
    _count: int = attr.ib(default=0)

    def exceeded(self, now: float) -> bool:
        """Count one event at ``now``; whether its window now holds more than ``limit``."""
        if now - self._window_start >= 1.0:
            self._window_start = now
            self._count = 0
        self._count += 1
        return self._count > self.limit


def _limit_kind(exc: Exception) -> str:
    if isinstance(exc, FrameLimitExceeded):
        return exc.kind
    if isinstance(exc, h2.exceptions.TooManyStreamsError):
        return "max-concurrent-streams"
    if isinstance(exc, h2.exceptions.DenialOfServiceError) or "header" in str(exc).lower() and "size" in str(exc).lower():
        return "header-list-size"
    return "protocol-error"
