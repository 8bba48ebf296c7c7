"""Fixtures for interop tests: a ztwisted node, and independent HBONE peers (Node.js, Envoy).

The mesh has one ztwisted node, ``node-z``, with two local workloads
(``client`` and ``echo``), and two workloads on ``peer-node``, a node no
ztwisted process serves: their HBONE side is the peer under test. All peers
get certificates from the CA the ztwisted node uses. When a test fails, the
log tails of every process it started are added to the report.
"""

from __future__ import annotations

import socket
import textwrap
import threading
import time

import pytest

from tests.interop.peers import (
    ENVOY_CLIENT_TEMPLATE,
    ENVOY_SERVER_TEMPLATE,
    EnvoyPeer,
    NodePeer,
    PeerCredentials,
    PeerMissing,
    find_envoy,
    find_node,
    unique_base_id,
    write_credentials,
)
from tests.support import TEST_NET, EchoServer, recv_all
from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import NodeProcess, recv_exact

NET = TEST_NET
ZT_CONTROL_IP = f"127.{NET}.40.254"
ZT_CLIENT_IP = f"127.{NET}.40.1"
ZT_ECHO_IP = f"127.{NET}.40.2"
PEER_CLIENT_IP = f"127.{NET}.41.1"
PEER_SERVER_IP = f"127.{NET}.41.2"
PEER_ADMIN_IP = f"127.{NET}.41.254"
PEER_SERVICE_VIP = f"127.{NET}.42.1"
PEER_SERVICE_HOSTNAME = "peer.default.svc.cluster.local"
APP_PORT = 8080
HBONE_PORT = 15008
ENVOY_APP_PORT = 10000

PAYLOAD_SIZE = 1024 * 1024
# More than ztwisted's 4 MiB stream window, so a tunnel lives on WINDOW_UPDATEs.
BEYOND_WINDOW = 5 * 1024 * 1024

TRUST_DOMAIN = "cluster.local"
ZT_NODE = "node-z"
PEER_NODE = "peer-node"


def identity(service_account: str) -> SpiffeId:
    return SpiffeId(TRUST_DOMAIN, "default", service_account)


CLIENT_ID = identity("client")
ECHO_ID = identity("echo")
PEER_CLIENT_ID = identity("peer-client")
PEER_SERVER_ID = identity("peer-server")

INTEROP_MESH = textwrap.dedent(
    f"""
    workloads:
    - uid: cluster1//v1/Pod/default/client
      name: client
      namespace: default
      serviceAccount: client
      workloadIps: ["{ZT_CLIENT_IP}"]
      protocol: HBONE
      node: {ZT_NODE}
    - uid: cluster1//v1/Pod/default/echo
      name: echo
      namespace: default
      serviceAccount: echo
      workloadIps: ["{ZT_ECHO_IP}"]
      protocol: HBONE
      node: {ZT_NODE}
    - uid: cluster1//v1/Pod/default/peer-client
      name: peer-client
      namespace: default
      serviceAccount: peer-client
      workloadIps: ["{PEER_CLIENT_IP}"]
      protocol: HBONE
      node: {PEER_NODE}
    - uid: cluster1//v1/Pod/default/peer-server
      name: peer-server
      namespace: default
      serviceAccount: peer-server
      workloadIps: ["{PEER_SERVER_IP}"]
      protocol: HBONE
      node: {PEER_NODE}
      services: {{"default/{PEER_SERVICE_HOSTNAME}": {{80: {APP_PORT}}}}}
    services:
    - name: peer
      namespace: default
      hostname: {PEER_SERVICE_HOSTNAME}
      vips: ["/{PEER_SERVICE_VIP}"]
      ports: {{80: {APP_PORT}}}
    """
)

# The two ways test apps address the peer-served workload through SOCKS5.
PEER_SERVER_DESTINATIONS = [
    pytest.param((PEER_SERVER_IP, APP_PORT), id="workload-ip"),
    pytest.param((PEER_SERVICE_HOSTNAME, 80), id="service-hostname"),
]


def echo_through(sock: socket.socket, payload: bytes, pause_at: int | None = None, during_pause=None) -> bytes:
    """Send ``payload`` and half-close (from a thread), return everything read until EOF.

    With ``pause_at``, ``during_pause()`` runs after that many bytes were sent
    and before the rest is.
    """
    errors = []

    def send():
        try:
            if pause_at is not None:
                sock.sendall(payload[:pause_at])
                during_pause()
                sock.sendall(payload[pause_at:])
            else:
                sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except Exception as e:  # noqa: BLE001 -- reported by the caller's thread
            errors.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        received = recv_all(sock)
    finally:
        sender.join(20)
    if errors:
        raise errors[0]
    return received


def describe_mismatch(received: bytes, payload: bytes) -> str:
    if received == payload:
        return "identical"
    first = next(
        (i for i, (a, b) in enumerate(zip(received, payload, strict=False)) if a != b), min(len(received), len(payload))
    )
    return f"received {len(received)} of {len(payload)} bytes, first difference at offset {first}"


def wait_for_metric(node: NodeProcess, name: str, expected: float, timeout: float = 5.0, **labels) -> float:
    """The metric's value once it equals ``expected``, or whatever it is after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = node.metric(name, **labels)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def assert_peer_client_counted(node: NodeProcess) -> None:
    """ztwisted's inbound named the peer client by its certificate and address in istio_tcp_* metrics."""
    opened = wait_for_metric(
        node,
        "istio_tcp_connections_opened_total",
        1,
        reporter="destination",
        source_workload="peer-client",
        source_principal=str(PEER_CLIENT_ID),
        destination_workload="echo",
        connection_security_policy="mutual_tls",
    )
    assert opened == 1


# -- process bookkeeping and failure reports --------------------------------------


class ProcessRegistry:
    """Processes a test started: stopped at teardown (newest first), log tails shown on failure."""

    def __init__(self):
        self.processes = []

    def add(self, process):
        self.processes.append(process)
        return process

    def stop_all(self):
        for process in reversed(self.processes):
            try:
                process.stop()
            except Exception:  # noqa: BLE001 -- stop the others regardless
                process.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    registry = getattr(item, "_interop_processes", None)
    if report.failed and registry is not None and call.when in ("setup", "call"):
        for process in registry.processes:
            report.sections.append((f"log tail of {process.name}", process.log_tail(60)))


@pytest.fixture
def interop_processes(request):
    registry = ProcessRegistry()
    request.node._interop_processes = registry
    yield registry
    registry.stop_all()


# -- binaries: missing ones fail the test (CI installs them) -----------------------


def _binary_or_fail(find) -> str:
    try:
        return find()
    except PeerMissing as e:
        problem = str(e)
    pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def node_binary() -> str:
    return _binary_or_fail(find_node)


@pytest.fixture(scope="session")
def envoy_binary() -> str:
    return _binary_or_fail(find_envoy)


# -- PKI and the ztwisted node --------------------------------------------------------


@pytest.fixture
def state_dir(tmp_path):
    return tmp_path / "state"


@pytest.fixture
def ca(state_dir) -> CertificateAuthority:
    """The dev CA, created before the node starts; the node loads the same files."""
    return CertificateAuthority.load_or_create_dev(state_dir)


@pytest.fixture
def credentials(ca, tmp_path):
    """``credentials(SpiffeId)`` -> PEM files for a peer, issued by the node's CA."""

    def issue(spiffe_id: SpiffeId, issuer: CertificateAuthority | None = None) -> PeerCredentials:
        return write_credentials(issuer or ca, spiffe_id, tmp_path / "peer-certs" / spiffe_id.service_account)

    return issue


@pytest.fixture
def start_ztwisted(tmp_path, state_dir, ca, interop_processes):
    """``start_ztwisted(*extra_args)`` -> the started ztwisted node ``node-z`` of the interop mesh.

    ``process_name`` names the process's directory and log, so a restarted
    node (same addresses, same CA) keeps its predecessor's log apart.
    """

    def start(*extra_args: str, process_name: str = ZT_NODE) -> NodeProcess:
        config = tmp_path / "mesh.yaml"
        config.write_text(INTEROP_MESH)
        node = NodeProcess(
            tmp_path / process_name,
            name=process_name,
            control_ip=ZT_CONTROL_IP,
            config=config,
            node=ZT_NODE,
            state_dir=state_dir,
            extra_args=extra_args,
        )
        interop_processes.add(node)
        return node.start()

    return start


@pytest.fixture
def ztwisted_node(start_ztwisted) -> NodeProcess:
    return start_ztwisted()


@pytest.fixture
def zt_echo_app():
    """The app of ztwisted's local workload ``echo``."""
    server = EchoServer(ZT_ECHO_IP, APP_PORT)
    yield server
    server.close()


class BannerEchoServer(EchoServer):
    """A server-first app: greets each connection with ``banner``, then echoes."""

    def __init__(self, ip: str, port: int, banner: bytes):
        self.banner = banner
        super().__init__(ip, port)

    def _echo(self, conn: socket.socket):
        try:
            conn.sendall(self.banner)
        except OSError:
            conn.close()
            return
        super()._echo(conn)


BANNER = b"220 echo ready\r\n"


@pytest.fixture
def zt_banner_app():
    """Instead of ``zt_echo_app``: workload ``echo`` runs a server-first app that sends BANNER."""
    server = BannerEchoServer(ZT_ECHO_IP, APP_PORT, BANNER)
    yield server
    server.close()


def lockstep_echo(sock: socket.socket, payload: bytes, chunk: int = 16 * 1024) -> None:
    """Send ``payload`` a chunk at a time, each only after the previous one came back."""
    for offset in range(0, len(payload), chunk):
        piece = payload[offset : offset + chunk]
        sock.sendall(piece)
        assert recv_exact(sock, len(piece)) == piece, f"echo differs in the chunk at offset {offset}"
    sock.shutdown(socket.SHUT_WR)
    assert recv_all(sock) == b"", "bytes after the last echo"


@pytest.fixture
def peer_echo_app():
    """The app of ``peer-server``, the workload whose HBONE side is a peer."""
    server = EchoServer(PEER_SERVER_IP, APP_PORT)
    yield server
    server.close()


# -- peers ------------------------------------------------------------------------------


@pytest.fixture
def node_peer(node_binary, tmp_path, interop_processes):
    """``node_peer(name, mode, config)`` -> a started NodePeer (``mode``: client or server)."""

    def start(name: str, mode: str, config: dict) -> NodePeer:
        peer = NodePeer(name, node_binary, mode, config, tmp_path / "peers")
        interop_processes.add(peer)
        peer.start()
        if mode == "server":
            peer.wait_for_event("listening", timeout=10)
        return peer

    return start


@pytest.fixture
def envoy_peer(envoy_binary, tmp_path, interop_processes):
    """``envoy_peer(name, "client"|"server", admin_port, extra_args=(), **template values)`` -> a ready EnvoyPeer."""

    def start(name: str, role: str, admin_port: int, extra_args: tuple[str, ...] = (), **values) -> EnvoyPeer:
        template = {"client": ENVOY_CLIENT_TEMPLATE, "server": ENVOY_SERVER_TEMPLATE}[role]
        peer = EnvoyPeer(
            name,
            envoy_binary,
            template,
            tmp_path / "peers",
            base_id=unique_base_id(NET),
            admin=(PEER_ADMIN_IP, admin_port),
            extra_args=extra_args,
            **values,
        )
        interop_processes.add(peer)
        return peer.start_and_wait_ready()

    return start
