"""One HTTP/2 connection carrying HBONE tunnels, for both the client and the server side.

The protocol sits inside a ``TLSMemoryBIOProtocol``. Each CONNECT stream is an
:class:`~ztwisted.interfaces.IPipeEnd`: data goes out as fast as the HTTP/2
flow-control windows allow and the TLS transport accepts, and received data
is acknowledged to the peer only while the stream's partner takes it, so a
slow reader closes the window instead of growing a buffer.

:class:`HBONEConnection` is the hub: it feeds received bytes to h2 (through
:mod:`~ztwisted.h2.goaway`'s filter) and hands each h2 event to one named
handler. The pieces it is made of each live in their own module:
:mod:`~ztwisted.h2.lifecycle` (the state machine, ``ended_by`` and the
timers), :mod:`~ztwisted.h2.stream`, :mod:`~ztwisted.h2.flow` (flow control),
:mod:`~ztwisted.h2.keepalive`, :mod:`~ztwisted.h2.shutdown` (GOAWAY handling)
and :mod:`~ztwisted.h2.limits` (floods and the other limits on the peer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack
import hpack.hpack
import hpack.table
import hyperframe.frame
from twisted.internet import defer, error
from twisted.internet.interfaces import IHandshakeListener, IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from zope.interface import implementer

from ztwisted.h2 import lean_data, lean_streams
from ztwisted.h2.admission import StreamAdmission, let_h2_accept_any_number_of_streams
from ztwisted.h2.events import EventHandlers
from ztwisted.h2.flow import FlowControl
from ztwisted.h2.goaway import FrameLimitExceeded, GoawayFilter, ReceivedGoaway, header_block_cap
from ztwisted.h2.keepalive import Keepalive, Pings
from ztwisted.h2.lifecycle import ENDINGS, Lifecycle, State, Timer, Timers
from ztwisted.h2.limits import FloodGuard
from ztwisted.h2.settings import ConnectionGone, H2Settings, StreamRefused, TunnelError, TunnelRefused
from ztwisted.h2.shutdown import Shutdown
from ztwisted.h2.stream import Stream

__all__ = [
    "ENDINGS",
    "ConnectionGone",
    "H2Settings",
    "HBONEConnection",
    "State",
    "Stream",
    "StreamRefused",
    "TunnelError",
    "TunnelRefused",
]


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


class _SilentLogger:
    """A logger whose ``debug`` and ``trace`` do nothing, in C: ``"".format`` takes any arguments.

    h2 calls its configured logger ~10 times per stream and node (its default ``DummyLogger``: a Python
    call each), and hpack its module's stdlib logger for nearly every header it encodes or decodes (two
    Python calls each, ~25 per stream and node). ztwisted logs through Twisted and never shows either.
    """

    debug = trace = staticmethod("".format)


_SILENT_LOGGER = _SilentLogger()
# hpack's modules only ever call ``log.debug``
hpack.hpack.log = hpack.table.log = _SILENT_LOGGER


def _h2_config(client: bool) -> h2.config.H2Configuration:
    # Received headers are validated (an authenticated peer is still untrusted). The ones sent
    # are ztwisted's own (a CONNECT to an IP authority, "forwarded", "baggage", ":status"):
    # checking them cost ~10 % of sending a CONNECT, and normalizing them (lowercasing names,
    # stripping whitespace and connection headers, never indexing credentials: all already
    # true of them) another ~10 %.
    return h2.config.H2Configuration(
        client_side=client,
        header_encoding="utf-8",
        validate_inbound_headers=True,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
        logger=_SILENT_LOGGER,
    )


class _LiteralEncoder(hpack.Encoder):
    """HPACK without Huffman coding of literals (which RFC 7541 leaves to the sender).

    What is not indexed yet is mostly the ``forwarded`` header, new on every CONNECT
    and never indexed: hpack's pure-Python Huffman coding of it took ~6 us here and
    decoding it ~5 us on the peer, to save ~7 bytes. Indexed headers are unchanged.
    """

    def encode(self, headers, huffman: bool = False) -> bytes:
        return super().encode(headers, huffman=huffman)


def _h2_connection(client: bool) -> h2.connection.H2Connection:
    connection = h2.connection.H2Connection(config=_h2_config(client))
    connection.encoder = _LiteralEncoder()
    return connection


def _write_given_buffer(transport, data: bytes | bytearray) -> None:
    """Write ``data``, h2's own buffer given away (:func:`~ztwisted.h2.lean_data.take_data_to_send`):
    ztwisted's TLS transport (``tls.tls_factory``) takes it as it is, any other gets ``bytes``."""
    write_buffer = getattr(transport, "write_buffer", None)
    if write_buffer is not None:
        write_buffer(data)
    else:
        transport.write(bytes(data))


#: what a peer's bytes can make receiving raise: each ends the connection with a GOAWAY
#: (UnicodeDecodeError: h2 decodes received header values as UTF-8, which RFC 9113 does not require)
_PEER_PROTOCOL_ERRORS = (h2.exceptions.ProtocolError, FrameLimitExceeded, UnicodeDecodeError)


@implementer(IHandshakeListener, IPushProducer)
class HBONEConnection(Protocol):
    """HTTP/2 over TLS for HBONE, client or server side.

    Server side: ``on_tunnel_request(connection, stream)`` is called for
    each CONNECT; it answers with ``stream.accept()`` or ``stream.refuse()``.
    Client side: :meth:`open_tunnel`. Either side ends it with :meth:`drain`
    or :meth:`abort_connection`; ``closed`` fires with :attr:`ended_by`.
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
        self.settings = s = settings or (H2Settings.client() if client else H2Settings.server())
        self.on_tunnel_request = on_tunnel_request
        self._get_peer_identity = get_peer_identity
        self.h2 = _h2_connection(client)
        self._goaway_filter = GoawayFilter(
            expect_client_preface=not client,
            max_frame_size=s.max_frame_size,
            max_header_block=header_block_cap(s.max_header_list_size),
        )
        self.streams: dict[int, Stream] = {}
        self.peer_identity = None
        self.ready: defer.Deferred = defer.Deferred()
        self.closed: defer.Deferred = defer.Deferred()
        self.lifecycle = Lifecycle()
        self.timers = Timers(clock)
        self.pings = Pings(self.h2)
        self.flow = FlowControl(self.h2, self.lifecycle, self.send_pending)
        self.keepalive = Keepalive(
            self.timers,
            self.pings,
            s.keepalive_interval,
            s.keepalive_timeout,
            self.send_pending,
            self._keepalive_failed,
        )
        self.shutdown = Shutdown(self)
        self.admission = StreamAdmission(self)
        self.floods = FloodGuard(s, clock, self.shutdown.flood)
        #: called with (kind, detail) when the peer trips a limit, for metrics
        self.on_limit: Callable[[str, str], None] | None = None
        #: called with this connection each time one of its streams ends
        self.stream_finished_hook: Callable[[HBONEConnection], None] | None = None
        self._handlers_by_type = EventHandlers(self).by_type

    # -- what the lifecycle says ----------------------------------------------------

    @property
    def state(self) -> State:
        return self.lifecycle.state

    @property
    def ended_by(self) -> str | None:
        """One of :data:`ENDINGS`, set when the connection starts to end."""
        return self.lifecycle.ended_by

    @property
    def goaway_received(self) -> ReceivedGoaway | None:
        return self.shutdown.received

    @property
    def goaway_sent_last_stream_id(self) -> int | None:
        return self.shutdown.sent_last_stream_id

    # -- Protocol ---------------------------------------------------------------

    def connectionMade(self) -> None:
        self.lifecycle.connected()
        s = self.settings
        self.h2.initiate_connection()
        if not self.client:
            let_h2_accept_any_number_of_streams(self.h2)
        self.h2.update_settings(s.announced())
        self.h2.increment_flow_control_window(s.connection_window - 65535)
        self.send_pending()
        self.transport.registerProducer(self, True)
        self.keepalive.start()
        self.timers.start(Timer.HANDSHAKE, s.handshake_timeout, self._handshake_timed_out)

    def handshakeCompleted(self) -> None:
        protocol = getattr(self.transport, "negotiatedProtocol", None)
        if protocol not in (b"h2", None):
            self.log.warn("peer negotiated ALPN {alpn!r}, not h2", alpn=protocol)
            self.abort_connection("protocol-error")
            return
        self.timers.cancel(Timer.HANDSHAKE)
        self.lifecycle.handshake_done()
        if self._get_peer_identity is not None:
            self.peer_identity = self._get_peer_identity(self.transport)
        if not self.client:
            self.timers.start(Timer.IDLE, self.settings.idle_timeout, self._idle_timed_out)
        if not self.ready.called:
            self.ready.callback(self)

    def dataReceived(self, data: bytes) -> None:
        if self.lifecycle.ending:
            # Closing: whatever the peer still sends is not processed (a flood stays cut off).
            return
        self.keepalive.heard_from_peer()
        try:
            segments, goaways = self._goaway_filter.segments(data, cut_out_frames=lean_data.ENABLED)
            events = lean_streams.receive(self.h2, segments)
        except _PEER_PROTOCOL_ERRORS as e:
            self.shutdown.protocol_error(e)
            return
        for event in events:
            self._handle_event(event)
            if self.lifecycle.ending:
                return
        for goaway in goaways:
            self.shutdown.goaway_received(goaway)
        self.send_pending()

    def connectionLost(self, reason=None) -> None:
        self.timers.cancel_all()
        # Gone before the streams learn it; how it ended is only decided after them.
        self.lifecycle.lost()
        if not self.ready.called:
            self.ready.errback(reason)
        for stream in list(self.streams.values()):
            stream.on_connection_lost(reason, self.lifecycle.ended_by)
        self.lifecycle.decide_ending("peer" if reason is None or reason.check(error.ConnectionDone) else "lost")
        self.closed.callback(self.ended_by)

    # -- IPushProducer: the TLS transport's write buffer --------------------------

    def pauseProducing(self) -> None:
        self.flow.transport_paused = True

    def resumeProducing(self) -> None:
        self.floods.peer_reads_again()
        self.flow.transport_resumed(self.streams.values())

    def stopProducing(self) -> None:
        pass

    # -- client API -----------------------------------------------------------

    @property
    def available_streams(self) -> int:
        """How many more tunnels this (client) connection may carry now."""
        if not self.usable:
            return 0
        limit = min(self.settings.max_concurrent_streams, self.h2.remote_settings.max_concurrent_streams)
        return max(0, limit - len(self.streams))

    @property
    def usable(self) -> bool:
        """Takes new streams: neither draining nor closing, and no GOAWAY received."""
        return self.lifecycle.accepting

    def open_tunnel(self, authority: str, headers: Iterable[tuple[str, str]] = ()) -> defer.Deferred:
        """Send a CONNECT (``headers`` as given: lowercase names); fires with the :class:`Stream` on 200."""
        if not self.usable:
            return defer.fail(StreamRefused("connection no longer takes new streams"))
        stream_id = self.h2.get_next_available_stream_id()
        request = [(":method", "CONNECT"), (":authority", authority), *headers]
        lean_streams.send_headers(self.h2, stream_id, request)
        stream = Stream(self, stream_id, dict(request))
        self.streams[stream_id] = stream
        self.send_pending()
        return stream.response

    # -- graceful and abrupt close ----------------------------------------------

    def drain(self, graceful: bool = True, deadline: float | None = None) -> defer.Deferred:
        """End this connection; fires when it is gone.

        Graceful: see :mod:`ztwisted.h2.shutdown`. ``deadline`` (seconds)
        bounds the wait; what is left then is reset.
        """
        if not self.lifecycle.connected_now:
            return defer.succeed(self.ended_by)
        closed = defer.Deferred()
        self.closed.addBoth(lambda r: (closed.callback(r), r)[1])
        if not graceful:
            self.abort_connection("abrupt")
            return closed
        if deadline is not None:
            self.shutdown.set_deadline(deadline)
        if self.lifecycle.accepting:
            self.shutdown.start()
        return closed

    def abort_connection(self, ended_by: str | None) -> None:
        """Close without close_notify; every stream is reset. ``ended_by``: one of :data:`ENDINGS`.

        It overrides the ending of a graceful close still waiting for the peer's close_notify
        (``None`` keeps it).
        """
        had_transport = self.lifecycle.connected_now
        if self.lifecycle.abort(ended_by) and had_transport:
            self.transport.abortConnection()

    def close_gracefully(self, ended_by: str) -> None:
        """Send TLS close_notify after what is queued; abort if the peer's does not come."""
        if self.lifecycle.ending:
            return
        self.send_pending()
        self.lifecycle.send_close_notify(ended_by)
        # TLSMemoryBIOProtocol sends close_notify only once no producer is registered.
        self.transport.unregisterProducer()
        self.transport.loseConnection()
        # It then waits for the peer's close_notify before closing TCP; a peer that is
        # gone would keep the connection until keepalive noticed.
        self.timers.start(Timer.CLOSE_NOTIFY, self.settings.close_notify_wait, lambda: self.abort_connection(None))

    # -- limits and timeouts ----------------------------------------------------

    def limit_hit(self, kind: str, detail: str) -> None:
        if self.on_limit is not None:
            self.on_limit(kind, detail)

    def _handshake_timed_out(self) -> None:
        timeout = self.settings.handshake_timeout
        self.log.info(
            "TLS handshake with {peer} not done after {timeout} s: closing", peer=self.peer_text(), timeout=timeout
        )
        self.limit_hit("handshake-timeout", "")
        self.abort_connection("handshake-timeout")

    def _idle_timed_out(self) -> None:
        if self.lifecycle.ending:
            return
        timeout = self.settings.idle_timeout
        self.log.info(
            "connection from {peer} opened no stream in {timeout} s: closing", peer=self.peer_text(), timeout=timeout
        )
        self.limit_hit("idle-timeout", "")
        self.close_gracefully("idle-timeout")

    def _keepalive_failed(self) -> None:
        timeout = self.settings.keepalive_timeout
        self.log.warn(
            "no PING answer from {peer} within {timeout} s: closing the connection",
            peer=self.peer_text(),
            timeout=timeout,
        )
        self.abort_connection("keepalive-timeout")

    # -- h2 events: one handler each --------------------------------------------

    def _handle_event(self, event) -> None:
        handler = self._handlers_by_type.get(type(event))
        if handler is not None:
            handler(event)

    # -- what streams use ---------------------------------------------------------

    def send_headers(self, stream: Stream, headers: list[tuple[str, str]], end_stream: bool) -> bool:
        """Queue a HEADERS frame (then :meth:`send_pending`); False when h2 has closed the stream, or
        forgot it (too low an ID), as when the peer reset it in the read of its request and of another."""
        try:
            lean_streams.send_headers(self.h2, stream.stream_id, headers, end_stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.StreamIDTooLowError):
            return False
        return True

    def reset_stream(self, stream: Stream, code: int) -> None:
        if not self.lifecycle.connected_now:
            return
        try:
            lean_streams.reset_stream(self.h2, stream.stream_id, code)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self.send_pending()

    def stream_finished(self, stream: Stream) -> None:
        self.streams.pop(stream.stream_id, None)
        self.shutdown.close_when_idle()
        if self.stream_finished_hook is not None:
            self.stream_finished_hook(self)

    def send_pending(self) -> None:
        """Write what h2 queued, unless the transport is closing or gone."""
        data = lean_data.take_data_to_send(self.h2)
        if data and self.lifecycle.writable:
            if self.flow.transport_paused and self.floods.unread_control_bytes(len(data)):
                return
            _write_given_buffer(self.transport, data)

    def peer_text(self) -> str:
        if self.peer_identity is not None:
            return str(self.peer_identity)
        try:
            peer = self.transport.getPeer()
            return f"{peer.host}:{peer.port}"
        except Exception:
            return "unknown peer"
