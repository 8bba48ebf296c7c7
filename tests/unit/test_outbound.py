"""Outbound.connect on a real Node (memory reactor, the pool's connects replaced): refusals and their records."""

from __future__ import annotations

import weakref

import pytest
from twisted.internet import defer, error
from twisted.internet.testing import MemoryReactorClock

from ztwisted.ca import CertificateAuthority, CertificateStore
from ztwisted.context import ProxyContext
from ztwisted.hbone.pool import ConnectionPool
from ztwisted.hbone.socks5 import Reply, Socks5Error
from ztwisted.metrics import Metrics
from ztwisted.model import Mesh, Workload
from ztwisted.network import HostNetwork
from ztwisted.node import Node
from ztwisted.splice import TCPEnd
from ztwisted.workloads import LocalWorkloads

CLIENT = Workload(
    uid="c//v1/Pod/default/client", name="client", namespace="default", workload_ips=["10.0.1.1"], node="n"
)
SERVER = Workload(
    uid="c//v1/Pod/default/echo",
    name="echo",
    namespace="default",
    workload_ips=["10.0.2.1"],
    node="m",
    protocol="HBONE",
)


@pytest.fixture(scope="module")
def certificate_authority(tmp_path_factory):
    return CertificateAuthority.load_or_create_dev(tmp_path_factory.mktemp("ca"))


def outbound_with_pool_connect(certificate_authority, connect):
    reactor = MemoryReactorClock()
    workloads = LocalWorkloads(Mesh([CLIENT, SERVER], [], []), "n", HostNetwork(reactor))
    context = ProxyContext(reactor, Metrics(), CertificateStore(certificate_authority, reactor), workloads)
    outbound = Node(context).outbound
    outbound.pool = ConnectionPool(reactor, connect)
    return outbound


def refused_connect(key):
    return defer.fail(error.ConnectionRefusedError("10.0.2.1:15008"))


def test_a_tunnel_whose_connection_is_refused_is_refused_to_the_client_and_logged(certificate_authority, access_events):
    outbound = outbound_with_pool_connect(certificate_authority, refused_connect)
    outcome = []
    outbound.connect(TCPEnd(), ("10.0.1.1", 40000), "10.0.2.1", 8080).addBoth(outcome.append)
    (failure,) = outcome
    assert failure.check(Socks5Error) and failure.value.reply_code == Reply.CONNECTION_REFUSED
    assert isinstance(failure.value.__cause__, error.ConnectionRefusedError)
    (event,) = access_events
    assert (event["outcome"], event["direction"], event["dst.addr"]) == ("refused", "outbound", "10.0.2.1:8080")
    assert "Connection was refused" in event["error"]
    closed = outbound.context.metrics.sample("istio_tcp_connections_closed_total", _labels(response_flags="CONNECT"))
    assert closed == 1


def _labels(**given: str) -> dict[str, str]:
    labels = {
        "reporter": "source",
        "source_workload": "client",
        "source_workload_namespace": "default",
        "source_principal": "spiffe://cluster.local/ns/default/sa/default",
        "destination_workload": "echo",
        "destination_workload_namespace": "default",
        "destination_principal": "spiffe://cluster.local/ns/default/sa/default",
        "destination_service": "unknown",
        "request_protocol": "tcp",
        "response_flags": "-",
        "connection_security_policy": "mutual_tls",
    }
    labels.update(given)
    return labels


@pytest.mark.parametrize(
    "source, host, reply",
    [
        (("10.0.9.9", 40000), "10.0.2.1", Reply.NOT_ALLOWED),  # not a local workload
        (("10.0.1.1", 40000), "no-such-service.example", Reply.HOST_UNREACHABLE),
    ],
)
def test_a_connection_refused_before_any_upstream_is_opened_has_no_record(
    certificate_authority, access_events, source, host, reply
):
    attempts = []
    outbound = outbound_with_pool_connect(certificate_authority, lambda key: attempts.append(key) or defer.Deferred())
    outcome = []
    outbound.connect(TCPEnd(), source, host, 8080).addBoth(outcome.append)
    (failure,) = outcome
    assert failure.check(Socks5Error) and failure.value.reply_code == reply
    assert access_events == [] and attempts == []


def test_a_refused_connection_leaves_no_reference_cycle(certificate_authority, no_cyclic_gc):
    outbound = outbound_with_pool_connect(certificate_authority, refused_connect)
    app = TCPEnd()
    outcome = []
    outbound.connect(app, ("10.0.1.1", 40000), "10.0.2.1", 8080).addBoth(outcome.append)
    (failure,) = outcome
    alive = [weakref.ref(failure.value), weakref.ref(failure.value.__cause__), weakref.ref(app)]
    del failure, outcome[:], app
    assert [ref() for ref in alive] == [None] * len(alive)


def test_baggage_values_from_a_hand_written_config_go_out_without_surrounding_whitespace():
    # The CONNECT's headers skip h2's normalization; a peer that validates them would end the
    # whole connection over "client-1 " (whitespace around a header value).
    from ztwisted.hbone.outbound import tunnel_headers

    workload = Workload(uid="u", name="client-1 ", namespace="\tshop", canonical_name=" ", canonical_revision="v1\t")
    headers = dict(tunnel_headers(workload, ("10.0.0.1", 40000)))
    assert headers["baggage"] == (
        "k8s.namespace.name=shop,k8s.pod.name=client-1,service.name=client-1,service.version=v1"
    )
