"""Sockets the reactor cannot make by itself (SO_REUSEPORT listeners, original destinations,
bound and marked connects), and write-through TCP transports."""

from __future__ import annotations

import ctypes
import errno
import functools
import ipaddress
import os
import re
import socket
import struct
from typing import Any

from twisted.internet import defer, main, tcp
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure

from ztwisted.model import parse_ip
from ztwisted.reactor import call_after_events

log = Logger()

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same number


def listening_socket(
    ip: str, port: int, *, reuse_port: bool = True, backlog: int = 1024, mark: int | None = None
) -> socket.socket:
    """A bound, listening, non-blocking TCP socket.

    SO_REUSEPORT lets a new proxy process share the ports of the running one
    (restart without loss), as ztunnel's listeners do. TCP_NODELAY is set on
    the listener because Linux copies it to every socket it accepts: the
    proxy's connections need it (see :func:`write_through`), and this way
    they have it without a ``setsockopt`` each.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.bind((ip, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {_address(ip, port)}: {e.strerror or e}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def adopt_listening_socket(reactor, sock: socket.socket, factory):
    """Hand a listening socket to the reactor (which keeps its own duplicate); returns the IListeningPort.

    The connections it accepts are write-through transports from the start
    (:func:`write_through`; the listener of :func:`listening_socket` gave them
    TCP_NODELAY), so even a protocol's first write, such as the SOCKS5
    method-selection reply, is sent at once.

    The factory's "Starting factory"/"Stopping factory" lines are switched off:
    whoever opens a listener logs one line for it, with its address and purpose.
    """
    quieted = factory
    while quieted is not None:  # a TLS factory wraps the protocol's: both would log
        quieted.noisy = False
        quieted = getattr(quieted, "wrappedFactory", None)
    try:
        port = reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
    finally:
        sock.close()
    if isinstance(port, tcp.Port):
        # Twisted's Port builds each accepted connection with its ``transport`` class;
        # nothing is accepted before the reactor runs again.
        port.transport = _with_write_through(port.transport)
        # Its ``_logger`` is a class attribute that builds a new Logger on every read (twice
        # per round of accepts); the port's own, made once, shadows it.
        port._logger = port._logger
    return port


# Twisted's own line for each listening port it starts and closes; ztwisted logs its own, with the address.
_PORT_NOISE = re.compile(r".+ starting on \d+|\(TCP Port \d+ Closed\)")


def is_port_noise(event: dict) -> bool:
    """Whether ``event`` is Twisted's "Site starting on 15000" or "(TCP Port 15000 Closed)" line."""
    message = event.get("message")
    return (
        event.get("log_namespace") == "log_legacy"
        and isinstance(message, tuple)
        and len(message) == 1
        and isinstance(message[0], str)
        and _PORT_NOISE.fullmatch(message[0]) is not None
    )


def original_destination(transport) -> tuple[str, int] | None:
    """Where a redirected (iptables REDIRECT/TPROXY-less) connection was going."""
    sock = transport.getHandle()
    try:
        if sock.family == socket.AF_INET6:
            raw = sock.getsockopt(socket.IPPROTO_IPV6, SO_ORIGINAL_DST, 28)
            port = struct.unpack("!H", raw[2:4])[0]
            return str(ipaddress.IPv6Address(raw[8:24])), port
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    port = struct.unpack("!H", raw[2:4])[0]
    return socket.inet_ntoa(raw[4:8]), port


class _OneProtocolFactory(Factory):
    noisy = False  # one per proxied connection: "Starting factory" lines would drown the log

    def __init__(self, protocol):
        self._protocol = protocol

    def buildProtocol(self, addr):
        return self._protocol


def factory_for(protocol) -> Factory:
    """A quiet factory for a connection whose protocol object already exists."""
    return _OneProtocolFactory(protocol)


IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h


def client_socket(
    ip: str, *, source_ip: str | None = None, source_port: int = 0, mark: int | None = None
) -> socket.socket:
    """A non-blocking TCP socket for reaching ``ip``, bound to ``source_ip`` and marked if asked.

    With a source address but no port, the port is chosen at connect time
    (IP_BIND_ADDRESS_NO_PORT), so many connections from one workload address
    do not make every bind search the port space. TCP_NODELAY is set here,
    before the connect (a connected socket inherits it from no listener; see
    :func:`write_through`).
    """
    # parse_ip: node-b connects to the same few app addresses again and again.
    family = socket.AF_INET6 if parse_ip(ip).version == 6 else socket.AF_INET
    # Non-blocking from the start (the connect below must not block).
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        if source_ip is not None:
            if not source_port:
                sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((source_ip, source_port))
    except BaseException:
        sock.close()
        raise
    return sock


def _established(sock: socket.socket) -> bool:
    """Whether a non-blocking connect in progress has already completed (one getpeername)."""
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


class _ConnectWaiter:
    """Waits (on the reactor) for a non-blocking connect to finish."""

    def __init__(self, reactor: Any, sock: socket.socket, address: tuple[str, int], timeout: float) -> None:
        self.reactor = reactor
        self.sock = sock
        self.address = address
        self.result: defer.Deferred[None] = defer.Deferred(self._cancel)
        self._timer = reactor.callLater(timeout, self._timed_out, timeout)
        reactor.addWriter(self)

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        return "connect"

    def doWrite(self) -> None:
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._finish(OSError(err, f"connect to {self._where()} failed: {os.strerror(err)}"))
        else:
            self._finish(None)

    def connectionLost(self, reason: Failure) -> None:
        # The reactor reports a failed connect as a hang-up: the real cause is in SO_ERROR.
        err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._finish(OSError(err, f"connect to {self._where()} failed: {os.strerror(err)}"))
        else:
            self._finish(OSError(errno.ECONNABORTED, f"connect to {self._where()} failed: {reason.getErrorMessage()}"))

    def _where(self) -> str:
        host, port = self.address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _timed_out(self, timeout: float) -> None:
        self._timer = None
        self._finish(TimeoutError(f"connect to {self._where()} timed out after {timeout:g} s"))

    def _cancel(self, _: defer.Deferred) -> None:
        self._stop()

    def _stop(self) -> None:
        self.reactor.removeWriter(self)
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _finish(self, error: Exception | None) -> None:
        if self.result.called:
            return
        self._stop()
        if error is None:
            self.result.callback(None)
        else:
            self.result.errback(Failure(error))


def connect_socket(
    reactor: Any, sock: socket.socket, address: tuple[str, int], factory: Any, *, timeout: float = 10.0
) -> defer.Deferred[Any]:
    """Connect a non-blocking ``sock`` without blocking, then run ``factory``'s protocol on it: fires with the protocol.

    The sockets come from :func:`client_socket`, made here or inside a pod's
    network namespace on a short-lived thread (:mod:`ztwisted.netns`), bound
    to a workload's address and marked: neither ``connectTCP`` nor a Twisted
    endpoint can take such a socket. So the connect is waited for here (if
    it has not already completed, as it has to an address of this host: then
    the result comes at the end of this reactor iteration), and the transport (:class:`_ConnectedTransport`) is then built over this very
    socket, which it owns from then on; on any failure ``sock`` is closed.
    """
    try:
        code = sock.connect_ex(address)
    except OSError as exc:
        sock.close()
        return defer.fail(exc)
    if code not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
        sock.close()
        return defer.fail(OSError(code, f"connect to {address[0]}:{address[1]} failed: {os.strerror(code)}"))
    if code == 0 or _established(sock):
        # To an address of this host (node-b to a local app, in a pod's namespace too) the
        # handshake is over by the time connect() returns: no poll and no connect timeout. The result
        # still comes after the caller's current work, at the end of this reactor iteration,
        # as a connect that waits would (callers act on the stream it is for; h2 may have
        # more to say about that stream from the same read): an after-events call, not a timed one.
        at_turn_end = None
        ready: defer.Deferred[None] = defer.Deferred(lambda _: at_turn_end.cancel())
        at_turn_end = call_after_events(reactor, ready.callback, None)
    else:
        ready = _ConnectWaiter(reactor, sock, address, timeout).result

    def connected(_: None) -> Any:
        return _ConnectedTransport.start(reactor, sock, address, factory).protocol

    def close_socket(failure: Failure) -> Failure:
        sock.close()
        return failure

    return ready.addCallbacks(connected, close_socket)


#: bytes asked of the kernel per ``recv`` on a data-path socket. Twisted asks 64 KiB; the
#: proxy's Python work per read is about the same whatever its size, so bulk costs less per MB
#: with bigger reads. Only a read in progress holds such a buffer: an idle connection holds none,
#: and an end whose partner stopped taking data holds at most one read (the partner pauses it).
#: Bigger reads need :func:`keep_read_buffers_in_the_heap` (the node calls it at start).
#: 512 KiB: bulk over one connection took ~4 % less proxy CPU per MB than with 256 KiB (nine
#: runs), 1 MiB 13 % more (its TLS write is over SEND_LIMIT) (``benchmarks/README.md``, "Bulk, session 6").
READ_SIZE = 512 * 1024

# mallopt(3) parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_read_buffers_in_the_heap() -> bool:
    """Ask glibc's malloc to serve allocations under 2 MiB from the heap and to keep up to
    4 MiB of freed memory instead of giving it back to the kernel at once; False where the
    C library has no ``mallopt`` (then nothing changes).

    A read's buffers (the read, its decrypted records, a DATA frame held until whole, its
    payload: each up to :data:`READ_SIZE`, up to 1 MiB for a frame) are freed together once
    the read is handled. With glibc's defaults, which start returning the top of the heap
    once 128 KiB of it are free (and move that mark only after a large mmapped block was
    freed), every such read faulted the same pages in again: ~550 minor page faults per MB
    on the node receiving TLS with 256 KiB reads. These are the limits glibc's own dynamic
    thresholds reach after 1-2 MiB blocks; here they hold from the start.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(_M_MMAP_THRESHOLD, 2 * 1024 * 1024) == 1 and mallopt(_M_TRIM_THRESHOLD, 4 * 1024 * 1024) == 1


#: how often a node that keeps read buffers in the heap gives freed memory back (seconds)
GIVE_BACK_INTERVAL = 10.0


def give_back_freed_memory() -> None:
    """``malloc_trim(0)``: return the heap's free pages to the kernel, wherever they are.

    What :func:`keep_read_buffers_in_the_heap` keeps for the next reads stays with the
    process after a burst of bulk tunnels (measured: ~9 MB on a node after 16 concurrent
    ones); the node calls this every :data:`GIVE_BACK_INTERVAL` seconds, which costs a
    walk of the heap and, during a transfer, the reads of the next moment faulting their
    pages in once more. Where the C library has no ``malloc_trim``, nothing happens.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):  # pragma: no cover (not glibc)
    _malloc_trim = None


#: the reason given to every write-through connection closed after its sending side
_CONNECTION_DONE = Failure(main.CONNECTION_DONE)


class _WriteThrough:
    """Mixed into a TCP transport's class by :func:`write_through`."""

    # Twisted hands the kernel at most 128 KiB per send (for Windows' sake), so a bigger
    # write would always leave its rest to the queue and the next poll.
    SEND_LIMIT = 1024 * 1024

    def doRead(self):
        # Twisted's tcp.Connection.doRead (and its _dataReceived), with READ_SIZE. Twisted's
        # bufferSize stays what it is: it is also the write queue's size at which the producer
        # is paused.
        try:
            data = self.socket.recv(READ_SIZE)
        except OSError as se:
            if se.args[0] == errno.EWOULDBLOCK:
                return None
            return main.CONNECTION_LOST
        if not data:
            return main.CONNECTION_DONE
        self.protocol.dataReceived(data)
        return None

    def _nothing_queued(self) -> bool:
        # Twisted's queue: dataBuffer from offset on, then _tempDataBuffer (_tempDataLen bytes).
        return not self._tempDataLen and self.offset == len(self.dataBuffer)

    def write(self, data: bytes) -> None:
        if (
            self.connected
            and not self.disconnecting
            and not self._aborting  # an aborted connection drops what is written
            # A half-close Twisted is still to make (a producer was registered) happens when
            # its queue empties: what is written meanwhile must join that queue, or the FIN
            # would never follow it. (It also covers a half-close made: Twisted sets
            # _writeDisconnected only after _writeDisconnecting, and so does loseWriteConnection.)
            and not self._writeDisconnecting
            # Nothing queued (_nothing_queued, inline: this is every message's path)
            and not self._tempDataLen
            and self.offset == len(self.dataBuffer)
            and data
        ):
            # Twisted's writeSomeData, without its helpers: Python retries a send interrupted by
            # a signal itself, and what a send refuses (EAGAIN, or an error, which Twisted's
            # own write then reports) goes to the queue.
            try:
                sent = self.socket.send(data if len(data) <= self.SEND_LIMIT else memoryview(data)[: self.SEND_LIMIT])
            except OSError:
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        super().write(data)

    def loseWriteConnection(self) -> None:
        # Twisted half-closes on the next poll for writability even with nothing to send
        # (epoll_ctl, a poll, an empty send, epoll_ctl). With nothing queued and no
        # producer to resume first, that is this: shutdown(SHUT_WR) and writeConnectionLost.
        if (
            self.connected
            and not self.disconnecting
            and not self._aborting
            and not self._writeDisconnecting
            and self.producer is None
            and self._nothing_queued()
        ):
            self._writeDisconnecting = True
            self._writeDisconnected = True
            self._closeWriteConnection()
            return
        super().loseWriteConnection()

    def loseConnection(self) -> None:
        # Sending side already shut down (the usual end of a proxied connection: the partner's
        # end, then the peer's): Twisted's FileDescriptor.loseConnection stops reading and
        # writing, which connectionLost does again, and builds a new Failure(ConnectionDone),
        # whose first check() names every class of the exception (reflect.qual on its MRO).
        # The reactor's own ends of connections share one Failure per kind (its
        # _disconnectSelectable); so does this.
        if self.connected and not self.disconnecting and self._writeDisconnected:
            self.connectionLost(_CONNECTION_DONE)
            return
        super().loseConnection()

    def _closeWriteConnection(self) -> None:
        # The FIN goes out here, so the final close needs no shutdown(SHUT_RDWR) before it
        # (Twisted's "just to be safe" for a socket another process holds; ours are close-on-exec).
        self._shouldShutdown = False
        super()._closeWriteConnection()


@functools.cache
def _with_write_through(transport_class: type) -> type:
    return type(f"WriteThrough{transport_class.__name__}", (_WriteThrough, transport_class), {})


def write_through(transport) -> None:
    """Make ``transport.write`` send at once when nothing is queued; queue only what the kernel does not take;
    read bigger pieces.

    Twisted's TCP transport queues every write until the reactor next polls
    for writability: per message an ``epoll_ctl`` to arm it, a poll, the
    ``send``, and an ``epoll_ctl`` to disarm it. A proxy forwarding one small
    message on each hop pays that on every hop. With nothing queued, the
    order of bytes cannot change by sending now; what the socket does not
    accept (EAGAIN, a partial send) goes to Twisted's queue as before, and so
    do writes to a transport that is closing or that has a queue, and errors
    (Twisted's own write then reports them). The same holds for the end of
    the stream: ``loseWriteConnection`` with nothing queued (and no producer
    registered) shuts the sending side down at once; with bytes queued, the
    FIN follows them when Twisted has written them, as before. Transports
    other than Twisted's TCP connections are left alone.

    Reads ask for :data:`READ_SIZE` bytes instead of Twisted's 64 KiB (see
    :func:`keep_read_buffers_in_the_heap`), and a write
    of up to 1 MiB is offered to the kernel in one ``send`` (Twisted's stop at 128 KiB):
    the proxy's work per read and per write hardly depends on its size.

    Nagle's algorithm is turned off (TCP_NODELAY, as ztunnel and Envoy do):
    the writes are already coalesced (the TLS layer makes one record of a
    reactor turn's HTTP/2 frames), and with Nagle a small write sent at once
    would hold back the next one until the peer's delayed ACK, 40 ms later.

    The transport changes class (to a subclass adding :class:`_WriteThrough`)
    rather than getting a ``write`` attribute of its own: that costs no memory
    per connection, where a closure per transport added ~0.6 KiB to every
    idle tunneled connection. The proxy's own connections are of such a class
    from the start, with TCP_NODELAY set on their listener
    (:func:`adopt_listening_socket`) or on the socket before it connected
    (:func:`connect_socket`): for them this does nothing.
    """
    if isinstance(transport, tcp.Connection) and not isinstance(transport, _WriteThrough):
        transport.__class__ = _with_write_through(type(transport))
        transport.setTcpNoDelay(True)


class _ConnectedTransport(_WriteThrough, tcp.Server):
    """The write-through transport of a connection made by :func:`connect_socket`, over its own socket.

    ``adoptStreamConnection``, Twisted's way to take over a connected socket,
    builds a ``tcp.Server`` (this class's base) over a duplicate of the file
    descriptor, which it asks for both addresses (``getsockname`` twice,
    ``getpeername``), and the caller then closes the original: five system
    calls per connection to learn what the caller knows. Here the transport
    takes the socket itself, and the peer is the address it connected to.
    """

    @classmethod
    def start(cls, reactor: Any, sock: socket.socket, address: tuple, factory: Any) -> _ConnectedTransport:
        """Connect ``factory``'s protocol to a transport over the connected ``sock``, which it then owns.

        If no protocol is built (None or an exception), ``sock`` is closed; if
        the protocol fails in ``makeConnection``, the connection is aborted.
        """
        try:
            if ":" in address[0]:  # an IPv6 address (``sock.family`` converts to an enum each time)
                peer = (*address[:2], 0, 0) if len(address) == 2 else tuple(address)
                protocol = factory.buildProtocol(IPv6Address("TCP", *peer))
            else:
                peer = tuple(address[:2])
                protocol = factory.buildProtocol(IPv4Address("TCP", *peer))
            if protocol is None:
                raise RuntimeError(f"{factory!r} built no protocol for the connection to {_address(*peer[:2])}")
        except BaseException:
            sock.close()
            raise
        try:
            transport = cls(sock, protocol, peer, None, 0, reactor)
        except BaseException:  # startReading's epoll_ctl failing, say: the socket is still ours
            sock.close()
            raise
        transport.repstr = f"<{type(protocol).__name__} to {_address(*peer[:2])}>"
        try:
            protocol.makeConnection(transport)
        except BaseException:
            transport.abortConnection()
            raise
        return transport


class CannotListen(Exception):
    """One of the proxy's own listeners cannot be opened; str() names the option and the address."""


def log_listening(port, purpose: str, where: str = "") -> None:
    """The one line logged for each listener the proxy opens."""
    host = port.getHost()
    address = _address(host.host, host.port) if hasattr(host, "port") else str(getattr(host, "name", host))
    log.info("listening on {address}{where}: {purpose}", address=address, where=where, purpose=purpose)


def allow_accept_queue_migration() -> bool:
    """Set net.ipv4.tcp_migrate_req=1 in this network namespace, if we may.

    With it, connections waiting in the accept queue of a SO_REUSEPORT
    listener that closes move to another listener of the group instead of
    being reset: a restarted proxy loses none of them.
    """
    path = "/proc/sys/net/ipv4/tcp_migrate_req"
    try:
        with open(path) as current:
            if current.read().strip() == "1":
                return True
        with open(path, "w") as setting:
            setting.write("1\n")
        return True
    except OSError:
        return False
