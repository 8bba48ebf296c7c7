"""Helpers shared by the integration and interop tests: apps that workloads run, waiting, sockets.

Standard library only: the in-pod apps import it inside pod namespaces.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable

#: Integration and interop tests put every address they use in 127.<TEST_NET>.0.0/16, so runs
#: with different ZTWISTED_TEST_NET values share a machine. The default is a range that the
#: README's demo (the example mesh on 127.0.x.x, its VIP 127.10.0.1, the proxy's 127.0.0.1
#: ports) never uses: a demo left running does not disturb the suite.
DEFAULT_TEST_NET = 100
TEST_NET = int(os.environ.get("ZTWISTED_TEST_NET", DEFAULT_TEST_NET))


def listeners_in(net: int) -> list[str]:
    """The TCP listeners of this network namespace in 127.<net>.0.0/16, as "ip:port (who)".

    Any of them would share a test's ports (SO_REUSEPORT) or take them.
    """
    taken = {}
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            address, port = local.split(":")
            ip = socket.inet_ntoa(bytes.fromhex(address)[::-1])
            if state == "0A" and ip.startswith(f"127.{net}."):  # 0A: LISTEN
                taken[inode] = f"{ip}:{int(port, 16)}"
    owners = _socket_owners(set(taken)) if taken else {}
    return sorted(f"{where} ({owners.get(inode, 'owner unknown')})" for inode, where in taken.items())


def _socket_owners(inodes: set[str]) -> dict[str, str]:
    """inode -> "pid N: command line" for the sockets among ``inodes`` that a process here holds."""

    def readlink(path: str) -> str:
        try:
            return os.readlink(path)
        except OSError:
            return ""  # closed meanwhile

    owners = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            held = {link[8:-1] for link in links if link.startswith("socket:[")} & inodes
            if held:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                owners.update(dict.fromkeys(held, f"pid {pid}: {command[:100].rstrip()}"))
        except OSError:
            continue  # the process is gone, or not ours to read
    return owners


class EchoServer:
    """A TCP echo app: echoes as it reads, half-closes after the client's FIN."""

    def __init__(self, ip: str, port: int = 8080):
        self.sock = listening_socket(ip, port, backlog=512)
        self.address = self.sock.getsockname()
        self.connections = 0
        #: how each finished connection ended: "closed" (EOF) or the OSError's class name
        self.outcomes: list[str] = []
        self._ended = threading.Condition()
        self._closing = False
        accept_in_background(self.sock, self._accepted)

    def _accepted(self, conn: socket.socket):
        self.connections += 1
        threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket):
        outcome = echo_until_eof(conn)
        with self._ended:
            self.outcomes.append(outcome)
            self._ended.notify_all()

    def wait_for_outcomes(self, count: int, timeout: float = 10.0) -> list[str]:
        """The outcomes once at least ``count`` connections have ended (or what there is at the timeout)."""
        with self._ended:
            self._ended.wait_for(lambda: len(self.outcomes) >= count, timeout)
            return list(self.outcomes)

    def close(self):
        close_listener(self.sock)


class SinkServer:
    """An app that accepts and never reads: the slow reader."""

    def __init__(self, ip: str, port: int):
        self.sock = listening_socket(ip, port, backlog=16)
        self.accepted: list[socket.socket] = []
        accept_in_background(self.sock, self._accepted)

    def _accepted(self, conn: socket.socket):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        self.accepted.append(conn)

    def close(self):
        for conn in self.accepted:
            conn.close()
        close_listener(self.sock)


def close_listener(sock: socket.socket) -> None:
    """Close a listening socket so its port is free at once.

    A plain close() leaves the port bound while a thread is blocked in
    accept() on it; shutdown() wakes that thread first.
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def listening_socket(ip: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on ip:port (SO_REUSEADDR, so a test's port is free again at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, port))
    sock.listen(backlog)
    return sock


def accept_in_background(sock: socket.socket, on_connection: Callable[[socket.socket], None]) -> None:
    """Accept on ``sock`` in a daemon thread, handing each connection to ``on_connection``, until it closes."""

    def accept_loop():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            on_connection(conn)

    threading.Thread(target=accept_loop, daemon=True).start()


def echo_until_eof(conn: socket.socket) -> str:
    """Echo what ``conn`` sends, half-close after its FIN, then close it.

    Returns how it ended: "closed" (EOF) or the OSError's class name.
    """
    with conn:
        try:
            while True:
                data = conn.recv(262144)
                if not data:
                    conn.shutdown(socket.SHUT_WR)
                    return "closed"
                conn.sendall(data)
        except OSError as e:
            return type(e).__name__


def wait_until(condition: Callable[[], object], timeout: float = 5.0, what: str = "condition", interval: float = 0.05):
    """Poll ``condition`` until it is truthy; return its value, or raise AssertionError at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def can_connect(ip: str, port: int = 15008) -> bool:
    """Whether something accepts TCP connections on ip:port (within a second)."""
    try:
        socket.create_connection((ip, port), timeout=1).close()
        return True
    except OSError:
        return False


def pod_uid(name: str, namespace: str = "default") -> str:
    """The uid ztunnel's workload discovery gives a Kubernetes pod of cluster1."""
    return f"cluster1//v1/Pod/{namespace}/{name}"


def mesh_workload(
    name: str,
    ip: str,
    node: str,
    *,
    uid: str | None = None,
    namespace: str = "default",
    service_account: str | None = None,
    services: str | None = None,
) -> str:
    """One HBONE workload as an entry of a mesh YAML ``workloads:`` list.

    The service account defaults to ``name``; ``services`` is the YAML flow
    mapping of the workload's service ports, when it backs a service.
    """
    fields = ([f"uid: {uid}"] if uid is not None else []) + [
        f"name: {name}",
        f"namespace: {namespace}",
        f"serviceAccount: {service_account or name}",
        f'workloadIps: ["{ip}"]',
        "protocol: HBONE",
        f"node: {node}",
    ]
    if services is not None:
        fields.append(f"services: {services}")
    return "- " + "\n  ".join(fields) + "\n"


def mesh_workloads(*entries: str) -> str:
    """A mesh YAML ``workloads:`` list of :func:`mesh_workload` entries."""
    return "workloads:\n" + "".join(entries)


def recv_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        data = sock.recv(262144)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


class ReplyAfterEofServer:
    """An app that reads until the client's FIN, then sends everything back and closes.

    Every reply byte leaves after the request half-closed, so a proxy that
    turns a half-close into a full close loses the reply.
    """

    def __init__(self, ip: str, port: int):
        self.sock = listening_socket(ip, port, backlog=16)
        accept_in_background(self.sock, self._accepted)

    def _accepted(self, conn: socket.socket):
        threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket):
        with conn:
            try:
                request = recv_all(conn)
                time.sleep(0.2)  # the FIN has long crossed both proxies by now
                conn.sendall(request)
            except OSError:
                return

    def close(self):
        close_listener(self.sock)


def echo_through(sock: socket.socket, payload: bytes, timeout: float = 30.0) -> bytes:
    """Send ``payload`` (then FIN) from a thread while reading everything back until EOF."""
    sock.settimeout(timeout)

    def send():
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received = recv_all(sock)
    sender.join(timeout)
    return received


def stream_and_hash(
    sock: socket.socket, total: int, chunk_size: int = 1 << 20, timeout: float = 60.0
) -> tuple[str, str, int]:
    """Send ``total`` random bytes in chunks while a concurrent reader hashes what comes back.

    Returns (sha256 of what was sent, sha256 of what was received, bytes received).
    """
    sock.settimeout(timeout)
    sent_hash = hashlib.sha256()
    errors: list[BaseException] = []

    def send():
        try:
            block = os.urandom(chunk_size)
            remaining = total
            while remaining:
                # A fresh byte pattern per chunk, cheap: rotate the random block.
                piece = block[: min(chunk_size, remaining)]
                block = block[7:] + block[:7]
                sent_hash.update(piece)
                sock.sendall(piece)
                remaining -= len(piece)
            sock.shutdown(socket.SHUT_WR)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    received_hash = hashlib.sha256()
    received = 0
    while True:
        data = sock.recv(1 << 20)
        if not data:
            break
        received_hash.update(data)
        received += len(data)
    sender.join(timeout)
    if errors:
        raise errors[0]
    return sent_hash.hexdigest(), received_hash.hexdigest(), received
