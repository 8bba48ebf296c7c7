"""xDS resources <-> model, the client's state machine, settings and the CA client's checks (no network)."""

from __future__ import annotations

import itertools
import time
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from ztwisted.ca import create_files
from ztwisted.config import builtin_example_path, load_config, parse_config
from ztwisted.identity import SpiffeId
from ztwisted.model import Mesh
from ztwisted.xds import ca_pb2, discovery_pb2, workload_pb2
from ztwisted.xds.certificates import certificate_from_response, make_csr
from ztwisted.xds.client import NodeInfo, XdsState
from ztwisted.xds.resources import ADDRESS_TYPE, AUTHORIZATION_TYPE, mesh_resources
from ztwisted.xds.settings import parse_duration


def response(type_url, resources, removed=(), nonce="1"):
    message = discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce=nonce, removed_resources=list(removed))
    for name, resource in resources.items():
        added = message.resources.add(name=name, version=str(hash(resource.SerializeToString())))
        added.resource.Pack(resource)
    return message


def test_the_example_mesh_survives_the_trip_through_xds_resources():
    mesh = load_config(builtin_example_path())
    state = XdsState()
    for type_url, resources in mesh_resources(mesh).items():
        _, rejected = state.apply(response(type_url, resources))
        assert rejected == []
    assert state.mesh().workloads == tuple(sorted(mesh.workloads, key=lambda w: w.uid))
    assert set(state.mesh().services) == set(mesh.services)
    assert set(state.mesh().policies) == set(mesh.policies)


def test_an_invalid_resource_is_rejected_and_its_last_good_version_stays():
    mesh = load_config(builtin_example_path())
    addresses = mesh_resources(mesh)[ADDRESS_TYPE]
    state = XdsState()
    state.apply(response(ADDRESS_TYPE, addresses))
    uid = mesh.workloads[0].uid
    broken = workload_pb2.Address()
    broken.CopyFrom(addresses[uid])
    broken.workload.addresses[:] = [b"\x01\x02\x03"]
    broken.workload.canonical_name = "changed"
    other = mesh.workloads[1]
    good = workload_pb2.Address()
    good.CopyFrom(addresses[other.uid])
    good.workload.canonical_name = "changed"
    mesh_after, rejected = state.apply(response(ADDRESS_TYPE, {uid: broken, other.uid: good}, nonce="2"))
    assert rejected == [f"workload {uid!r}: addresses[0]: 3 bytes is not an IPv4 (4) or IPv6 (16) address"]
    assert mesh_after.workload_by_uid(uid) == mesh.workloads[0]
    assert mesh_after.workload_by_uid(other.uid).canonical_name == "changed"


def test_unsupported_features_and_conflicts_are_named():
    state = XdsState()
    waypoint = workload_pb2.Address(workload=workload_pb2.Workload(uid="c//v1/Pod/ns/a", name="a", namespace="ns"))
    waypoint.workload.waypoint.hbone_mtls_port = 15008
    _, rejected = state.apply(response(ADDRESS_TYPE, {"c//v1/Pod/ns/a": waypoint}))
    assert rejected == ["workload 'c//v1/Pod/ns/a': waypoint is not supported by ztwisted"]
    # A uid is the one thing two workloads may not share (the model's rule): the later resource is rejected.
    same_uid = {
        f"name-{n}": workload_pb2.Address(
            workload=workload_pb2.Workload(
                uid="c//v1/Pod/ns/a", name="a", namespace="ns", addresses=[bytes([10, 0, 0, n])]
            )
        )
        for n in (1, 2)
    }
    mesh, rejected = state.apply(response(ADDRESS_TYPE, same_uid))
    assert rejected == ["name-2: workload uid 'c//v1/Pod/ns/a' is already name-1's"]
    assert [str(w.workload_ips[0]) for w in mesh.workloads] == ["10.0.0.1"]


def test_xds_accepts_the_shared_addresses_the_local_config_accepts():
    """Workloads sharing an address and services of different namespaces sharing a VIP, as ztunnel allows:
    the same mesh is accepted from a file and over xDS, and chooses the same way."""
    text = """
workloads:
- {uid: "c//v1/Pod/ns/a", name: a, namespace: ns, workloadIps: ["10.0.0.1"]}
- {uid: "c//v1/Pod/ns/b", name: b, namespace: ns, workloadIps: ["10.0.0.1"], protocol: HBONE}
services:
- {name: web, namespace: one, hostname: web.one.svc.cluster.local, vips: ["/10.96.0.1"], ports: {80: 8080}}
- {name: web, namespace: two, hostname: web.two.svc.cluster.local, vips: ["/10.96.0.1"], ports: {80: 8080}}
"""
    local = parse_config(text, "mesh.yaml")
    state = XdsState()
    over_xds, rejected = state.apply(response(ADDRESS_TYPE, mesh_resources(local)[ADDRESS_TYPE]))
    assert rejected == []
    assert {w.uid for w in over_xds.workloads} == {"c//v1/Pod/ns/a", "c//v1/Pod/ns/b"}
    assert {s.key for s in over_xds.services} == {"one/web.one.svc.cluster.local", "two/web.two.svc.cluster.local"}
    assert over_xds.workload_by_ip("10.0.0.1").uid == local.workload_by_ip("10.0.0.1").uid == "c//v1/Pod/ns/b"
    for namespace in ("one", "two"):
        assert over_xds.service_by_vip("10.96.0.1", namespace).key == local.service_by_vip("10.96.0.1", namespace).key
        assert local.service_by_vip("10.96.0.1", namespace).namespace == namespace
    # One rule in one place: a duplicate service key is what both refuse.
    twin = workload_pb2.Address()
    twin.CopyFrom(mesh_resources(local)[ADDRESS_TYPE]["one/web.one.svc.cluster.local"])
    _, rejected = state.apply(response(ADDRESS_TYPE, {"another-name": twin}, nonce="2"))
    assert rejected == [
        "another-name: service 'one/web.one.svc.cluster.local' is already one/web.one.svc.cluster.local's"
    ]
    with pytest.raises(ValueError, match="duplicate service 'one/web.one.svc.cluster.local'"):
        Mesh(services=[local.services[0], local.services[0]])


def test_removals_and_unknown_types():
    mesh = load_config(builtin_example_path())
    state = XdsState()
    state.apply(response(AUTHORIZATION_TYPE, mesh_resources(mesh)[AUTHORIZATION_TYPE]))
    key = mesh.policies[0].key
    after, rejected = state.apply(response(AUTHORIZATION_TYPE, {}, removed=[key]))
    assert rejected == [] and after.policy(key) is None and key not in state.versions[AUTHORIZATION_TYPE]
    _, rejected = state.apply(response("type.googleapis.com/other.Thing", {}))
    assert "not one ztwisted subscribed to" in rejected[0]


def test_node_metadata_is_shaped_like_ztunnels():
    node = NodeInfo(
        instance_ip="10.0.0.5",
        pod_name="zt-1",
        pod_namespace="istio-system",
        node_name="w1",
        metadata={"CLUSTER_ID": "c1"},
    ).to_proto()
    assert node.id == "ztunnel~10.0.0.5~zt-1.istio-system~istio-system.svc.cluster.local"
    assert dict(node.metadata) == {
        "NAME": "zt-1",
        "NAMESPACE": "istio-system",
        "INSTANCE_IPS": "10.0.0.5",
        "NODE_NAME": "w1",
        "CLUSTER_ID": "c1",
    }


@pytest.mark.parametrize(("text", "seconds"), [("24h", 86400), ("1h30m", 5400), ("500ms", 0.5), ("30", 30)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_durations_reject_nonsense():
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def pem(certificate) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode()


def test_a_csr_names_only_the_identity_and_the_answer_is_checked(tmp_path):
    ca = create_files(tmp_path / "ca")
    identity = SpiffeId("cluster.local", "default", "client")
    csr_pem, key_pem = make_csr(identity)
    csr = x509.load_pem_x509_csr(csr_pem)
    sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(n.value) for n in sans] == [str(identity)] and len(csr.subject) == 0
    leaf = ca.sign_csr(csr, timedelta(hours=1))
    answer = ca_pb2.IstioCertificateResponse(cert_chain=[pem(leaf)] + [pem(c) for c in ca.chain])
    issued = certificate_from_response(identity, key_pem, answer)
    assert str(issued.identity) == str(identity) and issued.roots() == [ca.roots[0]]
    with pytest.raises(ValueError, match="not spiffe://cluster.local/ns/default/sa/other"):
        certificate_from_response(SpiffeId("cluster.local", "default", "other"), key_pem, answer)
    _, other_key = make_csr(identity)
    with pytest.raises(ValueError, match="different public key"):
        certificate_from_response(identity, other_key, answer)
    with pytest.raises(ValueError, match="a leaf and at least the root"):
        certificate_from_response(identity, key_pem, ca_pb2.IstioCertificateResponse(cert_chain=[pem(leaf)]))


# -- gRPC framing and the client's reconnects -----------------------------------------------------


class FakeStream:
    """What GrpcCall needs of an h2 stream: headers, a response Deferred, writes, resets."""

    def __init__(self, headers=None):
        from twisted.internet import defer

        self.headers = dict(headers or {})
        self.response = defer.Deferred()
        self.written: list[bytes] = []
        self.eof = False
        self.was_reset = False
        self.partner = None
        self.connection = type("C", (), {"ended_by": None})()

    def set_partner(self, partner):
        self.partner = partner

    def write(self, data):
        self.written.append(data)

    def write_eof(self):
        self.eof = True

    def reset(self):
        self.was_reset = True


def test_grpc_messages_are_unframed_across_and_within_writes():
    from ztwisted.xds.grpc import GrpcCall, frame

    received = []
    stream = FakeStream()
    call = GrpcCall(stream, "/x.Y/Z", received.append)
    stream.response.callback(stream)
    data = frame(b"first") + frame(b"") + frame(b"third message")
    stream.partner.write(data[:3])
    stream.partner.write(data[3:12])
    stream.partner.write(data[12:])
    assert received == [b"first", b"", b"third message"]
    call.send(b"out")
    assert stream.written == [b"\x00\x00\x00\x00\x03out"]
    stream.headers.update({"grpc-status": "0"})
    stream.partner.write_eof()
    assert call.done.called


@pytest.mark.parametrize(
    ("headers", "data", "code", "text"),
    [
        ({"grpc-status": "16", "grpc-message": "no%20token"}, b"", 16, "no token"),
        ({}, b"", 2, "without grpc-status"),
        ({"grpc-status": "0"}, b"\x00\x00\x00\x00\x09half", 13, "inside a message"),
        ({"grpc-status": "0"}, b"\x01\x00\x00\x00\x01z", 13, "compressed"),
        ({"grpc-status": "0"}, b"\x00\xff\xff\xff\xff", 13, "over the"),
    ],
)
def test_grpc_call_failures_say_why(headers, data, code, text):
    from ztwisted.xds.grpc import GrpcCall, GrpcError

    stream = FakeStream()
    call = GrpcCall(stream, "/x.Y/Z", lambda message: None)
    stream.response.callback(stream)
    stream.headers.update(headers)
    if data:
        stream.partner.write(data)
    if not call.done.called:
        stream.partner.write_eof()
    failure = []
    call.done.addErrback(failure.append)
    assert failure[0].check(GrpcError)
    assert failure[0].value.code == code and text in str(failure[0].value)


def test_the_client_backs_off_with_jitter_and_keeps_its_state(monkeypatch):
    import random

    from twisted.internet import defer, task

    from ztwisted.xds import client as client_module
    from ztwisted.xds.client import MAX_BACKOFF, XdsClient
    from ztwisted.xds.grpc import Target

    clock = task.Clock()
    attempts = []

    def refuse(reactor, target, timeout):
        attempts.append(clock.seconds())
        return defer.fail(ConnectionRefusedError("nobody there"))

    monkeypatch.setattr(client_module.grpc, "connect", refuse)
    meshes = []
    xds = XdsClient(
        clock, Target("127.0.0.1", 15012, None), node=NodeInfo(), on_mesh=meshes.append, random=random.Random(7)
    )
    xds.startService()
    while len(attempts) < 14:
        (retry,) = clock.getDelayedCalls()
        clock.advance(retry.getTime() - clock.seconds())
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(attempts) > 5
    # each wait is between half and all of a doubling bound, capped at 15 s
    for n, gap in enumerate(gaps, start=1):
        bound = min(MAX_BACKOFF, 0.01 * 2**n)
        assert bound / 2 <= gap <= bound + 1e-9
    assert gaps[-1] >= MAX_BACKOFF / 2
    # jittered: not every proxy waits the same share of the bound
    assert len({round(gap / min(MAX_BACKOFF, 0.01 * 2**n), 6) for n, gap in enumerate(gaps, start=1)}) > 1
    assert not xds.ready() and xds.pending() == ["xDS istio.security.Authorization", "xDS istio.workload.Address"]
    assert "nobody there" in xds.status()["last_error"]
    xds.stopService()


def test_the_ca_client_requests_local_identities_renews_at_half_life_and_forgets_the_rest(tmp_path, monkeypatch):
    from twisted.internet import defer, task

    from ztwisted.xds import certificates as certificates_module
    from ztwisted.xds.certificates import CertificateUnavailable, RemoteCertificateStore
    from ztwisted.xds.grpc import Target

    ca = create_files(tmp_path / "ca")
    clock = task.Clock()
    clock.advance(time.time())
    pending: list[tuple[bytes, defer.Deferred]] = []
    monkeypatch.setattr(
        certificates_module.grpc,
        "connect",
        lambda reactor, target, timeout: defer.succeed(
            type("Connection", (), {"usable": True, "drain": lambda self, graceful: None})()
        ),
    )

    def unary(connection, method, request, metadata):
        answer = defer.Deferred()
        pending.append((request, answer))
        return answer

    monkeypatch.setattr(certificates_module.grpc, "unary", unary)

    def answer(index: int, lifetime: float = 3600) -> None:
        request, deferred = pending[index]
        csr = x509.load_pem_x509_csr(ca_pb2.IstioCertificateRequest.FromString(request).csr.encode())
        leaf = ca.sign_csr(csr, timedelta(seconds=lifetime), now=datetime.fromtimestamp(clock.seconds(), tz=UTC))
        deferred.callback(
            ca_pb2.IstioCertificateResponse(cert_chain=[pem(leaf)] + [pem(c) for c in ca.chain]).SerializeToString()
        )

    store = RemoteCertificateStore(clock, Target("127.0.0.1", 15012, None), secret_ttl=3600)
    a, b = SpiffeId("cluster.local", "ns", "a"), SpiffeId("cluster.local", "ns", "b")
    store.keep_only({a})
    assert len(pending) == 1 and store.missing({a}) == [a]
    with pytest.raises(CertificateUnavailable, match="in flight"):
        store.get(a)
    answer(0)
    first = store.get(a)
    assert store.missing({a}) == []
    renewed = []
    store.subscribe(renewed.append)
    clock.advance(1800 + 1)
    assert len(pending) == 2
    assert store.get(a) is first, "the old certificate serves until the new one arrives"
    answer(1)
    assert renewed == [store.get(a)] and store.get(a).serial != first.serial
    store.keep_only({b})
    assert len(pending) == 3 and store.all() == []
    clock.advance(3600)
    assert len(pending) == 3, "a is no longer renewed"
    store.stop()


def test_the_control_planes_help_says_it_is_a_lab_tool_and_lists_its_api(capsys):
    from ztwisted.tools.control_plane import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "LAB AND TEST control plane, NOT for production" in text
    assert "DELETE /workloads/NAME" in text and "CreateCertificate" in text


def test_call_headers_carry_the_token_the_cluster_id_and_the_prefixed_variables(tmp_path):
    from ztwisted.xds.settings import _headers

    options = {"auth-token": "static-token", "cluster-id": "c1"}
    environ = {"XDS_HEADER_X_TENANT": "t1", "CA_HEADER_OTHER": "no"}
    assert _headers(options, "XDS_HEADER_", environ)() == [
        ("x_tenant", "t1"),
        ("authorization", "Bearer static-token"),
        ("clusterid", "c1"),
    ]
    token = tmp_path / "istio-token"
    token.write_text("first\n")
    headers = _headers({"auth-token": str(token), "cluster-id": "c1"}, "CA_HEADER_", environ)
    assert headers() == [("other", "no"), ("authorization", "Bearer first"), ("clusterid", "c1")]
    token.write_text("rotated")
    assert ("authorization", "Bearer rotated") in headers(), "the file is read for every connection"
    token.write_text("")
    with pytest.raises(OSError, match="empty"):
        headers()


def _options(tmp_path, *args):
    from ztwisted import tap

    parsed = tap.Options()
    parsed.parseOptions(["--state-dir", str(tmp_path / "state"), *args])
    return parsed


def test_ztunnels_variables_become_the_xds_options_and_xds_mode_holds_no_ca_key(tmp_path, monkeypatch):
    from twisted.internet.testing import MemoryReactorClock

    from ztwisted import tap
    from ztwisted.xds.certificates import RemoteCertificateStore

    for name in ("LOCAL_XDS_PATH", "CA_ADDRESS", "ISTIO_META_CLUSTER_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDS_ADDRESS", "https://istiod.istio-system.svc:15012")
    monkeypatch.setenv("CLUSTER_ID", "c7")
    monkeypatch.setenv("SECRET_TTL", "90m")
    parsed = _options(tmp_path)
    assert parsed["xds-address"] == parsed["ca-address"] == "https://istiod.istio-system.svc:15012"
    assert (parsed["cluster-id"], parsed["secret-ttl"]) == ("c7", 5400)
    assert parsed.certificate_authority is None and parsed.mesh.workloads == ()
    proxy = tap.makeService(parsed, MemoryReactorClock()).proxy
    assert isinstance(proxy.node.context.certificates, RemoteCertificateStore)
    assert "xDS istio.workload.Address" in proxy.readiness.readiness()
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").rglob("*key*"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--xds-address", "http://plain:15010"), "TLS is required"),
        (("--xds-address", "https://a:1", "--config", builtin_example_path()), "exclude each other"),
        (("--ca-address", "https://a:1", "--ca-dir", "/nonexistent"), "exclude each other"),
        (("--secret-ttl", "soon"), "not a duration"),
    ],
)
def test_xds_option_mistakes_are_usage_errors(tmp_path, monkeypatch, args, message):
    from twisted.python import usage

    for name in ("XDS_ADDRESS", "CA_ADDRESS", "LOCAL_XDS_PATH", "SECRET_TTL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(usage.UsageError, match=message):
        _options(tmp_path, *args)


def test_host_network_pods_sharing_their_nodes_address_are_accepted():
    state = XdsState()
    pods = {}
    for name in ("a", "b"):
        uid = f"c//v1/Pod/kube-system/{name}"
        pods[uid] = workload_pb2.Address(
            workload=workload_pb2.Workload(
                uid=uid,
                name=name,
                namespace="kube-system",
                addresses=[bytes([10, 0, 0, 9])],
                network_mode=workload_pb2.HOST_NETWORK,
            )
        )
    mesh, rejected = state.apply(response(ADDRESS_TYPE, pods))
    assert rejected == [] and {w.name for w in mesh.workloads} == {"a", "b"}
    assert mesh.workload_by_ip("10.0.0.9") is None


def test_grpc_metadata_is_normalized_and_the_token_never_indexed():
    # Unlike an HBONE connection's own headers, a gRPC call's metadata comes from the
    # environment: a token with a trailing newline must not reach the wire as it is.
    from hpack import Decoder, NeverIndexedHeaderTuple
    from hyperframe.frame import HeadersFrame
    from twisted.internet import task
    from twisted.internet.testing import StringTransport

    from ztwisted.xds.grpc import GrpcConnection

    from .h2_support import parse_frames

    conn = GrpcConnection(clock=task.Clock(), authority="istiod.istio-system.svc:15012")
    transport = StringTransport()
    conn.makeConnection(transport)
    conn.handshakeCompleted()
    transport.clear()
    conn.call("/x.Y/Z", [("authorization", "Bearer tok123\n"), ("x-tenant", " t1 ")], lambda message: None)
    (frame,) = [f for f in parse_frames(transport.value()) if isinstance(f, HeadersFrame)]
    decoded = dict(Decoder().decode(frame.data, raw=False))
    assert decoded["authorization"] == "Bearer tok123" and decoded["x-tenant"] == "t1"
    (token,) = [h for h in Decoder().decode(frame.data, raw=False) if h[0] == "authorization"]
    assert isinstance(token, NeverIndexedHeaderTuple)
