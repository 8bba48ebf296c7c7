"""Support for the in-pod end-to-end tests: pod namespaces on a private bridge, agents, nodes and apps.

The topology lives entirely in namespaces the tests create (all named
``ztwtNET-*`` after ZTWISTED_TEST_NET, so parallel runs neither share nor
remove each other's, or another prefix given to :class:`PodNetworkLab`): a "network" namespace holding a Linux bridge, and one
namespace per pod joined to that bridge by a veth pair, with addresses in
:data:`POD_SUBNET`, which exists only inside these namespaces. The host
namespace's links, routes, sysctls and iptables are never touched; the
proxies and agents listen on loopback control addresses in 127.<NET>.0.0/16.

Apps run inside the pods with ``ip netns exec`` as this module's command
line (``python -m tests.integration.inpod_support echo|roundtrip|stream|loop``);
that part uses the standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import TEST_NET, echo_until_eof, listening_socket, mesh_workload
from ztwisted.tools.harness import NodeProcess, last_log_lines  # standard library only, as the apps below need
from ztwisted.tools.system import cannot_set_up_network

REPO_ROOT = Path(__file__).resolve().parents[2]
#: namespace names are global like addresses: one run's clean-up must not remove another run's
NETNS_PREFIX = f"ztwt{TEST_NET}-"
BRIDGE = "br0"
POD_SUBNET = "10.251.0.0/24"
APP_PORT = 8080
PACKET_MARK = 1337
REDIRECT_PORT = 15001
PLAINTEXT_INBOUND_PORT = 15006


def control_ip(net: int, number: int) -> str:
    """The loopback address of node ``number``'s (and its agent's) control listeners."""
    return f"127.{net}.{number}.254"


# -- namespaces -----------------------------------------------------------------------------


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def cannot_build_pods() -> str | None:
    """None when this process can build the pod network, else why not (a skip reason)."""
    return cannot_set_up_network("ip", "iptables", "ss")


def existing_namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftover_namespaces(prefix: str = NETNS_PREFIX) -> None:
    """Delete ``<prefix>*`` namespaces an earlier, interrupted run left behind."""
    for name in existing_namespaces():
        if name.startswith(prefix):
            _run("ip", "netns", "del", name, check=False)


class Pod:
    """A pod's network namespace, on the bridge through ``veth-<short>`` (``eth0`` inside)."""

    def __init__(self, network: PodNetworkLab, short: str, ip: str, uid: str, name: str):
        self.network = network
        self.short = short
        self.ip = ip
        self.uid = uid
        self.name = name
        self.namespace = "default"
        self.service_account = name
        self.netns = f"{network.prefix}{short}"
        self.netns_path = f"/var/run/netns/{self.netns}"
        self.peer = f"veth-{short}"

    def create(self) -> None:
        self.network.ip("netns", "add", self.netns)
        self.network.created.append(self.netns)
        self.network.ip("-n", self.netns, "link", "set", "lo", "up")
        # Made inside the bridge namespace, its peer straight in the pod's: the host never sees either.
        self.network.ip(
            "-n",
            self.network.bridge_netns,
            "link",
            "add",
            self.peer,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            self.netns,
        )
        self.network.ip("-n", self.network.bridge_netns, "link", "set", self.peer, "master", BRIDGE, "up")
        prefix = POD_SUBNET.split("/")[1]
        self.network.ip("-n", self.netns, "addr", "add", f"{self.ip}/{prefix}", "dev", "eth0")
        self.network.ip("-n", self.netns, "link", "set", "eth0", "up")

    def exec_argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*self.exec_argv(*argv), check=check)

    def redirect_outbound(self, mark: int = PACKET_MARK, port: int = REDIRECT_PORT) -> None:
        """The pod's capture rule: outbound TCP, except to loopback and the proxy's own, to ``port``."""
        self.run(
            "iptables",
            "-w",
            "-t",
            "nat",
            "-A",
            "OUTPUT",
            "-p",
            "tcp",
            "!",
            "-d",
            "127.0.0.0/8",
            "-m",
            "mark",
            "!",
            "--mark",
            str(mark),
            "-j",
            "REDIRECT",
            "--to-ports",
            str(port),
        )

    def _inbound_redirect_rule(self, app_port: int, port: int) -> list[str]:
        return [
            "PREROUTING",
            "-p",
            "tcp",
            "-i",
            "eth0",
            "--dport",
            str(app_port),
            "-j",
            "REDIRECT",
            "--to-ports",
            str(port),
        ]

    def redirect_inbound(self, app_port: int = APP_PORT, port: int = PLAINTEXT_INBOUND_PORT) -> None:
        """Capture TCP arriving on ``eth0`` for ``app_port`` to ``port`` (plaintext inbound, 15006).

        PREROUTING only: the proxy's own connection to the app is locally generated and never sees it.
        """
        self.run("iptables", "-w", "-t", "nat", "-A", *self._inbound_redirect_rule(app_port, port))

    def stop_redirecting_inbound(self, app_port: int = APP_PORT, port: int = PLAINTEXT_INBOUND_PORT) -> None:
        self.run("iptables", "-w", "-t", "nat", "-D", *self._inbound_redirect_rule(app_port, port))

    def allow_accept_queue_migration(self) -> None:
        """net.ipv4.tcp_migrate_req=1 in the pod, as docs/draining.rst advises for in-pod restarts
        (ztwisted sets it only in its own namespace); skipped on kernels without it (< 5.14)."""
        path = "/proc/sys/net/ipv4/tcp_migrate_req"
        self.run("sh", "-c", f"if [ -e {path} ]; then echo 1 > {path}; fi")

    def listening_ports(self) -> list[tuple[str, int]]:
        """(address, port) of every TCP listener in the pod, one entry per socket."""
        out = self.run("ss", "-Hltn").stdout
        ports = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 4:
                address, _, port = fields[3].rpartition(":")
                ports.append((address, int(port)))
        return ports

    def delete_veth(self) -> None:
        """The pod's network is gone (as when the CNI tears it down)."""
        self.network.ip("-n", self.network.bridge_netns, "link", "del", self.peer)

    def mesh_entry(self, node: str) -> str:
        return mesh_workload(
            self.name, self.ip, node, uid=self.uid, namespace=self.namespace, service_account=self.service_account
        )


class PodNetworkLab:
    """The bridge namespace and the pods on it; :meth:`destroy` removes every namespace it made."""

    def __init__(self, prefix: str = NETNS_PREFIX) -> None:
        self.prefix = prefix
        self.bridge_netns = f"{prefix}net"
        self.created: list[str] = []
        self.pods: dict[str, Pod] = {}

    @staticmethod
    def ip(*argv: str) -> None:
        _run("ip", *argv)

    def build(self, pods: list[tuple[str, str, str, str]]) -> PodNetworkLab:
        """``pods``: (short name, ip, uid, workload name) each."""
        self.ip("netns", "add", self.bridge_netns)
        self.created.append(self.bridge_netns)
        self.ip("-n", self.bridge_netns, "link", "set", "lo", "up")
        self.ip("-n", self.bridge_netns, "link", "add", BRIDGE, "type", "bridge")
        self.ip("-n", self.bridge_netns, "link", "set", BRIDGE, "up")
        for short, ip, uid, name in pods:
            self.add_pod(short, ip, uid, name)
        return self

    def add_pod(self, short: str, ip: str, uid: str, name: str) -> Pod:
        """One more namespace on the bridge (in the mesh or not: that is up to the caller's mesh file)."""
        pod = Pod(self, short, ip, uid, name)
        pod.create()
        self.pods[short] = pod
        return pod

    def destroy(self) -> None:
        for name in reversed(self.created):
            _run("ip", "netns", "del", name, check=False)
        self.created.clear()


# -- the node agent -----------------------------------------------------------------------


def agent_command() -> list[str]:
    script = shutil.which("ztunnel-agent", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "ztwisted.tools.agent"]


class AgentProcess:
    """``ztunnel-agent serve`` on ``socket_path``, its control API on ``host`` (a free port)."""

    def __init__(self, workdir: Path, name: str, socket_path: Path, host: str, *, manual_snapshot: bool = True):
        self.workdir = Path(workdir)
        self.name = name
        self.socket_path = Path(socket_path)
        self.host = host
        self.manual_snapshot = manual_snapshot
        self.log_path = self.workdir / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self.control: str | None = None

    def start(self, timeout: float = 15.0) -> AgentProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            *agent_command(),
            "serve",
            "--socket",
            str(self.socket_path),
            "--control",
            f"tcp:0:interface={self.host}",
        ]
        if self.manual_snapshot:
            argv.append("--manual-snapshot")
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, cwd=self.workdir)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"{self.name} did not start within {timeout} s:\n{self.log_tail()}")
        self.control = json.loads(line)["control"]
        return self

    def cli(self, operation: str, *args: str, timeout: float = 30.0) -> tuple[int, dict]:
        """Run ``ztunnel-agent OPERATION ... --control`` and return (exit status, its JSON reply)."""
        result = subprocess.run(
            [*agent_command(), operation, *args, "--control", self.control],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        try:
            reply = json.loads(result.stdout) if result.stdout.strip() else {}
        except ValueError:
            reply = {"unparsed": result.stdout}
        if result.stderr.strip():
            reply.setdefault("stderr", result.stderr)
        return result.returncode, reply

    def cli_background(self, operation: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*agent_command(), operation, *args, "--control", self.control],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def add(self, pod: Pod) -> tuple[int, dict]:
        return self.cli(
            "add",
            "--uid",
            pod.uid,
            "--name",
            pod.name,
            "--namespace",
            pod.namespace,
            "--service-account",
            pod.service_account,
            "--netns",
            pod.netns_path,
        )

    def call(self, operation: str, body: dict | None = None) -> tuple[int, dict]:
        """One call of the control API from this process (what the CLI does, without its start-up time)."""
        from ztwisted.tools.agent import call_control  # not at the top: the apps import this module

        return call_control(self.control, operation, body, timeout=30)

    def status(self) -> dict:
        code, reply = self.call("status")
        if code != 200:
            raise RuntimeError(f"{self.name} status failed ({code}): {reply}")
        return reply

    def proxies_said_hello(self, count: int = 1) -> bool:
        return sum(1 for proxy in self.status()["proxies"] if proxy["hello_version"] == 1) >= count

    def log_tail(self, lines: int = 30) -> str:
        return last_log_lines(self.log_path, lines)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        if getattr(self, "_log", None) is not None:
            self._log.close()


class InpodNode:
    """One node: its ``ztunnel-agent serve`` and a ztwisted process in in-pod mode driven by it.

    Several proxies may share one agent (an upgrade): pass the first one's ``agent``.
    """

    def __init__(
        self,
        workdir: Path,
        number: int,
        net: int,
        *,
        config: Path,
        state_dir: Path,
        extra_args: tuple[str, ...] = (),
        agent: AgentProcess | None = None,
        control_number: int | None = None,
        name: str | None = None,
    ):
        self.workdir = Path(workdir)
        self.number = number
        self.name = name or f"node-{number}"
        self.own_agent = agent is None
        self.agent = agent or AgentProcess(
            self.workdir, f"agent-{number}", self.workdir / f"node{number}.sock", control_ip(net, number)
        )
        self.proxy = NodeProcess(
            self.workdir / self.name,
            name=self.name,
            control_ip=control_ip(net, control_number or number),
            config=config,
            node=f"node-{number}",
            state_dir=state_dir,
            extra_args=("--inpod-uds", str(self.agent.socket_path), *extra_args),
        )

    def start(self) -> InpodNode:
        if self.own_agent:
            self.agent.start()
        self.proxy.start()
        return self

    def ready(self) -> int:
        return self.proxy.http("readiness", "/healthz/ready")[0]

    def stop(self) -> None:
        try:
            self.proxy.stop()
        except RuntimeError:
            self.proxy.kill()
        if self.own_agent:
            self.agent.stop()


def acks_ok(reply: dict) -> bool:
    acks = reply.get("acks", [])
    return bool(acks) and all(ack.get("ok") for ack in acks)


# -- apps in pods ----------------------------------------------------------------------------


class App:
    """One app process in a pod (``ip netns exec``), talking JSON lines on stdout."""

    def __init__(self, pod: Pod, mode: str, *args: str):
        argv = pod.exec_argv(sys.executable, "-m", "tests.integration.inpod_support", mode, *args)
        self.mode = mode
        self.process = subprocess.Popen(
            argv, cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        try:
            for line in self.process.stdout:
                self._lines.put(line)
        except (OSError, ValueError):  # closed by kill()
            pass
        self._lines.put("")  # EOF

    def read_event(self, timeout: float = 10.0) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            stderr = self.process.stderr.read()[-2000:]
            self.kill()
            raise AssertionError(f"app {self.mode}: no report within {timeout} s; its stderr: {stderr}")
        return json.loads(line)

    def stop(self, timeout: float = 15.0) -> dict:
        """Tell the app to finish (a line on stdin) and return its final report."""
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()
        return self.read_event(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except OSError:
                pass


def start_echo(pod: Pod, port: int = APP_PORT) -> App:
    app = App(pod, "echo", pod.ip, str(port))
    event = app.read_event()
    assert event == {"event": "listening"}, event
    return app


def roundtrip(pod: Pod, ip: str, port: int, size: int, timeout: float = 20.0) -> dict:
    """One connection from ``pod`` to ip:port: send ``size`` random bytes, read the echo; the report."""
    app = App(pod, "roundtrip", ip, str(port), str(size))
    try:
        return app.read_event(timeout)
    finally:
        app.kill()


# -- the apps' own code (standard library only) ----------------------------------------------


def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _echo_main(ip: str, port: int) -> None:
    server = listening_socket(ip, port, backlog=512)
    _emit({"event": "listening"})
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo_until_eof, args=(conn,), daemon=True).start()


def _exchange(sock: socket.socket, payload: bytes) -> bytes:
    """Send ``payload`` (a writer thread), half-close, read until EOF; returns what came back."""
    errors: list[BaseException] = []

    def write() -> None:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    received = bytearray()
    while True:
        chunk = sock.recv(262144)
        if not chunk:
            break
        received += chunk
    writer.join(10)
    if errors:
        raise errors[0]
    return bytes(received)


def _roundtrip_main(ip: str, port: int, size: int) -> None:
    payload = os.urandom(size)
    started = time.monotonic()
    try:
        with socket.create_connection((ip, port), timeout=15) as sock:
            received = _exchange(sock, payload)
        _emit(
            {
                "event": "done",
                "exact": received == payload,
                "sent": size,
                "received": len(received),
                "seconds": round(time.monotonic() - started, 3),
            }
        )
    except OSError as exc:
        _emit({"event": "done", "exact": False, "sent": size, "received": 0, "error": repr(exc)})


def _stop_event() -> threading.Event:
    """Set when a line (or EOF) arrives on stdin."""
    stop = threading.Event()

    def wait() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait, daemon=True).start()
    return stop


def _stream_main(ip: str, port: int, chunk: int, interval: float) -> None:
    """One long tunnel: a chunk every ``interval`` s until told to stop, then half-close and drain."""
    stop = _stop_event()
    sent = bytearray()
    received = bytearray()
    error = None
    first_echo = threading.Event()
    try:
        sock = socket.create_connection((ip, port), timeout=15)
    except OSError as exc:
        _emit({"event": "connected", "error": repr(exc)})
        _emit({"event": "done", "exact": False, "error": repr(exc), "sent": 0, "received": 0})
        return
    sock.settimeout(30)

    def read() -> None:
        nonlocal error
        try:
            while True:
                data = sock.recv(262144)
                if not data:
                    return
                received.extend(data)
                if len(received) >= chunk:
                    first_echo.set()
        except OSError as exc:
            error = error or f"recv: {exc!r}"
        finally:
            first_echo.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        data = os.urandom(chunk)
        sock.sendall(data)
        sent += data
        first_echo.wait(15)
        _emit({"event": "connected", "echoed": len(received)})
        while not stop.wait(interval):
            data = os.urandom(chunk)
            sock.sendall(data)
            sent += data
        sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        error = f"send: {exc!r}"
    reader.join(30)
    sock.close()
    _emit(
        {
            "event": "done",
            "exact": error is None and bytes(received) == bytes(sent),
            "sent": len(sent),
            "received": len(received),
            "error": error,
            "finished_at": time.monotonic(),
        }
    )


def _loop_main(ip: str, port: int, pause: float) -> None:
    """Short connections (each a byte-exact 1-16 KB echo) one after another until told to stop."""
    stop = _stop_event()
    made = 0
    failures: list[str] = []
    while not stop.is_set():
        payload = os.urandom(1024 * (1 + made % 16))
        try:
            with socket.create_connection((ip, port), timeout=10) as sock:
                sock.settimeout(10)
                received = _exchange(sock, payload)
            if received != payload:
                failures.append(f"connection {made}: {len(received)} of {len(payload)} bytes came back")
        except OSError as exc:
            failures.append(f"connection {made}: {exc!r}")
        made += 1
        time.sleep(pause)
    _emit({"event": "done", "made": made, "failures": failures})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inpod_support", description="apps for the in-pod end-to-end tests")
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode in ("echo", "roundtrip", "stream", "loop"):
        sub = modes.add_parser(mode)
        sub.add_argument("ip")
        sub.add_argument("port", type=int)
        if mode == "roundtrip":
            sub.add_argument("size", type=int)
        if mode == "stream":
            sub.add_argument("--chunk", type=int, default=4096)
            sub.add_argument("--interval", type=float, default=0.01)
        if mode == "loop":
            sub.add_argument("--pause", type=float, default=0.01)
    args = parser.parse_args(argv)
    if args.mode == "echo":
        _echo_main(args.ip, args.port)
    elif args.mode == "roundtrip":
        _roundtrip_main(args.ip, args.port, args.size)
    elif args.mode == "stream":
        _stream_main(args.ip, args.port, args.chunk, args.interval)
    else:
        _loop_main(args.ip, args.port, args.pause)


if __name__ == "__main__":
    main()
