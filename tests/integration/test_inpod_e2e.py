"""In-pod mode end to end, with real namespaces: an app in pod A reaches pod B's app through HBONE.

Topology (all in namespaces these tests create, see inpod_support): pods A
(POD_A_IP) and B (POD_B_IP) on a private bridge; pod A's iptables send its
outbound TCP to 15001 except the proxy's own (mark 1337). Two "nodes" run
in the host namespace, each a ``ztunnel-agent serve`` and a ztwisted in
in-pod mode connected to it: node 1 serves pod A, node 2 pod B, each with
listeners inside its pod's namespace. A's app connects to POD_B_IP:8080;
the redirect sends it to node 1's 15001 in pod A, which tunnels it over
HBONE, from pod A's namespace, to POD_B_IP:15008 (node 2, inside pod B),
which connects to B's app.

The plaintext-inbound test (5) adds a namespace outside the mesh on the same
bridge; pod B's PREROUTING rule sends its connections to node 2's 15006.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.integration.conftest import NET
from tests.integration.inpod_support import (
    APP_PORT,
    NETNS_PREFIX,
    PACKET_MARK,
    PLAINTEXT_INBOUND_PORT,
    App,
    InpodNode,
    PodNetworkLab,
    acks_ok,
    cannot_build_pods,
    remove_leftover_namespaces,
    roundtrip,
    start_echo,
)
from tests.support import mesh_workloads, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.root]

# Pods, agents and proxies in namespaces take longer than loopback nodes.
POD_WAIT_SECONDS = 10.0
POD_A_IP = "10.251.0.2"
POD_B_IP = "10.251.0.3"
PODS = [("a", POD_A_IP, "uid-pod-a", "pod-a"), ("b", POD_B_IP, "uid-pod-b", "pod-b")]
POD_PORTS = {15001, 15006, 15008}
POD_A_IDENTITY = "spiffe://cluster.local/ns/default/sa/pod-a"
POD_B_IDENTITY = "spiffe://cluster.local/ns/default/sa/pod-b"
OUTSIDE_IP = "10.251.0.9"  # a client on the bridge that is not in the mesh


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def netns_prefix():
    """Names of the namespaces ``network`` makes; a test may parametrize it to keep its own apart."""
    return NETNS_PREFIX


@pytest.fixture
def network(netns_prefix):
    """Pods A and B on the bridge, pod A's outbound redirected to 15001; every namespace removed after."""
    reason = cannot_build_pods()
    if reason:
        pytest.skip(f"in-pod end-to-end tests skipped: {reason}")
    remove_leftover_namespaces(netns_prefix)
    lab = PodNetworkLab(netns_prefix)
    try:
        try:
            lab.build(PODS)
        except RuntimeError as exc:
            if not lab.created:  # the very first `ip netns add`
                pytest.skip(f"in-pod end-to-end tests skipped: `ip netns add` failed: {exc}")
            raise
        lab.pods["a"].redirect_outbound(PACKET_MARK)
        yield lab
    finally:
        lab.destroy()


@pytest.fixture
def mesh(tmp_path, network):
    path = tmp_path / "mesh.yaml"
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    path.write_text(mesh_workloads(pod_a.mesh_entry("node-1"), pod_b.mesh_entry("node-2")))
    return path


@pytest.fixture
def apps():
    """Apps started in pods; killed at the end whatever happened."""
    started: list[App] = []
    yield started
    for app in started:
        app.kill()


@pytest.fixture
def echo_b(network, apps):
    app = start_echo(network.pods["b"], APP_PORT)
    apps.append(app)
    return app


@pytest.fixture
def nodes(tmp_path, mesh, network):
    """``start(number, *args, agent=None, control_number=None, name=None)`` starts a node; all stopped after."""
    started: list[InpodNode] = []

    def start(number: int, *extra_args: str, **options) -> InpodNode:
        node = InpodNode(
            tmp_path, number, NET, config=mesh, state_dir=tmp_path / "state", extra_args=tuple(extra_args), **options
        )
        started.append(node)
        return node.start()

    yield start
    for node in reversed(started):
        node.stop()


# -- helpers -------------------------------------------------------------------------------------


def serve_pod(
    node: InpodNode, pod, *, check_not_ready: bool = True, in_snapshot: bool = False, proxies: int = 1
) -> None:
    """``node`` gets ``pod`` (from the agent's snapshot, or by ``ztunnel-agent add``), then the snapshot
    ends; readiness turns 200 only then. ``proxies``: how many proxies the agent has with this one."""
    wait_until(
        lambda: node.agent.proxies_said_hello(proxies),
        timeout=POD_WAIT_SECONDS,
        what=f"{node.name} to say hello to its agent",
    )
    if check_not_ready:
        assert node.ready() == 500, "ready before the node agent's snapshot"
    if in_snapshot:
        wait_until(
            lambda: not node.agent.status()["proxies"][-1]["busy"],
            timeout=POD_WAIT_SECONDS,
            what="the snapshot's Add to be acked",
        )
    else:
        code, reply = node.agent.add(pod)
        assert code == 0 and acks_ok(reply), reply
    if check_not_ready:
        assert node.ready() == 500, "ready before SnapshotSent"
    code, reply = node.agent.call("snapshot-end")  # to the newest proxy: this one
    assert code == 200 and acks_ok(reply), reply
    wait_until(lambda: node.ready() == 200, timeout=POD_WAIT_SECONDS, what=f"{node.name} to be ready")


def pod_listeners(pod) -> list[int]:
    return sorted(port for address, port in pod.listening_ports() if address in ("0.0.0.0", "*"))


def events(node: InpodNode, **match) -> list[dict]:
    return [e for e in node.proxy.log_events() if all(e.get(k) == v for k, v in match.items())]


def messages(node: InpodNode, prefix: str) -> list[dict]:
    return [e for e in node.proxy.log_events() if e.get("message", "").startswith(prefix)]


def closed_hbone(node: InpodNode, direction: str, ended_by: str) -> float:
    return node.proxy.metric("ztwisted_hbone_connections_closed_total", direction=direction, ended_by=ended_by)


def ended_by_counts(node: InpodNode, direction: str) -> dict[str, float]:
    counts = {}
    for line in node.proxy.metrics().splitlines():
        if line.startswith("ztwisted_hbone_connections_closed_total{") and f'direction="{direction}"' in line:
            head, _, value = line.rpartition(" ")
            counts[head.split('ended_by="', 1)[1].split('"', 1)[0]] = float(value)
    return counts


# -- 1. echo through HBONE ------------------------------------------------------------------------


def test_app_in_pod_a_reaches_pod_b_through_hbone(network, nodes, echo_b):
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    node1 = nodes(1)
    node2 = nodes(2)
    serve_pod(node1, pod_a)
    serve_pod(node2, pod_b)
    assert set(pod_listeners(pod_a)) >= POD_PORTS
    assert set(pod_listeners(pod_b)) >= POD_PORTS

    report = roundtrip(pod_a, POD_B_IP, APP_PORT, 300_000)
    assert report["exact"], report

    outbound = wait_until(
        lambda: events(node1, scope="access", direction="outbound"),
        timeout=POD_WAIT_SECONDS,
        what="node 1's access log",
    )
    inbound = wait_until(
        lambda: events(node2, scope="access", direction="inbound"), timeout=POD_WAIT_SECONDS, what="node 2's access log"
    )
    (out,), (inn,) = outbound, inbound
    assert out["src.addr"].startswith(f"{POD_A_IP}:") and out["src.workload"] == "pod-a"
    assert out["dst.addr"] == f"{POD_B_IP}:{APP_PORT}" and out["dst.hbone_addr"] == f"{POD_B_IP}:15008"
    assert out["dst.workload"] == "pod-b" and "error" not in out
    assert inn["dst.addr"] == f"{POD_B_IP}:{APP_PORT}" and inn["dst.workload"] == "pod-b" and "error" not in inn
    assert inn["src.identity"] == POD_A_IDENTITY
    assert out["bytes_sent"] == inn["bytes_recv"] == 300_000
    # Both sides count it as mutual TLS; node 2 saw the HBONE connection come from pod A's address.
    assert (
        node1.proxy.metric(
            "istio_tcp_connections_opened_total",
            reporter="source",
            source_workload="pod-a",
            destination_workload="pod-b",
            connection_security_policy="mutual_tls",
        )
        == 1
    )
    assert (
        node2.proxy.metric(
            "istio_tcp_connections_opened_total",
            reporter="destination",
            source_workload="pod-a",
            destination_workload="pod-b",
            connection_security_policy="mutual_tls",
        )
        == 1
    )
    assert node1.proxy.metric("ztwisted_hbone_connections", direction="outbound") == 1
    # The pooled HBONE connection lives in pod A's namespace, from A's address, with the proxy's mark.
    (pooled,) = pod_a.run("ss", "-Htne", "state", "established", "dst", f"{POD_B_IP}:15008").stdout.splitlines()
    assert f"{POD_A_IP}:" in pooled and f"fwmark:{PACKET_MARK:#x}" in pooled, pooled


# -- 2. last-mile: Del while the network still exists ---------------------------------------------


def test_last_mile_del_lets_the_tunnel_in_flight_finish_before_the_ack(network, nodes, echo_b, apps):
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    node1 = nodes(1)
    node2 = nodes(2, "--drain-strategy", "last-mile", "--pod-drain-timeout", "3")
    serve_pod(node1, pod_a, check_not_ready=False)
    serve_pod(node2, pod_b, check_not_ready=False)

    stream = App(pod_a, "stream", POD_B_IP, str(APP_PORT), "--interval", "0.01")
    apps.append(stream)
    assert stream.read_event().get("echoed", 0) > 0, "the tunnel carries data before the Del"

    delete = node2.agent.cli_background("delete", "--uid", pod_b.uid)
    wait_until(
        lambda: messages(node1, "GOAWAY from"), timeout=POD_WAIT_SECONDS, what="node 1 to receive GOAWAY from node 2"
    )
    time.sleep(1.0)  # the app keeps sending through the draining connection
    assert delete.poll() is None, "the Del was acked while a tunnel was still in flight"
    report = stream.stop()
    assert report["exact"], report
    out, err = delete.communicate(timeout=10)
    assert delete.returncode == 0, (out, err)
    (ack,) = json.loads(out)["acks"]
    assert ack["ok"] and ack["request"] == "del"
    assert ack["latency_ms"] >= 1000, ack

    # Node 2 ended the connection gracefully (GOAWAY, the stream finished, close_notify) ...
    assert closed_hbone(node2, "inbound", "drained") == 1, ended_by_counts(node2, "inbound")
    # ... and node 1 saw GOAWAY, then a clean close: close_notify, not a lost TCP connection.
    goaways = [e["message"] for e in messages(node1, "GOAWAY from")]
    assert goaways and all(POD_B_IDENTITY in message for message in goaways), goaways
    assert goaways[-1].endswith("last stream 1, error code 0"), goaways  # the tunnel's stream was kept
    wait_until(
        lambda: ended_by_counts(node1, "outbound"),
        timeout=POD_WAIT_SECONDS,
        what="node 1 to count the connection's end",
    )
    # Node 1 processes the stream's END_STREAM before node 2's close_notify (which follows it on the
    # wire), so with GOAWAY received and no stream left it closes first, itself with close_notify:
    # "drained", not "peer". A TCP close without close_notify would have been "lost".
    assert ended_by_counts(node1, "outbound") == {"drained": 1.0}
    # Node 2's own log: the tunnel's access-log event comes before the pod-removed drain completes.
    log2 = node2.proxy.log_events()
    access = [i for i, e in enumerate(log2) if e.get("scope") == "access" and e.get("direction") == "inbound"]
    removed = [
        i
        for i, e in enumerate(log2)
        if e.get("message", "").startswith("drain event pod_removed") and "complete" in e["message"]
    ]
    assert access and removed and access[-1] < removed[0], "the pod-removed drain ended before the tunnel"
    inbound = [log2[i] for i in access]
    assert "error" not in inbound[-1], inbound[-1]
    assert pod_listeners(pod_b) == []  # the Ack came once the pod's proxy was gone
    # Only now does the network go away.
    pod_b.delete_veth()


# -- 3. immediate, and the network gone first ------------------------------------------------------


def test_immediate_with_network_gone_pooled_connection_found_dead_by_keepalive(network, nodes, echo_b):
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    node1 = nodes(1, "--keepalive-interval", "1", "--keepalive-timeout", "2")
    node2 = nodes(2, "--drain-strategy", "immediate")
    serve_pod(node1, pod_a, check_not_ready=False)
    serve_pod(node2, pod_b, check_not_ready=False)

    assert roundtrip(pod_a, POD_B_IP, APP_PORT, 10_000)["exact"]
    (pooled,) = node1.proxy.config_dump()["pool"]
    assert pooled["destination"] == f"{POD_B_IP}:15008" and pooled["source_ip"] == POD_A_IP
    assert pooled["streams"] == 0 and pooled["usable"]
    time.sleep(1.5)  # longer than the keepalive interval: PINGs are answered while the network is up
    assert ended_by_counts(node1, "outbound") == {}
    assert len(node1.proxy.config_dump()["pool"]) == 1

    pod_b.delete_veth()
    gone_at = time.monotonic()
    code, reply = node2.agent.cli("delete", "--uid", pod_b.uid)
    assert code == 0 and acks_ok(reply), reply
    assert closed_hbone(node2, "inbound", "abrupt") == 1, ended_by_counts(node2, "inbound")
    assert pod_listeners(pod_b) == []

    # Nothing reaches node 1 from pod B any more: the idle pooled connection dies by keepalive,
    # within one interval plus the timeout (1 + 2 s) of the last frame it received.
    wait_until(lambda: ended_by_counts(node1, "outbound"), timeout=8, what="node 1 to close its pooled connection")
    elapsed = time.monotonic() - gone_at
    assert ended_by_counts(node1, "outbound") == {"keepalive-timeout": 1.0}
    assert elapsed < 5.0, f"found dead after {elapsed:.1f} s"
    assert node1.proxy.config_dump()["pool"] == []
    assert messages(node1, "no PING answer from")


# -- 4. upgrade: a second proxy on the same agent, then the old one drains ---------------------------


def test_upgrade_second_proxy_takes_over_pod_b_without_losing_a_connection(network, nodes, echo_b, apps):
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    # Without it a connection waiting in the old listener's accept queue at SIGTERM would be reset
    # (a window of microseconds; docs/draining.rst "Restart without loss").
    pod_b.allow_accept_queue_migration()
    node1 = nodes(1)
    old = nodes(2, "--drain-timeout", "10")
    serve_pod(node1, pod_a, check_not_ready=False)
    serve_pod(old, pod_b, check_not_ready=False)

    loop = App(pod_a, "loop", POD_B_IP, str(APP_PORT), "--pause", "0.01")
    apps.append(loop)
    stream = App(pod_a, "stream", POD_B_IP, str(APP_PORT), "--interval", "0.02")
    apps.append(stream)
    assert stream.read_event().get("echoed", 0) > 0
    wait_until(
        lambda: old.proxy.metric("istio_tcp_connections_opened_total", reporter="destination") >= 10,
        timeout=POD_WAIT_SECONDS,
        what="short connections through the old proxy",
    )

    # The upgraded proxy connects to the same agent and gets the snapshot: listeners beside the old ones.
    new = nodes(2, agent=old.agent, control_number=3, name="node-2-new")
    serve_pod(new, pod_b, in_snapshot=True, proxies=2)
    assert [port for port in pod_listeners(pod_b) if port == 15008] == [15008, 15008]
    (proxy_old, proxy_new) = old.agent.status()["proxies"]
    assert proxy_old["snapshot_complete"] and proxy_new["snapshot_complete"]

    old.proxy.process.send_signal(signal.SIGTERM)  # proxy stopping: it drains
    wait_until(
        lambda: [port for port in pod_listeners(pod_b) if port == 15008] == [15008],
        timeout=POD_WAIT_SECONDS,
        what="the old proxy to close its listeners in pod B",
    )
    carried_before = new.proxy.metric("istio_tcp_connections_opened_total", reporter="destination")
    time.sleep(1.0)  # short connections keep coming, now to the new proxy; the long tunnel stays on the old
    assert old.proxy.process.poll() is None, "the old proxy exited with the long tunnel still open"
    report = stream.stop()
    assert report["exact"], report
    status = old.proxy.process.wait(15)
    assert status in (0, -signal.SIGTERM), old.proxy.log_tail()
    result = loop.stop()
    assert result["failures"] == [], result["failures"][:5]
    assert result["made"] >= 30, result
    assert new.proxy.metric("istio_tcp_connections_opened_total", reporter="destination") > carried_before
    # The old proxy's log (its metrics went with it): a complete drain, every tunnel it carried clean,
    # the long one among them.
    assert messages(old, "proxy drain complete") and not messages(old, "drain deadline reached")
    carried = events(old, scope="access", direction="inbound")
    assert [e for e in carried if "error" in e] == []
    assert report["sent"] in [e["bytes_recv"] for e in carried]
    wait_until(
        lambda: len(old.agent.status()["proxies"]) == 1,
        timeout=POD_WAIT_SECONDS,
        what="the agent to see the old proxy leave",
    )
    assert roundtrip(pod_a, POD_B_IP, APP_PORT, 50_000)["exact"]


# -- 5. plaintext inbound: a client outside the mesh, captured to 15006 in pod B ---------------------


@pytest.mark.parametrize("netns_prefix", [f"{NETNS_PREFIX}out-"])
def test_plaintext_inbound_from_outside_the_mesh_goes_through_15006_in_pod_b(network, nodes, echo_b, apps):
    pod_b = network.pods["b"]
    outside = network.add_pod("out", OUTSIDE_IP, "uid-outside", "outside")  # not in the mesh file: no proxy
    node2 = nodes(2)
    serve_pod(node2, pod_b, check_not_ready=False)
    assert PLAINTEXT_INBOUND_PORT in pod_listeners(pod_b)

    def plaintext_opened() -> float:
        return node2.proxy.metric(
            "istio_tcp_connections_opened_total", reporter="destination", connection_security_policy="unknown"
        )

    # No capture rule yet: the client reaches the app directly and node 2 never sees the connection.
    assert roundtrip(outside, POD_B_IP, APP_PORT, 100_000)["exact"]
    assert plaintext_opened() == 0
    assert events(node2, scope="access") == []

    pod_b.redirect_inbound()
    report = roundtrip(outside, POD_B_IP, APP_PORT, 300_000)
    assert report["exact"], report
    (inn,) = wait_until(
        lambda: events(node2, scope="access", direction="inbound"),
        timeout=POD_WAIT_SECONDS,
        what="node 2's access log of the plaintext connection",
    )
    assert inn["dst.addr"] == f"{POD_B_IP}:{APP_PORT}" and inn["dst.workload"] == "pod-b"
    assert inn["src.addr"].startswith(f"{OUTSIDE_IP}:"), inn
    assert "error" not in inn and inn["outcome"] == "closed", inn
    assert inn["bytes_sent"] == inn["bytes_recv"] == 300_000, inn
    assert plaintext_opened() == 1
    assert (
        node2.proxy.metric(
            "istio_tcp_connections_opened_total",
            reporter="destination",
            destination_workload="pod-b",
            connection_security_policy="unknown",
        )
        == 1
    )
    assert node2.proxy.metric("istio_tcp_connections_opened_total", connection_security_policy="mutual_tls") == 0

    # While a connection is open: the proxy's own leg to the app lives in pod B's namespace with the
    # proxy's mark (the PREROUTING rule never applies to it: it is locally generated).
    stream = App(outside, "stream", POD_B_IP, str(APP_PORT), "--interval", "0.02")
    apps.append(stream)
    assert stream.read_event().get("echoed", 0) > 0
    (leg,) = pod_b.run("ss", "-Htne", "state", "established", "dst", f"{POD_B_IP}:{APP_PORT}").stdout.splitlines()
    assert f"fwmark:{PACKET_MARK:#x}" in leg, leg
    result = stream.stop()
    assert result["exact"], result
    wait_until(
        lambda: len(events(node2, scope="access", direction="inbound")) == 2,
        timeout=POD_WAIT_SECONDS,
        what="node 2's access log of the streamed connection",
    )
    assert plaintext_opened() == 2

    # The rule removed, connections bypass the proxy again: its counter stays put.
    pod_b.stop_redirecting_inbound()
    assert roundtrip(outside, POD_B_IP, APP_PORT, 50_000)["exact"]
    time.sleep(0.5)
    assert plaintext_opened() == 2
    assert len(events(node2, scope="access")) == 2


# -- 5b. plaintext inbound is authorized like HBONE inbound, with no peer identity ---------------------


def outside_policy(action: str, match: str) -> str:
    """A Namespace-scope policy for the pods' namespace with one rule of one match."""
    return (
        "policies:\n"
        f"- name: outside-{action.lower()}\n"
        "  namespace: default\n"
        "  scope: Namespace\n"
        f"  action: {action}\n"
        "  rules:\n"
        f"  - - - {match}\n"
    )


@pytest.mark.parametrize(
    "policy",
    [
        # A Deny rule on the source address matches a client without identity.
        outside_policy("Deny", f'sourceIps: ["{OUTSIDE_IP}/32"]'),
        # An Allow rule that needs an identity never matches one: nothing allows the client.
        outside_policy("Allow", 'principals: ["*"]'),
    ],
    ids=["deny-source-ip", "allow-identity-only"],
)
@pytest.mark.parametrize("netns_prefix", ["ztw16-"])
def test_plaintext_inbound_is_refused_by_policy(network, mesh, nodes, echo_b, policy):
    mesh.write_text(mesh.read_text() + policy)
    pod_b = network.pods["b"]
    outside = network.add_pod("out", OUTSIDE_IP, "uid-outside", "outside")
    node2 = nodes(2)
    serve_pod(node2, pod_b, check_not_ready=False)
    pod_b.redirect_inbound()

    report = roundtrip(outside, POD_B_IP, APP_PORT, 10_000)
    assert not report["exact"] and report["received"] == 0, report
    (denied,) = wait_until(
        lambda: events(node2, scope="access", direction="inbound"),
        timeout=POD_WAIT_SECONDS,
        what="node 2's access log of the refused connection",
    )
    assert denied["src.addr"].startswith(f"{OUTSIDE_IP}:") and denied["dst.addr"] == f"{POD_B_IP}:{APP_PORT}", denied
    assert denied["outcome"] == "refused" and denied["level"] == "error", denied
    assert denied["error"] in ("denied by policy default/outside-deny", "no allow policy matched"), denied
    assert (
        node2.proxy.metric(
            "istio_tcp_connections_closed_total",
            reporter="destination",
            connection_security_policy="unknown",
            response_flags="DENY",
        )
        == 1
    )


@pytest.mark.parametrize("netns_prefix", ["ztw17-"])
def test_plaintext_inbound_to_the_proxys_own_port_is_refused(network, nodes, echo_b):
    """Traffic captured to 15006 whose original destination is the proxy's own 15008: a self-call."""
    pod_b = network.pods["b"]
    outside = network.add_pod("out", OUTSIDE_IP, "uid-outside", "outside")
    node2 = nodes(2)
    serve_pod(node2, pod_b, check_not_ready=False)
    pod_b.redirect_inbound(app_port=15008)

    report = roundtrip(outside, POD_B_IP, 15008, 1_000)
    assert report["received"] == 0, report
    (refused,) = wait_until(
        lambda: events(node2, scope="access", direction="inbound"),
        timeout=POD_WAIT_SECONDS,
        what="node 2's access log of the self-call",
    )
    assert refused["dst.addr"] == f"{POD_B_IP}:15008" and refused["outcome"] == "refused", refused
    assert refused["error"] == "self-call: port 15008 is the proxy's own", refused


# -- 6. an Add before discovery knows the pod --------------------------------------------------------


def test_pod_added_before_discovery_is_captured_at_once_and_discovery_fills_in_later(tmp_path, network, nodes, echo_b):
    """As in ztunnel, the agent's workload info alone starts pod B's proxy: node 2's configuration does not
    describe pod B yet, the Add is acked, B's listeners open and A's tunnel to B is served with B's identity.
    When node 2's configuration gains pod B, the proxy takes its addresses from there."""
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    node2_config = tmp_path / "node2-mesh.yaml"
    node2_config.write_text(mesh_workloads(pod_a.mesh_entry("node-1")))  # discovery on node 2: no pod B
    node1 = nodes(1)
    node2 = InpodNode(tmp_path, 2, NET, config=node2_config, state_dir=tmp_path / "state").start()
    try:
        serve_pod(node1, pod_a)
        serve_pod(node2, pod_b)  # asserts the Add was acked with success and readiness turned 200
        assert set(pod_listeners(pod_b)) >= POD_PORTS
        (served,) = [w for w in node2.proxy.config_dump()["workloads"] if w["uid"] == pod_b.uid]
        assert served["local"] and served["workloadIps"] == [] and served["identity"] == POD_B_IDENTITY

        report = roundtrip(pod_a, POD_B_IP, APP_PORT, 100_000)
        assert report["exact"], report
        (inn,) = wait_until(
            lambda: events(node2, scope="access", direction="inbound"),
            timeout=POD_WAIT_SECONDS,
            what="node 2's access log",
        )
        assert inn["dst.addr"] == f"{POD_B_IP}:{APP_PORT}" and inn["dst.workload"] == "pod-b" and "error" not in inn
        assert inn["src.identity"] == POD_A_IDENTITY and inn["dst.identity"] == POD_B_IDENTITY

        # Discovery catches up: the running proxy learns pod B's address, and keeps serving.
        replacement = tmp_path / "node2-mesh.yaml.new"
        replacement.write_text(mesh_workloads(pod_a.mesh_entry("node-1"), pod_b.mesh_entry("node-2")))
        replacement.rename(node2_config)

        def discovered():
            (entry,) = [w for w in node2.proxy.config_dump()["workloads"] if w["uid"] == pod_b.uid]
            return entry if entry["workloadIps"] == [POD_B_IP] else None

        entry = wait_until(discovered, timeout=POD_WAIT_SECONDS, what="node 2 to apply pod B's discovery")
        assert entry["local"]
        report = roundtrip(pod_a, POD_B_IP, APP_PORT, 100_000)
        assert report["exact"], report
        assert len(events(node2, scope="access", direction="inbound")) == 2
    finally:
        node2.stop()
