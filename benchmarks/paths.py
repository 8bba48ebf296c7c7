"""The benchmarked paths from a client app to the echo/sink app, and the processes behind them.

Every address is in 127.<net>.0.0/16 (net 41 by default):

- apps (echo :8080, sink :8081) on 127.<net>.3.1, the ``echo`` workload;
- the client app leaves from 127.<net>.2.1, the ``client`` workload;
- stunnel: client-mode listeners on 127.<net>.4.1, server-mode on 127.<net>.5.1;
- ztwisted: node-a's control IP 127.<net>.2.254 (SOCKS5 :15080), node-b's
  127.<net>.3.254; HBONE :15008 on each workload IP.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import NodeProcess

ECHO_PORT = 8080
SINK_PORT = 8081
TLS13_CIPHERSUITES = "TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256"  # ztwisted's (ztwisted/tls.py)


class Addresses:
    def __init__(self, net: int):
        self.client = f"127.{net}.2.1"
        self.app = f"127.{net}.3.1"
        self.stunnel_client = f"127.{net}.4.1"
        self.stunnel_server = f"127.{net}.5.1"
        self.node_a = f"127.{net}.2.254"
        self.node_b = f"127.{net}.3.254"


def wait_for_port(ip: str, port: int, what: str, process: subprocess.Popen | None = None, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before listening on {ip}:{port}")
        try:
            socket.create_connection((ip, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} is not listening on {ip}:{port} after {timeout} s")


class Apps:
    """The echo and sink apps, in their own process."""

    def __init__(self, addresses: Addresses):
        self.ip = addresses.app
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        script = Path(__file__).with_name("apps.py")
        self.process = subprocess.Popen(
            [sys.executable, str(script), self.ip, str(ECHO_PORT), str(SINK_PORT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"echo/sink apps failed to start on {self.ip}:{ECHO_PORT}/{SINK_PORT}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class BenchPath:
    """A way from the client app to the apps; ``echo``/``sink`` are load.py targets."""

    name = ""
    description = ""
    echo: dict
    sink: dict

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def pids(self) -> dict[str, int]:
        """Proxy processes by role (for profiling)."""
        return {}


class Direct(BenchPath):
    name = "direct"
    description = "client -> echo, plain TCP"

    def __init__(self, addresses: Addresses):
        self.echo = {"connect": [addresses.app, ECHO_PORT], "source_ip": addresses.client}
        self.sink = {"connect": [addresses.app, SINK_PORT], "source_ip": addresses.client}


def write_stunnel_certificates(ca: CertificateAuthority, directory: Path) -> dict[str, Path]:
    """Certificates from ztwisted's dev CA: the same CA and key type (EC P-256) the nodes use."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {"ca": directory / "roots.pem"}
    files["ca"].write_bytes(ca.roots_pem)
    for role, account in (("client", "client"), ("server", "echo")):
        issued = ca.issue(SpiffeId("cluster.local", "default", account))
        files[f"{role}_cert"] = directory / f"{role}-cert.pem"
        files[f"{role}_cert"].write_bytes(issued.cert_pem + issued.chain_pem)
        files[f"{role}_key"] = directory / f"{role}-key.pem"
        files[f"{role}_key"].write_bytes(issued.key_pem)
        files[f"{role}_key"].chmod(0o600)
    return files


class Stunnel(BenchPath):
    """Two stunnel processes: client mode next to the client app, server mode next to the apps.

    Mutual TLS 1.3 with ztwisted's cipher suites; every other setting is
    stunnel's default, which includes TLS session resumption (the client
    side caches the session). With ``resume=False`` both sides set
    ``sessionResume = no``, so every connection pays a full handshake, as
    ztunnel and ztwisted (which never resume) would without pooling.
    """

    def __init__(self, addresses: Addresses, workdir: Path, ca: CertificateAuthority, *, resume: bool = True):
        self.resume = resume
        self.name = "stunnel" if resume else "stunnel-noresume"
        self.description = "client -> stunnel client -> mTLS 1.3 -> stunnel server -> echo" + (
            "" if resume else " (session resumption off)")
        self.addresses = addresses
        self.workdir = workdir / self.name
        self.ca = ca
        offset = 0 if resume else 10
        self.ports = {"echo": (9000 + offset, 9443 + offset), "sink": (9001 + offset, 9444 + offset)}
        self.echo = {"connect": [addresses.stunnel_client, self.ports["echo"][0]], "source_ip": addresses.client}
        self.sink = {"connect": [addresses.stunnel_client, self.ports["sink"][0]], "source_ip": addresses.client}
        self.processes: dict[str, subprocess.Popen] = {}

    def _config(self, role: str, certs: dict[str, Path]) -> str:
        a = self.addresses
        lines = [
            "foreground = yes",
            "pid =",
            # stunnel's notice-level connection log goes to the file only: without a syslog
            # daemon, glibc's syslog writes every line to /dev/console, ~1 ms each.
            "syslog = no",
            f"output = {self.workdir / (role + '.log')}",
        ]
        for app, (client_port, server_port) in self.ports.items():
            lines += [
                f"[{app}]",
                "client = yes" if role == "client" else "client = no",
                f"accept = {a.stunnel_client}:{client_port}" if role == "client" else f"accept = {a.stunnel_server}:{server_port}",
                f"connect = {a.stunnel_server}:{server_port}" if role == "client" else f"connect = {a.app}:{ECHO_PORT if app == 'echo' else SINK_PORT}",
                f"cert = {certs[role + '_cert']}",
                f"key = {certs[role + '_key']}",
                f"CAfile = {certs['ca']}",
                "verifyChain = yes",
                "sslVersionMin = TLSv1.3",
                "sslVersionMax = TLSv1.3",
                f"ciphersuites = {TLS13_CIPHERSUITES}",
            ]
            if not self.resume:
                lines.append("sessionResume = no")
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        stunnel = shutil.which("stunnel4") or shutil.which("stunnel")
        if stunnel is None:
            raise RuntimeError("stunnel is not installed: apt-get install -y stunnel4")
        certs = write_stunnel_certificates(self.ca, self.workdir / "certs")
        for role in ("server", "client"):
            config = self.workdir / f"{role}.conf"
            config.write_text(self._config(role, certs))
            process = subprocess.Popen([stunnel, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.processes[role] = process
            ip = self.addresses.stunnel_server if role == "server" else self.addresses.stunnel_client
            for client_port, server_port in self.ports.values():
                wait_for_port(ip, server_port if role == "server" else client_port, f"stunnel {role}", process)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def pids(self) -> dict[str, int]:
        return {f"stunnel-{role}": p.pid for role, p in self.processes.items()}


MESH = textwrap.dedent(
    """\
    workloads:
    - uid: cluster1//v1/Pod/default/client
      name: client
      namespace: default
      serviceAccount: client
      workloadIps: ["{client}"]
      protocol: HBONE
      node: node-a
    - uid: cluster1//v1/Pod/default/echo
      name: echo
      namespace: default
      serviceAccount: echo
      workloadIps: ["{app}"]
      protocol: HBONE
      node: node-b
    """
)


class Ztwisted(BenchPath):
    """Two ``twistd -n ztunnel`` nodes; the client app uses node-a's SOCKS5 listener.

    Every new app connection pays a SOCKS5 handshake (two round trips to
    node-a: method selection, then CONNECT, whose reply comes once node-b
    has the HBONE stream open to the app) before its first byte.
    """

    name = "ztwisted"
    description = "client -> SOCKS5 node-a -> HBONE (pooled mTLS 1.3 + HTTP/2) -> node-b -> echo"

    def __init__(self, addresses: Addresses, workdir: Path, state_dir: Path):
        self.addresses = addresses
        self.workdir = workdir / "ztwisted"
        self.state_dir = state_dir
        socks5 = [addresses.node_a, 15080]
        self.echo = {"connect": [addresses.app, ECHO_PORT], "source_ip": addresses.client, "socks5": socks5}
        self.sink = {"connect": [addresses.app, SINK_PORT], "source_ip": addresses.client, "socks5": socks5}
        self.nodes: list[NodeProcess] = []

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "mesh.yaml"
        config.write_text(MESH.format(client=self.addresses.client, app=self.addresses.app))
        for name, ip in (("node-b", self.addresses.node_b), ("node-a", self.addresses.node_a)):
            node = NodeProcess(self.workdir / name, name=name, control_ip=ip, config=config, node=name, state_dir=self.state_dir)
            self.nodes.append(node)
            node.start()

    def stop(self) -> None:
        for node in self.nodes:
            try:
                node.stop()
            except RuntimeError:
                node.kill()

    def pids(self) -> dict[str, int]:
        return {node.name: node.process.pid for node in self.nodes}
