from __future__ import annotations

import textwrap

import pytest

from tests.support import TEST_NET, EchoServer, SinkServer, mesh_workload, mesh_workloads, pod_uid
from ztwisted.tools.harness import NodeProcess

# Every address is in 127.<NET>.0.0/16, so separate runs can share a machine.
NET = TEST_NET
CLIENT_IP = f"127.{NET}.2.1"
SERVER_IP = f"127.{NET}.3.1"
SINK_IP = f"127.{NET}.3.2"
ECHO_VIP = f"127.{NET}.10.1"
NODE_A_CONTROL_IP = f"127.{NET}.2.254"
NODE_B_CONTROL_IP = f"127.{NET}.3.254"

ECHO_SERVICE_PORTS = '{"default/echo.default.svc.cluster.local": {80: 8080}}'
TWO_NODE_MESH = mesh_workloads(
    mesh_workload("client", CLIENT_IP, "node-a", uid=pod_uid("client")),
    mesh_workload("echo", SERVER_IP, "node-b", uid=pod_uid("echo"), services=ECHO_SERVICE_PORTS),
    mesh_workload("sink", SINK_IP, "node-b", uid=pod_uid("sink")),
) + textwrap.dedent(
    f"""\
    services:
    - name: echo
      namespace: default
      hostname: echo.default.svc.cluster.local
      vips: ["/{ECHO_VIP}"]
      ports: {{80: 8080}}
    """
)


class TwoNodes:
    def __init__(self, tmp_path, mesh_text: str = TWO_NODE_MESH):
        self.config = tmp_path / "mesh.yaml"
        self.config.write_text(mesh_text)
        state = tmp_path / "state"
        self.a = NodeProcess(
            tmp_path / "a",
            name="node-a",
            control_ip=NODE_A_CONTROL_IP,
            config=self.config,
            node="node-a",
            state_dir=state,
        )
        self.b = NodeProcess(
            tmp_path / "b",
            name="node-b",
            control_ip=NODE_B_CONTROL_IP,
            config=self.config,
            node="node-b",
            state_dir=state,
        )

    def start(self):
        self.b.start()
        try:
            self.a.start()
        except BaseException:
            self.stop()  # no orphaned node-b holding the ports
            raise
        return self

    def stop(self):
        for node in (self.a, self.b):
            try:
                node.stop()
            except RuntimeError:
                node.kill()


@pytest.fixture
def echo_app():
    server = EchoServer(SERVER_IP, 8080)
    yield server
    server.close()


@pytest.fixture
def sink_app():
    """The slow reader: accepts on SINK_IP:8080 and never reads."""
    server = SinkServer(SINK_IP, 8080)
    yield server
    server.close()


@pytest.fixture
def two_nodes(tmp_path, echo_app):
    nodes = TwoNodes(tmp_path).start()
    yield nodes
    nodes.stop()
