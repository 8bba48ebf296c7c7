"""SPIFFE workload identities and reading them out of certificates."""

from __future__ import annotations

import re

import attrs
from cryptography import x509
from OpenSSL import crypto

DEFAULT_TRUST_DOMAIN = "cluster.local"

_SCHEME = "spiffe://"
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_SHAPE = "spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>"


class InvalidSpiffeId(ValueError):
    """A string is not a SPIFFE ID of the shape Istio uses."""


def _check_segment(what: str, value: str) -> None:
    if not value:
        raise InvalidSpiffeId(f"{what} must not be empty")
    if not _SEGMENT.fullmatch(value) or value in (".", ".."):
        raise InvalidSpiffeId(f"{what} {value!r} may only contain letters, digits, '.', '-' and '_'")


def _trust_domain(value: str) -> str:
    # Istio treats an empty trust domain as the Kubernetes default.
    return value or DEFAULT_TRUST_DOMAIN


@attrs.frozen(order=True)
class SpiffeId:
    """``spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>``."""

    trust_domain: str = attrs.field(converter=_trust_domain)
    namespace: str = attrs.field()
    service_account: str = attrs.field()
    # The URI, built once: a connection writes its identities into its labels and log line
    # several times, and identities are shared (``model.Workload.identity``).
    _uri: str = attrs.field(init=False, eq=False, order=False, hash=False, repr=False)

    @trust_domain.validator
    def _check_trust_domain(self, _attribute, value: str) -> None:
        _check_segment("trust domain", value)

    @namespace.validator
    def _check_namespace(self, _attribute, value: str) -> None:
        _check_segment("namespace", value)

    @service_account.validator
    def _check_service_account(self, _attribute, value: str) -> None:
        _check_segment("service account", value)

    @_uri.default
    def _build_uri(self) -> str:
        return f"{_SCHEME}{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"

    def __str__(self) -> str:
        return self._uri

    @classmethod
    def parse(cls, uri: str) -> SpiffeId:
        """Parse ``uri``; raise `InvalidSpiffeId` unless it has exactly the Istio shape."""
        if not isinstance(uri, str):
            raise InvalidSpiffeId(f"SPIFFE ID must be a string, not {type(uri).__name__}")
        if not uri.startswith(_SCHEME):
            raise InvalidSpiffeId(f"{uri!r} is not a SPIFFE ID: expected {_SHAPE}")
        parts = uri[len(_SCHEME) :].split("/")
        if len(parts) != 5 or parts[1] != "ns" or parts[3] != "sa":
            raise InvalidSpiffeId(f"{uri!r} is not a SPIFFE ID: expected {_SHAPE}")
        try:
            return cls(parts[0], parts[2], parts[4])
        except InvalidSpiffeId as e:
            raise InvalidSpiffeId(f"{uri!r} is not a valid SPIFFE ID: {e}") from None


def _as_cryptography(cert: crypto.X509 | x509.Certificate) -> x509.Certificate:
    if isinstance(cert, crypto.X509):
        return cert.to_cryptography()
    if isinstance(cert, x509.Certificate):
        return cert
    raise TypeError(f"expected a certificate, got {type(cert).__name__}")


def uri_sans(cert: crypto.X509 | x509.Certificate) -> list[str]:
    """The URI subject alternative names of ``cert``, in certificate order."""
    try:
        san = _as_cryptography(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return san.value.get_values_for_type(x509.UniformResourceIdentifier)


def spiffe_ids(cert: crypto.X509 | x509.Certificate) -> list[SpiffeId]:
    """The URI SANs of ``cert`` that are well-formed SPIFFE IDs."""
    ids = []
    for uri in uri_sans(cert):
        try:
            ids.append(SpiffeId.parse(uri))
        except InvalidSpiffeId:
            continue
    return ids
