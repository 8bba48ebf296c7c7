"""Real TLS handshakes between ServerTLS and ClientTLS (in memory via iosim, and over TCP)."""

from __future__ import annotations

import sys
import weakref

import attr
import pytest
import pytest_twisted
from OpenSSL import SSL
from twisted.internet import defer, task
from twisted.internet.address import IPv4Address
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import (
    IHandshakeListener,
    IOpenSSLClientConnectionCreator,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import formatEvent, globalLogPublisher
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer

import ztwisted.tls
from ztwisted.ca import CertificateAuthority, IssuedCertificate, create_files
from ztwisted.identity import SpiffeId
from ztwisted.tls import (
    ALPN_H2,
    ClientTLS,
    PeerVerificationError,
    ServerTLS,
    negotiated_alpn,
    peer_identity,
    tls_factory,
)

CLIENT = SpiffeId("cluster.local", "default", "client")
SERVER = SpiffeId("cluster.local", "default", "server")
ALLOWED_CIPHERS = {"TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256"}


@implementer(IHandshakeListener)
class Peer(Protocol):
    """Records what happens to one side; echoes if ``echo``."""

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo
        self.handshake_done = False
        self.received = b""
        self.lost: Failure | None = None
        # Fires with True after the handshake, or False if the connection is lost first.
        self.handshake: defer.Deferred[bool] = defer.Deferred()
        # Fires (with None; see ``lost``) when the connection is gone.
        self.closed: defer.Deferred[None] = defer.Deferred()

    def handshakeCompleted(self) -> None:
        self.handshake_done = True
        self.handshake.callback(True)

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        if self.echo:
            self.transport.write(data)

    def connectionLost(self, reason: Failure) -> None:
        self.lost = reason
        if not self.handshake.called:
            self.handshake.callback(False)
        self.closed.callback(None)


@attr.s
class Link:
    client_tls = attr.ib()
    server_tls = attr.ib()
    pump: iosim.IOPump = attr.ib()
    # Kept here: the TLS wrapper drops wrappedProtocol when the connection is lost.
    client: Peer = attr.ib()
    server: Peer = attr.ib()


def connect(server_creator, client_creator, *, client_through_tls_factory: bool = False, client_reactor=None) -> Link:
    """Handshake in memory (deterministic), pumping until both sides are quiet.

    The client side is ztwisted's own TLS transport (:func:`tls_factory`) if asked,
    else, like the server side, Twisted's; ``client_reactor`` is the reactor its writes
    are aggregated on (the pump's clock if not given).
    """
    clock = task.Clock()
    address = IPv4Address("TCP", "127.0.0.1", 15008)

    def wrap(creator, is_client):
        factory = Factory.forProtocol(Peer)
        return TLSMemoryBIOFactory(creator, is_client, factory, clock=clock)

    server_factory = wrap(server_creator, False)
    if client_through_tls_factory:
        client_factory = tls_factory(client_creator, True, Factory.forProtocol(Peer), client_reactor or clock)
    else:
        client_factory = wrap(client_creator, True)
    client_tls, server_tls, pump = iosim.connectedServerAndClient(
        lambda: server_factory.buildProtocol(address),
        lambda: client_factory.buildProtocol(address),
        clock=clock,
        greet=False,
    )
    link = Link(
        client_tls,
        server_tls,
        pump,
        client_tls.wrappedProtocol,
        server_tls.wrappedProtocol,
    )
    pump.flush()
    return link


@implementer(IOpenSSLClientConnectionCreator)
@attr.s
class RawClient:
    """A client built directly on an SSL.Context, for peers that break the policy."""

    context: SSL.Context = attr.ib()
    session: SSL.Session | None = attr.ib(default=None)

    def clientConnectionForTLS(self, tlsProtocol):
        connection = SSL.Connection(self.context, None)
        if self.session is not None:
            connection.set_session(self.session)
        return connection


def raw_client_context(issued: IssuedCertificate | None, max_version=SSL.TLS1_3_VERSION):
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_max_proto_version(max_version)
    context.set_verify(SSL.VERIFY_NONE)
    context.set_alpn_protos([ALPN_H2])
    if issued is not None:
        context.use_certificate(issued.certificate())
        context.use_privatekey(issued.private_key())
        for cert in issued.chain():
            context.add_extra_chain_cert(cert)
    return context


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create_dev(tmp_path_factory.mktemp("state"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create_dev(tmp_path_factory.mktemp("other"))


@pytest.fixture(scope="module")
def server_cert(ca) -> IssuedCertificate:
    return ca.issue(SERVER)


@pytest.fixture(scope="module")
def client_cert(ca) -> IssuedCertificate:
    return ca.issue(CLIENT)


def server_for(issued: IssuedCertificate, trust_domain: str | None = None) -> ServerTLS:
    return ServerTLS(lambda: issued, trust_domain)


def client_for(issued: IssuedCertificate, *expected) -> ClientTLS:
    return ClientTLS(issued, expected or {str(SERVER)})


def assert_refused(peer: Peer, *fragments: str) -> None:
    """``peer`` saw the handshake fail with a PeerVerificationError saying ``fragments``."""
    assert not peer.handshake_done
    assert peer.lost is not None
    assert peer.lost.check(PeerVerificationError), peer.lost
    for fragment in fragments:
        assert fragment in str(peer.lost.value)


def assert_failed(peer: Peer) -> None:
    """``peer`` lost the connection with a TLS error (e.g. an alert from the other side)."""
    assert peer.lost is not None
    assert peer.lost.check(SSL.Error), peer.lost
    assert peer.received == b""


# -- success -------------------------------------------------------------------------


def test_mutual_tls_identifies_both_peers(server_cert, client_cert):
    link = connect(server_for(server_cert), client_for(client_cert))
    assert link.client.handshake_done and link.server.handshake_done
    assert link.client.lost is None and link.server.lost is None

    assert peer_identity(link.client_tls) == SERVER
    assert peer_identity(link.server_tls) == CLIENT
    # The application protocol's transport works too.
    assert peer_identity(link.client.transport) == SERVER
    assert peer_identity(link.server_tls.getHandle()) == CLIENT

    link.client.transport.write(b"hello")
    link.pump.flush()
    assert link.server.received == b"hello"


def test_policy_tls13_h2_aes_gcm_no_sni(server_cert, client_cert):
    link = connect(server_for(server_cert), client_for(client_cert))
    for tls in (link.client_tls, link.server_tls):
        connection = tls.getHandle()
        assert connection.get_protocol_version_name() == "TLSv1.3"
        assert connection.get_cipher_name() in ALLOWED_CIPHERS
        assert negotiated_alpn(tls) == b"h2"
        assert negotiated_alpn(connection) == b"h2"
    assert link.server_tls.getHandle().get_servername() is None


def test_server_sends_its_own_certificate_with_chain(server_cert, client_cert):
    link = connect(server_for(server_cert), client_for(client_cert))
    chain = link.client_tls.getHandle().get_peer_cert_chain(as_cryptography=True)
    assert chain[0] == server_cert.certificate()
    assert chain[1:] == server_cert.chain()


def test_intermediate_issued_leaves_verify_against_root_only(tmp_path):
    layered = create_files(tmp_path / "cacerts")
    server_cert = layered.issue(SERVER)
    client_cert = layered.issue(CLIENT)
    # Trust anchors are the root alone; the intermediate signed the leaves.
    assert (tmp_path / "cacerts" / "root-cert.pem").read_bytes() == server_cert.roots_pem
    assert server_cert.roots() == [layered.roots[0]]
    assert server_cert.certificate().issuer == layered.ca_cert.subject != layered.roots[0].subject

    link = connect(server_for(server_cert), client_for(client_cert))
    assert peer_identity(link.client_tls) == SERVER
    assert peer_identity(link.server_tls) == CLIENT
    sent = link.client_tls.getHandle().get_peer_cert_chain(as_cryptography=True)
    assert layered.ca_cert in sent


def test_leaf_without_chain_is_refused_when_only_root_is_trusted(tmp_path):
    layered = create_files(tmp_path / "cacerts")
    bare_server = attr.evolve(layered.issue(SERVER), chain_pem=b"")
    link = connect(server_for(bare_server), client_for(layered.issue(CLIENT)))
    assert_refused(link.client, "server certificate does not chain", "local issuer")
    assert_failed(link.server)


def test_client_accepts_any_of_the_expected_identities(server_cert, client_cert):
    creator = client_for(client_cert, "spiffe://cluster.local/ns/default/sa/other", SERVER)
    link = connect(server_for(server_cert), creator)
    assert link.client.handshake_done
    assert peer_identity(link.client_tls) == SERVER


def test_server_trust_domain_can_be_configured(ca, server_cert):
    foreign = ca.issue(SpiffeId("partner.example", "default", "client"))
    link = connect(server_for(server_cert, "partner.example"), client_for(foreign))
    assert link.server.handshake_done
    assert peer_identity(link.server_tls) == SpiffeId("partner.example", "default", "client")


# -- failures -----------------------------------------------------------------------------


def test_client_without_certificate_is_refused(server_cert):
    link = connect(server_for(server_cert), RawClient(raw_client_context(None)))
    assert not link.server.handshake_done
    assert link.server.lost.check(SSL.Error)
    assert "did not return a certificate" in str(link.server.lost.value)
    assert_failed(link.client)


def test_client_certificate_from_another_ca_is_refused(other_ca, server_cert):
    # The client trusts our server, but its own certificate is from another CA.
    foreign = attr.evolve(other_ca.issue(CLIENT), roots_pem=other_ca.roots_pem + server_cert.roots_pem)
    link = connect(server_for(server_cert), client_for(foreign))
    assert_refused(link.server, "client certificate does not chain", "self-signed")
    assert_failed(link.client)


def test_client_from_another_trust_domain_is_refused(ca, server_cert):
    foreign = ca.issue(SpiffeId("other.example", "default", "client"))
    link = connect(server_for(server_cert), client_for(foreign))
    assert_refused(
        link.server,
        "client certificate has no SPIFFE identity in trust domain 'cluster.local'",
        "spiffe://other.example/ns/default/sa/client",
    )
    assert_failed(link.client)


def test_refusal_is_logged_with_reason(ca, server_cert):
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        foreign = ca.issue(SpiffeId("other.example", "default", "client"))
        connect(server_for(server_cert), client_for(foreign))
    finally:
        globalLogPublisher.removeObserver(events.append)
    refusals = [formatEvent(e) for e in events if "refused" in e.get("log_format", "")]
    assert len(refusals) == 1
    assert "client certificate has no SPIFFE identity in trust domain 'cluster.local'" in refusals[0]


def test_server_not_expected_is_refused(server_cert, client_cert):
    creator = client_for(client_cert, "spiffe://cluster.local/ns/default/sa/echo")
    link = connect(server_for(server_cert), creator)
    assert_refused(
        link.client,
        "server certificate identity spiffe://cluster.local/ns/default/sa/server",
        "not one of the expected spiffe://cluster.local/ns/default/sa/echo",
    )
    assert_failed(link.server)
    assert not link.server.handshake_done


def test_server_from_another_ca_is_refused(other_ca, client_cert):
    link = connect(server_for(other_ca.issue(SERVER)), client_for(client_cert))
    assert_refused(link.client, "server certificate does not chain")
    assert_failed(link.server)


def test_tls12_only_client_is_refused(server_cert, client_cert):
    context = raw_client_context(client_cert, max_version=SSL.TLS1_2_VERSION)
    link = connect(server_for(server_cert), RawClient(context))
    assert not link.server.handshake_done
    assert not link.client.handshake_done
    assert link.server.lost.check(SSL.Error)
    assert "unsupported protocol" in str(link.server.lost.value)
    assert_failed(link.client)


def test_client_without_h2_is_refused(server_cert, client_cert):
    context = raw_client_context(client_cert)
    context.set_alpn_protos([b"http/1.1"])
    link = connect(server_for(server_cert), RawClient(context))
    assert not link.server.handshake_done
    assert link.server.lost.check(SSL.Error)
    assert_failed(link.client)


def test_sessions_are_not_resumed(server_cert, client_cert):
    from OpenSSL._util import lib  # private, but the only way to ask SSL_session_reused

    server = server_for(server_cert)
    context = raw_client_context(client_cert)
    first = connect(server, RawClient(context))
    # Make the client read what the server sent after the handshake (tickets).
    first.server.transport.write(b"x")
    first.pump.flush()
    assert first.client.received == b"x"
    session = first.client_tls.getHandle().get_session()
    assert session is not None

    second = connect(server, RawClient(context, session))
    assert second.server.handshake_done
    assert lib.SSL_session_reused(second.server_tls.getHandle()._ssl) == 0


def test_client_needs_expected_identities(client_cert):
    with pytest.raises(ValueError, match="at least one expected"):
        ClientTLS(client_cert, [])


# -- renewal -----------------------------------------------------------------------------


def test_renewed_server_certificate_applies_to_new_connections_only(ca, client_cert):
    current = {"cert": ca.issue(SERVER)}
    server = ServerTLS(lambda: current["cert"])
    assert server.context() is server.context()

    old = connect(server, client_for(client_cert))
    old_serial = old.client_tls.getPeerCertificate().get_serial_number()
    assert old_serial == current["cert"].serial

    current["cert"] = ca.issue(SERVER)
    new = connect(server, client_for(client_cert))
    assert new.client_tls.getPeerCertificate().get_serial_number() == current["cert"].serial

    # The connection made before the renewal keeps working.
    old.client.transport.write(b"still here")
    old.pump.flush()
    assert old.server.received == b"still here"
    old.server.transport.write(b"and back")
    old.pump.flush()
    assert old.client.received == b"and back"
    assert old.client.lost is None and old.server.lost is None


# -- over real TCP -----------------------------------------------------------------------

TCP_TIMEOUT = 10


def within(d: defer.Deferred, reactor) -> defer.Deferred:
    """``d``, failing with TimeoutError if it takes longer than TCP_TIMEOUT."""
    return d.addTimeout(TCP_TIMEOUT, reactor)


@defer.inlineCallbacks
def tcp_connect(reactor, server_creator, client_creator, echo: bool = False):
    """Listen on 127.0.0.1:0 and connect to it; returns (port, client, servers)."""
    servers: list[Peer] = []

    def server_protocol() -> Peer:
        peer = Peer(echo=echo)
        servers.append(peer)
        return peer

    server_factory = TLSMemoryBIOFactory(server_creator, False, Factory.forProtocol(server_protocol))
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server_factory)
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
    client_tls = yield endpoint.connect(TLSMemoryBIOFactory(client_creator, True, Factory.forProtocol(Peer)))
    return port, client_tls.wrappedProtocol, servers


@defer.inlineCallbacks
def tcp_cleanup(port, client: Peer, servers: list[Peer]):
    for peer in [client, *servers]:
        if peer.lost is None:
            peer.transport.abortConnection()
    yield port.stopListening()


@pytest_twisted.inlineCallbacks
def test_handshake_over_loopback_tcp(server_cert, client_cert):
    from twisted.internet import reactor

    port, client, servers = yield tcp_connect(reactor, server_for(server_cert), client_for(client_cert), echo=True)
    try:
        assert (yield within(client.handshake, reactor))
        assert peer_identity(client.transport) == SERVER
        assert negotiated_alpn(client.transport) == b"h2"

        client.transport.write(b"ping")
        deadline = reactor.seconds() + TCP_TIMEOUT
        while client.received != b"ping" and reactor.seconds() < deadline:
            yield task.deferLater(reactor, 0.01, lambda: None)
        assert client.received == b"ping"
        assert peer_identity(servers[0].transport) == CLIENT

        client.transport.loseConnection()
        yield within(client.closed, reactor)
        yield within(servers[0].closed, reactor)
    finally:
        yield tcp_cleanup(port, client, servers)


@pytest_twisted.inlineCallbacks
def test_unexpected_server_fails_over_loopback_tcp(server_cert, client_cert):
    from twisted.internet import reactor

    creator = client_for(client_cert, "spiffe://cluster.local/ns/default/sa/echo")
    port, client, servers = yield tcp_connect(reactor, server_for(server_cert), creator)
    try:
        yield within(client.closed, reactor)
        assert client.lost.check(PeerVerificationError)
        assert "not one of the expected" in str(client.lost.value)
        yield within(servers[0].closed, reactor)
        assert servers[0].lost.check(SSL.Error)
        assert not servers[0].handshake_done
    finally:
        yield tcp_cleanup(port, client, servers)


@defer.inlineCallbacks
def _tls_factory_client(reactor, server_cert, client_cert):
    """A plain TLS server on loopback and a client connected to it through :func:`tls_factory`."""
    servers: list[Peer] = []
    server_factory = TLSMemoryBIOFactory(
        server_for(server_cert), False, Factory.forProtocol(lambda: servers.append(Peer()) or servers[-1])
    )
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server_factory)
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
    client_tls = yield endpoint.connect(tls_factory(client_for(client_cert), True, Factory.forProtocol(Peer), reactor))
    return port, servers, client_tls


@pytest_twisted.inlineCallbacks
def test_tls_factory_sends_the_records_of_one_write_together(server_cert, client_cert):
    """64 KiB is four TLS records: handed to TCP as one write, sent at once, arriving whole."""
    from twisted.internet import reactor

    port, servers, client_tls = yield _tls_factory_client(reactor, server_cert, client_cert)
    client = client_tls.wrappedProtocol
    try:
        assert (yield within(client.handshake, reactor))
        tcp = client_tls.transport
        assert tcp.getTcpNoDelay()
        tcp_writes = []
        send = tcp.write
        tcp.write = lambda data: (tcp_writes.append(len(data)), send(data))  # this test's probe only
        payload = bytes(range(256)) * 256
        client_tls.write(payload)  # above Twisted's 64,000-byte aggregation limit: encrypted now
        assert len(tcp_writes) == 1 and tcp_writes[0] > len(payload), tcp_writes
        # Sent at once: nothing waits in Twisted's queue for the next poll.
        assert tcp.dataBuffer[tcp.offset :] == b"" and not tcp._tempDataBuffer
        deadline = reactor.seconds() + TCP_TIMEOUT
        while len(servers[0].received) < len(payload) and reactor.seconds() < deadline:
            yield task.deferLater(reactor, 0.01, lambda: None)
        assert servers[0].received == payload
    finally:
        yield tcp_cleanup(port, client, servers)


@pytest_twisted.inlineCallbacks
def test_tls_factory_abort_sends_no_close_notify(server_cert, client_cert):
    """Writes go out at once, but an abort still ends without close_notify: nothing reaches TCP."""
    from twisted.internet import reactor

    port, servers, client_tls = yield _tls_factory_client(reactor, server_cert, client_cert)
    client = client_tls.wrappedProtocol
    try:
        assert (yield within(client.handshake, reactor))
        tcp = client_tls.transport
        tcp_writes = []
        send = tcp.write
        tcp.write = lambda data: (tcp_writes.append(data), send(data))  # this test's probe only
        client_tls.abortConnection()
        assert tcp_writes == [], "the abort handed TCP a close_notify"
        yield within(client.closed, reactor)
    finally:
        yield tcp_cleanup(port, client, servers)


class ChunkCountingPeer(Peer):
    """A :class:`Peer` that also remembers the size of each ``dataReceived`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[int] = []

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(len(data))
        super().dataReceived(data)


def _counting_link(server_cert, client_cert) -> tuple[Link, ChunkCountingPeer]:
    link = connect(server_for(server_cert), client_for(client_cert), client_through_tls_factory=True)
    assert link.client.handshake_done and link.server.handshake_done
    counting = ChunkCountingPeer()
    counting.makeConnection(link.client_tls)
    link.client_tls.wrappedProtocol = counting
    return link, counting


def test_a_closed_tls_connection_is_freed_at_once_not_by_the_cyclic_garbage_collector(
    server_cert, client_cert, no_cyclic_gc
):
    # Twisted breaks the cycle between its TLS protocol and pyOpenSSL's connection when the
    # connection is lost; the direct paths' handles must not make it again.
    link, client = _counting_link(server_cert, client_cert)
    pyopenssl_connection = weakref.ref(link.client_tls._tlsConnection)
    link.client_tls.loseConnection()
    link.pump.flush()
    assert client.lost is not None
    del link, client
    assert pyopenssl_connection() is None


class _LibThatRefuses:
    """pyOpenSSL's bindings, except that the functions named refuse what the direct path hands them."""

    def __init__(self, lib, *refused: str):
        self._lib = lib
        self._refused = refused

    def __getattr__(self, name):
        if name in self._refused:
            return self._refuse
        return getattr(self._lib, name)

    @staticmethod
    def _refuse(*args):
        raise TypeError("initializer for ctype 'SSL *' must be a cdata pointer")


def _error_check_unfit_in_the_direct_path(original):
    """pyOpenSSL's error check, refusing (as one taking other arguments would) the direct path's call."""

    def error_check(self, ssl, result):
        if sys._getframe(1).f_code.co_name == "_why_ssl_read_stopped":
            raise TypeError("_raise_ssl_error() takes other arguments")
        return original(self, ssl, result)

    return error_check


@pytest.fixture(
    params=["into one buffer", "through pyOpenSSL's recv", "internals found not to fit", "error check found not to fit"]
)
def decrypting(request, monkeypatch):
    """Every way the TLS transport decrypts: straight into one buffer; the fallback for a
    pyOpenSSL without the internals it uses (one public ``recv`` per record); and the switch
    to that fallback when the internals are there but do not fit."""
    monkeypatch.setattr(ztwisted.tls._WriteThroughTLSTransport, "decrypts_directly", True)
    if request.param == "through pyOpenSSL's recv":
        monkeypatch.setattr(ztwisted.tls, "_no_zero_buffer", None)
    elif request.param == "internals found not to fit":
        monkeypatch.setattr(ztwisted.tls, "_lib", _LibThatRefuses(ztwisted.tls._lib, "SSL_read"))
    elif request.param == "error check found not to fit":
        monkeypatch.setattr(
            SSL.Connection, "_raise_ssl_error", _error_check_unfit_in_the_direct_path(SSL.Connection._raise_ssl_error)
        )
    yield request.param
    if request.param == "internals found not to fit":
        assert not ztwisted.tls._WriteThroughTLSTransport.decrypts_directly, "the switch to recv was made"
    if request.param == "into one buffer":
        assert ztwisted.tls._WriteThroughTLSTransport.decrypts_directly, "no switch to recv was made"


def assert_switched_if_the_error_check_does_not_fit(decrypting: str) -> None:
    """The error check is called for errors other than "want more bytes": the tests that make one say so."""
    if decrypting == "error check found not to fit":
        assert not ztwisted.tls._WriteThroughTLSTransport.decrypts_directly, "the switch to recv was made"


class _CountingSslWrites(_LibThatRefuses):
    """pyOpenSSL's bindings, counting the direct path's ``SSL_write`` calls."""

    def __init__(self, lib, sizes: list[int]):
        super().__init__(lib)
        self._sizes = sizes

    def SSL_write(self, ssl, data, size):
        self._sizes.append(size)
        return self._lib.SSL_write(ssl, data, size)


@pytest.fixture(params=["directly", "through pyOpenSSL's methods", "internals found not to fit"])
def encrypting(request, monkeypatch):
    """Every way the TLS transport encrypts and uses its memory BIOs after the handshake:
    calling OpenSSL directly; through pyOpenSSL's public ``send``, ``bio_write`` and
    ``bio_read``; and the switch to those when the internals are there but do not fit."""
    monkeypatch.setattr(
        ztwisted.tls._WriteThroughTLSTransport, "encrypts_directly", request.param != "through pyOpenSSL's methods"
    )
    if request.param == "internals found not to fit":
        monkeypatch.setattr(
            ztwisted.tls, "_lib", _LibThatRefuses(ztwisted.tls._lib, "SSL_write", "BIO_write", "BIO_get_mem_data")
        )
    yield request.param
    if request.param == "internals found not to fit":
        assert not ztwisted.tls._WriteThroughTLSTransport.encrypts_directly, "the switch to pyOpenSSL was made"
    if request.param == "directly":
        assert ztwisted.tls._WriteThroughTLSTransport.encrypts_directly, "no switch to pyOpenSSL was made"


def test_tls_factory_delivers_the_records_of_one_read_in_one_call(server_cert, client_cert, decrypting, encrypting):
    """What one TCP read brings (here seven 16 KiB records) reaches the protocol in one call, in order."""
    link, client = _counting_link(server_cert, client_cert)
    payload = bytes(range(256)) * 400  # 102,400 bytes: seven records, written at once
    link.server_tls.write(payload)
    link.pump.flush()  # iosim hands the client everything written in one dataReceived
    assert client.chunks == [len(payload)]
    assert client.received == payload


def test_writes_still_held_from_before_the_handshake_go_out_when_the_next_read_comes(
    server_cert, client_cert, encrypting
):
    """Twisted holds writes OpenSSL could not take yet (a TLS 1.2 renegotiation; never with TLS
    1.3) and sends them when the peer's next bytes arrive: the direct read path leaves that to
    Twisted, before the bytes are decrypted."""
    link, client = _counting_link(server_cert, client_cert)
    link.client_tls._appSendBuffer.append(b"held back")
    link.server_tls.write(b"the peer's next bytes")
    link.pump.flush()
    assert client.received == b"the peer's next bytes"
    assert link.server.received == b"held back"
    assert link.client_tls._appSendBuffer == []


def test_tls_factory_delivers_data_before_the_close_notify_that_follows_it(
    server_cert, client_cert, decrypting, encrypting
):
    """Records and the close_notify after them in one read: the data first, then a clean close."""
    link, client = _counting_link(server_cert, client_cert)
    payload = b"last words" * 5000
    link.server_tls.write(payload)
    link.server_tls.loseConnection()
    link.pump.flush()
    assert client.chunks == [len(payload)]
    assert client.received == payload
    assert client.lost is not None and client.lost.check(ConnectionDone), client.lost
    assert_switched_if_the_error_check_does_not_fit(decrypting)


def test_tls_factory_encrypts_a_write_in_one_ssl_write(server_cert, client_cert, encrypting, monkeypatch):
    """A write of many records is one SSL_write and one write to TCP, whatever its size."""
    link, _ = _counting_link(server_cert, client_cert)
    connection = link.client_tls._tlsConnection
    ssl_writes = []
    if encrypting == "directly":
        monkeypatch.setattr(ztwisted.tls, "_lib", _CountingSslWrites(ztwisted.tls._lib, ssl_writes))
    send = connection.send
    connection.send = lambda data: (ssl_writes.append(len(data)), send(data))[1]  # this test's probe only
    tcp_writes = []
    tcp_write = link.client_tls.transport.write
    link.client_tls.transport.write = lambda data: (tcp_writes.append(len(data)), tcp_write(data))
    payload = bytes(range(256)) * 1024  # 256 KiB: sixteen records
    link.client_tls.write(payload)
    assert ssl_writes == [len(payload)]
    assert len(tcp_writes) == 1 and tcp_writes[0] >= len(payload) + 16 * 22, tcp_writes
    link.pump.flush()
    assert link.server.received == payload


def test_tls_factory_hands_tcp_nothing_when_a_read_makes_nothing_to_send(server_cert, client_cert, encrypting):
    link, client = _counting_link(server_cert, client_cert)
    link.server_tls.write(b"hello")
    tcp_writes = []
    tcp_write = link.client_tls.transport.write
    link.client_tls.transport.write = lambda data: (tcp_writes.append(data), tcp_write(data))
    link.pump.flush()
    assert client.received == b"hello" and tcp_writes == []
    link.client_tls.write(b"an answer")
    link.pump.flush()
    assert link.server.received == b"an answer" and len(tcp_writes) == 1


def test_tls_factory_fails_the_connection_on_garbage_after_the_handshake(
    server_cert, client_cert, decrypting, encrypting
):
    """Bytes that are no TLS record: the protocol loses the connection with OpenSSL's error."""
    link, client = _counting_link(server_cert, client_cert)
    link.server_tls.write(b"before")
    link.pump.flush()
    # An application-data record that does not decrypt, as if TCP had brought it.
    link.client_tls.dataReceived(b"\x17\x03\x03\x00\x20" + b"\xab" * 32)
    link.pump.flush()
    assert client.received == b"before"
    assert client.lost is not None and client.lost.check(SSL.Error), client.lost
    assert_switched_if_the_error_check_does_not_fit(decrypting)


def test_tls_factory_fails_the_connection_when_openssl_refuses_a_write(server_cert, client_cert, encrypting):
    """SSL_write after TLS was shut down underneath: OpenSSL's error ends the connection, as in Twisted."""
    link, client = _counting_link(server_cert, client_cert)
    link.client_tls._tlsConnection.shutdown()  # close_notify sent: OpenSSL refuses to write more
    link.client_tls.write(b"x" * 70_000)  # above the aggregation limit: encrypted now
    link.pump.flush()
    assert client.lost is not None and client.lost.check(SSL.Error), client.lost


def test_tls_factory_decrypts_more_records_than_it_expected(server_cert, client_cert):
    """Records already in the receive BIO beyond what the last read can have made (which the
    sizing rules out) are still all delivered, in order, in one call."""
    link, client = _counting_link(server_cert, client_cert)
    payload = bytes(range(256)) * 400  # seven records
    link.server_tls.write(payload)
    ciphertext = link.pump.serverIO.getOutBuffer()
    link.client_tls._tlsConnection.bio_write(ciphertext)  # not through dataReceived: no size hint
    link.client_tls._flushReceiveBIO()
    assert client.chunks == [len(payload)]
    assert client.received == payload


def test_tls_factory_write_buffer_sends_a_bytearray_it_is_given(server_cert, client_cert, encrypting):
    """write_buffer: a big buffer is encrypted at once, after the small writes that wait; a small one waits too."""
    link, _ = _counting_link(server_cert, client_cert)
    link.client_tls.write(b"small, ")  # aggregated until the end of the reactor turn
    big = bytearray(bytes(range(256)) * 400)
    link.client_tls.write_buffer(big)
    link.client_tls.write_buffer(bytearray(b", and a small one"))
    link.pump.flush()
    assert link.server.received == b"small, " + bytes(big) + b", and a small one"


def _not_called(name: str):
    def refuse(*args):
        raise AssertionError(f"pyOpenSSL's {name} was called after the handshake")

    return refuse


def test_after_the_handshake_tls_calls_openssl_directly_whatever_buffer_it_is_given(server_cert, client_cert):
    """With bindings that fit, a write (bytes or a bytearray), a read (bytes, a bytearray, a
    memoryview) and the records that come out never go through pyOpenSSL's methods: the
    handles the direct paths use are there from the start, and buffers other than bytes are
    handed to OpenSSL as what they are, not refused (which would switch every connection to
    pyOpenSSL's methods for good)."""
    link, client = _counting_link(server_cert, client_cert)
    connection = link.client_tls._tlsConnection
    for name in ("send", "recv", "bio_write", "bio_read"):
        setattr(connection, name, _not_called(name))  # this test's probes only
    link.client_tls.write(b"small")
    link.client_tls.write_buffer(bytearray(b"big" * 30_000))  # encrypted at once, from the bytearray
    link.pump.flush()
    assert link.server.received == b"small" + b"big" * 30_000
    for kind in (bytes, bytearray, memoryview):
        link.server_tls.write(kind.__name__.encode())
        link.pump.clock.advance(0)  # the end of the peer's reactor turn: its write is encrypted
        ciphertext = link.pump.serverIO.getOutBuffer()
        link.client_tls.dataReceived(kind(ciphertext))
    assert client.received == b"bytesbytearraymemoryview"
    assert ztwisted.tls._WriteThroughTLSTransport.encrypts_directly
    assert ztwisted.tls._WriteThroughTLSTransport.decrypts_directly


def _link_aggregated_on(lean_reactor, server_cert, client_cert) -> tuple[Link, list[int], list[int]]:
    """A link whose client aggregates its writes on ``lean_reactor``, with its SSL_write and TCP writes counted."""
    link = connect(
        server_for(server_cert), client_for(client_cert), client_through_tls_factory=True, client_reactor=lean_reactor
    )
    assert link.client.handshake_done and link.server.handshake_done
    ssl_writes, tcp_writes = [], []
    encrypt = link.client_tls._encrypt
    link.client_tls._encrypt = lambda data: (ssl_writes.append(len(data)), encrypt(data))[1]  # probes only
    tcp_write = link.client_tls.transport.write
    link.client_tls.transport.write = lambda data: (tcp_writes.append(len(data)), tcp_write(data))
    return link, ssl_writes, tcp_writes


def test_the_small_writes_of_a_reactor_turn_are_one_tls_write_after_its_events(
    lean_reactor, server_cert, client_cert, encrypting
):
    """Many streams' frames in one turn: one SSL_write and one TCP write, once the turn's events were handled."""
    link, ssl_writes, tcp_writes = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    frames = [b"frame %d;" % i for i in range(16)]
    for frame in frames[:8]:
        link.client_tls.write(frame)
    for frame in frames[8:]:
        link.client_tls.write_buffer(bytearray(frame))  # h2's buffer, given away
    assert ssl_writes == [] and tcp_writes == []
    lean_reactor.doIteration(0)  # the end of the turn: its after-events calls
    assert ssl_writes == [sum(map(len, frames))] and len(tcp_writes) == 1
    lean_reactor.doIteration(0)  # nothing left for a later turn
    assert len(ssl_writes) == 1
    for turn in range(3):  # and every later turn's writes are flushed at its own end
        link.client_tls.write(b"turn %d;" % turn)
        lean_reactor.doIteration(0)
    assert len(ssl_writes) == 4
    link.pump.flush()
    assert link.server.received == b"".join(frames) + b"turn 0;turn 1;turn 2;"


def test_small_writes_past_the_aggregation_limit_are_encrypted_at_once_in_order(lean_reactor, server_cert, client_cert):
    link, ssl_writes, tcp_writes = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    first, second, third = b"a" * 40_000, b"b" * 30_000, b"c" * 10
    for data in (first, second, third):
        link.client_tls.write(data)
    assert ssl_writes == [70_000]  # the limit passed: encrypted before the turn ended
    lean_reactor.doIteration(0)
    assert ssl_writes == [70_000, 10] and len(tcp_writes) == 2
    link.pump.flush()
    assert link.server.received == first + second + third


def test_a_write_as_big_as_the_limit_is_encrypted_at_once_after_the_small_writes_that_wait(
    lean_reactor, server_cert, client_cert
):
    """write() takes write_buffer's path for a big write (after a copy): what waits first, then it, each now."""
    link, ssl_writes, tcp_writes = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    small, big = b"small, ", bytearray(b"b" * 64_000)
    link.client_tls.write(small)
    link.client_tls.write(big)
    big[:1] = b"x"  # write() copied it: the caller may change it afterwards
    assert ssl_writes == [len(small), 64_000] and len(tcp_writes) == 2
    lean_reactor.doIteration(0)
    assert len(ssl_writes) == 2  # nothing was left for the end of the turn
    link.pump.flush()
    assert link.server.received == small + b"b" * 64_000


def test_after_an_abort_a_write_as_big_as_the_limit_is_dropped_like_a_small_one(lean_reactor, server_cert, client_cert):
    """A registered producer keeps writes going after loseConnection, not after an abort: none is encrypted."""
    link, ssl_writes, _ = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    link.client_tls.registerProducer(Peer(), True)
    link.client_tls.abortConnection()
    link.client_tls.write(b"small")
    link.client_tls.write(b"b" * 64_000)
    link.client_tls.write_buffer(bytearray(b"c" * 64_000))
    lean_reactor.doIteration(0)
    assert ssl_writes == []
    link.pump.flush()
    assert link.client.lost is not None and not link.client.lost.check(SSL.Error), link.client.lost


def test_writes_of_the_turn_go_before_close_notify_and_later_ones_are_dropped(lean_reactor, server_cert, client_cert):
    """loseConnection sends what the turn wrote first; after it (no producer) writes are dropped, as in Twisted."""
    link, ssl_writes, _ = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    link.client_tls.write(b"last words")
    link.client_tls.loseConnection()
    link.client_tls.write(b" and more")
    lean_reactor.doIteration(0)
    link.pump.flush()
    assert ssl_writes == [len(b"last words")]
    assert link.server.received == b"last words"
    assert link.server.lost is not None and link.server.lost.check(ConnectionDone), link.server.lost


def test_what_a_turn_wrote_before_the_connection_was_lost_is_not_written_afterwards(
    lean_reactor, server_cert, client_cert
):
    link, ssl_writes, _ = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    link.client_tls.write(b"in flight")
    link.client_tls.connectionLost(Failure(ConnectionDone()))
    assert ssl_writes == [len(b"in flight")], "written then, as Twisted's aggregation does"
    count = len(ssl_writes)
    link.client_tls.write(b"after the end")
    lean_reactor.doIteration(0)  # the flush scheduled before the loss finds nothing
    assert len(ssl_writes) == count


def test_a_given_buffer_written_after_the_connection_was_lost_is_dropped_like_a_write(
    lean_reactor, server_cert, client_cert
):
    link, ssl_writes, _ = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    turn = link.client_tls._aggregator
    link.client_tls.connectionLost(Failure(ConnectionDone()))
    link.client_tls.write_buffer(bytearray(b"after the end"))
    assert turn._buffer == [], "not held by the closed aggregator for a flush that cannot happen"
    lean_reactor.doIteration(0)
    assert ssl_writes == []


def test_a_turns_writes_are_dropped_when_the_connection_is_aborted_in_it(lean_reactor, server_cert, client_cert):
    """An abort ends TLS at once: the turn's held writes are not encrypted after it (with a
    producer registered, as an HBONE connection has, OpenSSL refused them and that error
    became the reason the protocol was told)."""
    link, ssl_writes, _ = _link_aggregated_on(lean_reactor, server_cert, client_cert)
    link.client_tls.registerProducer(link.client, True)
    link.client_tls.write(b"held until the end of the turn")
    link.client_tls.abortConnection()
    lean_reactor.doIteration(0)
    link.pump.flush()
    assert ssl_writes == []
    assert link.client.lost is not None and not link.client.lost.check(SSL.Error), link.client.lost


def test_the_direct_paths_are_used_only_with_bindings_that_have_all_they_call():
    # A cryptography without one of the functions (an AttributeError at the first call, not the
    # TypeError the switch handles) leaves every connection to pyOpenSSL's public methods.
    from types import SimpleNamespace

    from OpenSSL._util import lib

    everything = {name: getattr(lib, name) for name in ztwisted.tls._DIRECT_CALLS}
    assert ztwisted.tls._bindings_fit(SimpleNamespace(**everything))
    assert ztwisted.tls._BINDINGS_FIT, "this machine's bindings fit: the direct paths are tested"
    for missing in ztwisted.tls._DIRECT_CALLS:
        assert not ztwisted.tls._bindings_fit(
            SimpleNamespace(**{name: value for name, value in everything.items() if name != missing})
        )
    assert not ztwisted.tls._bindings_fit(None)
