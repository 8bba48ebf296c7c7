"""In-pod mode fed by xDS: the node agent adds pods, discovery and the CA come from the lab control plane."""

from __future__ import annotations

import pytest

from tests.integration.conftest import NET
from tests.integration.inpod_support import APP_PORT, InpodNode, roundtrip
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


def test_pods_added_by_the_node_agent_are_served_with_workloads_and_certificates_from_the_control_plane(
    tmp_path,
    network,  # noqa: F811
    control_plane,
    echo_b,  # noqa: F811
):
    started = []
    try:
        for number in (1, 2):
            node = InpodNode(
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
                ),
            )
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
