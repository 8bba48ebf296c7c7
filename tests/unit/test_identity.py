from datetime import UTC, datetime, timedelta

import attrs
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from OpenSSL import crypto

from ztwisted.identity import (
    DEFAULT_TRUST_DOMAIN,
    InvalidSpiffeId,
    SpiffeId,
    spiffe_ids,
    uri_sans,
)


def test_str_has_istio_shape():
    identity = SpiffeId("example.org", "default", "client")
    assert str(identity) == "spiffe://example.org/ns/default/sa/client"


def test_the_uri_built_once_takes_no_part_in_comparisons():
    identity = SpiffeId("example.org", "default", "client")
    same = SpiffeId.parse("spiffe://example.org/ns/default/sa/client")
    assert identity == same and hash(identity) == hash(same)
    assert identity < SpiffeId("example.org", "default", "server")
    assert repr(identity) == "SpiffeId(trust_domain='example.org', namespace='default', service_account='client')"
    # A changed copy gets its own URI.
    assert str(attrs.evolve(identity, namespace="shop")) == "spiffe://example.org/ns/shop/sa/client"


def test_parse_round_trips():
    uri = "spiffe://cluster.local/ns/kube-system/sa/my_sa.v1"
    identity = SpiffeId.parse(uri)
    assert identity == SpiffeId("cluster.local", "kube-system", "my_sa.v1")
    assert str(identity) == uri


def test_empty_trust_domain_means_cluster_local():
    assert DEFAULT_TRUST_DOMAIN == "cluster.local"
    parsed = SpiffeId.parse("spiffe:///ns/default/sa/client")
    assert parsed.trust_domain == "cluster.local"
    assert SpiffeId("", "default", "client") == parsed
    assert str(parsed) == "spiffe://cluster.local/ns/default/sa/client"


def test_ids_are_hashable_values():
    a = SpiffeId("td", "ns1", "sa1")
    assert {a, SpiffeId("td", "ns1", "sa1")} == {a}
    with pytest.raises(AttributeError):
        a.namespace = "other"


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "cluster.local/ns/default/sa/client",
        "http://cluster.local/ns/default/sa/client",
        "SPIFFE://cluster.local/ns/default/sa/client",
        "spiffe://cluster.local",
        "spiffe://cluster.local/ns/default",
        "spiffe://cluster.local/ns/default/sa",
        "spiffe://cluster.local/ns/default/sa/",
        "spiffe://cluster.local/ns//sa/client",
        "spiffe://cluster.local/namespace/default/sa/client",
        "spiffe://cluster.local/ns/default/serviceaccount/client",
        "spiffe://cluster.local/ns/default/sa/client/extra",
        "spiffe://cluster.local/ns/default/sa/client/",
        "spiffe://cluster.local/ns/de fault/sa/client",
        "spiffe://cluster.local/ns/default/sa/client?x=1",
        "spiffe://cluster.local/ns/default/sa/client#frag",
        "spiffe://cluster.local/ns/../sa/client",
        "spiffe://user@cluster.local/ns/default/sa/client",
        "spiffe://cluster.local:443/ns/default/sa/client",
    ],
)
def test_parse_rejects_anything_else(uri):
    with pytest.raises(InvalidSpiffeId) as info:
        SpiffeId.parse(uri)
    message = str(info.value)
    assert repr(uri) in message
    assert isinstance(info.value, ValueError)


def test_parse_error_says_what_shape_is_expected():
    with pytest.raises(InvalidSpiffeId, match=r"expected spiffe://<trust-domain>/ns/"):
        SpiffeId.parse("spiffe://cluster.local/ns/default")


def test_parse_error_names_the_bad_part():
    with pytest.raises(InvalidSpiffeId, match="service account must not be empty"):
        SpiffeId.parse("spiffe://cluster.local/ns/default/sa/")
    with pytest.raises(InvalidSpiffeId, match="namespace 'a b'"):
        SpiffeId.parse("spiffe://cluster.local/ns/a b/sa/x")


def test_parse_rejects_non_strings():
    with pytest.raises(InvalidSpiffeId, match="must be a string"):
        SpiffeId.parse(b"spiffe://cluster.local/ns/default/sa/client")


def test_constructor_validates_parts():
    with pytest.raises(InvalidSpiffeId, match="namespace"):
        SpiffeId("cluster.local", "", "client")
    with pytest.raises(InvalidSpiffeId, match="service account"):
        SpiffeId("cluster.local", "default", "a/b")


def _certificate(sans: list[x509.GeneralName] | None) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test")])
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + timedelta(hours=1))
    )
    if sans is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256())


MIXED_SANS = [
    x509.DNSName("echo.default.svc"),
    x509.UniformResourceIdentifier("spiffe://cluster.local/ns/default/sa/server"),
    x509.UniformResourceIdentifier("https://example.com/not-spiffe"),
    x509.UniformResourceIdentifier("spiffe://other.td/ns/prod/sa/api"),
]


def test_uri_sans_of_cryptography_certificate():
    assert uri_sans(_certificate(MIXED_SANS)) == [
        "spiffe://cluster.local/ns/default/sa/server",
        "https://example.com/not-spiffe",
        "spiffe://other.td/ns/prod/sa/api",
    ]


def test_uri_sans_of_pyopenssl_certificate():
    cert = crypto.X509.from_cryptography(_certificate(MIXED_SANS))
    assert uri_sans(cert)[0] == "spiffe://cluster.local/ns/default/sa/server"


def test_spiffe_ids_keeps_only_parseable_ones():
    assert spiffe_ids(_certificate(MIXED_SANS)) == [
        SpiffeId("cluster.local", "default", "server"),
        SpiffeId("other.td", "prod", "api"),
    ]


def test_certificate_without_san_has_no_identities():
    cert = _certificate(None)
    assert uri_sans(cert) == []
    assert spiffe_ids(cert) == []


def test_uri_sans_rejects_non_certificates():
    with pytest.raises(TypeError, match="expected a certificate"):
        uri_sans(b"-----BEGIN CERTIFICATE-----")
