import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import attr
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store
from twisted.internet import task
from twisted.logger import globalLogPublisher

from ztwisted.ca import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    CERT_CHAIN_FILE,
    CLOCK_SKEW,
    LAYOUT_FILES,
    ROOT_CERT_FILE,
    CAError,
    CertificateAuthority,
    CertificateStore,
    IssuedCertificate,
    create_files,
)
from ztwisted.identity import SpiffeId, spiffe_ids

CLIENT = SpiffeId("cluster.local", "default", "client")
SERVER = SpiffeId("cluster.local", "default", "server")
NOW = datetime(2030, 5, 17, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def layered_ca(tmp_path) -> CertificateAuthority:
    return create_files(tmp_path / "cacerts", now=NOW - timedelta(days=1))


@pytest.fixture
def dev_ca(tmp_path) -> CertificateAuthority:
    return CertificateAuthority.load_or_create_dev(tmp_path / "state")


def _about(path: Path, message: str) -> str:
    """A pattern for an error message that starts with ``path``."""
    return "^" + re.escape(str(path)) + message


def _verify_client_cert(issued: IssuedCertificate, at: datetime) -> x509.Certificate:
    """Verify ``issued`` as RFC 5280 client cert with cryptography's own verifier."""
    verifier = PolicyBuilder().store(Store(issued.roots())).time(at).build_client_verifier()
    verified = verifier.verify(issued.certificate(), issued.chain())
    return verified.chain[-1]


# -- issuing ---------------------------------------------------------------------


def test_issued_leaf_has_istio_profile(layered_ca):
    issued = layered_ca.issue(CLIENT, now=NOW)
    cert = issued.certificate()

    assert issued.identity == CLIENT
    assert spiffe_ids(cert) == [CLIENT]
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).critical
    assert cert.not_valid_before_utc == NOW - CLOCK_SKEW == issued.not_before
    assert cert.not_valid_after_utc == NOW + timedelta(hours=24) == issued.not_after
    assert issued.serial == cert.serial_number

    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.key_encipherment
    assert not usage.key_cert_sign
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    }
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca

    key = issued.private_key()
    assert key.curve.name == "secp256r1"
    assert key.public_key() == cert.public_key()


def test_leaf_from_intermediate_chains_to_root(layered_ca, tmp_path):
    issued = layered_ca.issue(SERVER, now=NOW)
    chain = issued.chain()
    roots = issued.roots()

    # Istio layout: chain is ca-cert (the intermediate) then the root.
    assert [c.subject for c in chain] == [layered_ca.ca_cert.subject, roots[0].subject]
    assert issued.roots_pem == (tmp_path / "cacerts" / ROOT_CERT_FILE).read_bytes()
    issued.certificate().verify_directly_issued_by(layered_ca.ca_cert)
    assert _verify_client_cert(issued, NOW) == roots[0]


def test_leaf_from_dev_root(dev_ca):
    issued = dev_ca.issue(CLIENT)
    assert issued.chain() == [dev_ca.ca_cert] == issued.roots()
    assert _verify_client_cert(issued, datetime.now(UTC)) == dev_ca.ca_cert


def test_naive_now_is_utc(layered_ca):
    issued = layered_ca.issue(CLIENT, now=NOW.replace(tzinfo=None))
    assert issued.not_after == NOW + timedelta(hours=24)


def test_each_issue_has_fresh_key_and_serial(dev_ca):
    a, b = dev_ca.issue(CLIENT), dev_ca.issue(CLIENT)
    assert a.serial != b.serial
    assert a.key_pem != b.key_pem


def test_leaf_never_outlives_the_ca(tmp_path):
    ca = create_files(tmp_path / "ca", now=NOW, lifetime=timedelta(hours=2))
    issued = ca.issue(CLIENT, lifetime=timedelta(hours=24), now=NOW)
    assert issued.not_after == ca.ca_cert.not_valid_after_utc == NOW + timedelta(hours=2)


def test_expired_ca_refuses_to_issue(tmp_path):
    ca = create_files(tmp_path / "ca", now=NOW, lifetime=timedelta(hours=2))
    with pytest.raises(CAError, match="expired"):
        ca.issue(CLIENT, now=NOW + timedelta(hours=3))


def test_lifetime_must_be_positive(dev_ca):
    with pytest.raises(ValueError, match="lifetime must be positive"):
        dev_ca.issue(CLIENT, lifetime=timedelta(0))


def test_private_key_is_not_in_repr(dev_ca):
    issued = dev_ca.issue(CLIENT)
    assert b"PRIVATE KEY" in issued.key_pem
    assert "PRIVATE KEY" not in repr(issued)


# -- loading -----------------------------------------------------------------------


def test_create_files_writes_istio_layout(tmp_path):
    ca_dir = tmp_path / "cacerts"
    create_files(ca_dir)
    assert sorted(p.name for p in ca_dir.iterdir()) == sorted(LAYOUT_FILES)
    ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT_FILE).read_bytes())
    chain = x509.load_pem_x509_certificates((ca_dir / CERT_CHAIN_FILE).read_bytes())
    root = x509.load_pem_x509_certificate((ca_dir / ROOT_CERT_FILE).read_bytes())
    assert chain == [ca_cert, root]
    assert ca_cert != root
    assert stat.S_IMODE((ca_dir / CA_KEY_FILE).stat().st_mode) == 0o600


def test_load_accepts_chain_without_ca_cert(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    (ca_dir / CERT_CHAIN_FILE).write_bytes((ca_dir / ROOT_CERT_FILE).read_bytes())
    loaded = CertificateAuthority.load(ca_dir)
    assert loaded.chain == [layered_ca.ca_cert, layered_ca.roots[0]]


def test_load_accepts_root_as_ca_cert_with_empty_chain(tmp_path):
    ca_dir = tmp_path / "cacerts"
    create_files(ca_dir, intermediate=False)
    (ca_dir / CERT_CHAIN_FILE).write_bytes(b"")
    loaded = CertificateAuthority.load(ca_dir)
    assert loaded.chain == loaded.roots == [loaded.ca_cert]


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_load_names_missing_file(tmp_path, layered_ca, name):
    ca_dir = tmp_path / "cacerts"
    (ca_dir / name).unlink()
    with pytest.raises(CAError, match=_about(ca_dir / name, ": missing")):
        CertificateAuthority.load(ca_dir)


@pytest.mark.parametrize("name", LAYOUT_FILES)
def test_load_names_unreadable_file(tmp_path, layered_ca, name):
    ca_dir = tmp_path / "cacerts"
    # A directory in place of the file is unreadable even for root.
    (ca_dir / name).unlink()
    (ca_dir / name).mkdir()
    with pytest.raises(CAError, match=_about(ca_dir / name, ": cannot read")):
        CertificateAuthority.load(ca_dir)


@pytest.mark.parametrize("name", [CA_CERT_FILE, CA_KEY_FILE, ROOT_CERT_FILE])
def test_load_names_garbage_file(tmp_path, layered_ca, name):
    ca_dir = tmp_path / "cacerts"
    (ca_dir / name).write_bytes(b"-----BEGIN CERTIFICATE-----\nnot base64!\n")
    with pytest.raises(CAError, match=_about(ca_dir / name, ": not")):
        CertificateAuthority.load(ca_dir)


def test_load_names_empty_root_file(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    (ca_dir / ROOT_CERT_FILE).write_bytes(b"\n")
    with pytest.raises(CAError, match=_about(ca_dir / ROOT_CERT_FILE, ": empty")):
        CertificateAuthority.load(ca_dir)


def test_load_rejects_key_of_another_ca(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    create_files(tmp_path / "other")
    shutil.copy(tmp_path / "other" / CA_KEY_FILE, ca_dir / CA_KEY_FILE)
    with pytest.raises(CAError) as info:
        CertificateAuthority.load(ca_dir)
    assert str(info.value).startswith(f"{ca_dir / CA_KEY_FILE}: private key does not match")
    assert CA_CERT_FILE in str(info.value)


def test_load_rejects_encrypted_key(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    key = serialization.load_pem_private_key((ca_dir / CA_KEY_FILE).read_bytes(), None)
    (ca_dir / CA_KEY_FILE).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(CAError, match=_about(ca_dir / CA_KEY_FILE, ": .*encrypted")):
        CertificateAuthority.load(ca_dir)


def test_load_rejects_chain_from_another_ca(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    create_files(tmp_path / "other")
    shutil.copy(tmp_path / "other" / CERT_CHAIN_FILE, ca_dir / CERT_CHAIN_FILE)
    with pytest.raises(CAError, match=_about(ca_dir / CERT_CHAIN_FILE, ": .* is not signed by")):
        CertificateAuthority.load(ca_dir)


def test_load_rejects_root_that_did_not_issue_the_chain(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    create_files(tmp_path / "other")
    shutil.copy(tmp_path / "other" / ROOT_CERT_FILE, ca_dir / ROOT_CERT_FILE)
    with pytest.raises(CAError, match=_about(ca_dir / ROOT_CERT_FILE, ": no root here issued")):
        CertificateAuthority.load(ca_dir)


def test_load_rejects_leaf_as_ca_cert(tmp_path, layered_ca):
    ca_dir = tmp_path / "cacerts"
    leaf = layered_ca.issue(CLIENT)
    (ca_dir / CA_CERT_FILE).write_bytes(leaf.cert_pem)
    (ca_dir / CA_KEY_FILE).write_bytes(leaf.key_pem)
    with pytest.raises(CAError, match=_about(ca_dir / CA_CERT_FILE, ": not a CA certificate")):
        CertificateAuthority.load(ca_dir)


def test_load_names_missing_directory(tmp_path):
    with pytest.raises(CAError, match=_about(tmp_path / "nope", ": CA directory does not exist")):
        CertificateAuthority.load(tmp_path / "nope")


# -- dev CA --------------------------------------------------------------------------


def test_dev_ca_is_a_self_signed_p256_root(tmp_path, dev_ca):
    root = dev_ca.ca_cert
    assert dev_ca.roots == [root]
    assert root.issuer == root.subject
    root.verify_directly_issued_by(root)
    assert root.public_key().curve.name == "secp256r1"
    constraints = root.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca
    assert root.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    lifetime = root.not_valid_after_utc - root.not_valid_before_utc
    assert timedelta(days=3649) < lifetime < timedelta(days=3651)

    ca_dir = tmp_path / "state" / "ca"
    assert stat.S_IMODE((ca_dir / CA_KEY_FILE).stat().st_mode) == 0o600
    assert CertificateAuthority.load(ca_dir).ca_cert == root


def test_dev_ca_is_created_once_and_reused(tmp_path, dev_ca):
    key_file = tmp_path / "state" / "ca" / CA_KEY_FILE
    before = key_file.stat()
    again = CertificateAuthority.load_or_create_dev(tmp_path / "state")
    assert again.ca_cert == dev_ca.ca_cert
    assert again.roots_pem == dev_ca.roots_pem
    assert key_file.stat().st_ino == before.st_ino
    assert key_file.stat().st_mtime_ns == before.st_mtime_ns


def test_dev_ca_loads_an_existing_plugin_layout(tmp_path):
    plugged = create_files(tmp_path / "state" / "ca")
    loaded = CertificateAuthority.load_or_create_dev(tmp_path / "state")
    assert loaded.ca_cert == plugged.ca_cert
    assert loaded.ca_cert != loaded.roots[0]


def test_dev_ca_refuses_incomplete_directory(tmp_path, dev_ca):
    (tmp_path / "state" / "ca" / ROOT_CERT_FILE).unlink()
    with pytest.raises(CAError, match=f"incomplete CA directory, missing {ROOT_CERT_FILE}"):
        CertificateAuthority.load_or_create_dev(tmp_path / "state")


def test_dev_ca_created_by_racing_threads_is_shared(tmp_path):
    results: list[bytes] = []
    barrier = threading.Barrier(4)

    def start() -> None:
        barrier.wait()
        results.append(CertificateAuthority.load_or_create_dev(tmp_path / "s").roots_pem)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == 4
    assert len(set(results)) == 1


def test_dev_ca_created_by_racing_processes_is_shared(tmp_path):
    script = (
        "import sys, time\n"
        "from ztwisted.ca import CertificateAuthority\n"
        "from cryptography.hazmat.primitives import hashes\n"
        "while time.time() < float(sys.argv[2]): pass\n"
        "ca = CertificateAuthority.load_or_create_dev(sys.argv[1])\n"
        "sys.stdout.write(ca.ca_cert.fingerprint(hashes.SHA256()).hex())\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    start_at = str(time.time() + 1.5)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "s"), start_at],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err.decode()
    fingerprints = {out for out, _err in outputs}
    assert len(fingerprints) == 1
    on_disk = CertificateAuthority.load(tmp_path / "s" / "ca").ca_cert
    assert fingerprints == {on_disk.fingerprint(hashes.SHA256()).hex().encode()}


# -- CertificateStore -----------------------------------------------------------------


@pytest.fixture
def clock() -> task.Clock:
    clock = task.Clock()
    clock.advance(NOW.timestamp())
    return clock


def test_store_issues_on_first_use_and_caches(layered_ca, clock):
    store = CertificateStore(layered_ca, clock)
    first = store.get(CLIENT)
    assert first.not_before == NOW - CLOCK_SKEW
    assert first.not_after == NOW + timedelta(hours=24)
    assert store.get(CLIENT) is first
    assert store.get(str(CLIENT)) is first
    other = store.get(SERVER)
    assert other.identity == SERVER and other is not first
    assert store.all() == [first, other]
    store.stop()


def test_store_renews_at_half_life(layered_ca, clock):
    store = CertificateStore(layered_ca, clock, lifetime=timedelta(hours=24))
    renewed: list[IssuedCertificate] = []
    store.subscribe(renewed.append)
    first = store.get(CLIENT)

    clock.advance(timedelta(hours=12).total_seconds() - 1)
    assert store.get(CLIENT) is first
    assert renewed == []

    clock.advance(1)
    second = store.get(CLIENT)
    assert second is not first
    assert second.serial != first.serial
    assert second.not_before == NOW + timedelta(hours=12) - CLOCK_SKEW
    assert second.not_after == NOW + timedelta(hours=36)
    assert renewed == [second]

    clock.advance(timedelta(hours=12).total_seconds())
    assert renewed[-1] is store.get(CLIENT)
    assert len(renewed) == 2
    assert len(clock.getDelayedCalls()) == 1
    store.stop()


def test_store_stop_cancels_timers(layered_ca, clock):
    store = CertificateStore(layered_ca, clock)
    store.get(CLIENT)
    store.get(SERVER)
    assert len(clock.getDelayedCalls()) == 2
    store.stop()
    assert clock.getDelayedCalls() == []


def test_store_replaces_an_expired_certificate_on_get(layered_ca, clock):
    store = CertificateStore(layered_ca, clock, lifetime=timedelta(hours=1))
    first = store.get(CLIENT)
    store.stop()  # no renewals: the cached one expires
    clock.advance(timedelta(hours=2).total_seconds())
    fresh = store.get(CLIENT)
    assert fresh is not first
    assert fresh.not_after == NOW + timedelta(hours=3)


def test_store_discard_forgets_identity(layered_ca, clock):
    store = CertificateStore(layered_ca, clock)
    store.get(CLIENT)
    store.discard(CLIENT)
    assert store.all() == []
    assert clock.getDelayedCalls() == []


@attr.s
class FlakyCA:
    """Wraps a real CA and fails the next ``failures`` issues."""

    ca: CertificateAuthority = attr.ib()
    failures: int = attr.ib(default=0)

    def issue(self, identity, lifetime, now=None):
        if self.failures:
            self.failures -= 1
            raise CAError("signing service unavailable")
        return self.ca.issue(identity, lifetime, now=now)


def test_store_retries_failed_renewal(layered_ca, clock):
    events = []
    globalLogPublisher.addObserver(events.append)
    try:
        flaky = FlakyCA(layered_ca)
        store = CertificateStore(flaky, clock)
        first = store.get(CLIENT)
        flaky.failures = 1
        clock.advance(timedelta(hours=12).total_seconds())
        assert store.get(CLIENT) is first  # still valid, kept
        assert any(
            "Renewing the certificate" in e.get("log_format", "")
            and "signing service unavailable" in str(e.get("log_failure"))
            for e in events
        )
        clock.advance(60)
        assert store.get(CLIENT) is not first
        store.stop()
    finally:
        globalLogPublisher.removeObserver(events.append)


def test_failing_subscriber_does_not_starve_others(layered_ca, clock):
    store = CertificateStore(layered_ca, clock)
    seen = []

    def broken(_issued):
        raise RuntimeError("subscriber bug")

    store.subscribe(broken)
    store.subscribe(seen.append)
    store.get(CLIENT)
    clock.advance(timedelta(hours=12).total_seconds())
    assert len(seen) == 1
    store.stop()


def test_unsubscribe(layered_ca, clock):
    store = CertificateStore(layered_ca, clock)
    seen = []
    unsubscribe = store.subscribe(seen.append)
    store.get(CLIENT)
    unsubscribe()
    clock.advance(timedelta(hours=12).total_seconds())
    assert seen == []
    store.stop()
