"""Netns mode (root): every pod in its own network namespace, the proxies in in-pod mode.

Each pod namespace (``ztw<net>-<pid>-<pod>``) has one address on ``eth0``,
the end of a veth pair whose other end is in a router namespace
(``ztw<net>-<pid>-router``, with forwarding on) that stands in for the
node's host network. Node A and node B run ``twistd ztunnel --inpod``, each
driven by its own ``ztunnel-agent``, which hands them the pods' namespaces
(Add), tells node B that B1 is terminating (ShutdownStarting) and deletes it
(Del, whose Ack the lab times). The client pods have istio-cni's redirect
rule, an iptables ``REDIRECT`` of their connections to the service VIP to
their proxy's port 15001 (its own marked traffic excepted), and the apps run
in threads that entered the pods' namespaces. The teardown deletes B1's
veth: its address really vanishes. Discovery and certificates come from one
``ztunnel-control-plane`` (see :class:`NetnsPlatform`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import attr

from ztwisted.netns import call_in_netns, enter_netns
from ztwisted.tools.harness import NodeProcess, terminate
from ztwisted.tools.lab.mesh import APP_PORT, SERVICE_PORT, write_mesh
from ztwisted.tools.lab.platform import LabError, Platform
from ztwisted.tools.lab.server import ServerApp
from ztwisted.tools.system import missing_for_network_setup

PACKET_MARK = 1337  # the in-pod proxy's mark on its own sockets
UNIX_PATH_MAX = 108  # sun_path, with its terminating NUL
ROUTER_ADDRESS = "169.254.1.1"  # the pods' gateway, on every router-side veth
PODS = {
    "client-pool": ("client", "node-a"),
    "client-req": ("client", "node-a"),
    "b1": ("echo", "node-b"),
    "b2": ("echo", "node-b"),
}


@attr.s(frozen=True)
class NetnsAddresses:
    """Pods in 10.<net>.0.0/16 (private to the lab's namespaces); the proxies' own ports on 127.<net>.x.y."""

    net: int = attr.ib(default=91)

    pool_client = property(lambda self: f"10.{self.net}.2.1")
    request_client = property(lambda self: f"10.{self.net}.2.2")
    b1 = property(lambda self: f"10.{self.net}.3.1")
    b2 = property(lambda self: f"10.{self.net}.3.2")
    vip = property(lambda self: f"10.{self.net}.10.1")
    node_a = property(lambda self: f"127.{self.net}.2.254")
    node_b = property(lambda self: f"127.{self.net}.3.254")
    agent_a = property(lambda self: f"127.{self.net}.2.253")
    agent_b = property(lambda self: f"127.{self.net}.3.253")
    control_plane = property(lambda self: f"127.{self.net}.1.1")

    @property
    def network(self) -> str:
        return f"10.{self.net}.0.0/16"

    def pod_ip(self, pod: str) -> str:
        return {"client-pool": self.pool_client, "client-req": self.request_client, "b1": self.b1, "b2": self.b2}[pod]


def missing_for_netns() -> list[str]:
    """What this machine or this ztwisted lacks for netns mode (empty: nothing)."""
    # iptables: the client pods' redirect to their proxy (SO_ORIGINAL_DST needs a NAT rule)
    missing = missing_for_network_setup("ip", "iptables")
    if importlib.util.find_spec("ztwisted.tools.agent") is None:
        missing.append("ztwisted.tools.agent (the ZDS node agent)")
    if importlib.util.find_spec("grpc") is None:
        missing.append(
            "grpcio, for the lab control plane that feeds both nodes (pip install 'ztwisted[control-plane]')"
        )
    return missing


def check_netns_mode() -> None:
    missing = missing_for_netns()
    if missing:
        raise LabError(
            "--mode netns is not available here; missing:\n  - "
            + "\n  - ".join(missing)
            + "\nUse --mode loopback (the default)."
        )


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise LabError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.returncode}")


class Namespaces:
    """A router namespace and pod namespaces joined to it by veth pairs.

    Names are ``ztw<net>-<pid>-<pod>`` (``ztunnel-lab cleanup`` finds those
    of a dead process). The router (``ztw<net>-<pid>-router``, forwarding on)
    stands in for the nodes' host network; each pod gets ``eth0``, the end of
    a veth pair whose router end is ``r-<pod>``, with its addresses as /32s
    and a default route to the router. The lab and the ztunnel peer runner
    (:mod:`ztwisted.tools.lab.ztunnel_peer`) share it.
    """

    def __init__(self, net: int):
        self.prefix = f"ztw{net}-{os.getpid()}"
        self.router = f"{self.prefix}-router"
        self.made: list[str] = []

    def path(self, pod: str) -> str:
        return f"/var/run/netns/{self.prefix}-{pod}"

    def name(self, pod: str) -> str:
        return f"{self.prefix}-{pod}"

    def add_router(self) -> None:
        self._add(self.router)
        for setting in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
            _run("ip", "netns", "exec", self.router, "sysctl", "-qw", setting)

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def add_pod(self, pod: str, *ips: str) -> str:
        """A namespace for ``pod`` (at most 13 characters) with ``ips`` on its eth0; its path."""
        if len(f"r-{pod}") > 15:
            raise LabError(f"pod name {pod!r} is too long for an interface name (at most 13 characters)")
        name = self.name(pod)
        self._add(name)
        outside = f"r-{pod}"
        _run("ip", "-n", self.router, "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", name)
        _run("ip", "-n", self.router, "addr", "add", f"{ROUTER_ADDRESS}/32", "dev", outside)
        _run("ip", "-n", self.router, "link", "set", outside, "up")
        for ip in ips:
            _run("ip", "-n", self.router, "route", "add", f"{ip}/32", "dev", outside)
            _run("ip", "-n", name, "addr", "add", f"{ip}/32", "dev", "eth0")
        _run("ip", "-n", name, "link", "set", "eth0", "up")
        _run("ip", "-n", name, "route", "add", f"{ROUTER_ADDRESS}/32", "dev", "eth0")
        _run("ip", "-n", name, "route", "add", "default", "via", ROUTER_ADDRESS, "dev", "eth0")
        return self.path(pod)

    def unplug(self, pod: str) -> None:
        """The CNI's teardown: delete the pod's veth (both ends go)."""
        _run("ip", "-n", self.router, "link", "del", f"r-{pod}")

    def destroy(self) -> None:
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()


def create_lab_namespaces(namespaces: Namespaces, addresses: NetnsAddresses) -> None:
    """The lab's router and pods; the client pods get istio-cni's redirect to their proxy's 15001."""
    namespaces.add_router()
    for pod in PODS:
        namespaces.add_pod(pod, addresses.pod_ip(pod))
    for pod in ("client-pool", "client-req"):
        _run(
            "ip",
            "netns",
            "exec",
            namespaces.name(pod),
            "iptables",
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "-d",
            f"{addresses.vip}/32",
            "-m",
            "mark",
            "!",
            "--mark",
            str(PACKET_MARK),
            "-j",
            "REDIRECT",
            "--to-ports",
            "15001",
        )


def leftover_namespaces(net: int) -> list[str]:
    """Namespaces of lab runs (``ztw<net>-<pid>-...``) whose process is gone."""
    try:
        names = os.listdir("/var/run/netns")
    except OSError:
        return []
    left = []
    for name in names:
        parts = name.split("-", 2)
        if (
            len(parts) == 3
            and parts[0] == f"ztw{net}"
            and parts[1].isdigit()
            and not Path(f"/proc/{parts[1]}").exists()
        ):
            left.append(name)
    return sorted(left)


class Agent:
    """A ``ztunnel-agent serve`` process and its control API."""

    def __init__(self, name: str, workdir: Path, control_ip: str):
        self.name = name
        self.socket_path = workdir / f"{name}.sock"
        self._short_dir = None
        if len(os.fsencode(self.socket_path)) >= UNIX_PATH_MAX:
            # A Unix socket's path has at most 107 bytes; a deep --out (or pytest's tmp_path) exceeds it.
            self._short_dir = tempfile.mkdtemp(prefix="ztw-agent-")
            self.socket_path = Path(self._short_dir) / f"{name}.sock"
        self.control = f"http://{control_ip}:15099"
        self.log_path = workdir / f"{name}.log"
        self.workdir = workdir
        self.control_ip = control_ip
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ztwisted.tools.agent",
                "serve",
                "--socket",
                str(self.socket_path),
                "--control",
                f"tcp:15099:interface={self.control_ip}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LabError(f"{self.name} exited with {self.process.returncode} (log: {self.log_path})")
            try:
                urllib.request.urlopen(f"{self.control}/status", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise LabError(f"{self.name}'s control API did not answer within 15 s (log: {self.log_path})")

    def call(self, operation: str, timeout: float = 30.0, **body) -> tuple[dict, float]:
        """POST an operation; (the JSON answer with every proxy's Ack, seconds until it came)."""
        request = urllib.request.Request(
            f"{self.control}/{operation}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise LabError(
                f"{self.name} {operation} {body.get('uid', '')}: {e.code} {e.read().decode(errors='replace').strip()}"
            ) from None
        except OSError as e:
            raise LabError(f"{self.name} {operation}: {e}") from None
        return answer, time.monotonic() - started

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)


def _uid(pod: str) -> str:
    return f"lab//v1/Pod/default/{pod}"


class NetnsPlatform(Platform):
    """Pods in namespaces; discovery and certificates for both nodes from one ``ztunnel-control-plane``.

    The lab's "unready" and "removed" are calls to the control plane's API
    (``POST /workloads/b1/unhealthy``, ``DELETE /workloads/b1``); it pushes
    them over xDS to every node at once, as istiod does. Node B's inbound
    does not look at B1's health, so B1 being unhealthy changes nothing there
    until it is gone.
    """

    mode = "netns"
    discovery_via = "the lab control plane's API, pushed over xDS to both nodes"

    def __init__(self, config, workdir: Path, state_dir: Path):
        super().__init__(config, workdir, state_dir)
        self.addresses = NetnsAddresses(config.net)
        self.namespaces = Namespaces(self.addresses.net)

    def start(self, node_args: tuple[str, ...]) -> None:
        check_netns_mode()
        xds_args = self._start_control_plane()
        self.cleanup.callback(self.namespaces.destroy)
        create_lab_namespaces(self.namespaces, self.addresses)
        self._start_server_apps()
        self.agents = {
            "node-a": self._start_agent("node-a", self.addresses.agent_a),
            "node-b": self._start_agent("node-b", self.addresses.agent_b),
        }
        self.node_b = self._ztwisted_node("node-b", self.addresses.node_b, node_args + xds_args)
        if self.config.client_proxy == "ztunnel":
            self._start_ztunnel_node_a()
        else:
            self.node_a = self._ztwisted_node("node-a", self.addresses.node_a, node_args + xds_args)
        self._add_pods()

    def _start_control_plane(self) -> tuple[str, ...]:
        """The ``ztunnel-control-plane`` serving the lab's mesh; the proxies' arguments to use it for xDS and CA."""
        from ztwisted.tools.control_plane import ControlPlaneProcess

        addresses = self.addresses
        mesh = self.workdir / "discovery" / "mesh.yaml"
        write_mesh(mesh, addresses)
        self.control_plane = ControlPlaneProcess(
            self.workdir / "discovery",
            mesh,
            listen=f"{addresses.control_plane}:15012",
            api=f"{addresses.control_plane}:15014",
        )
        try:
            self.control_plane.start()
        except RuntimeError as e:
            raise LabError(f"cannot start the lab control plane: {e}") from None
        self.cleanup.callback(self.control_plane.stop)
        root = str(self.control_plane.root_cert)
        return ("--xds-address", self.control_plane.address, "--xds-root-ca", root, "--ca-root-ca", root)

    def _start_server_apps(self) -> None:
        """B1's and B2's echo apps, each listening in its pod's namespace."""
        addresses = self.addresses
        self.b1_app = call_in_netns(self.namespaces.path("b1"), ServerApp("b1", addresses.b1, APP_PORT).start)
        self.cleanup.callback(self.b1_app.close)
        b2 = call_in_netns(self.namespaces.path("b2"), ServerApp("b2", addresses.b2, APP_PORT).start)
        self.cleanup.callback(b2.close)

    def _start_agent(self, node: str, control_ip: str) -> Agent:
        """The ``ztunnel-agent`` of ``node``: the lab tells it which pods to hand its proxy, and when."""
        agent = Agent(f"agent-{node[-1]}", self.workdir / "agents", control_ip)
        agent.start()
        self.cleanup.callback(agent.stop)
        return agent

    def _ztwisted_node(self, name: str, control_ip: str, args: tuple[str, ...]) -> NodeProcess:
        """A started ``twistd ztunnel --inpod`` for ``name``, served pods by that node's agent."""
        node = self.node(name, control_ip, None, args + ("--inpod-uds", str(self.agents[name].socket_path)))
        self.start_node(node)
        return node

    def _start_ztunnel_node_a(self) -> None:
        """Istio's ztunnel as node A (``--client-proxy ztunnel``), fed by the same control plane and agent."""
        from ztwisted.tools.lab.ztunnel_client import ZtunnelNodeA

        self.node_a = ZtunnelNodeA(
            self.namespaces, self.workdir / "node-a", self.control_plane, self.agents["node-a"].socket_path
        )
        self.cleanup.callback(self.node_a.stop)
        self.node_a.start()

    def _add_pods(self) -> None:
        """Each node's agent hands its proxy the pods of that node (ZDS Add); every proxy must Ack."""
        for pod, (service_account, node) in PODS.items():
            answer, _ = self.agents[node].call(
                "add",
                uid=_uid(pod),
                name=pod,
                namespace="default",
                service_account=service_account,
                netns=self.namespaces.path(pod),
            )
            failed = [ack for ack in answer.get("acks", []) if not ack.get("ok")]
            if failed or not answer.get("acks"):
                raise LabError(f"{node} did not start pod {pod}: {failed or answer}")

    def change_discovery(self, b1: str) -> None:
        method, path = ("POST", "/workloads/b1/unhealthy") if b1 == "unready" else ("DELETE", "/workloads/b1")
        try:
            status, body = self.control_plane.api(method, path)
        except OSError as e:
            raise LabError(f"the lab control plane's API ({method} {path}): {e}") from None
        if status != 200:
            raise LabError(f"the lab control plane's API answered {method} {path} with {status}: {body}")

    def watch_wire(self, clock):
        from ztwisted.tools.lab.wire import WireWatch

        watch = WireWatch(
            clock,
            [self.namespaces.path(pod) for pod, (_, node) in PODS.items() if node == "node-a"],
            {self.addresses.b1: "b1", self.addresses.b2: "b2"},
        )
        self.cleanup.callback(watch.stop)
        return watch.start()

    def client(self, pod: str) -> dict:
        vip, path = self.addresses.vip, self.namespaces.path(pod)
        return {
            "connect": lambda timeout: socket.create_connection((vip, SERVICE_PORT), timeout=timeout),
            "enter": lambda: enter_netns(path),
            "tunnel_opened_on_connect": False,
        }

    def pod_terminating(self) -> dict:
        answer, took = self.agents["node-b"].call("shutdown-starting", uid=_uid("b1"))
        acks = answer.get("acks", [])
        return {"status": 200 if acks and all(a.get("ok") for a in acks) else 500, "answered_in_s": round(took, 4)}

    def delete_pod(self) -> dict:
        answer, took = self.agents["node-b"].call("delete", uid=_uid("b1"), timeout=self.config.pod_drain_timeout + 30)
        acks = answer.get("acks", [])
        ok = bool(acks) and all(a.get("ok") for a in acks)
        latencies = [a["latency_ms"] / 1000 for a in acks if a.get("latency_ms") is not None]
        return {
            "status": 200 if ok else 500,
            "delete_to_ack_s": round(max(latencies), 4) if latencies else round(took, 4),
            "acks": acks,
        }

    def teardown(self) -> tuple[str, str | None]:
        if not self.config.teardown:
            return "skipped", "network teardown: skipped (--no-teardown); B1's veth stays"
        self.namespaces.unplug("b1")
        return "veth deleted", (
            "netns mode: a router namespace stands in for the nodes' host network, and both proxies run on "
            "the host; the teardown deletes B1's veth for real"
        )
