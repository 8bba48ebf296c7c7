"""SOCK_SEQPACKET Unix sockets on the Twisted reactor, with SCM_RIGHTS fds.

Twisted has no SEQPACKET transport, and its stream transports would merge
datagrams, so :class:`SeqpacketConnection` is a minimal read/write
descriptor of its own: one ``recvmsg`` per datagram, one ``sendmsg`` per
queued datagram. :class:`SeqpacketListener` accepts connections (agent side)
and :func:`connect_seqpacket` connects (proxy side). No threads.
"""

from __future__ import annotations

import array
import errno
import os
import select
import socket
from collections import deque
from collections.abc import Callable, Iterable

from twisted.internet import error as twisted_error
from twisted.internet.interfaces import IReadDescriptor, IWriteDescriptor
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import Interface, implementer

log = Logger()

DEFAULT_MAX_DATAGRAM = 1024  # ztunnel's receive buffer; zds.md asks for at least this
DEFAULT_MAX_FDS = 8  # room to see (and refuse) a few fds more than the one expected
_INT_SIZE = array.array("i").itemsize
_READS_PER_TURN = 32  # datagrams read per reactor turn before letting others run
_WOULD_BLOCK = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


class ISeqpacketHandler(Interface):
    """What a :class:`SeqpacketConnection` reports to."""

    def datagram_received(payload, fds, flags):
        """One datagram: ``payload`` bytes, ``fds`` (list of received fds, now
        owned by the handler, which must close them), ``flags`` (recvmsg's
        msg_flags: test ``socket.MSG_TRUNC`` / ``socket.MSG_CTRUNC``)."""

    def connection_lost(reason):
        """The connection is closed (``reason`` is a Failure); called once."""


def _fds_from(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array("i")
            # A truncated control message can end in a partial int: drop it.
            ints.frombytes(data[: len(data) - (len(data) % _INT_SIZE)])
            fds.extend(ints)
    return fds


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _peer_hung_up(fd: int) -> bool:
    """After a zero-byte recvmsg: EOF, or an empty datagram? EOF leaves RDHUP/HUP set."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | getattr(select, "POLLRDHUP", 0x2000))
    for _, events in poller.poll(0):
        if events & (getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR):
            return True
    return False


@implementer(IReadDescriptor, IWriteDescriptor)
class SeqpacketConnection:
    """A connected SEQPACKET socket driven by the reactor.

    Takes ownership of ``sock`` (made non-blocking). Call :meth:`start` to
    begin reading. :meth:`send` never blocks: datagrams that do not fit now
    wait in a queue flushed when the socket becomes writable.
    """

    def __init__(
        self,
        reactor,
        sock: socket.socket,
        handler,
        *,
        max_datagram: int = DEFAULT_MAX_DATAGRAM,
        max_fds: int = DEFAULT_MAX_FDS,
        name: str = "seqpacket",
    ) -> None:
        if sock.type != socket.SOCK_SEQPACKET:
            raise ValueError(f"{name}: expected a SOCK_SEQPACKET socket, got {sock.type!r}")
        sock.setblocking(False)
        self.reactor = reactor
        self.handler = handler
        self.name = name
        self._sock = sock
        self._fileno = sock.fileno()
        self._bufsize = max_datagram
        self._ancbufsize = socket.CMSG_SPACE(max_fds * _INT_SIZE)
        self._queue: deque[tuple[bytes, list[int]]] = deque()
        self._writing = False
        self._close_when_flushed = False
        self._reset_seen = False
        self.disconnected = False

    # -- public ----------------------------------------------------------

    def start(self) -> None:
        if not self.disconnected:
            self.reactor.addReader(self)

    def send(self, payload: bytes, fds: Iterable[int] = ()) -> None:
        """Queue one datagram (with ``fds`` as SCM_RIGHTS). The caller keeps its fds."""
        if self.disconnected or self._close_when_flushed:
            raise twisted_error.ConnectionDone(f"{self.name}: cannot send, the connection is closed")
        # Our own duplicates: the caller may close its fds before the queue drains.
        owned = [os.dup(fd) for fd in fds]
        self._queue.append((bytes(payload), owned))
        if not self._writing:
            self._flush()

    def close_after_flush(self) -> None:
        """Close once every queued datagram has been sent."""
        if self.disconnected:
            return
        self._close_when_flushed = True
        if not self._queue:
            self._disconnect(Failure(twisted_error.ConnectionDone("closed by this side")))

    def abort(self) -> None:
        """Close now, dropping anything still queued."""
        if not self.disconnected:
            self._disconnect(Failure(twisted_error.ConnectionDone("aborted by this side")))

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- IReadDescriptor / IWriteDescriptor ---------------------------------

    def fileno(self) -> int:
        return -1 if self.disconnected else self._fileno

    def logPrefix(self) -> str:
        return self.name

    def doRead(self):
        for _ in range(_READS_PER_TURN):
            if self.disconnected:
                return None
            try:
                payload, ancdata, flags, _ = self._sock.recvmsg(
                    self._bufsize, self._ancbufsize, socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                return None
            except OSError as exc:
                if exc.errno in _WOULD_BLOCK:
                    return None
                if exc.errno == errno.ECONNRESET and not self._reset_seen:
                    # The peer closed with our datagrams unread; the kernel reports that
                    # before the datagrams it did send us (an error Ack, say): read those.
                    self._reset_seen = True
                    continue
                self._disconnect(Failure(twisted_error.ConnectionLost(f"{self.name}: recvmsg failed: {exc}")))
                return None
            fds = _fds_from(ancdata)
            flags &= ~socket.MSG_CMSG_CLOEXEC  # Linux echoes the request flag back
            if not payload and not fds and not flags and _peer_hung_up(self._fileno):
                if self._reset_seen:
                    failure = Failure(
                        twisted_error.ConnectionLost(
                            f"{self.name}: the peer closed the connection without reading everything we sent"
                        )
                    )
                else:
                    failure = Failure(twisted_error.ConnectionDone(f"{self.name}: the peer closed the connection"))
                self._disconnect(failure)
                return None
            try:
                self.handler.datagram_received(payload, fds, flags)
            except Exception:
                # The handler owns the fds once called; a bug there must not kill the reader.
                log.failure("{name}: datagram handler failed", name=self.name)
        return None

    def doWrite(self):
        self._flush()
        return None

    def connectionLost(self, reason: Failure) -> None:
        """Called by the reactor (a doRead/doWrite error, or reactor shutdown)."""
        self._disconnect(reason)

    # -- internals ---------------------------------------------------------

    def _flush(self) -> None:
        while self._queue and not self.disconnected:
            payload, fds = self._queue[0]
            ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            try:
                self._sock.sendmsg([payload], ancdata)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _WOULD_BLOCK:
                    break
                self._disconnect(Failure(twisted_error.ConnectionLost(f"{self.name}: sendmsg failed: {exc}")))
                return
            self._queue.popleft()
            _close_fds(fds)
        if self.disconnected:
            return
        if self._queue and not self._writing:
            self._writing = True
            self.reactor.addWriter(self)
        elif not self._queue and self._writing:
            self._writing = False
            self.reactor.removeWriter(self)
        if not self._queue and self._close_when_flushed:
            self._disconnect(Failure(twisted_error.ConnectionDone("closed by this side")))

    def _discard_unread(self) -> None:
        """Read away what the peer sent and we will not handle (closing its fds).

        Closing a Unix socket with unread data makes the peer's next read fail
        with ECONNRESET, which hides what we sent last (an error Ack) from it.
        """
        for _ in range(1024):
            try:
                payload, ancdata, flags, _ = self._sock.recvmsg(
                    self._bufsize, self._ancbufsize, socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT
                )
            except OSError:
                return
            fds = _fds_from(ancdata)
            _close_fds(fds)
            if not payload and not fds and _peer_hung_up(self._fileno):
                return

    def _disconnect(self, reason: Failure) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        self.reactor.removeReader(self)
        self.reactor.removeWriter(self)
        self._writing = False
        while self._queue:
            _close_fds(self._queue.popleft()[1])
        self._discard_unread()
        self._sock.close()
        try:
            self.handler.connection_lost(reason)
        except Exception:
            log.failure("{name}: connection_lost handler failed", name=self.name)


@implementer(IReadDescriptor)
class SeqpacketListener:
    """A listening SEQPACKET socket at ``path``; ``on_accept(sock)`` gets each new connection.

    An existing file at ``path`` (a stale socket) is replaced, as the real
    node agent does; :meth:`close` removes it.
    """

    def __init__(self, reactor, path: str, on_accept: Callable[[socket.socket], None], *, backlog: int = 16) -> None:
        self.reactor = reactor
        self.path = str(path)
        self.on_accept = on_accept
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            sock.listen(backlog)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot listen on SEQPACKET socket {self.path}: {exc.strerror}") from exc
        self._sock = sock
        self._fileno = sock.fileno()
        self.closed = False
        reactor.addReader(self)

    def fileno(self) -> int:
        return -1 if self.closed else self._fileno

    def logPrefix(self) -> str:
        return f"seqpacket-listener {self.path}"

    def doRead(self):
        for _ in range(_READS_PER_TURN):
            if self.closed:
                return None
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return None
            except OSError as exc:
                if exc.errno in _WOULD_BLOCK + (errno.ECONNABORTED,):
                    return None
                # EMFILE and the like: say so, and try again on the next readable event.
                log.error("accept on {path} failed: {error}", path=self.path, error=exc)
                return None
            conn.setblocking(False)
            try:
                self.on_accept(conn)
            except Exception:
                log.failure("handling a new connection on {path} failed", path=self.path)
                conn.close()
        return None

    def connectionLost(self, reason: Failure) -> None:
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.reactor.removeReader(self)
        self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def connect_seqpacket(path: str) -> socket.socket:
    """A connected, non-blocking SEQPACKET socket to ``path``.

    Unix connects complete at once (or fail: ENOENT, ECONNREFUSED, EAGAIN
    when the listener's backlog is full), so this never waits. Raises
    OSError with the path in its message.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot connect to {path}: {exc.strerror or exc}") from exc
    return sock
