"""In-pod mode: which workload a pod's proxy serves, before and after discovery knows the pod."""

from __future__ import annotations

from ipaddress import ip_address

import pytest
import pytest_twisted
from twisted.internet import reactor

from tests.unit.test_zds_client import Harness, request
from ztwisted import tap
from ztwisted.config import builtin_example_path, parse_config
from ztwisted.hbone.inbound import serves_address
from ztwisted.inpod import wire
from ztwisted.inpod.proxies import PodProxies, pod_workload
from ztwisted.inpod.wire import AddWorkload, DelWorkload, SnapshotSent, WorkloadInfo
from ztwisted.model import Mesh
from ztwisted.network import HostNetwork, PodNetwork
from ztwisted.tools.zds_testing import unshared_netns

INFO = WorkloadInfo("web-1", "shop", "web")

DISCOVERED = """
workloads:
- uid: uid-web-1
  name: web-1
  namespace: shop
  serviceAccount: web
  workloadIps: ["10.0.0.5"]
  protocol: HBONE
  node: node-1
  trustDomain: example.org
  services: {"shop/web.shop.svc.cluster.local": {80: 8080}}
- uid: Kubernetes//v1/Pod/shop/web-2
  name: web-2
  namespace: shop
  serviceAccount: web
  workloadIps: ["10.0.0.6"]
  node: node-1
services:
- name: web
  namespace: shop
  hostname: web.shop.svc.cluster.local
  vips: ["/10.96.0.1"]
  ports: {80: 8080}
"""


def test_a_pod_discovery_does_not_know_is_served_from_the_agents_workload_info():
    workload = pod_workload("uid-new", INFO, Mesh(), "node-1")
    assert (workload.uid, workload.name, workload.namespace, workload.service_account) == (
        "uid-new",
        "web-1",
        "shop",
        "web",
    )
    assert str(workload.identity) == "spiffe://cluster.local/ns/shop/sa/web"
    assert workload.workload_ips == () and not workload.services
    assert workload.node == "node-1" and workload.protocol == "HBONE"


def test_discovery_fills_in_addresses_services_and_trust_domain_by_uid():
    workload = pod_workload("uid-web-1", INFO, parse_config(DISCOVERED), "node-1")
    assert workload.workload_ips == (ip_address("10.0.0.5"),)
    assert set(workload.services) == {"shop/web.shop.svc.cluster.local"}
    assert str(workload.identity) == "spiffe://example.org/ns/shop/sa/web"


def test_discovery_is_matched_by_name_namespace_and_service_account_as_ztunnel_does():
    # The agent's uid is the Kubernetes pod uid, discovery's another: ztunnel matches the rest.
    workload = pod_workload("3f1c-pod-uid", WorkloadInfo("web-2", "shop", "web"), parse_config(DISCOVERED), "node-1")
    assert workload.uid == "3f1c-pod-uid"
    assert workload.workload_ips == (ip_address("10.0.0.6"),)
    # Only on this node, and only if every part matches.
    assert (
        pod_workload("u", WorkloadInfo("web-2", "shop", "web"), parse_config(DISCOVERED), "node-2").workload_ips == ()
    )
    assert (
        pod_workload("u", WorkloadInfo("web-2", "shop", "other"), parse_config(DISCOVERED), "node-1").workload_ips == ()
    )


def test_a_pod_without_known_addresses_serves_only_the_address_a_connection_arrived_at():
    pod = pod_workload("uid-new", INFO, Mesh(), "node-1")
    in_pod = PodNetwork(reactor=None, netns=None)
    assert serves_address(pod, in_pod, "10.0.0.9", arrived_at=lambda: "10.0.0.9")
    assert not serves_address(pod, in_pod, "10.0.0.10", arrived_at=lambda: "10.0.0.9"), "a relay to another address"
    # Outside a pod's own namespace an unknown address means nothing.
    assert not serves_address(pod, HostNetwork(reactor=None), "10.0.0.9", arrived_at=lambda: "10.0.0.9")
    known = pod_workload("uid-web-1", INFO, parse_config(DISCOVERED), "node-1")
    assert serves_address(known, in_pod, "10.0.0.5", arrived_at=lambda: "10.0.0.5")
    assert not serves_address(known, in_pod, "10.0.0.9", arrived_at=lambda: "10.0.0.9"), "discovery knows its addresses"


def test_the_local_address_is_asked_for_only_for_a_pod_without_known_addresses():
    """Asking is a ``getsockname`` per HBONE tunnel; a workload discovery described never needs it."""
    asked = []

    def arrived_at():
        asked.append(True)
        return "10.0.0.9"

    in_pod = PodNetwork(reactor=None, netns=None)
    known = pod_workload("uid-web-1", INFO, parse_config(DISCOVERED), "node-1")
    assert serves_address(known, in_pod, "10.0.0.5", arrived_at)
    assert not serves_address(known, in_pod, "10.0.0.9", arrived_at)
    assert asked == []
    assert serves_address(pod_workload("uid-new", INFO, Mesh(), "node-1"), in_pod, "10.0.0.9", arrived_at)
    assert asked == [True]


# -- through the ZDS client, with a real node and a real pod namespace ---------------------------


@pytest.fixture
def proxy(tmp_path):
    options = tap.Options()
    options.parseOptions(
        ["--state-dir", str(tmp_path / "state"), "--inpod", "--node", "node-1", "--config", builtin_example_path()]
    )
    return tap.makeService(options, reactor).proxy


@pytest.fixture
def pod_netns():
    ns = unshared_netns()
    if ns is None:
        pytest.skip("cannot create a network namespace here (needs root or user namespaces)")
    yield ns
    ns.close()


@pytest_twisted.inlineCallbacks
def test_an_add_before_discovery_is_acked_served_and_completed_by_discovery_later(proxy, pod_netns):
    node = proxy.node
    harness = Harness(manager=PodProxies(node, proxy.drain))
    try:
        agent = yield harness.start()
        ack = yield request(agent, wire.encode_request(AddWorkload("uid-new", INFO)), [pod_netns.fileno()])
        assert ack.ok, ack.error  # was: "pod uid-new (shop/web-1) is not in the configuration"
        served = node.workloads.find("uid-new")
        assert (str(served.identity), served.workload_ips) == ("spiffe://cluster.local/ns/shop/sa/web", ())
        listeners = node.listeners["uid-new"]
        assert len(listeners.ports) == 3  # 15008, 15006 and 15001 in the pod's namespace

        proxy.reconciler.apply_mesh(parse_config(DISCOVERED.replace("uid-web-1", "uid-new")))
        served = node.workloads.find("uid-new")
        assert served.workload_ips == (ip_address("10.0.0.5"),) and str(served.identity) == (
            "spiffe://example.org/ns/shop/sa/web"
        )
        assert listeners.hbone.workload is listeners.plaintext.workload is served
        assert listeners.redirect.source is served
        assert node.workloads.by_ip("10.0.0.5") is served
    finally:
        harness.client.stopService()
        for peer in harness.peers:
            peer.close()
        served = node.workloads.find("uid-new")
        if served is not None:
            yield node.listeners[served.uid].stop_listening()
            node.workloads.network_of(served).close()


@pytest_twisted.inlineCallbacks
def test_pods_added_and_removed_over_and_over_leave_nothing_behind(proxy, pod_netns):
    """Pod churn through the node agent, pods the configuration never lists: each removed pod's
    listeners, certificate (no longer renewed, gone from the config dump) and every record of it go."""
    node = proxy.node
    certificates = node.context.certificates
    harness = Harness(manager=PodProxies(node, proxy.drain))
    try:
        agent = yield harness.start()
        ack = yield request(agent, wire.encode_request(SnapshotSent()))
        assert ack.ok, ack.error
        for number in range(6):
            uid, info = f"uid-churn-{number}", WorkloadInfo(f"churn-{number}", "shop", f"churn-{number}")
            ack = yield request(agent, wire.encode_request(AddWorkload(uid, info)), [pod_netns.fileno()])
            assert ack.ok, ack.error
            identity = node.workloads.find(uid).identity
            certificates.get(identity)  # what the pod's first inbound TLS handshake does
            assert str(identity) in [c["identity"] for c in proxy.config_dump()["certificates"]]
            ack = yield request(agent, wire.encode_request(DelWorkload(uid)))
            assert ack.ok, ack.error
            assert node.workloads.find(uid) is None and uid not in node.listeners
            assert str(identity) not in [c["identity"] for c in proxy.config_dump()["certificates"]]
            renewals = [call for call in reactor.getDelayedCalls() if call.args == (identity,)]
            assert renewals == [], "a removed pod's certificate is no longer renewed"
        # Withdrawals are ended by a reloaded configuration, which never lists these pods:
        # a record of each would only grow.
        assert node.workloads._removed_uids == set()
    finally:
        harness.client.stopService()
        for peer in harness.peers:
            peer.close()
