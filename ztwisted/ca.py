"""A certificate authority for workload certificates, and a renewing cache of them.

The on-disk layout is Istio's plug-in CA (``cacerts``) layout:

- ``ca-cert.pem``: the signing certificate (an intermediate, or the root itself)
- ``ca-key.pem``: its private key
- ``cert-chain.pem``: the chain from ``ca-cert.pem`` up to the root
- ``root-cert.pem``: the trust anchor(s)
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger

from ztwisted.identity import SpiffeId

log = Logger()

CA_CERT_FILE = "ca-cert.pem"
CA_KEY_FILE = "ca-key.pem"
CERT_CHAIN_FILE = "cert-chain.pem"
ROOT_CERT_FILE = "root-cert.pem"
LAYOUT_FILES = (CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE)

DEFAULT_LIFETIME = timedelta(hours=24)
CA_LIFETIME = timedelta(days=3650)
# Backdate certificates so peers with a slightly slow clock accept them.
CLOCK_SKEW = timedelta(minutes=5)
# After a failed renewal, try again this soon (but never after expiry matters).
RENEWAL_RETRY = timedelta(minutes=1)

_SigningKey = (
    rsa.RSAPrivateKey
    | ec.EllipticCurvePrivateKey
    | ed25519.Ed25519PrivateKey
    | ed448.Ed448PrivateKey
    | dsa.DSAPrivateKey
)


class CAError(Exception):
    """The CA cannot be loaded, created or used; the message names the file."""


def _pem(certs: Sequence[x509.Certificate]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def _utc(moment: datetime | None) -> datetime:
    if moment is None:
        return datetime.now(UTC)
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def _serial_of(issued: IssuedCertificate) -> int:
    return x509.load_pem_x509_certificate(issued.cert_pem).serial_number


@attrs.frozen(order=True)
class IssuedCertificate:
    """A workload certificate with its key, issuing chain and trust roots (all PEM)."""

    identity: SpiffeId
    key_pem: bytes = attrs.field(repr=False)
    cert_pem: bytes = attrs.field(repr=False)
    # Issuing chain without the leaf: ca-cert.pem, then up to the root.
    chain_pem: bytes = attrs.field(repr=False)
    not_before: datetime
    not_after: datetime
    roots_pem: bytes = attrs.field(repr=False)
    serial: int = attrs.field(default=attrs.Factory(_serial_of, takes_self=True), eq=False)

    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)

    def chain(self) -> list[x509.Certificate]:
        return _load_certificates(self.chain_pem)

    def roots(self) -> list[x509.Certificate]:
        return _load_certificates(self.roots_pem)

    def private_key(self) -> _SigningKey:
        return serialization.load_pem_private_key(self.key_pem, password=None)


def _load_certificates(data: bytes) -> list[x509.Certificate]:
    if not data.strip():
        return []
    return x509.load_pem_x509_certificates(data)


def _signature_hash(key: _SigningKey) -> hashes.HashAlgorithm | None:
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed448.Ed448PrivateKey)):
        return None
    return hashes.SHA256()


def _same_public_key(cert: x509.Certificate, key: _SigningKey) -> bool:
    def spki(public_key) -> bytes:
        return public_key.public_bytes(
            serialization.Encoding.DER,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )

    return spki(cert.public_key()) == spki(key.public_key())


def _authority_key_id(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key())
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski.value)


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    except x509.ExtensionNotFound:
        return False
    return constraints.value.ca


def _issued_by(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        child.verify_directly_issued_by(parent)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _describe(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string() or f"serial {cert.serial_number:x}"


class CertificateAuthority:
    """Signs workload certificates with the key of ``ca_cert``.

    ``chain`` is the issuing chain starting with ``ca_cert`` (up to, and
    possibly including, the root); ``roots`` are the trust anchors.
    """

    def __init__(
        self,
        ca_cert: x509.Certificate,
        ca_key: _SigningKey,
        chain: Sequence[x509.Certificate],
        roots: Sequence[x509.Certificate],
    ) -> None:
        if not _same_public_key(ca_cert, ca_key):
            raise CAError("the CA private key does not match the CA certificate")
        if not roots:
            raise CAError("a CA needs at least one root certificate")
        self.ca_cert = ca_cert
        self._ca_key = ca_key
        self.chain = list(chain) if chain else [ca_cert]
        if self.chain[0] != ca_cert:
            self.chain.insert(0, ca_cert)
        self.roots = list(roots)
        self.chain_pem = _pem(self.chain)
        self.roots_pem = _pem(self.roots)

    # -- loading -----------------------------------------------------------

    @classmethod
    def load(cls, ca_dir: str | os.PathLike[str]) -> CertificateAuthority:
        """Load an Istio plug-in CA directory; `CAError` names the offending file."""
        ca_dir = Path(ca_dir)
        if not ca_dir.is_dir():
            raise CAError(f"{ca_dir}: CA directory does not exist")
        ca_cert_path = ca_dir / CA_CERT_FILE
        key_path = ca_dir / CA_KEY_FILE
        chain_path = ca_dir / CERT_CHAIN_FILE
        root_path = ca_dir / ROOT_CERT_FILE

        ca_certs = _read_certificates(ca_cert_path, allow_empty=False)
        ca_cert = ca_certs[0]
        ca_key = _read_private_key(key_path)
        chain_tail = _read_certificates(chain_path, allow_empty=True)
        roots = _read_certificates(root_path, allow_empty=False)

        if not _same_public_key(ca_cert, ca_key):
            raise CAError(f"{key_path}: private key does not match the certificate in {ca_cert_path}")
        if not _is_ca(ca_cert):
            raise CAError(f"{ca_cert_path}: not a CA certificate (needs basicConstraints CA:TRUE)")
        chain = [ca_cert] + [c for c in chain_tail if c != ca_cert]
        for child, parent in itertools.pairwise(chain):
            if not _issued_by(child, parent):
                raise CAError(
                    f"{chain_path}: {_describe(child)!r} is not signed by the next "
                    f"certificate {_describe(parent)!r}; list the chain from "
                    f"{CA_CERT_FILE} up to the root, in order"
                )
        top = chain[-1]
        if top not in roots and not any(_issued_by(top, root) for root in roots):
            raise CAError(
                f"{root_path}: no root here issued {_describe(top)!r}, the top of the "
                f"chain formed by {CA_CERT_FILE} and {CERT_CHAIN_FILE}"
            )
        return cls(ca_cert, ca_key, chain, roots)

    @classmethod
    def load_or_create_dev(cls, state_dir: str | os.PathLike[str]) -> CertificateAuthority:
        """Load ``state_dir/ca``, or create a self-signed dev root CA there once.

        A lock file serialises creation, so processes started together with the
        same directory all end up with the same CA.
        """
        ca_dir = Path(state_dir) / "ca"
        try:
            ca_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CAError(f"{ca_dir}: cannot create CA directory: {e.strerror}") from e
        with _exclusive_lock(ca_dir / ".lock"):
            present = [name for name in LAYOUT_FILES if (ca_dir / name).exists()]
            if len(present) == len(LAYOUT_FILES):
                return cls.load(ca_dir)
            if present:
                missing = ", ".join(n for n in LAYOUT_FILES if n not in present)
                raise CAError(
                    f"{ca_dir}: incomplete CA directory, missing {missing}; restore "
                    f"those files or remove the directory to create a new dev CA"
                )
            root, key = _make_ca_certificate(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ztwisted"),
                        x509.NameAttribute(NameOID.COMMON_NAME, "ztwisted dev root CA"),
                    ]
                ),
                now=_utc(None),
                lifetime=CA_LIFETIME,
            )
            write_layout(ca_dir, root, key, chain=[root], roots=[root])
            log.info("Created a self-signed dev CA in {ca_dir}", ca_dir=str(ca_dir))
            # Re-read so this process uses exactly what others will load.
            return cls.load(ca_dir)

    # -- issuing -----------------------------------------------------------

    def issue(
        self,
        identity: SpiffeId,
        lifetime: timedelta = DEFAULT_LIFETIME,
        now: datetime | None = None,
    ) -> IssuedCertificate:
        """Issue an EC P-256 certificate whose only URI SAN is ``identity``."""
        if lifetime <= timedelta(0):
            raise ValueError(f"certificate lifetime must be positive, not {lifetime}")
        now = _utc(now)
        # A leaf must not outlive the certificate that signed it.
        not_after = min(now + lifetime, self.ca_cert.not_valid_after_utc)
        if not_after <= now:
            raise CAError(
                f"the CA certificate ({_describe(self.ca_cert)}) expired at "
                f"{self.ca_cert.not_valid_after_utc.isoformat()}"
            )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign_leaf(key.public_key(), [x509.UniformResourceIdentifier(str(identity))], not_after, now)
        return IssuedCertificate(
            identity=identity,
            key_pem=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            cert_pem=cert.public_bytes(serialization.Encoding.PEM),
            chain_pem=self.chain_pem,
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
            roots_pem=self.roots_pem,
            serial=cert.serial_number,
        )

    def _sign_leaf(
        self, public_key, sans: list[x509.GeneralName], not_after: datetime, now: datetime
    ) -> x509.Certificate:
        """A leaf for ``public_key`` whose only names are ``sans`` (Istio leaves have an empty subject)."""
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(self.ca_cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=True,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            # Critical because the subject is empty (RFC 5280 4.2.1.6).
            .add_extension(x509.SubjectAlternativeName(sans), critical=True)
            .add_extension(_authority_key_id(self.ca_cert), critical=False)
            .sign(self._ca_key, _signature_hash(self._ca_key))
        )

    # -- signing requests (the lab control plane's CA service) ------------------------

    def sign_csr(
        self, csr: x509.CertificateSigningRequest, lifetime: timedelta, now: datetime | None = None
    ) -> x509.Certificate:
        """Sign a CSR's key with the names it asks for (URI, DNS and IP SANs); CAError if it is not acceptable."""
        if not csr.is_signature_valid:
            raise CAError("the CSR's signature does not verify")
        try:
            requested = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            raise CAError("the CSR asks for no subjectAltName") from None
        now = _utc(now)
        not_after = min(now + lifetime, self.ca_cert.not_valid_after_utc)
        if not_after <= now:
            raise CAError(f"the CA certificate ({_describe(self.ca_cert)}) has expired")
        return self._sign_leaf(csr.public_key(), list(requested), not_after, now)


# -- files -------------------------------------------------------------------


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CAError(f"{path}: missing; a CA directory needs {', '.join(LAYOUT_FILES)}") from None
    except OSError as e:
        raise CAError(f"{path}: cannot read: {e.strerror}") from e


def _read_certificates(path: Path, *, allow_empty: bool) -> list[x509.Certificate]:
    data = _read_file(path)
    if not data.strip():
        if allow_empty:
            return []
        raise CAError(f"{path}: empty, expected PEM certificates")
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as e:
        raise CAError(f"{path}: not valid PEM certificates: {e}") from None


def _read_private_key(path: Path) -> _SigningKey:
    data = _read_file(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise CAError(f"{path}: the private key is encrypted; provide it unencrypted") from None
    except (ValueError, UnsupportedAlgorithm) as e:
        raise CAError(f"{path}: not a valid PEM private key: {e}") from None
    if not isinstance(key, _SigningKey):
        raise CAError(f"{path}: a {type(key).__name__} cannot sign certificates")
    return key


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise CAError(f"{path}: cannot open lock file: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # also releases the lock


def _atomic_write(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_layout(
    ca_dir: str | os.PathLike[str],
    ca_cert: x509.Certificate,
    ca_key: _SigningKey,
    chain: Sequence[x509.Certificate],
    roots: Sequence[x509.Certificate],
) -> None:
    """Write the four plug-in CA files, each atomically; the key with mode 0600.

    ``chain`` is written as ``cert-chain.pem`` (Istio puts ``ca-cert.pem``
    first, then its issuers up to the root).
    """
    ca_dir = Path(ca_dir)
    ca_dir.mkdir(parents=True, exist_ok=True)
    key_pem = ca_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _atomic_write(ca_dir / CA_KEY_FILE, key_pem, 0o600)
    _atomic_write(ca_dir / CA_CERT_FILE, _pem([ca_cert]), 0o644)
    _atomic_write(ca_dir / CERT_CHAIN_FILE, _pem(chain), 0o644)
    _atomic_write(ca_dir / ROOT_CERT_FILE, _pem(roots), 0o644)


def _make_ca_certificate(
    subject: x509.Name,
    *,
    now: datetime,
    lifetime: timedelta,
    issuer: x509.Certificate | None = None,
    issuer_key: _SigningKey | None = None,
    path_length: int | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """An EC P-256 CA certificate, self-signed unless ``issuer`` is given."""
    key = ec.generate_private_key(ec.SECP256R1())
    signer = issuer_key if issuer_key is not None else key
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if issuer is not None:
        builder = builder.add_extension(_authority_key_id(issuer), critical=False)
    return builder.sign(signer, _signature_hash(signer)), key


def create_files(
    ca_dir: str | os.PathLike[str],
    *,
    intermediate: bool = True,
    organization: str = "ztwisted",
    now: datetime | None = None,
    lifetime: timedelta = CA_LIFETIME,
) -> CertificateAuthority:
    """Create a plug-in CA layout in ``ca_dir`` and return it loaded.

    With ``intermediate`` (the default) a root signs an intermediate that
    becomes ``ca-cert.pem``; otherwise the root signs workloads directly.
    """
    now = _utc(now)

    def name(cn: str) -> x509.Name:
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                x509.NameAttribute(NameOID.COMMON_NAME, cn),
            ]
        )

    root, root_key = _make_ca_certificate(name(f"{organization} root CA"), now=now, lifetime=lifetime)
    if intermediate:
        ca_cert, ca_key = _make_ca_certificate(
            name(f"{organization} intermediate CA"),
            now=now,
            lifetime=lifetime,
            issuer=root,
            issuer_key=root_key,
            path_length=0,
        )
        write_layout(ca_dir, ca_cert, ca_key, chain=[ca_cert, root], roots=[root])
    else:
        write_layout(ca_dir, root, root_key, chain=[root], roots=[root])
    return CertificateAuthority.load(ca_dir)


# -- renewing cache ------------------------------------------------------------


class CertificateStore:
    """Issues one certificate per identity on first use and renews it at half-life.

    Time comes from ``clock`` (an `IReactorTime`), so `task.Clock` drives it.
    """

    def __init__(
        self,
        ca: CertificateAuthority,
        clock: IReactorTime,
        lifetime: timedelta = DEFAULT_LIFETIME,
    ) -> None:
        self._ca = ca
        self._clock = clock
        self._lifetime = lifetime
        self._certs: dict[SpiffeId, IssuedCertificate] = {}
        self._timers: dict[SpiffeId, IDelayedCall] = {}
        self._subscribers: list[Callable[[IssuedCertificate], object]] = []
        self._stopped = False

    @property
    def ca(self) -> CertificateAuthority:
        return self._ca

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self._clock.seconds(), tz=UTC)

    def get(self, identity: SpiffeId | str) -> IssuedCertificate:
        """The current certificate for ``identity``, issuing one if needed."""
        if isinstance(identity, str):
            identity = SpiffeId.parse(identity)
        current = self._certs.get(identity)
        # Renewal normally happens long before expiry; this covers failed
        # renewals and clock jumps.
        if current is None or current.not_after <= self._now():
            current = self._issue(identity)
        return current

    def all(self) -> list[IssuedCertificate]:
        """Current certificates, sorted by identity (for the admin config dump)."""
        return sorted(self._certs.values(), key=lambda c: str(c.identity))

    def subscribe(self, callback: Callable[[IssuedCertificate], object]) -> Callable[[], None]:
        """Call ``callback(new_cert)`` after each renewal; returns an unsubscribe function."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def discard(self, identity: SpiffeId) -> None:
        """Forget ``identity`` (its workload is gone) and stop renewing it."""
        self._certs.pop(identity, None)
        self._cancel(identity)

    def stop(self) -> None:
        """Cancel all renewal timers; `get` still works but no longer schedules renewals."""
        self._stopped = True
        for identity in list(self._timers):
            self._cancel(identity)

    def _cancel(self, identity: SpiffeId) -> None:
        timer = self._timers.pop(identity, None)
        if timer is not None and timer.active():
            timer.cancel()

    def _issue(self, identity: SpiffeId) -> IssuedCertificate:
        now = self._now()
        issued = self._ca.issue(identity, self._lifetime, now=now)
        self._certs[identity] = issued
        # Renew at half-life, as Istio does.
        self._schedule(identity, (issued.not_after - now) / 2)
        return issued

    def _schedule(self, identity: SpiffeId, delay: timedelta) -> None:
        self._cancel(identity)
        if self._stopped:
            return
        self._timers[identity] = self._clock.callLater(max(delay.total_seconds(), 0.0), self._renew, identity)

    def _renew(self, identity: SpiffeId) -> None:
        self._timers.pop(identity, None)
        try:
            issued = self._issue(identity)
        except Exception:  # a timer callback must not die; retry instead
            log.failure(
                "Renewing the certificate of {identity} failed; retrying in {retry}",
                identity=str(identity),
                retry=RENEWAL_RETRY,
            )
            self._schedule(identity, RENEWAL_RETRY)
            return
        log.info(
            "Renewed the certificate of {identity}, serial {serial}, valid until {not_after}",
            identity=str(identity),
            serial=f"{issued.serial:x}",
            not_after=issued.not_after.isoformat(),
        )
        self._notify_renewal(issued)

    def _notify_renewal(self, issued: IssuedCertificate) -> None:
        for callback in list(self._subscribers):
            try:
                callback(issued)
            except Exception:  # one bad subscriber must not starve the rest
                log.failure(
                    "Certificate renewal subscriber {callback!r} failed",
                    callback=callback,
                )
