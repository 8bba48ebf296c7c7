"""gRPC client calls over the proxy's own HTTP/2 connection (see docs/architecture.rst).

A gRPC call is an HTTP/2 POST stream: request headers name the method
(``:path /package.Service/Method``, ``content-type: application/grpc``,
``te: trailers``), each message travels as a 5-byte prefix (a compression
flag and a big-endian length) and the serialized protobuf, and the outcome
comes in the trailers as ``grpc-status`` and ``grpc-message`` (or in the
response headers alone, for a call that fails at once).

:class:`GrpcConnection` is :class:`~ztwisted.h2.connection.HBONEConnection`
with POST streams instead of CONNECT ones, so flow control, keepalive and
the GOAWAY handling are the data plane's; :class:`GrpcCall` is the far end
of one stream's pipe, framing and unframing messages.
"""

from __future__ import annotations

import struct
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
import h2.events
from OpenSSL import SSL, crypto
from twisted.internet import defer, ssl
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from zope.interface import implementer

from ztwisted.h2.connection import H2Settings, HBONEConnection, Stream, TunnelRefused
from ztwisted.interfaces import IPipeEnd
from ztwisted.sockets import factory_for

log = Logger()

#: google.rpc.Code values the clients act on
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 1, 2, 3, 4
UNAUTHENTICATED, UNAVAILABLE, INTERNAL = 16, 14, 13

#: ztunnel accepts xDS responses up to 200 MiB; more than that is a broken or hostile server
MAX_MESSAGE_SIZE = 200 * 1024 * 1024
_PREFIX = struct.Struct(">BI")


class GrpcError(Exception):
    """A call ended with a grpc-status other than OK, or without one."""

    def __init__(self, code: int, message: str):
        super().__init__(f"gRPC status {code}: {message}" if message else f"gRPC status {code}")
        self.code = code
        self.message = message


def frame(message: bytes) -> bytes:
    """One length-prefixed, uncompressed gRPC message."""
    return _PREFIX.pack(0, len(message)) + message


@attrs.frozen
class Target:
    """Where a control-plane service is: ``https://host:port`` and how to check its certificate."""

    host: str
    port: int
    #: PEM trust anchors for the server certificate; None: the system's
    roots_pem: bytes | None
    #: the name the server certificate must carry, if not ``host`` (ztunnel's ALT_*_HOSTNAME)
    server_name: str | None = None

    @classmethod
    def parse(cls, address: str, roots_pem: bytes | None, server_name: str | None = None) -> Target:
        url = urllib.parse.urlsplit(address)
        if url.scheme != "https" or not url.hostname:
            raise ValueError(
                f"{address!r}: a control-plane address is https://host:port (TLS is required, as for ztunnel)"
            )
        return cls(url.hostname, url.port or 443, roots_pem, server_name)

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def read_root_setting(value: str) -> bytes | None:
    """ztunnel's XDS_ROOT_CA/CA_ROOT_CA rule: a file that exists, ``SYSTEM``, or PEM text itself."""
    if Path(value).exists():
        return Path(value).read_bytes()
    if value == "SYSTEM":
        return None
    return value.encode()


@implementer(IOpenSSLClientConnectionCreator)
class _ControlPlaneTLS:
    """Server-authenticated TLS (no client certificate), ALPN h2, checking the name in ``target``."""

    def __init__(self, target: Target):
        name = target.server_name or target.host
        if target.roots_pem is None:
            trust = ssl.platformTrust()
        else:
            try:
                certificates = [
                    ssl.Certificate(crypto.load_certificate(crypto.FILETYPE_PEM, block))
                    for block in _pem_blocks(target.roots_pem)
                ]
            except crypto.Error as e:
                raise ValueError(f"the control plane's root certificate is not valid PEM: {e}") from None
            if not certificates:
                raise ValueError("the control plane's root certificate setting holds no PEM certificate")
            trust = ssl.trustRootFromCertificates(certificates)
        self._options = ssl.optionsForClientTLS(name, trustRoot=trust, acceptableProtocols=[b"h2"])

    def clientConnectionForTLS(self, tlsProtocol) -> SSL.Connection:
        return self._options.clientConnectionForTLS(tlsProtocol)


def _pem_blocks(data: bytes) -> list[bytes]:
    end = b"-----END CERTIFICATE-----"
    return [block + end for block in data.split(end) if b"-----BEGIN CERTIFICATE-----" in block]


class GrpcConnection(HBONEConnection):
    """One HTTP/2 connection to a gRPC server, carrying calls as POST streams."""

    def __init__(self, *, clock, authority: str, settings: H2Settings | None = None):
        super().__init__(client=True, clock=clock, settings=settings or H2Settings.client())
        # An HBONE connection's headers are its own and already normal, so h2 leaves them as they
        # are. A call's metadata comes from the environment and files (a token with a trailing
        # newline, XDS_HEADER_* values): h2 strips it and never indexes the credentials.
        self.h2.config.normalize_outbound_headers = True
        self.authority = authority

    def call(self, method: str, metadata: Iterable[tuple[str, str]], on_message: Callable[[bytes], None]) -> GrpcCall:
        """Start ``method`` (``/package.Service/Method``); messages go out with :meth:`GrpcCall.send`."""
        if not self.usable:
            raise GrpcError(UNAVAILABLE, "the connection to the control plane no longer takes new calls")
        stream_id = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", method),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.h2.send_headers(stream_id, headers)
        stream = Stream(self, stream_id, dict(headers))
        self.streams[stream_id] = stream
        self.send_pending()
        return GrpcCall(stream, method, on_message)

    def _handle_event(self, event) -> None:
        if isinstance(event, h2.events.TrailersReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.headers.update(dict(event.headers))
        super()._handle_event(event)


@implementer(IPipeEnd)
@attrs.define(eq=False)
class GrpcCall:
    """The proxy's end of one call: unframes what the server sends, frames what we send.

    ``done`` fires with None on grpc-status OK and fails with :class:`GrpcError` otherwise.
    """

    stream: Stream
    method: str
    on_message: Callable[[bytes], None]
    done: defer.Deferred = attrs.field(init=False, factory=defer.Deferred)
    #: what the server sent that is not a whole message yet
    _buffer: bytearray = attrs.field(init=False, factory=bytearray)

    def __attrs_post_init__(self) -> None:
        self.stream.response.addCallbacks(self._answered, self._refused)

    # -- what we send ----------------------------------------------------------

    def send(self, message: bytes) -> None:
        self.stream.write(frame(message))

    def close_send(self) -> None:
        self.stream.write_eof()

    def cancel(self) -> None:
        self.stream.reset()
        self._fail(GrpcError(CANCELLED, "cancelled by the client"))

    # -- the response stream -----------------------------------------------------

    def _answered(self, stream: Stream) -> None:
        stream.set_partner(self)

    def _refused(self, failure) -> None:
        error = failure.value
        if isinstance(error, TunnelRefused):
            self._fail(GrpcError(UNKNOWN, f"{self.method}: HTTP status {error.status}, not a gRPC answer"))
        else:
            self._fail(GrpcError(UNAVAILABLE, f"{self.method}: {error}"))

    # IPipeEnd, as the stream's partner

    def write(self, data: bytes) -> None:
        if self.done.called:
            return
        self._buffer += data
        while len(self._buffer) >= _PREFIX.size:
            compressed, length = _PREFIX.unpack_from(self._buffer)
            if length > MAX_MESSAGE_SIZE:
                self._protocol_error(f"a {length} byte message is over the {MAX_MESSAGE_SIZE} byte limit")
                return
            if compressed:
                self._protocol_error("a compressed message, but no grpc-encoding was agreed")
                return
            if len(self._buffer) < _PREFIX.size + length:
                return
            message = bytes(self._buffer[_PREFIX.size : _PREFIX.size + length])
            del self._buffer[: _PREFIX.size + length]
            try:
                self.on_message(message)
            except Exception as e:  # the receiver ends the call by raising
                log.failure("{method}: the message handler failed", method=self.method)
                self.stream.reset()
                self._fail(GrpcError(INTERNAL, f"{self.method}: {e}"))
                return
            if self.done.called:
                return

    def write_eof(self) -> None:
        headers = self.stream.headers
        if self._buffer:
            self._fail(GrpcError(INTERNAL, f"{self.method}: the stream ended inside a message"))
            return
        status = headers.get("grpc-status")
        if status is None:
            self._fail(GrpcError(UNKNOWN, f"{self.method}: the stream ended without grpc-status"))
            return
        try:
            code = int(status)
        except ValueError:
            code = UNKNOWN
        if code == OK:
            if not self.done.called:
                self.done.callback(None)
            return
        self._fail(GrpcError(code, urllib.parse.unquote(headers.get("grpc-message", ""))))

    def abort(self) -> None:
        ended = self.stream.connection.ended_by
        self._fail(GrpcError(UNAVAILABLE, f"{self.method}: stream reset" + (f" (connection {ended})" if ended else "")))

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass

    def _protocol_error(self, why: str) -> None:
        self.stream.reset()
        self._fail(GrpcError(INTERNAL, f"{self.method}: {why}"))

    def _fail(self, error: GrpcError) -> None:
        if not self.done.called:
            self.done.errback(error)


def connect(reactor, target: Target, *, timeout: float = 5.0, settings: H2Settings | None = None) -> defer.Deferred:
    """A TLS connection to ``target``; fires with the :class:`GrpcConnection` once the handshake is done."""
    try:
        creator = _ControlPlaneTLS(target)
    except ValueError as e:
        return defer.fail(e)
    # ztunnel's control-plane channel: a PING after 30 s of silence, 10 s for its answer.
    settings = settings or H2Settings.client(keepalive_interval=30.0, keepalive_timeout=10.0)
    connection = GrpcConnection(clock=reactor, authority=target.authority, settings=settings)
    factory = TLSMemoryBIOFactory(creator, True, factory_for(connection))
    factory.noisy = False
    # A name (istiod.istio-system.svc) is resolved without blocking the reactor.
    endpoint = HostnameEndpoint(reactor, target.host, target.port, timeout=timeout)
    connecting = endpoint.connect(factory)
    connecting.addCallback(lambda _: connection.ready)
    return connecting


def unary(
    connection: GrpcConnection, method: str, request: bytes, metadata: Iterable[tuple[str, str]] = ()
) -> defer.Deferred:
    """One request, one response message; fires with the response's bytes."""
    answers: list[bytes] = []
    call = connection.call(method, metadata, answers.append)
    call.send(request)
    call.close_send()

    def answered(_):
        if len(answers) != 1:
            raise GrpcError(INTERNAL, f"{method}: {len(answers)} response messages to a unary call")
        return answers[0]

    return call.done.addCallback(answered)
