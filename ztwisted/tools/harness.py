"""Run ztwisted nodes as real ``twistd`` processes: for integration tests, benchmarks and the lab.

Each node gets its own loopback address for its admin, metrics, readiness,
SOCKS5 and redirect listeners, so several nodes share one machine with the
standard port numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ztwisted.sockets import IP_BIND_ADDRESS_NO_PORT


def twistd_command() -> list[str]:
    twistd = shutil.which("twistd", path=os.path.dirname(sys.executable)) or shutil.which("twistd")
    if twistd is None:
        return [sys.executable, "-m", "twisted"]
    return [twistd]


class NodeProcess:
    """One ``twistd -n ztunnel`` process."""

    def __init__(
        self,
        workdir: Path,
        *,
        name: str,
        control_ip: str,
        config: Path | None = None,
        node: str | None = None,
        state_dir: Path | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict | None = None,
        netns: str | None = None,
    ):
        """``netns``: run in that named network namespace (``ip netns exec``); its control IP is there too."""
        self.workdir = Path(workdir)
        self.name = name
        self.control_ip = control_ip
        self.config = config
        self.node = node
        self.state_dir = Path(state_dir or self.workdir / "state")
        self.extra_args = tuple(extra_args)
        self.env = env
        self.netns = netns
        self.log_path = self.workdir / f"{name}.log"
        self.process: subprocess.Popen | None = None

    @property
    def socks5(self) -> tuple[str, int]:
        return (self.control_ip, 15080)

    def command(self) -> list[str]:
        ip = self.control_ip
        args = twistd_command() + [
            "-n",
            "--pidfile=",
            "ztunnel",
            "--state-dir",
            str(self.state_dir),
            "--log-format",
            "json",
        ]
        args += [
            f"--socks5=tcp:15080:interface={ip}",
            f"--outbound=tcp:15001:interface={ip}",
            f"--admin=tcp:15000:interface={ip}",
            f"--metrics=tcp:15020:interface={ip}",
            f"--readiness=tcp:15021:interface={ip}",
        ]
        if self.config is not None:
            args += ["--config", str(self.config)]
        if self.node is not None:
            args += ["--node", self.node]
        args += list(self.extra_args)
        return ["ip", "netns", "exec", self.netns, *args] if self.netns else args

    def start(self, timeout: float = 20.0) -> NodeProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env or {})
        self.log_path.unlink(missing_ok=True)
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            self.command(), cwd=self.workdir, stdout=self._log_file, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + timeout
        # The node's own log says when it is ready: with SO_REUSEPORT, the
        # readiness port may be answered by another process on the same ports.
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"node {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self._logged_ready():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"node {self.name} not ready within {timeout} s:\n{self.log_tail()}")

    def _logged_ready(self) -> bool:
        """Whether the log says the node is ready, in JSON lines or (``--log-format text``) Twisted's text lines."""
        if any(event.get("message", "").startswith("node proxy ready") for event in self.log_events()):
            return True
        return any("] node proxy ready" in line for line in self.log_path.read_text(errors="replace").splitlines())

    def http(self, listener: str, path: str, method: str = "GET") -> tuple[int, bytes]:
        port = {"admin": 15000, "metrics": 15020, "readiness": 15021}[listener]
        return http_request(f"http://{self.control_ip}:{port}{path}", method, netns=self.netns)

    def config_dump(self) -> dict:
        return json.loads(self.http("admin", "/config_dump")[1])

    def metrics(self) -> str:
        return self.http("metrics", "/metrics")[1].decode()

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return metric_sum(self.metrics(), name, **labels)

    def log_events(self) -> list[dict]:
        return json_events(read_log(self.log_path))

    def log_tail(self, lines: int = 40) -> str:
        return last_log_lines(self.log_path, lines)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"node {self.name} did not stop within {timeout} s:\n{self.log_tail()}") from None
        finally:
            self._log_file.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def terminate(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM a helper process and wait for it; SIGKILL it if it is not gone within ``timeout``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def read_log(path: Path) -> str:
    """A process's log (its stdout and stderr) as it is now; empty if it has written none yet."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def last_log_lines(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a process's log, for an error message."""
    return "\n".join(read_log(path).splitlines()[-lines:]) or "(no log)"


def json_events(log: str) -> list[dict]:
    """The JSON objects among a log's lines (the other lines, such as a traceback, are skipped)."""
    events = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def metric_sum(exposition: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` in Prometheus text ``exposition`` whose labels include ``labels``."""
    total = 0.0
    for line in exposition.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def http_request(
    url: str, method: str = "GET", *, netns: str | None = None, timeout: float = 5.0, body: bytes | None = None
) -> tuple[int, bytes]:
    """(status, body) of one HTTP request; with ``netns``, sent from inside that named network namespace."""

    def send() -> tuple[int, bytes]:
        request = urllib.request.Request(url, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    if netns is None:
        return send()
    from ztwisted.netns import call_in_netns  # here: the apps that import this module need the standard library only

    return call_in_netns(f"/var/run/netns/{netns}", send)


def socks5_connect(
    proxy: tuple[str, int], source_ip: str, host: str, port: int, timeout: float = 10.0
) -> socket.socket:
    """A socket connected through a SOCKS5 proxy, leaving from ``source_ip`` (the workload's address)."""
    sock = socket.socket(socket.AF_INET6 if ":" in proxy[0] else socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        # Let connect() pick the port by the whole 4-tuple: a plain bind(ip, 0) must skip every
        # port a TIME_WAIT socket holds on that address (many test connections from one workload).
        sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source_ip, 0))
        sock.connect(proxy)
        socks5_handshake(sock, host, port)
    except BaseException:
        sock.close()
        raise
    return sock


def socks5_handshake(sock: socket.socket, host: str, port: int) -> None:
    """SOCKS5 CONNECT to ``host`` (an IPv4 address or a name) on a connected socket: two round
    trips, nothing pipelined. Raises :class:`Socks5Refused` with the proxy's reply code."""
    sock.sendall(b"\x05\x01\x00")
    if recv_exact(sock, 2) != b"\x05\x00":
        raise ConnectionError("SOCKS5 proxy refused the no-auth method")
    try:
        address = b"\x01" + socket.inet_aton(host)
    except OSError:
        encoded = host.encode()
        address = b"\x03" + bytes([len(encoded)]) + encoded
    sock.sendall(b"\x05\x01\x00" + address + struct.pack("!H", port))
    reply = recv_exact(sock, 4)
    if reply[1] != 0:
        raise Socks5Refused(reply[1])
    atyp = reply[3]
    recv_exact(sock, {1: 4, 4: 16}.get(atyp, 0) + 2 if atyp != 3 else recv_exact(sock, 1)[0] + 2)


class Socks5Refused(ConnectionError):
    def __init__(self, code: int):
        super().__init__(f"SOCKS5 reply {code:#04x}")
        self.code = code


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes from a blocking socket; ConnectionError on an early EOF."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {size} bytes")
        data += chunk
    return data
