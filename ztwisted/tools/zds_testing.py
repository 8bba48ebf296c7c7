"""Test helpers for in-pod mode: a recording pod manager, a datagram peer, namespace helpers.

Used by ztwisted's own tests; also handy for anyone driving a ZdsClient or
a ZdsAgent in a test of their own.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet import defer
from twisted.python.failure import Failure

from ztwisted.inpod.seqpacket import SeqpacketConnection
from ztwisted.inpod.wire import WorkloadInfo
from ztwisted.netns import Netns
from ztwisted.tools.system import cannot_set_up_network


@attrs.define
class Call:
    method: str
    uid: str
    workload_info: WorkloadInfo | None = None
    netns_inode: int | None = None


class RecordingPodManager:
    """An ``IPodManager`` that records calls and lets a test decide outcomes.

    - ``fail_starts[uid] = n``: the next ``n`` add_pod calls for ``uid`` fail.
    - ``hold_removals = True``: remove_pod's Deferred waits in ``held[uid]``
      until the test fires it (a drain that takes time).
    - ``on_add(uid, info, netns) -> Deferred``: extra work per start (e.g.
      opening listeners in the netns); its failure fails the start.
    """

    def __init__(self, on_add: Callable[..., Any] | None = None, on_remove: Callable[[str], Any] | None = None) -> None:
        self.calls: list[Call] = []
        self.pods: dict[str, tuple[WorkloadInfo, Netns]] = {}
        self.fail_starts: dict[str, int] = {}
        self.hold_removals = False
        self.hold_terminating = False
        self.held: dict[str, defer.Deferred] = {}
        self.on_add = on_add
        self.on_remove = on_remove

    def add_pod(self, uid: str, workload_info: WorkloadInfo, netns: Netns) -> defer.Deferred:
        self.calls.append(Call("add_pod", uid, workload_info, netns.inode))
        if self.fail_starts.get(uid, 0) > 0:
            self.fail_starts[uid] -= 1
            return defer.fail(RuntimeError(f"cannot start the proxy for {uid}: address in use"))
        result = defer.maybeDeferred(self.on_add, uid, workload_info, netns) if self.on_add else defer.succeed(None)

        def started(_: Any) -> None:
            self.pods[uid] = (workload_info, netns)

        return result.addCallback(started)

    def remove_pod(self, uid: str) -> defer.Deferred:
        self.calls.append(Call("remove_pod", uid))
        entry = self.pods.pop(uid, None)
        done: defer.Deferred = defer.Deferred()

        def cleanup(result: Any) -> Any:
            if entry is not None:
                entry[1].close()
            return result

        done.addBoth(cleanup)
        if self.on_remove is not None:
            done.addCallback(lambda _: self.on_remove(uid))
        if self.hold_removals:
            self.held[uid] = done
        else:
            done.callback(None)
        return done

    def pod_terminating(self, uid: str) -> defer.Deferred:
        self.calls.append(Call("pod_terminating", uid))
        done: defer.Deferred = defer.Deferred()
        if self.hold_terminating:
            self.held[uid] = done
        else:
            done.callback(None)
        return done

    def running_pods(self) -> set[str]:
        return set(self.pods)

    def methods(self) -> list[tuple[str, str]]:
        return [(call.method, call.uid) for call in self.calls]

    def close(self) -> None:
        for _, netns in self.pods.values():
            netns.close()
        self.pods.clear()


class DatagramPeer:
    """The far end of a SEQPACKET connection in tests: queues what arrives, sends raw datagrams."""

    def __init__(self, reactor: Any, sock: socket.socket, name: str = "peer") -> None:
        self.reactor = reactor
        self.received: defer.DeferredQueue = defer.DeferredQueue()
        self.lost: defer.Deferred = defer.Deferred()
        self.conn = SeqpacketConnection(reactor, sock, self, name=name, max_datagram=65536, max_fds=16)
        self.conn.start()

    def datagram_received(self, payload: bytes, fds: list[int], flags: int) -> None:
        self.received.put((payload, fds, flags))

    def connection_lost(self, reason: Failure) -> None:
        self.lost.callback(reason.value)

    def send(self, payload: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        self.conn.send(payload, fds)

    def next(self, timeout: float = 5.0) -> defer.Deferred:
        """The next datagram (payload, fds, flags); fails with TimeoutError after ``timeout``."""
        return self.received.get().addTimeout(timeout, self.reactor)

    def close(self) -> None:
        self.conn.abort()


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def can_manage_netns() -> str | None:
    """None if this process may create network namespaces, else the reason why not."""
    return cannot_set_up_network("ip")


class NamedNetns:
    """``ip netns add NAME`` (NAME = prefix + random), removed by :meth:`delete`."""

    def __init__(self, prefix: str = "ztw51-") -> None:
        self.name = f"{prefix}{uuid.uuid4().hex[:8]}"
        self.path = f"/var/run/netns/{self.name}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, text=True)
        self.exec("ip", "link", "set", "lo", "up")

    def exec(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], check=check, capture_output=True, text=True)

    def open(self) -> Netns:
        return Netns.open(self.path)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)


def unshared_netns() -> Netns | None:
    """A fresh network namespace without a name (held only by the returned fd), or None.

    Tries ``unshare --net`` (root), then ``unshare --user --map-root-user --net``.
    """
    if shutil.which("unshare") is None:
        return None
    for argv in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
        try:
            proc = subprocess.Popen([*argv, "sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            continue
        try:
            own = os.stat("/proc/self/ns/net").st_ino
            for _ in range(200):  # the child enters its namespace right after it starts
                try:
                    if os.stat(f"/proc/{proc.pid}/ns/net").st_ino != own:
                        return Netns.open(f"/proc/{proc.pid}/ns/net")
                except FileNotFoundError:
                    break
                if proc.poll() is not None:
                    break
                time.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()
    return None
