"""Workload certificates from the mesh CA (``IstioCertificateService/CreateCertificate``), as ztunnel gets them.

For each local workload identity the proxy makes a key pair in memory,
sends a CSR whose only URI SAN is the identity, and keeps the signed chain
it gets back. The CA's key never reaches the node, and nothing is written to
disk. A certificate is renewed at half its life; the old one keeps serving
until the new one arrives, and established connections keep theirs (TLS
contexts are per connection), so a renewal drops nothing.

:class:`RemoteCertificateStore` has the interface of
:class:`ztwisted.ca.CertificateStore` that the data plane uses (``get``,
``all``, ``subscribe``, ``discard``, ``stop``); ``get`` cannot wait, so it
raises :class:`CertificateUnavailable` until the first certificate of an
identity has arrived, and readiness waits for them (:meth:`missing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from twisted.internet import defer
from twisted.logger import Logger

from ztwisted.ca import CertificateStore, IssuedCertificate
from ztwisted.identity import SpiffeId, uri_sans
from ztwisted.xds import ca_pb2, grpc

log = Logger()

CREATE_CERTIFICATE = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
DEFAULT_SECRET_TTL = 24 * 3600.0
FIRST_RETRY = 1.0
MAX_RETRY = 60.0


class CertificateUnavailable(Exception):
    """No certificate for this identity has come from the CA yet."""


def make_csr(identity: SpiffeId) -> tuple[bytes, bytes]:
    """(PEM CSR, PEM private key): EC P-256, empty subject, the identity as the only URI SAN."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(str(identity))]), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return csr.public_bytes(serialization.Encoding.PEM), key_pem


def certificate_from_response(
    identity: SpiffeId, key_pem: bytes, response: ca_pb2.IstioCertificateResponse
) -> IssuedCertificate:
    """Check the CA's answer against what we asked for; ValueError says what is wrong."""
    if len(response.cert_chain) < 2:
        raise ValueError(
            f"the CA answered {len(response.cert_chain)} certificates; a leaf and at least the root are needed"
        )
    try:
        chain = [x509.load_pem_x509_certificates(pem.encode()) for pem in response.cert_chain]
    except ValueError as e:
        raise ValueError(f"the CA answered a certificate that is not PEM: {e}") from None
    certificates = [c for group in chain for c in group]
    leaf, issuers = certificates[0], certificates[1:]
    key = serialization.load_pem_private_key(key_pem, password=None)
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if leaf.public_key().public_bytes(serialization.Encoding.DER, public) != key.public_key().public_bytes(
        serialization.Encoding.DER, public
    ):
        raise ValueError("the CA signed a different public key than the one in our CSR")
    from OpenSSL import crypto

    sans = uri_sans(crypto.X509.from_cryptography(leaf))
    if str(identity) not in sans:
        raise ValueError(f"the certificate names {', '.join(sans) or 'no identity'}, not {identity}")
    pem = serialization.Encoding.PEM
    return IssuedCertificate(
        identity=identity,
        key_pem=key_pem,
        cert_pem=leaf.public_bytes(pem),
        chain_pem=b"".join(c.public_bytes(pem) for c in issuers),
        not_before=leaf.not_valid_before_utc,
        not_after=leaf.not_valid_after_utc,
        # As ztunnel: the last certificate of the chain is the mesh's trust anchor.
        roots_pem=issuers[-1].public_bytes(pem),
        serial=leaf.serial_number,
    )


class RemoteCertificateStore(CertificateStore):
    """One certificate per identity, requested from the CA at ``target`` and renewed at half-life.

    What it shares with the local CA's store: the certificates kept, the
    renewal timers, the subscribers; what differs: issuing is a request.
    """

    def __init__(
        self,
        reactor,
        target: grpc.Target,
        *,
        headers: Callable[[], list[tuple[str, str]]] = list,
        secret_ttl: float = DEFAULT_SECRET_TTL,
        connect_timeout: float = 5.0,
    ):
        super().__init__(None, reactor, timedelta(seconds=secret_ttl))
        self._reactor = reactor
        self.target = target
        self._headers = headers
        self.secret_ttl = secret_ttl
        self._connect_timeout = connect_timeout
        self._fetching: dict[SpiffeId, defer.Deferred] = {}
        self._retry_delay: dict[SpiffeId, float] = {}
        self._errors: dict[SpiffeId, str] = {}
        self._live: grpc.GrpcConnection | None = None
        #: identities asked for and not discarded since: an answer for another one is dropped
        self._wanted: set[SpiffeId] = set()
        self.requests = 0

    # -- the interface the data plane uses ----------------------------------------------

    def get(self, identity: SpiffeId | str) -> IssuedCertificate:
        if isinstance(identity, str):
            identity = SpiffeId.parse(identity)
        current = self._certs.get(identity)
        now = datetime.fromtimestamp(self._reactor.seconds(), tz=UTC)
        if current is not None and current.not_after > now:
            return current
        self.ensure([identity])
        why = self._errors.get(identity, "the request is in flight")
        raise CertificateUnavailable(
            f"no certificate for {identity} from the CA at https://{self.target.authority} yet: {why}"
        )

    def discard(self, identity: SpiffeId) -> None:
        self._wanted.discard(identity)
        self._errors.pop(identity, None)
        self._retry_delay.pop(identity, None)
        super().discard(identity)

    def stop(self) -> None:
        super().stop()
        if self._live is not None:
            self._live.drain(graceful=False)

    # -- what readiness and the mesh updates use ------------------------------------------

    def ensure(self, identities: Iterable[SpiffeId]) -> None:
        """Request a certificate for each identity that has none and none on the way."""
        for identity in identities:
            self._wanted.add(identity)
            if identity not in self._certs and identity not in self._fetching and identity not in self._timers:
                self._fetch(identity)

    def keep_only(self, identities: Iterable[SpiffeId]) -> None:
        """The local identities are these: request what is missing, stop renewing what is no longer local."""
        wanted = set(identities)
        for identity in set(self._certs) | set(self._timers) | set(self._fetching):
            if identity not in wanted:
                self.discard(identity)
        self.ensure(wanted)

    def missing(self, identities: Iterable[SpiffeId]) -> list[SpiffeId]:
        return sorted({i for i in identities if i not in self._certs}, key=str)

    def status(self) -> dict:
        return {
            "address": f"https://{self.target.authority}",
            "requests": self.requests,
            "errors": {str(i): e for i, e in sorted(self._errors.items(), key=lambda kv: str(kv[0]))},
        }

    # -- requesting -------------------------------------------------------------------------

    def _renew(self, identity: SpiffeId) -> None:
        self._fetch(identity)

    def _fetch(self, identity: SpiffeId) -> None:
        self._timers.pop(identity, None)
        if self._stopped:
            return
        csr, key_pem = make_csr(identity)
        request = ca_pb2.IstioCertificateRequest(csr=csr.decode(), validity_duration=int(self.secret_ttl))
        self.requests += 1
        fetching = self._call(request.SerializeToString())
        fetching.addCallback(
            lambda data: certificate_from_response(identity, key_pem, ca_pb2.IstioCertificateResponse.FromString(data))
        )
        fetching.addCallbacks(
            lambda issued: self._issued(identity, issued), lambda failure: self._failed(identity, failure)
        )
        self._fetching[identity] = fetching
        fetching.addBoth(self._fetched, identity, fetching)

    def _fetched(self, result, identity: SpiffeId, fetching: defer.Deferred) -> None:
        if self._fetching.get(identity) is fetching:
            del self._fetching[identity]

    def _call(self, request: bytes) -> defer.Deferred:
        """One CreateCertificate call, on the kept connection if it is still usable."""
        live = self._live
        if live is not None and live.usable:
            connecting = defer.succeed(live)
        else:
            connecting = grpc.connect(self._reactor, self.target, timeout=self._connect_timeout)
            connecting.addCallback(self._keep)

        def call(connection):
            answered = grpc.unary(connection, CREATE_CERTIFICATE, request, self._headers())
            if connection is not self._live:
                # Another request's connection won the race: this one closes after its call.
                answered.addBoth(lambda result: (connection.drain(graceful=True), result)[1])
            return answered

        return connecting.addCallback(call)

    def _keep(self, connection):
        if self._stopped:
            connection.drain(graceful=False)
        elif self._live is None or not self._live.usable:
            self._live = connection
        return connection

    def _issued(self, identity: SpiffeId, issued: IssuedCertificate) -> None:
        if identity not in self._wanted:
            return
        renewal = identity in self._certs
        self._certs[identity] = issued
        self._errors.pop(identity, None)
        self._retry_delay.pop(identity, None)
        now = self._reactor.seconds()
        half_life = (issued.not_after.timestamp() - now) / 2
        self._schedule(identity, timedelta(seconds=max(half_life, 0.0)))
        log.info(
            "{what} the certificate of {identity} from the CA: serial {serial}, valid until {not_after}",
            what="Renewed" if renewal else "Got",
            identity=str(identity),
            serial=f"{issued.serial:x}",
            not_after=issued.not_after.isoformat(),
        )
        if renewal:
            self._notify_renewal(issued)

    def _failed(self, identity: SpiffeId, failure) -> None:
        if identity not in self._wanted:
            return
        delay = self._retry_delay.get(identity, FIRST_RETRY / 2) * 2
        self._retry_delay[identity] = min(delay, MAX_RETRY)
        error = failure.getErrorMessage() or failure.type.__name__
        self._errors[identity] = error
        log.error(
            "cannot get a certificate for {identity} from the CA at {address}: {error}; retrying in {delay:.0f} s",
            identity=str(identity),
            address=f"https://{self.target.authority}",
            error=error,
            delay=delay,
        )
        self._schedule(identity, timedelta(seconds=min(delay, MAX_RETRY)))
