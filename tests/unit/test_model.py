"""The mesh model: construction, lookups, service resolution, reload diffs."""

from ipaddress import ip_address

import attrs
import pytest

from ztwisted.identity import SpiffeId
from ztwisted.model import (
    Destination,
    FrozenMap,
    Match,
    Mesh,
    Service,
    StringMatch,
    Workload,
    diff,
    parse_ip,
)

ECHO_KEY = "default/echo.default.svc.cluster.local"


def workload(name, ip, *, node="node-b", services=None, **kw):
    ips = ip if isinstance(ip, (list, tuple)) else [ip]
    return Workload(
        uid=f"Kubernetes//v1/Pod/default/{name}",
        name=name,
        namespace=kw.pop("namespace", "default"),
        service_account=kw.pop("service_account", name),
        workload_ips=ips,
        protocol="HBONE",
        node=node,
        services=services or {},
        **kw,
    )


def echo_service(**kw):
    kw.setdefault("ports", {80: 8080, 443: 8443})
    return Service(
        name="echo",
        namespace="default",
        hostname="echo.default.svc.cluster.local",
        vips=[("", "127.10.0.1")],
        **kw,
    )


def mesh_with(*workloads, services=None, policies=()):
    return Mesh(workloads, services if services is not None else [echo_service()], policies)


def test_workload_identity_is_a_spiffe_id():
    w = workload("echo", "127.0.3.1", trust_domain="example.org")
    assert w.identity == SpiffeId("example.org", "default", "echo")
    assert str(w.identity) == "spiffe://example.org/ns/default/sa/echo"


def test_workload_identity_with_empty_trust_domain_is_cluster_local():
    w = workload("echo", "127.0.3.1", trust_domain="")
    assert str(w.identity) == "spiffe://cluster.local/ns/default/sa/echo"


def test_model_objects_are_frozen_and_hashable():
    w = workload("echo", "127.0.3.1", services={ECHO_KEY: {80: 8080}})
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        w.name = "other"
    assert isinstance(w.services, FrozenMap)
    assert w.services[ECHO_KEY] == {80: 8080}
    assert hash(w) == hash(workload("echo", "127.0.3.1", services={ECHO_KEY: {80: 8080}}))
    assert w.workload_ips == (ip_address("127.0.3.1"),)


def test_frozen_map_compares_with_dicts_and_rejects_assignment():
    m = FrozenMap({1: 2})
    assert m == {1: 2}
    assert m != {1: 3}
    with pytest.raises(TypeError):
        m[1] = 5


def test_frozen_map_reads_like_its_dict_and_its_views_do_not_write():
    m = FrozenMap({"a": 1, "b": 2})
    assert "a" in m and "c" not in m
    assert m.get("a") == 1 and m.get("c") is None and m.get("c", 3) == 3
    assert list(m.keys()) == ["a", "b"] and list(m.values()) == [1, 2] and list(m.items()) == [("a", 1), ("b", 2)]
    assert 2 in m.values() and ("b", 2) in m.items()
    for view in (m.keys(), m.values(), m.items()):
        assert not hasattr(view, "__setitem__") and not hasattr(view, "pop")
    assert m == {"a": 1, "b": 2}


def test_lookups():
    client = workload("client", "127.0.2.1", node="node-a")
    echo = workload("echo", "127.0.3.1", services={ECHO_KEY: {80: 8080}})
    mesh = mesh_with(client, echo)
    assert mesh.workload_by_ip("127.0.2.1") is client
    assert mesh.workload_by_ip(ip_address("127.0.3.1")) is echo
    assert mesh.workload_by_ip("127.0.9.9") is None
    assert mesh.workload_by_uid("Kubernetes//v1/Pod/default/echo") is echo
    assert mesh.workload_by_uid("nope") is None
    assert mesh.service_by_vip("127.10.0.1").hostname == "echo.default.svc.cluster.local"
    assert mesh.service_by_vip("127.0.3.1") is None
    assert mesh.service_by_hostname("echo.default.svc.cluster.local").name == "echo"
    assert mesh.service_by_hostname("echo.default.svc.cluster.local", "default").name == "echo"
    assert mesh.service_by_hostname("echo.default.svc.cluster.local", "other") is None
    assert mesh.service_by_hostname("nope") is None


def test_local_workloads_by_node_and_all_when_no_node_given():
    client = workload("client", "127.0.2.1", node="node-a")
    echo = workload("echo", "127.0.3.1", node="node-b")
    mesh = mesh_with(client, echo)
    assert mesh.local_workloads("node-a") == (client,)
    assert mesh.local_workloads("node-b") == (echo,)
    assert mesh.local_workloads("node-c") == ()
    assert mesh.local_workloads(None) == (client, echo)
    assert mesh.local_workloads("") == (client, echo)


def test_endpoints_only_healthy_members_with_target_ports():
    a = workload("a", "127.0.3.1", services={ECHO_KEY: {80: 9090}})  # own target port
    b = workload("b", "127.0.3.2", services={ECHO_KEY: {}})  # falls back to the service's
    sick = workload("sick", "127.0.3.3", services={ECHO_KEY: {80: 8080}}, status="Unhealthy")
    outsider = workload("outsider", "127.0.3.4")
    mesh = mesh_with(a, b, sick, outsider)
    svc = mesh.services[0]
    assert mesh.endpoints(svc) == [(a, 9090), (b, 8080)]  # first declared port: 80
    assert mesh.endpoints(svc, 443) == [(a, 8443), (b, 8443)]
    assert mesh.endpoints(svc, 25) == []


def test_resolve_vip_picks_endpoint_with_the_injected_choice():
    a = workload("a", "127.0.3.1", services={ECHO_KEY: {80: 9090}})
    b = workload("b", "127.0.3.2", services={ECHO_KEY: {80: 8080}})
    mesh = mesh_with(a, b)
    seen = []

    def last(options):
        seen.append(list(options))
        return options[-1]

    dest = mesh.resolve("127.10.0.1", 80, choice=last)
    assert seen == [[(a, 9090), (b, 8080)]]
    assert dest == Destination("service", ip_address("127.0.3.2"), 8080, workload=b, service=mesh.services[0])
    dest = mesh.resolve("127.10.0.1", 80, choice=lambda options: options[0])
    assert (dest.kind, dest.ip, dest.port, dest.workload) == ("service", ip_address("127.0.3.1"), 9090, a)


def test_resolve_vip_with_seeded_random_choice_is_repeatable():
    import random

    members = [workload(f"w{i}", f"127.0.3.{i + 1}", services={ECHO_KEY: {80: 8080}}) for i in range(5)]
    mesh = mesh_with(*members)
    first = [mesh.resolve("127.10.0.1", 80, choice=random.Random(7).choice).workload for _ in range(3)]
    again = [mesh.resolve("127.10.0.1", 80, choice=random.Random(7).choice).workload for _ in range(3)]
    assert first == again
    spread = {mesh.resolve("127.10.0.1", 80, choice=random.Random(s).choice).workload.name for s in range(40)}
    assert len(spread) > 1


def test_resolve_prefers_endpoint_ip_of_the_vip_family():
    dual = workload("dual", ["fd00::5", "127.0.3.1"], services={ECHO_KEY: {80: 8080}})
    svc = Service(
        name="echo",
        namespace="default",
        hostname="echo.default.svc.cluster.local",
        vips=["127.10.0.1", ("", "fd00::10")],
        ports={80: 8080},
    )
    mesh = Mesh([dual], [svc])
    assert mesh.resolve("127.10.0.1", 80, choice=lambda o: o[0]).ip == ip_address("127.0.3.1")
    assert mesh.resolve("fd00::10", 80, choice=lambda o: o[0]).ip == ip_address("fd00::5")


def test_resolve_unroutable_service():
    sick = workload("sick", "127.0.3.3", services={ECHO_KEY: {80: 8080}}, status="Unhealthy")
    mesh = mesh_with(sick)
    dest = mesh.resolve("127.10.0.1", 80)
    assert dest.kind == "unroutable"
    assert dest.workload is None
    assert dest.service.name == "echo"
    assert dest.reason == "service echo.default.svc.cluster.local has no healthy endpoints"
    dest = mesh.resolve("127.10.0.1", 25)
    assert dest.kind == "unroutable"
    assert dest.reason == "service echo.default.svc.cluster.local has no port 25"


def test_resolve_workload_ip_and_passthrough():
    sick = workload("sick", "127.0.3.3", status="Unhealthy")
    mesh = mesh_with(sick)
    # Addressing a workload directly reaches it even when it is unhealthy (as in ztunnel).
    assert mesh.resolve("127.0.3.3", 1234) == Destination("workload", ip_address("127.0.3.3"), 1234, workload=sick)
    assert mesh.resolve("192.0.2.1", 443) == Destination("passthrough", ip_address("192.0.2.1"), 443)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Mesh([workload("a", "10.0.0.1"), workload("a", "10.0.0.2")]), "duplicate workload uid"),
        (lambda: Mesh([], [echo_service(), echo_service()]), "duplicate service"),
    ],
)
def test_mesh_rejects_inconsistent_data(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_string_match_wildcards():
    assert StringMatch.parse("*") == StringMatch("presence")
    assert StringMatch.parse("abc*") == StringMatch("prefix", "abc")
    assert StringMatch.parse("*abc") == StringMatch("suffix", "abc")
    assert StringMatch.parse("abc") == StringMatch("exact", "abc")
    assert StringMatch("presence").matches("x") and not StringMatch("presence").matches("")
    assert StringMatch("prefix", "ab").matches("abc") and not StringMatch("prefix", "ab").matches("cab")
    assert StringMatch("suffix", "bc").matches("abc") and not StringMatch("suffix", "bc").matches("bca")
    assert str(StringMatch.parse("*abc")) == "*abc"


def test_match_principals_drop_spiffe_scheme():
    m = Match(principals=["spiffe://td/ns/a/sa/b", "td/ns/c/sa/*"], service_accounts=["ns/sa"])
    assert m.principals == (StringMatch("exact", "td/ns/a/sa/b"), StringMatch("prefix", "td/ns/c/sa/"))
    assert m.service_accounts[0].namespace == "ns"
    assert Match().is_empty()
    assert not m.is_empty()


def test_diff_by_uid():
    a = workload("a", "10.0.0.1")
    b = workload("b", "10.0.0.2")
    c = workload("c", "10.0.0.3")
    b2 = attrs.evolve(b, status="Unhealthy")
    old = Mesh([a, b], [])
    new = Mesh([b2, c], [])
    d = diff(old, new)
    assert d.removed == (a,)
    assert d.added == (c,)
    assert d.changed == ((b, b2),)
    assert not d.services_changed and not d.policies_changed
    assert d
    assert not diff(old, Mesh([a, b], []))
    assert diff(Mesh([a], []), Mesh([a], [echo_service()])).services_changed


def test_parse_ip_is_ip_address_remembered():
    assert parse_ip("10.0.0.1") == ip_address("10.0.0.1")
    assert parse_ip("10.0.0.1") is parse_ip("10.0.0.1")
    assert parse_ip("fd00::1") == ip_address("fd00::1")
    for bad in ("not-an-ip", "10.0.0.256", ""):
        with pytest.raises(ValueError):
            parse_ip(bad)
