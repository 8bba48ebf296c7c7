"""In-pod mode fed by xDS: the node agent adds pods, discovery and the CA come from the lab control plane."""

from __future__ import annotations

import time

import pytest

from tests.integration.conftest import NET
from tests.integration.inpod_support import APP_PORT, InpodNode, acks_ok, roundtrip
from tests.integration.test_inpod_e2e import (  # noqa: F401 (fixtures)
    POD_B_IP,
    apps,
    echo_b,
    events,
    network,
    serve_pod,
)
from tests.support import mesh_workloads, wait_until
from ztwisted.tools.control_plane import ControlPlaneProcess

pytestmark = [pytest.mark.integration, pytest.mark.root]

CONTROL_PLANE_IP = f"127.{NET}.0.51"


@pytest.fixture
def netns_prefix():
    """Namespaces of their own: other runs of the in-pod tests remove theirs (ztw12-*) when they start."""
    return f"ztw{NET}i-"


@pytest.fixture
def control_plane(tmp_path, network):  # noqa: F811
    path = tmp_path / "mesh.yaml"
    pod_a, pod_b = network.pods["a"], network.pods["b"]
    path.write_text(mesh_workloads(pod_a.mesh_entry("node-1"), pod_b.mesh_entry("node-2")))
    plane = ControlPlaneProcess(
        tmp_path, path, listen=f"{CONTROL_PLANE_IP}:15012", api=f"{CONTROL_PLANE_IP}:15014"
    ).start()
    yield plane
    plane.stop()


def xds_node(tmp_path, number: int, control_plane, *extra_args: str) -> InpodNode:
    """An in-pod node with neither a config file nor a CA of its own: discovery and certificates
    come from ``control_plane``."""
    return InpodNode(
        tmp_path,
        number,
        NET,
        config=None,
        state_dir=tmp_path / f"state-{number}",
        extra_args=(
            "--xds-address",
            control_plane.address,
            "--xds-root-ca",
            str(control_plane.root_cert),
            "--ca-root-ca",
            str(control_plane.root_cert),
            *extra_args,
        ),
    )


def test_pods_added_by_the_node_agent_are_served_with_workloads_and_certificates_from_the_control_plane(
    tmp_path,
    network,  # noqa: F811
    control_plane,
    echo_b,  # noqa: F811
):
    started = []
    try:
        for number in (1, 2):
            node = xds_node(tmp_path, number, control_plane)
            started.append(node)
            node.start()
        node1, node2 = started
        serve_pod(node1, network.pods["a"], check_not_ready=False)
        serve_pod(node2, network.pods["b"], check_not_ready=False)
        report = roundtrip(network.pods["a"], POD_B_IP, APP_PORT, 100_000)
        assert report["exact"], report
        (inbound,) = wait_until(
            lambda: events(node2, scope="access", direction="inbound"), timeout=10, what="node 2's access log"
        )
        assert inbound["src.identity"] == "spiffe://cluster.local/ns/default/sa/pod-a"
        signed = {san for entry in control_plane.state()["signed"] for san in entry["sans"]}
        assert signed == {"spiffe://cluster.local/ns/default/sa/pod-a", "spiffe://cluster.local/ns/default/sa/pod-b"}
    finally:
        for node in started:
            node.stop()


def test_a_removed_pods_certificate_from_the_control_plane_stops_renewing_and_leaves_the_config_dump(
    tmp_path,
    network,  # noqa: F811
    control_plane,
):
    pod_b = network.pods["b"]
    identity = "spiffe://cluster.local/ns/default/sa/pod-b"
    # Renewed at half-life: every 2 s, so that a renewal that goes on would show.
    node = xds_node(tmp_path, 2, control_plane, "--secret-ttl", "4s")

    def signed_for_b() -> int:
        return sum(identity in entry["sans"] for entry in control_plane.state()["signed"])

    def dumped() -> list[str]:
        return [certificate["identity"] for certificate in node.proxy.config_dump()["certificates"]]

    try:
        node.start()
        serve_pod(node, pod_b, check_not_ready=False)
        assert identity in dumped()
        wait_until(lambda: signed_for_b() >= 2, timeout=20, what="pod b's certificate to be renewed")
        code, reply = node.agent.call("delete", {"uid": pod_b.uid})
        assert code == 200 and acks_ok(reply), reply
        wait_until(lambda: identity not in dumped(), timeout=10, what="pod b's certificate to leave the config dump")
        time.sleep(1)  # a renewal already asked for when the pod went is answered (and dropped)
        signed = signed_for_b()
        time.sleep(6)  # three renewal periods
        assert signed_for_b() == signed, "a removed pod's certificate is no longer renewed"
        assert identity not in dumped()
    finally:
        node.stop()
