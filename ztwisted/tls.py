"""Mutual TLS for HBONE: pyOpenSSL connection creators for `TLSMemoryBIOFactory`.

Policy (as ztunnel): TLS 1.3 only, ALPN ``h2``, AES-GCM suites, no session
resumption, no SNI. Peers are identified by SPIFFE URI SANs: the server
accepts any client chained to the roots with an identity in its trust domain
(authorization decides the rest); the client accepts only a server presenting
one of the identities it expects.

A refused certificate raises `PeerVerificationError` (an `OpenSSL.SSL.Error`)
from inside OpenSSL's verify callback, so the handshake fails and the
protocol's ``connectionLost`` receives that error with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from OpenSSL import SSL, crypto
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    IReactorTime,
)
from twisted.logger import Logger
from twisted.protocols.tls import BufferingTLSTransport, TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from zope.interface import implementer

from ztwisted.ca import IssuedCertificate
from ztwisted.identity import SpiffeId, spiffe_ids, uri_sans
from ztwisted.reactor import AfterEventsClock, write_aggregation_clock
from ztwisted.sockets import write_through

try:
    # Private but stable: the binding pyOpenSSL itself uses for X509 errors.
    from OpenSSL._util import ffi as _ffi
    from OpenSSL._util import lib as _lib
except ImportError:  # pragma: no cover
    _ffi = _lib = None

#: what the direct paths call
_DIRECT_CALLS = (
    "SSL_read",
    "SSL_write",
    "SSL_get_error",
    "SSL_ERROR_WANT_READ",
    "BIO_read",
    "BIO_write",
    "BIO_get_mem_data",
)


def _bindings_fit(lib) -> bool:
    """Whether OpenSSL's bindings have every function the direct paths call: without one (a later
    cryptography may drop any), every connection uses pyOpenSSL's public methods."""
    return lib is not None and all(hasattr(lib, name) for name in _DIRECT_CALLS)


_BINDINGS_FIT = _bindings_fit(_lib)

#: allocates cffi buffers without zeroing them first (they are written before being read)
_no_zero_buffer = _ffi.new_allocator(should_clear_after_alloc=False) if _ffi is not None else None

log = Logger()

ALPN_H2 = b"h2"
TLS13_CIPHERSUITES = b"TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256"


class HandshakeRefused(SSL.Error):
    """We refused the TLS handshake; ``str()`` (and ``reason``) says why."""

    def __init__(self, reason: str) -> None:
        # Shaped like OpenSSL's error queue, which Twisted's TLS code inspects.
        super().__init__([("ztwisted", type(self).__name__, reason)])
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class PeerVerificationError(HandshakeRefused):
    """The peer's certificate was refused."""


class ApplicationProtocolError(HandshakeRefused):
    """The client did not offer ALPN ``h2``."""


def _verify_error_text(errno: int) -> str:
    if _ffi is None or _lib is None:
        return f"X509 verify error {errno}"
    return _ffi.string(_lib.X509_verify_cert_error_string(errno)).decode("ascii", "replace")


def _subject(cert: crypto.X509) -> str:
    return cert.to_cryptography().subject.rfc4514_string() or "<empty subject>"


def _peer_address(connection: SSL.Connection) -> str:
    protocol = connection.get_app_data()
    transport = getattr(protocol, "transport", None)
    if transport is None:
        return "<unknown>"
    peer = transport.getPeer()
    host, port = getattr(peer, "host", None), getattr(peer, "port", None)
    return f"{host}:{port}" if host is not None else str(peer)


def _refuse(connection: SSL.Connection, role: str, reason: str) -> None:
    log.warn(
        "TLS handshake with {peer} refused: {role} certificate {reason}",
        peer=_peer_address(connection),
        role=role,
        reason=reason,
    )
    raise PeerVerificationError(f"{role} certificate {reason}")


def _chain_problem(cert: crypto.X509, errno: int, depth: int) -> str:
    return (
        f"does not chain to the trusted roots: {_verify_error_text(errno)} (depth {depth}, subject {_subject(cert)!r})"
    )


def _make_context(
    issued: IssuedCertificate,
    verify: Callable[[SSL.Connection, crypto.X509, int, int, int], bool],
) -> SSL.Context:
    """A context with the shared policy, our certificate chain and the roots."""
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_3_VERSION)
    context.set_max_proto_version(SSL.TLS1_3_VERSION)
    set_suites = getattr(context, "set_tls13_ciphersuites", None) or getattr(context, "set_ciphersuites", None)
    if set_suites is not None:
        set_suites(TLS13_CIPHERSUITES)
    # No resumption: never cache sessions, and no stateless tickets.
    context.set_options(SSL.OP_NO_TICKET | SSL.OP_NO_COMPRESSION)
    context.set_session_cache_mode(SSL.SESS_CACHE_OFF)

    context.use_certificate(issued.certificate())
    context.use_privatekey(issued.private_key())
    # Send the issuing chain so peers need to trust only the root.
    for cert in issued.chain():
        context.add_extra_chain_cert(cert)
    context.check_privatekey()

    store = context.get_cert_store()
    for root in issued.roots():
        store.add_cert(crypto.X509.from_cryptography(root))
    context.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, verify)
    return context


def _select_h2(connection: SSL.Connection, offered: list[bytes]) -> bytes:
    if ALPN_H2 in offered:
        return ALPN_H2
    # Raising (rather than returning NO_OVERLAPPING_PROTOCOLS, which just
    # skips ALPN) makes OpenSSL send the fatal no_application_protocol alert.
    reason = f"client offered ALPN {offered!r}, not {ALPN_H2!r}"
    log.warn(
        "TLS handshake with {peer} refused: {reason}",
        peer=_peer_address(connection),
        reason=reason,
    )
    raise ApplicationProtocolError(reason)


@implementer(IOpenSSLServerConnectionCreator)
class ServerTLS:
    """Server side of HBONE mTLS for one destination workload.

    ``current_certificate`` returns the workload's current certificate; a
    new context is built when it changes, so renewals apply to new
    connections while established ones keep theirs. Clients must present a
    certificate chained to the roots with a SPIFFE ID in ``trust_domain``
    (default: the trust domain of the server's own identity).
    """

    def __init__(
        self,
        current_certificate: Callable[[], IssuedCertificate],
        trust_domain: str | None = None,
    ) -> None:
        self._current_certificate = current_certificate
        self._configured_trust_domain = trust_domain
        self._issued: IssuedCertificate | None = None
        self._context: SSL.Context | None = None
        self.trust_domain: str | None = trust_domain

    def context(self) -> SSL.Context:
        """The context for the current certificate (rebuilt after a renewal)."""
        issued = self._current_certificate()
        if self._context is None or issued is not self._issued:
            self.trust_domain = self._configured_trust_domain or issued.identity.trust_domain
            context = _make_context(issued, self._verify_client)
            context.set_alpn_select_callback(_select_h2)
            self._issued, self._context = issued, context
        return self._context

    def serverConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:
        return SSL.Connection(self.context(), None)

    def _verify_client(
        self,
        connection: SSL.Connection,
        cert: crypto.X509,
        errno: int,
        depth: int,
        ok: int,
    ) -> bool:
        if not ok:
            _refuse(connection, "client", _chain_problem(cert, errno, depth))
        if depth == 0 and not any(identity.trust_domain == self.trust_domain for identity in spiffe_ids(cert)):
            _refuse(
                connection,
                "client",
                f"has no SPIFFE identity in trust domain {self.trust_domain!r} (URI SANs: {uri_sans(cert) or 'none'})",
            )
        return True


@implementer(IOpenSSLClientConnectionCreator)
class ClientTLS:
    """Client side of HBONE mTLS: present ``certificate``, accept only ``expected`` servers.

    ``expected`` holds the SPIFFE URIs the server may present (the
    destination workload's identity plus the service's subjectAltNames).
    """

    def __init__(
        self,
        certificate: IssuedCertificate,
        expected: Iterable[str | SpiffeId],
    ) -> None:
        self.certificate = certificate
        self.expected = frozenset(str(e) for e in expected)
        if not self.expected:
            raise ValueError("ClientTLS needs at least one expected server identity")
        self._context = _make_context(certificate, self._verify_server)
        self._context.set_alpn_protos([ALPN_H2])

    def clientConnectionForTLS(self, tlsProtocol: object) -> SSL.Connection:
        # Deliberately no set_tlsext_host_name: HBONE clients send no SNI.
        return SSL.Connection(self._context, None)

    def _verify_server(
        self,
        connection: SSL.Connection,
        cert: crypto.X509,
        errno: int,
        depth: int,
        ok: int,
    ) -> bool:
        if not ok:
            _refuse(connection, "server", _chain_problem(cert, errno, depth))
        if depth == 0:
            presented = uri_sans(cert)
            if self.expected.isdisjoint(presented):
                _refuse(
                    connection,
                    "server",
                    f"identity {', '.join(presented) or '(no URI SAN)'} is not one of "
                    f"the expected {', '.join(sorted(self.expected))}",
                )
        return True


def _ssl_connection(connection_or_transport: object) -> SSL.Connection | None:
    if isinstance(connection_or_transport, SSL.Connection):
        return connection_or_transport
    get_handle = getattr(connection_or_transport, "getHandle", None)
    if get_handle is not None:
        handle = get_handle()
        if isinstance(handle, SSL.Connection):
            return handle
    return None


def peer_identity(connection_or_transport: object) -> SpiffeId | None:
    """The SPIFFE ID of the verified peer of an established connection.

    Accepts a `TLSMemoryBIOProtocol` (the transport of the protocol it wraps),
    any `ISSLTransport`, or an `OpenSSL.SSL.Connection`.
    """
    connection = _ssl_connection(connection_or_transport)
    if connection is not None:
        cert = connection.get_peer_certificate()
    else:
        get_peer_certificate = getattr(connection_or_transport, "getPeerCertificate", None)
        if get_peer_certificate is None:
            raise TypeError(f"cannot get a peer certificate from {type(connection_or_transport).__name__}")
        cert = get_peer_certificate()
    if cert is None:
        return None
    ids = spiffe_ids(cert)
    return ids[0] if ids else None


def negotiated_alpn(connection_or_transport: object) -> bytes | None:
    """The ALPN protocol agreed on (``b"h2"``), or None."""
    connection = _ssl_connection(connection_or_transport)
    if connection is None:
        return getattr(connection_or_transport, "negotiatedProtocol", None)
    return connection.get_alpn_proto_negotiated() or None


#: what TLS 1.3 adds to each record of at most 16 KiB: a 5-byte header, the content type and a 16-byte tag
_RECORD_OVERHEAD = 22
_RECORD_PLAINTEXT = 2**14
#: bytes asked of the send BIO when the caller does not know how many are there (Twisted's size)
_SEND_BIO_READ = 2**15
#: writes at least this big are not held back for the end of the reactor turn (Twisted's
#: ``_AggregateSmallWrites.MAX_BUFFER_SIZE``)
_AGGREGATED_BELOW = 64_000


class _WritesOfATurn:
    """The small writes of a reactor turn, encrypted together once the turn's events were handled.

    Twisted's write aggregation (``_AggregateSmallWrites``), with the same moment, limit and
    order, in fewer calls per write: the flush is an after-events call of ztwisted's reactor
    itself (``callLater(0)`` on any other clock) and encrypts through the transport's ``_write``
    (Twisted goes through its ``_scheduledFlush``, ``flush`` and ``TLSMemoryBIOProtocol.write``).
    So many streams' frames in one turn still become one TLS write, and one ``send``.
    """

    __slots__ = ("_transport", "_call_after_events", "_buffer", "_left", "_scheduled")

    def __init__(self, transport: TLSMemoryBIOProtocol, clock: IReactorTime) -> None:
        self._transport = transport
        if isinstance(clock, AfterEventsClock):
            self._call_after_events = clock.reactor.callAfterEvents
        else:
            self._call_after_events = functools.partial(clock.callLater, 0)
        self._buffer: list[bytes | bytearray] = []
        self._left = _AGGREGATED_BELOW
        self._scheduled = None

    def write(self, data: bytes) -> None:
        """The transport's ``write``: held for the end of the turn, as Twisted's."""
        self.write_buffer(data + b"")  # a copy of a bytearray (and a TypeError for str), as Twisted's

    def write_buffer(self, data: bytes | bytearray) -> None:
        """The transport's ``write_buffer``: :meth:`write` for a buffer the caller gives up (it must
        not change it afterwards), held as it is (the join in :meth:`flush` copies it).

        A write as big as Twisted's aggregation limit (64,000 bytes) is encrypted at once,
        after what smaller writes of this reactor turn left waiting: as the aggregation
        does, but without first copying it into ``bytes`` and again into one joined
        ``bytes``.
        """
        if len(data) >= _AGGREGATED_BELOW:
            self.flush()
            transport = self._transport
            if transport._aborted:  # dropped, as flush drops it (TLSMemoryBIOProtocol.write would not)
                return
            if transport._appSendBuffer:  # writes still held from before the handshake ended go first
                transport._bufferedWrite(bytes(data))
                return
            TLSMemoryBIOProtocol.write(transport, data)  # which drops it after loseConnection, as flush
            return
        self._buffer.append(data)
        self._left -= len(data)
        if self._left < 0:
            self.flush()
        elif self._scheduled is None:
            self._scheduled = self._call_after_events(self.flush)

    def flush(self) -> None:
        """Encrypt what is held, now. A flush scheduled earlier still comes (and finds what was
        written since, or nothing): cancelling it would cost a call in every turn."""
        self._scheduled = None
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer = []
        self._left = _AGGREGATED_BELOW
        transport = self._transport
        # TLSMemoryBIOProtocol.write's rule: after loseConnection only a registered producer
        # writes. After an abort nothing does (Twisted's would, and OpenSSL's refusal would then
        # be the reason the protocol is told).
        if not (transport._aborted or (transport.disconnecting and transport._producer is None)):
            transport._write(data)

    def close(self) -> None:
        """The connection is lost: what is held is written (as Twisted's), nothing is scheduled."""
        if self._scheduled is not None:
            self._scheduled.cancel()
        self.flush()


#: bytes asked of ``SSL_read``, which returns at most one record's plaintext (16 KiB) per call
_RECORD_READ = 2**15


class _WriteThroughTLSTransport(BufferingTLSTransport):
    """Twisted's TLS transport over a TCP connection that sends at once (:func:`write_through`), with
    a fixed cost per write and per read rather than per 16 KiB record.

    Twisted makes one TLS write of a reactor turn's writes (at the end of the turn), encrypts
    it 16 KiB at a time and hands each record to TCP on its own: sent at once, a ``send`` per
    record. Here a write is encrypted in one ``SSL_write`` (OpenSSL still makes the records) and
    leaves the send BIO in one piece, so it becomes one TCP write, whatever its size.

    Received, OpenSSL returns one record's plaintext per ``SSL_read``; the records one TCP read
    brought are delivered to the protocol together, in one ``dataReceived`` call, instead of one
    call per record. Either way at most what one read or one write carries is held at once.

    Once the handshake is done, OpenSSL is called directly (through pyOpenSSL's own bindings)
    for the memory BIOs and ``SSL_write``, as for ``SSL_read``: pyOpenSSL's methods check their
    arguments, look for errors its handshake callbacks stored and ask OpenSSL for an error
    after every call, and an empty send BIO is a raised ``WantReadError``, ~15 Python calls per
    message and node. Here errors are looked at only when OpenSSL reports one, and the send BIO
    only when it holds something. Without those internals, pyOpenSSL's public methods do it all.
    """

    #: False (for every connection) once the direct ``SSL_read`` path found this pyOpenSSL's
    #: internals not to fit; then every read goes through the public ``recv``
    decrypts_directly = _BINDINGS_FIT
    #: the same for ``SSL_write`` and the memory BIOs: then pyOpenSSL's ``send``, ``bio_write``
    #: and ``bio_read`` (also without pyOpenSSL's bindings at all)
    encrypts_directly = _BINDINGS_FIT
    # While an abort runs: what it encrypts (a close_notify) is dropped, not sent.
    _dropping_output = False
    # Bytes the TCP read being handled brought.
    _ciphertext_received = 0
    # pyOpenSSL's internals the direct paths use (see makeConnection)
    _openssl = _openssl_receive_bio = _openssl_send_bio = _openssl_error_check = None

    def __init__(self, factory, wrappedProtocol, _connectWrapped: bool = True) -> None:
        super().__init__(factory, wrappedProtocol, _connectWrapped)
        # Twisted's aggregation replaced by the same in fewer calls (BufferingTLSTransport's
        # loseConnection flushes it, its connectionLost closes it, as they did Twisted's).
        self._aggregator = _WritesOfATurn(self, factory._clock)
        self.write = self._aggregator.write
        #: :meth:`write` for a buffer the caller gives up (it must not change it afterwards): see
        #: :meth:`_WritesOfATurn.write_buffer`
        self.write_buffer = self._aggregator.write_buffer

    def makeConnection(self, transport) -> None:
        write_through(transport)
        super().makeConnection(transport)
        # pyOpenSSL's SSL*, its memory BIOs and its error check, not public API: looked up once
        # (None where this pyOpenSSL lacks one; the direct paths are then not taken).
        connection = self._tlsConnection
        self._openssl = ssl = getattr(connection, "_ssl", None)
        self._openssl_receive_bio = getattr(connection, "_into_ssl", None)
        self._openssl_send_bio = getattr(connection, "_from_ssl", None)
        self._openssl_error_check = getattr(connection, "_raise_ssl_error", None)
        clear_mode = getattr(_lib, "SSL_clear_mode", None)
        if ssl is not None and clear_mode is not None:
            # pyOpenSSL turns on partial writes, with which SSL_write returns after each record.
            # A memory BIO takes any amount, so without them one SSL_write encrypts a whole write.
            clear_mode(ssl, _lib.SSL_MODE_ENABLE_PARTIAL_WRITE)

    def connectionLost(self, reason) -> None:
        super().connectionLost(reason)
        # Twisted's connectionLost swaps the aggregator for one that drops writes and
        # rebinds write to it; write_buffer, bound to the closed aggregator, must follow.
        self.write_buffer = self.write
        # Twisted drops its pyOpenSSL connection here to break the reference cycle through it
        # (the connection's app data is this protocol); the handles taken from it, its bound
        # error check among them, would keep that cycle.
        self._openssl = self._openssl_receive_bio = self._openssl_send_bio = self._openssl_error_check = None

    def _write(self, data: bytes) -> None:
        # Twisted's _write, in one SSL_write instead of one per 16 KiB (the loop only takes
        # partial writes, should the mode be on after all).
        if self._lostTLSConnection:
            return
        written = 0
        try:
            while written < len(data):
                written += self._encrypt(memoryview(data)[written:] if written else data)
        except SSL.WantReadError:
            # Renegotiation-like states (never with TLS 1.3 in practice): retried with the same
            # bytes once the peer's answer arrived, as Twisted does.
            self._bufferedWrite(data[written:])
        except SSL.Error:
            failure = Failure()
            self._flush_send_bio(written)
            self._tlsShutdownFinished(failure)
            return
        self._flush_send_bio(written)

    def _encrypt(self, data) -> int:
        """One ``SSL_write`` of ``data``; raises pyOpenSSL's errors, as its ``send`` does."""
        raise_ssl_error = self._openssl_error_check
        # During the handshake pyOpenSSL's send also reports what its callbacks (certificate
        # verification, ALPN) raised: it stays with pyOpenSSL.
        if not (self._handshakeDone and _WriteThroughTLSTransport.encrypts_directly) or raise_ssl_error is None:
            return self._tlsConnection.send(data)
        ssl = self._openssl
        try:
            # bytes as they are (cffi passes their buffer), any other buffer through from_buffer
            result = _lib.SSL_write(ssl, data if type(data) is bytes else _ffi.from_buffer(data), len(data))
        except TypeError:  # this pyOpenSSL's SSL* is not a cffi pointer: its public methods from now on
            _WriteThroughTLSTransport.encrypts_directly = False
            return self._tlsConnection.send(data)
        if result > 0:
            return result
        raise_ssl_error(ssl, result)
        raise SSL.Error(f"SSL_write failed ({result}) and OpenSSL reports no error")

    def _flushSendBIO(self) -> None:
        self._flush_send_bio(_SEND_BIO_READ)

    def _flush_send_bio(self, plaintext: int) -> None:
        """Hand TCP everything in the send BIO, in one write (``plaintext``: the bytes just encrypted)."""
        bio = self._openssl_send_bio
        if bio is not None and _no_zero_buffer is not None and _WriteThroughTLSTransport.encrypts_directly:
            try:
                pending = _lib.BIO_get_mem_data(bio, _ffi.NULL)  # a memory BIO's length
            except TypeError:
                _WriteThroughTLSTransport.encrypts_directly = False
            else:
                if pending > 0:
                    buffer = _no_zero_buffer("char[]", pending)
                    taken = _lib.BIO_read(bio, buffer, pending)
                    if taken > 0 and not self._dropping_output:
                        self.transport.write(_ffi.unpack(buffer, taken))
                return
        # pyOpenSSL's bio_read: asked for a little more than there can be, BIO_read returns all
        # of it in one call; a full answer means there may be more.
        size = plaintext + _RECORD_OVERHEAD * (plaintext // _RECORD_PLAINTEXT + 1) + 1024
        pieces = []
        while True:
            try:
                piece = self._tlsConnection.bio_read(size)
            except SSL.WantReadError:
                break  # nothing (more) in the send BIO
            pieces.append(piece)
            if len(piece) < size:
                break
        if pieces and not self._dropping_output:
            self.transport.write(b"".join(pieces))

    def dataReceived(self, data: bytes) -> None:
        self._ciphertext_received = len(data)  # bounds the plaintext it can make (_flushReceiveBIO)
        bio = self._openssl_receive_bio
        if (
            not self._handshakeDone
            or self._appSendBuffer
            or bio is None
            or not _WriteThroughTLSTransport.encrypts_directly
        ):
            super().dataReceived(data)  # Twisted's: the handshake, writes held back until it is done
            return
        try:
            written = _lib.BIO_write(bio, data if type(data) is bytes else _ffi.from_buffer(data), len(data))
        except TypeError:
            _WriteThroughTLSTransport.encrypts_directly = False
            super().dataReceived(data)
            return
        if written != len(data):  # a memory BIO takes all or nothing: pyOpenSSL's raises what failed
            self._tlsConnection.bio_write(data)
        self._flushReceiveBIO()

    def _flushReceiveBIO(self) -> None:
        # Twisted's _flushReceiveBIO, delivering the plaintext of every record now in the receive
        # BIO in one dataReceived call; an end or an error found after them comes after it, as
        # in Twisted's order.
        if self._lostTLSConnection:  # TLS already ended: nothing more is read (as in Twisted)
            self._flushSendBIO()
            return
        plaintext, peer_closed, failure = self._decrypt_records()
        if plaintext and not self._aborted:
            self.wrappedProtocol.dataReceived(plaintext)  # as ProtocolWrapper.dataReceived
        if peer_closed:
            self._shutdownTLS()
            # None: the protocol's connectionLost gets the reason from the TCP transport.
            self._tlsShutdownFinished(None)
        elif failure is not None:
            self._tlsShutdownFinished(failure)
        self._flush_send_bio(_SEND_BIO_READ)  # what reading made OpenSSL send (alerts, key updates)

    def _decrypt_records(self) -> tuple[bytes, bool, Failure | None]:
        """The plaintext of the whole records in the receive BIO, whether a close_notify followed
        them, and the failure that did.

        OpenSSL returns one record per ``SSL_read``. pyOpenSSL's ``recv`` allocates a buffer,
        checks for errors and copies the result for each; here the records are decrypted
        straight into one buffer, copied out once, and errors are looked at when OpenSSL reports
        one, through pyOpenSSL's error check unless OpenSSL only wants more bytes (every read
        ends so: pyOpenSSL would raise a ``WantReadError`` each time).
        """
        ssl = self._openssl
        raise_ssl_error = self._openssl_error_check
        if (
            _no_zero_buffer is None
            or ssl is None
            or raise_ssl_error is None
            or not _WriteThroughTLSTransport.decrypts_directly
        ):
            return self._decrypt_records_one_by_one()
        # What just arrived, and at most one record OpenSSL kept from an earlier read: the
        # plaintext cannot be longer (and if it were, the loop would start a second buffer).
        size = self._ciphertext_received + _RECORD_PLAINTEXT
        self._ciphertext_received = 0
        buffer = _no_zero_buffer("char[]", size)
        pieces = []
        filled = 0
        while True:
            try:
                result = _lib.SSL_read(ssl, buffer + filled, size - filled)
            except TypeError:  # this pyOpenSSL's SSL* is not a cffi pointer: its public recv from now on
                _WriteThroughTLSTransport.decrypts_directly = False
                return self._decrypt_records_one_by_one()
            if result > 0:
                filled += result
                if filled == size:
                    pieces.append(_ffi.unpack(buffer, filled))
                    filled = 0
                continue
            if filled:
                pieces.append(_ffi.unpack(buffer, filled))
            if _lib.SSL_get_error(ssl, result) == _lib.SSL_ERROR_WANT_READ:
                # The rest of the bytes do not make a record yet: the usual end, without an exception.
                return b"".join(pieces), False, None
            peer_closed, failure, rest = self._why_ssl_read_stopped(raise_ssl_error, ssl, result)
            pieces.append(rest)
            return b"".join(pieces), peer_closed, failure

    def _why_ssl_read_stopped(self, raise_ssl_error, ssl, result: int) -> tuple[bool, Failure | None, bytes]:
        """Whether a close_notify or which failure ended :meth:`_decrypt_records`'s reading, through
        pyOpenSSL's error check; and what is still to be decrypted if that check does not fit."""
        try:
            raise_ssl_error(ssl, result)
        except SSL.WantReadError:
            pass  # the rest of the bytes do not make a record yet
        except SSL.ZeroReturnError:
            return True, None, b""  # close_notify: TLS has shut down
        except SSL.Error:
            return False, Failure(), b""
        except TypeError:  # this pyOpenSSL's error check takes other arguments: recv from now on
            _WriteThroughTLSTransport.decrypts_directly = False
            rest, peer_closed, failure = self._decrypt_records_one_by_one()
            return peer_closed, failure, rest
        return False, None, b""

    def _decrypt_records_one_by_one(self) -> tuple[bytes, bool, Failure | None]:
        """:meth:`_decrypt_records` through pyOpenSSL's public ``recv``, one record per call."""
        received = []
        peer_closed = False
        failure = None
        while True:
            try:
                received.append(self._tlsConnection.recv(_RECORD_READ))
            except SSL.WantReadError:
                pass
            except SSL.ZeroReturnError:
                peer_closed = True
            except SSL.Error:
                failure = Failure()
            else:
                continue
            break
        return b"".join(received), peer_closed, failure

    def abortConnection(self) -> None:
        # Twisted's TLS abort writes a close_notify, then aborts TCP, which drops it
        # unsent. Sent at once, it would reach the peer and make the abrupt end look
        # like a clean one: keep back what the abort encrypts.
        self._dropping_output = True
        try:
            super().abortConnection()
        finally:
            self._dropping_output = False


def tls_factory(
    creator, is_client: bool, wrapped_factory, reactor: IReactorTime, factory_class=TLSMemoryBIOFactory
) -> TLSMemoryBIOFactory:
    """A ``TLSMemoryBIOFactory`` (or ``factory_class``, a subclass) for HBONE connections: see
    :class:`_WriteThroughTLSTransport`; a turn's writes are sent together after the turn's
    events (:func:`~ztwisted.reactor.write_aggregation_clock`)."""
    factory = factory_class(creator, is_client, wrapped_factory, clock=write_aggregation_clock(reactor))
    factory.protocol = _WriteThroughTLSTransport
    return factory
