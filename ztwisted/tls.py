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

from collections.abc import Callable, Iterable

from OpenSSL import SSL, crypto
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    IReactorTime,
)
from twisted.logger import Logger
from twisted.protocols.tls import BufferingTLSTransport, TLSMemoryBIOFactory
from zope.interface import implementer

from ztwisted.ca import IssuedCertificate
from ztwisted.identity import SpiffeId, spiffe_ids, uri_sans
from ztwisted.reactor import write_aggregation_clock
from ztwisted.sockets import write_through

try:
    # Private but stable: the binding pyOpenSSL itself uses for X509 errors.
    from OpenSSL._util import ffi as _ffi
    from OpenSSL._util import lib as _lib
except ImportError:  # pragma: no cover
    _ffi = _lib = None

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


class _WriteThroughTLSTransport(BufferingTLSTransport):
    """Twisted's TLS transport over a TCP connection that sends at once (:func:`write_through`).

    Twisted makes one TLS write of a reactor turn's writes (at the end of the
    turn) and splits it into 16 KiB records, handing each record to TCP as
    soon as it is encrypted. Sent at once, that is a ``send`` per record;
    here the records of one write are joined and sent together.
    """

    _records: list[bytes] | None = None

    def makeConnection(self, transport) -> None:
        write_through(transport)
        super().makeConnection(transport)

    def _write(self, data: bytes) -> None:
        if self._records is not None:  # re-entered: the outer call sends
            super()._write(data)
            return
        self._records = []
        try:
            super()._write(data)
        finally:
            records, self._records = self._records, None
            if records:
                self.transport.write(b"".join(records))

    def abortConnection(self) -> None:
        # Twisted's TLS abort writes a close_notify, then aborts TCP, which drops it
        # unsent. Sent at once, it would reach the peer and make the abrupt end look
        # like a clean one: keep back what the abort encrypts.
        self._records = []
        try:
            super().abortConnection()
        finally:
            self._records = None

    def _flushSendBIO(self) -> None:
        if self._records is None:
            super()._flushSendBIO()
            return
        try:
            self._records.append(self._tlsConnection.bio_read(2**15))
        except SSL.WantReadError:
            pass  # nothing in the send BIO


def tls_factory(
    creator, is_client: bool, wrapped_factory, reactor: IReactorTime, factory_class=TLSMemoryBIOFactory
) -> TLSMemoryBIOFactory:
    """A ``TLSMemoryBIOFactory`` (or ``factory_class``, a subclass) for HBONE connections: see
    :class:`_WriteThroughTLSTransport`; a turn's writes are sent together after the turn's
    events (:func:`~ztwisted.reactor.write_aggregation_clock`)."""
    factory = factory_class(creator, is_client, wrapped_factory, clock=write_aggregation_clock(reactor))
    factory.protocol = _WriteThroughTLSTransport
    return factory
