"""Istio's real ztunnel as a peer process, each instance in its own network namespace.

ztunnel binds 15001/15006/15008 on the wildcard address and its admin and
SOCKS5 ports on localhost, so every instance needs a network namespace of its
own; :class:`~ztwisted.tools.lab.netns.Namespaces` makes them (a router namespace
and pods joined to it by veth pairs). The binary comes from
``tests/peers/ztunnel_build.py`` (built once, cached outside the clone).

Typical use (as root)::

    from ztwisted.tools.lab.netns import Namespaces
    from ztwisted.tools.lab.ztunnel_peer import ZtunnelPeer, find_ztunnel, write_plugin_ca

    install = find_ztunnel()                      # ZtunnelMissing says how to build it
    write_plugin_ca(install, state / "ca")        # ztwisted --ca-dir: the root ztunnel's FAKE_CA signs with
    namespaces = Namespaces(net)
    namespaces.add_router()
    namespaces.add_pod("zt", "10.33.1.1")
    peer = ZtunnelPeer("zt", netns=namespaces.name("zt"), config=mesh_yaml,
                       workload="default/zpod/zpod", workdir=tmp, install=install).start()
    peer.config_dump(); peer.metric("istio_tcp_connections_opened_total", reporter="source")
    peer.freeze(); peer.thaw(); peer.stop()       # SIGSTOP, SIGCONT, SIGTERM (ztunnel's drain)
    namespaces.destroy()

By default it runs as the README of the peer's archive says ztunnel runs
without a cluster: ``FAKE_CA=true`` (certificates from the test root in
ztunnel's ``src/tls/``), no XDS server, the local config file, dedicated
proxy mode for one workload (connecting to its app from its own address,
not the client's: ``ENABLE_ORIG_SRC=false``), and SOCKS5 on
``127.0.0.1:15080`` in its namespace. ``env`` adds or overrides variables (for example
``PROXY_MODE=shared`` and ``INPOD_UDS`` for in-pod mode with
``workload=None``); a variable given as ``None`` is unset (``FAKE_CA`` and
``LOCAL_XDS_PATH`` when ``XDS_ADDRESS``/``CA_ADDRESS`` name a control plane).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import attr

from ztwisted.ca import CertificateAuthority, write_layout
from ztwisted.netns import call_in_netns
from ztwisted.tools.harness import http_request, last_log_lines, metric_sum, read_log

ADMIN_PORT = 15000
METRICS_PORT = 15020
READINESS_PORT = 15021
SOCKS5_PORT = 15080
HBONE_PORT = 15008

BUILD_SCRIPT = "tests/peers/ztunnel_build.py"


class ZtunnelMissing(RuntimeError):
    """ztunnel is not built (or not found); the message says how to build it."""


class ZtunnelFailed(RuntimeError):
    """A ztunnel process did not start or stop as asked; the message has its log tail."""


@attr.s(frozen=True)
class ZtunnelInstall:
    """The cached build: the binaries, and ztunnel's ``src/tls`` (the test root FAKE_CA signs with)."""

    ztunnel: Path = attr.ib()
    inpodserver: Path = attr.ib()
    tls: Path = attr.ib()

    @property
    def root_cert(self) -> Path:
        return self.tls / "root-cert.pem"

    @property
    def root_key(self) -> Path:
        return self.tls / "ca-key.pem"


def _build_module():
    """``tests/peers/ztunnel_build.py``: importable from the clone (pytest, tox), else from the working directory."""
    try:
        return importlib.import_module("tests.peers.ztunnel_build")
    except ImportError:
        pass
    script = Path.cwd() / BUILD_SCRIPT
    if not script.is_file():
        return None
    spec = importlib.util.spec_from_file_location("ztunnel_build", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_ztunnel() -> ZtunnelInstall:
    """The cached ztunnel build; :class:`ZtunnelMissing` if there is none.

    ``$ZTWISTED_ZTUNNEL`` names a ztunnel binary directly; its ``inpodserver``
    is beside it and the test root in ``../tls``, the cache's layout.
    """
    named = os.environ.get("ZTWISTED_ZTUNNEL")
    if named:
        binary = Path(named)
        install = ZtunnelInstall(binary, binary.with_name("inpodserver"), binary.parent.parent / "tls")
    else:
        build = _build_module()
        if build is None:
            raise ZtunnelMissing(
                f"cannot find {BUILD_SCRIPT} (run from the clone, or set ZTWISTED_ZTUNNEL to the ztunnel binary)"
            )
        archive = build.default_archive()
        if archive is None or not archive.is_file():
            raise ZtunnelMissing(
                "no ztunnel source archive (shared/peers/ztunnel/ztunnel-*.tar.gz; or set ZTWISTED_ZTUNNEL_ARCHIVE)"
            )
        if not build.cached(archive):
            raise ZtunnelMissing(
                f"ztunnel is not built yet: run `python {BUILD_SCRIPT}` (once; it caches in {build.cache_dir(archive)})"
            )
        paths = build.binaries(archive)
        install = ZtunnelInstall(paths["ztunnel"], paths["inpodserver"], build.fake_ca_root_dir(archive))
    for path in (install.ztunnel, install.root_cert, install.root_key):
        if not path.is_file():
            raise ZtunnelMissing(f"{path} is missing: rebuild with `python {BUILD_SCRIPT}`")
    return install


def write_plugin_ca(install: ZtunnelInstall, ca_dir: Path) -> CertificateAuthority:
    """An Istio plug-in CA directory (for ``--ca-dir``) that signs with ztunnel's FAKE_CA root.

    ztunnel with ``FAKE_CA=true`` issues its own certificate from the root in
    its ``src/tls`` and trusts only that root, so ztwisted signs with the same
    root: the two then trust each other's certificates.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    root = x509.load_pem_x509_certificate(install.root_cert.read_bytes())
    key = serialization.load_pem_private_key(install.root_key.read_bytes(), password=None)
    write_layout(Path(ca_dir), root, key, chain=[root], roots=[root])
    return CertificateAuthority.load(ca_dir)


def _workload_info(workload: str | tuple[str, str, str] | None) -> str | None:
    if workload is None or isinstance(workload, str):
        return workload
    namespace, name, service_account = workload
    return f"{namespace}/{name}/{service_account}"


class ZtunnelPeer:
    """One ztunnel process in the named network namespace ``netns``.

    ``workload`` is ``PROXY_WORKLOAD_INFO`` (``namespace/name/serviceAccount``
    or a 3-tuple) for dedicated mode; ``None`` leaves the proxy mode to
    ``env``. The log (ztunnel's stdout and stderr) is ``workdir/<name>.log``.
    """

    def __init__(
        self,
        name: str,
        *,
        netns: str,
        config: Path,
        workdir: Path,
        workload: str | tuple[str, str, str] | None,
        install: ZtunnelInstall | None = None,
        env: Mapping[str, str | None] | None = None,
    ):
        self.name = name
        self.netns = netns
        self.config = Path(config)
        self.workdir = Path(workdir)
        self.workload = _workload_info(workload)
        self.install = install or find_ztunnel()
        self.extra_env = dict(env or {})
        self.log_path = self.workdir / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def environment(self) -> dict[str, str]:
        """ztunnel's environment: a clean one (ztunnel reads many variables), the defaults, then ``env``."""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.workdir),
            "FAKE_CA": "true",
            "XDS_ADDRESS": "",
            "CA_ADDRESS": "",
            "LOCAL_XDS_PATH": str(self.config),
            "UNSTABLE_ENABLE_SOCKS5": "true",
            "RUST_BACKTRACE": "1",
        }
        if self.workload is not None:
            # As root, ztunnel would otherwise connect to the app from the client's address
            # (IP_TRANSPARENT), and the app's answers would leave the namespace by its default route.
            env.update(PROXY_MODE="dedicated", PROXY_WORKLOAD_INFO=self.workload, ENABLE_ORIG_SRC="false")
        for name, value in self.extra_env.items():
            if value is None:
                env.pop(name, None)  # unset: e.g. FAKE_CA and LOCAL_XDS_PATH when a control plane serves
            else:
                env[name] = value
        return env

    def command(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns, str(self.install.ztunnel)]

    def start(self, timeout: float = 30.0) -> ZtunnelPeer:
        """Start ztunnel and wait until ``:15021/healthz/ready`` answers 200 inside its namespace."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(), cwd=self.workdir, env=self.environment(), stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ZtunnelFailed(f"ztunnel {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.1)
        self.kill()
        raise ZtunnelFailed(f"ztunnel {self.name} not ready within {timeout} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            return self.http(READINESS_PORT, "/healthz/ready")[0] == 200
        except OSError:
            return False

    # -- lifecycle ------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (ztunnel drains), then wait for it to exit; its exit status.

        ztunnel's drain lasts up to ``TERMINATION_GRACE_PERIOD_SECONDS`` - 1
        (or ``CONNECTION_TERMINATION_DEADLINE``, default 5 s): give ``timeout``
        room for it. :class:`ZtunnelFailed` (after a SIGKILL) if it does not exit.
        """
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.thaw()  # a frozen process cannot act on SIGTERM
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise ZtunnelFailed(
                    f"ztunnel {self.name} did not exit within {timeout} s of SIGTERM:\n{self.log_tail()}"
                ) from None
        self._close_log()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: no drain at all."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_log()

    def freeze(self) -> None:
        """SIGSTOP: the process stops reading and writing; its sockets stay open (a hung peer)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # -- what it says -----------------------------------------------------------------

    def log_text(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, lines: int = 40) -> str:
        return last_log_lines(self.log_path, lines)

    def log_lines(self, *words: str) -> list[str]:
        """Log lines that contain every one of ``words``."""
        return [line for line in self.log_text().splitlines() if all(word in line for word in words)]

    def http(self, port: int, path: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, bytes]:
        """(status, body) of a request to ztunnel's ``127.0.0.1:port`` inside its namespace."""
        return http_request(f"http://127.0.0.1:{port}{path}", method, netns=self.netns, timeout=timeout)

    def config_dump(self) -> dict:
        """``/config_dump`` on the admin port: config, workloads, services, policies, certificates."""
        status, body = self.http(ADMIN_PORT, "/config_dump")
        if status != 200:
            raise ZtunnelFailed(f"ztunnel {self.name} /config_dump answered {status}: {body[:200]!r}")
        return json.loads(body)

    def metrics(self) -> str:
        return self.http(METRICS_PORT, "/metrics")[1].decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        return metric_sum(self.metrics(), name, **labels)

    def in_netns(self, function, timeout: float = 30.0):
        """Run ``function`` on a thread inside ztunnel's namespace (sockets it makes stay there); its result."""
        return call_in_netns(self.netns_path, function, timeout=timeout)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<ZtunnelPeer {self.name} netns={self.netns} pid={self.pid} {state}>"
