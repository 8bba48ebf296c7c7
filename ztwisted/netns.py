"""Network namespaces: a checked netns fd, and sockets created inside one.

A socket belongs to the namespace its creator thread was in when it was
created, and keeps it for life. So :func:`run_in_netns` runs a function on a
short-lived thread that first ``setns``-es into the pod's namespace (a thread
that called setns stays there, so it exits afterwards) and hands the result
back to the reactor thread, which then adopts the socket.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from twisted.internet import defer
from twisted.python.failure import Failure

from ztwisted import sockets

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3), linux/nsfs.h
NSFS_MAGIC = 0x6E736673  # linux/magic.h

_NS_TYPE_NAMES = {
    0x00020000: "mount",
    0x02000000: "cgroup",
    0x04000000: "uts",
    0x08000000: "ipc",
    0x10000000: "user",
    0x20000000: "pid",
    CLONE_NEWNET: "network",
    0x00000080: "time",
}


class NotANetworkNamespace(ValueError):
    """An fd (or path) that should be a network namespace is not one."""


_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _fstatfs_type(fd: int) -> int:
    """``f_type`` of fstatfs(fd): the first field of struct statfs on Linux."""
    buf = ctypes.create_string_buffer(256)  # larger than struct statfs on every Linux ABI
    if _get_libc().fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fstatfs(fd {fd}): {os.strerror(err)}")
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def _setns(fd: int, nstype: int) -> None:
    setns = getattr(os, "setns", None)  # Python >= 3.12
    if setns is not None:
        setns(fd, nstype)
        return
    if _get_libc().setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(fd {fd}, CLONE_NEWNET): {os.strerror(err)}")


class Netns:
    """A network namespace, held by an fd this object owns (closed by :meth:`close`)."""

    def __init__(self, fd: int, *, name: str | None = None) -> None:
        self._fd = fd
        stat = os.fstat(fd)
        self.inode: int = stat.st_ino
        self.device: int = stat.st_dev
        self.name = name or f"fd {fd}"

    @classmethod
    def open(cls, path: str) -> Netns:
        """Open a namespace file such as ``/var/run/netns/NAME`` or ``/proc/PID/ns/net`` (checked)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open network namespace {path}: {exc.strerror}") from exc
        netns = cls(fd, name=str(path))
        try:
            netns.check()
        except BaseException:
            netns.close()
            raise
        return netns

    @classmethod
    def current(cls) -> Netns:
        """The calling thread's own network namespace."""
        return cls.open(f"/proc/self/task/{threading.get_native_id()}/ns/net")

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError(f"network namespace {self.name} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def check(self) -> None:
        """Raise :class:`NotANetworkNamespace` unless the fd is a network namespace.

        Asks the kernel (ioctl NS_GET_NSTYPE, Linux >= 4.11); where that ioctl
        is unknown, accepts any nsfs file (fstatfs magic NSFS_MAGIC).
        """
        fd = self.fileno()
        try:
            nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError as exc:
            if exc.errno not in (errno.ENOTTY, errno.EINVAL):
                raise NotANetworkNamespace(
                    f"{self.name} is not a network namespace: ioctl NS_GET_NSTYPE: {exc}"
                ) from exc
            try:
                magic = _fstatfs_type(fd)
            except OSError as stat_exc:
                raise NotANetworkNamespace(f"{self.name} is not a network namespace: {stat_exc}") from stat_exc
            if magic != NSFS_MAGIC:
                raise NotANetworkNamespace(
                    f"{self.name} is not a network namespace: not a namespace file "
                    f"(filesystem magic {magic:#x}, nsfs is {NSFS_MAGIC:#x})"
                ) from exc
            return
        if nstype != CLONE_NEWNET:
            kind = _NS_TYPE_NAMES.get(nstype, f"type {nstype:#x}")
            raise NotANetworkNamespace(f"{self.name} is a {kind} namespace, not a network namespace")

    def same_as(self, other: Netns) -> bool:
        return (self.device, self.inode) == (other.device, other.inode)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Netns:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<Netns {self.name} inode={self.inode} {state}>"


def enter_netns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``, for good (a thread
    cannot leave it again; threads it starts follow it). For threads of their own only."""
    with Netns.open(path) as netns:
        try:
            _setns(netns.fileno(), CLONE_NEWNET)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot enter network namespace {path}: {exc.strerror or exc}") from exc


def call_in_netns(path: str, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
    """Blocking: ``fn()`` on a new thread inside the namespace at ``path``; its result, or its
    exception raised here. For tools and tests off the reactor thread; the proxy uses
    :func:`run_in_netns`."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(path)
            outcome["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome["error"] = e

    thread = threading.Thread(target=run, name=f"netns {path}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {path} did not return within {timeout} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def run_in_netns(netns: Netns, fn: Callable[[], T], *, reactor: Any = None) -> defer.Deferred[T]:
    """Run ``fn()`` inside ``netns`` on a dedicated thread; the Deferred fires on the reactor thread.

    The thread exits after ``fn`` returns, because it cannot leave the namespace.
    """
    if reactor is None:
        from twisted.internet import reactor as default_reactor

        reactor = default_reactor
    result: defer.Deferred[T] = defer.Deferred()
    # A private duplicate: the caller may close its Netns while the thread starts.
    fd = os.dup(netns.fileno())
    name = netns.name

    def in_thread() -> None:
        try:
            try:
                _setns(fd, CLONE_NEWNET)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot enter network namespace {name}: {exc.strerror or exc}") from exc
            finally:
                os.close(fd)
            value = fn()
        except BaseException:
            reactor.callFromThread(result.errback, Failure())
        else:
            reactor.callFromThread(result.callback, value)

    thread = threading.Thread(target=in_thread, name=f"netns {name}", daemon=True)
    try:
        thread.start()
    except BaseException:
        os.close(fd)
        raise
    return result


def listening_socket_in(
    netns: Netns,
    ip: str,
    port: int,
    *,
    reuse_port: bool = True,
    mark: int | None = None,
    backlog: int = 1024,
    reactor: Any = None,
) -> defer.Deferred[socket.socket]:
    """A bound, listening, non-blocking TCP socket inside ``netns``.

    Adopt it with :func:`ztwisted.sockets.adopt_listening_socket`.
    """
    return run_in_netns(
        netns,
        lambda: sockets.listening_socket(ip, port, reuse_port=reuse_port, backlog=backlog, mark=mark),
        reactor=reactor,
    )


def connecting_socket_in(
    netns: Netns,
    ip: str,
    *,
    source_ip: str | None = None,
    source_port: int = 0,
    mark: int | None = None,
    reactor: Any = None,
) -> defer.Deferred[socket.socket]:
    """A non-blocking TCP socket for reaching ``ip``, created (and bound) inside ``netns``.

    ``ip`` only picks the address family; connect with :func:`connect_socket`.
    """
    return run_in_netns(
        netns,
        lambda: sockets.client_socket(ip, source_ip=source_ip, source_port=source_port, mark=mark),
        reactor=reactor,
    )


# Kept importable from here for callers that connect sockets made in a namespace.
connect_socket = sockets.connect_socket
