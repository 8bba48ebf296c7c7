"""Write-through TCP transports (ztwisted.sockets): write_through, the proxy's listeners, connect_socket; real sockets."""

from __future__ import annotations

import errno
import fcntl
import socket
import struct
import termios
import time

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor, threads
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.logger import globalLogPublisher
from zope.interface import implementer

from ztwisted.sockets import (
    _CONNECTION_DONE,
    READ_SIZE,
    _ConnectWaiter,
    adopt_listening_socket,
    client_socket,
    connect_socket,
    listening_socket,
    write_through,
)

from .h2_support import RecordingEnd


class _Accepted(protocol.Protocol):
    def connectionMade(self):
        self.chunks: list[int] = []
        self.factory.accepted.callback(self)

    def dataReceived(self, data):
        self.chunks.append(len(data))


@defer.inlineCallbacks
def _connected_pair():
    """(the reactor's accepted transport, a plain blocking client socket)."""
    factory = protocol.Factory.forProtocol(_Accepted)
    factory.accepted = defer.Deferred()
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    client = socket.create_connection(("127.0.0.1", port.getHost().port))
    server = yield factory.accepted
    yield port.stopListening()
    return server.transport, client


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(10)
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(min(1 << 20, size - got))
        assert chunk, f"connection closed after {got} of {size} bytes"
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _write_more_than_the_socket_takes(transport, client: socket.socket) -> bytes:
    """Make ``transport`` write-through and write so much that part of it is queued; returns what it wrote."""
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    write_through(transport)
    big = bytes(range(256)) * 1024  # 256 KiB: far more than the socket buffers hold
    transport.write(big)
    assert transport._tempDataLen > 0 or len(transport.dataBuffer) > transport.offset, "nothing was queued"
    return big


@pytest_twisted.inlineCallbacks
def test_a_write_with_nothing_queued_is_sent_before_the_reactor_runs_again():
    transport, client = yield _connected_pair()
    try:
        write_through(transport)
        transport.write(b"hello")
        # No reactor turn in between: the bytes are already in the kernel.
        client.setblocking(False)
        assert client.recv(100) == b"hello"
        assert transport.dataBuffer[transport.offset :] == b"" and not transport._tempDataBuffer
        assert transport.getTcpNoDelay()
    finally:
        client.close()
        transport.abortConnection()


@pytest_twisted.inlineCallbacks
def test_what_the_socket_does_not_take_is_queued_and_order_is_kept_and_the_producer_paused():
    from twisted.internet import task

    transport, client = yield _connected_pair()
    try:
        producer = RecordingEnd()  # the partner end whose reads a full queue must stop
        transport.registerProducer(producer, True)
        big = _write_more_than_the_socket_takes(transport, client)
        assert producer.paused, "the queue grew past the transport's buffer size without pausing the producer"
        # With a queue, later writes join it instead of jumping ahead.
        transport.write(b"tail")
        received = yield threads.deferToThread(_read_exactly, client, len(big) + 4)
        assert received == big + b"tail"
        deadline = reactor.seconds() + 10
        while producer.paused and reactor.seconds() < deadline:
            yield task.deferLater(reactor, 0.01, lambda: None)
        assert not producer.paused, "the producer was not resumed once the queue was sent"
    finally:
        client.close()
        transport.abortConnection()


class _RecordingLoss(protocol.Protocol):
    def __init__(self):
        self.lost = defer.Deferred()
        self.reasons = []

    def connectionLost(self, reason):
        self.reasons.append(reason)
        self.lost.callback(None)


def _drain_the_kernels_buffers(client: socket.socket) -> bytes:
    """What the kernel holds for ``client``, until the sender's socket buffer is empty too (its
    last bytes acknowledged: a delayed ACK takes up to 200 ms). Blocks the reactor on purpose:
    Twisted must not send meanwhile."""
    client.setblocking(False)
    chunks = []
    waited = False
    for _ in range(100):
        try:
            chunks.append(client.recv(1 << 20))
            waited = False
        except BlockingIOError:
            if waited:
                break
            time.sleep(0.25)
            waited = True
    client.setblocking(True)
    return b"".join(chunks)


@pytest_twisted.inlineCallbacks
def test_a_write_joins_what_twisted_is_still_sending_from_its_buffer():
    """Twisted's queue is in two parts: writes not yet looked at (``_tempDataBuffer``) and the
    buffer it is sending from (``dataBuffer`` after ``offset``). With the first part empty and
    the second not, and room in the socket again, a write still joins the queue."""
    transport, client = yield _connected_pair()
    try:
        big = _write_more_than_the_socket_takes(transport, client)
        transport.doWrite()  # Twisted's turn for writability: the queue moves into dataBuffer
        assert transport._tempDataLen == 0 and transport.offset < len(transport.dataBuffer)
        head = _drain_the_kernels_buffers(client)  # room in the socket again, with no reactor turn in between
        transport.write(b"tail")
        rest = yield threads.deferToThread(_read_exactly, client, len(big) + 4 - len(head))
        assert head + rest == big + b"tail"
    finally:
        client.close()
        transport.abortConnection()


@pytest_twisted.inlineCallbacks
def test_a_write_the_kernel_refuses_with_an_error_is_reported_as_the_connection_lost():
    transport, client = yield _connected_pair()
    recorder = _RecordingLoss()
    transport.protocol = recorder  # the transport reports to its protocol: this one records how it ended
    write_through(transport)
    transport.stopReading()  # the reset is found by the write, not by a read
    # The peer resets the connection (SO_LINGER 0), so the next sends fail with EPIPE or ECONNRESET.
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    yield threads.deferToThread(lambda: None)  # let the RST arrive
    transport.write(b"into a reset connection")
    assert transport.connected and not transport._nothing_queued(), "the refused bytes wait in Twisted's queue"
    transport.write(b"and more")
    yield recorder.lost
    assert [reason.check(ConnectionLost, ConnectionDone) for reason in recorder.reasons] == [ConnectionLost]
    assert not transport.connected


@pytest_twisted.inlineCallbacks
def test_the_peers_fin_ends_a_write_through_connection_cleanly():
    # doRead's empty read is the end: without that check the socket would stay readable forever.
    transport, client = yield _connected_pair()
    recorder = _RecordingLoss()
    transport.protocol = recorder
    write_through(transport)
    client.sendall(b"last words")
    client.close()
    yield recorder.lost
    assert [reason.check(ConnectionLost, ConnectionDone) for reason in recorder.reasons] == [ConnectionDone]
    assert not transport.connected


@pytest_twisted.inlineCallbacks
def test_other_transports_are_left_alone():
    from twisted.internet.testing import StringTransport

    transport = StringTransport()
    write_through(transport)
    transport.write(b"x")
    assert transport.value() == b"x"
    assert type(transport) is StringTransport
    yield defer.succeed(None)


@implementer(IHalfCloseableProtocol)
class _HalfClosing(protocol.Protocol):
    """Records writeConnectionLost (Twisted calls it once the FIN is sent)."""

    write_closed = 0

    @classmethod
    def on(cls, transport) -> _HalfClosing:
        """A new one as ``transport``'s protocol."""
        protocol = cls()
        protocol.makeConnection(transport)
        transport.protocol = protocol
        return protocol

    def writeConnectionLost(self):
        self.write_closed += 1

    def readConnectionLost(self):
        pass


@pytest_twisted.inlineCallbacks
def test_a_half_close_with_nothing_queued_is_sent_before_the_reactor_runs_again():
    transport, client = yield _connected_pair()
    try:
        halves = _HalfClosing.on(transport)
        write_through(transport)
        transport.write(b"last")
        transport.loseWriteConnection()
        # Data and FIN are already in the kernel: a recv sees both, no reactor turn in between.
        client.setblocking(False)
        assert client.recv(100) == b"last"
        assert client.recv(100) == b""
        assert halves.write_closed == 1
        # The other direction still works.
        client.sendall(b"x")
    finally:
        client.close()
        transport.abortConnection()


@pytest_twisted.inlineCallbacks
def test_a_half_close_behind_queued_bytes_comes_after_all_of_them():
    transport, client = yield _connected_pair()
    try:
        halves = _HalfClosing.on(transport)
        big = _write_more_than_the_socket_takes(transport, client)
        transport.loseWriteConnection()
        assert halves.write_closed == 0, "the FIN must wait for the queued bytes"

        def read_to_eof() -> bytes:
            received = _read_exactly(client, len(big))
            assert client.recv(100) == b"", "more than was written, or no FIN after it"
            return received

        received = yield threads.deferToThread(read_to_eof)
        assert received == big
        assert halves.write_closed == 1
    finally:
        client.close()
        transport.abortConnection()


def _nodelay(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


@pytest_twisted.inlineCallbacks
def test_connections_accepted_by_the_proxys_listeners_write_through_with_nodelay_from_the_start():
    factory = protocol.Factory.forProtocol(_Accepted)
    factory.accepted = defer.Deferred()
    listener = listening_socket("127.0.0.1", 0, reuse_port=False, backlog=4)
    assert _nodelay(listener)
    port = adopt_listening_socket(reactor, listener, factory)
    client = socket.create_connection(("127.0.0.1", port.getHost().port), timeout=5)
    try:
        server = yield factory.accepted
        transport = server.transport
        # Inherited from the listener (Linux copies TCP_NODELAY to accepted sockets): no setsockopt per connection.
        assert _nodelay(transport.getHandle())
        kind = type(transport)
        write_through(transport)  # nothing left to do
        assert type(transport) is kind
        transport.write(b"at once")
        client.setblocking(False)
        assert client.recv(100) == b"at once"
    finally:
        client.close()
        yield port.stopListening()


class _Received(protocol.Protocol):
    def __init__(self):
        self.data = b""

    def dataReceived(self, data):
        self.data += data


@pytest_twisted.inlineCallbacks
def test_connect_socket_runs_the_transport_on_the_socket_it_was_given():
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    sock = client_socket("127.0.0.1")
    assert _nodelay(sock), "set before the connect: a connected socket inherits it from no listener"
    fd = sock.fileno()
    try:
        connecting = connect_socket(reactor, sock, address, protocol.Factory.forProtocol(_Received), timeout=5)
        # To an address of this host the connect is complete at once: no poll for writability.
        assert not [waiter for waiter in reactor.getWriters() if isinstance(waiter, _ConnectWaiter)]
        made = yield connecting
        transport = made.transport
        # No duplicate of the file descriptor: the transport owns this very socket.
        assert transport.getHandle() is sock and transport.fileno() == fd
        assert (transport.getPeer().host, transport.getPeer().port) == address
        assert transport.getHost().port == sock.getsockname()[1]
        accepted, _ = listener.accept()
        with accepted:
            transport.write(b"hello")
            accepted.setblocking(False)
            assert accepted.recv(100) == b"hello"  # write-through: sent before the reactor runs again
            accepted.sendall(b"back")
            yield _until(lambda: made.data == b"back")
            transport.loseConnection()
            yield _until(lambda: not transport.connected)
        assert sock.fileno() == -1, "the transport closes its socket"
    finally:
        listener.close()
        sock.close()


def _full_listener() -> tuple[socket.socket, socket.socket]:
    """A listener whose accept queue is full (Linux then drops SYNs), and the client queued in it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = socket.create_connection(listener.getsockname(), timeout=5)
    return listener, queued


@pytest_twisted.inlineCallbacks
def test_connect_socket_waits_for_a_connect_still_in_progress():
    listener, queued = _full_listener()
    sock = client_socket("127.0.0.1")
    try:
        connecting = connect_socket(
            reactor, sock, listener.getsockname(), protocol.Factory.forProtocol(_Received), timeout=10
        )
        assert not connecting.called, "the SYN was dropped: the connect is still in progress"
        assert [waiter for waiter in reactor.getWriters() if isinstance(waiter, _ConnectWaiter)]
        accepted, _ = listener.accept()  # room in the queue: the SYN sent again (after ~1 s) is answered
        accepted.close()
        made = yield connecting
        assert made.transport.getHandle() is sock
        made.transport.loseConnection()
    finally:
        queued.close()
        listener.close()


@pytest_twisted.inlineCallbacks
def test_connect_socket_times_out_and_closes_the_socket():
    listener, queued = _full_listener()
    sock = client_socket("127.0.0.1")
    try:
        with pytest.raises(TimeoutError, match="timed out after 0.2 s"):
            yield connect_socket(
                reactor, sock, listener.getsockname(), protocol.Factory.forProtocol(_Received), timeout=0.2
            )
        assert sock.fileno() == -1
    finally:
        queued.close()
        listener.close()


@pytest_twisted.inlineCallbacks
def test_connect_socket_closes_the_socket_when_the_connect_fails():
    probe = socket.create_server(("127.0.0.1", 0))
    address = probe.getsockname()
    probe.close()  # nothing listens there now
    sock = client_socket("127.0.0.1")
    with pytest.raises(OSError) as failed:
        yield connect_socket(reactor, sock, address, protocol.Factory.forProtocol(_Received), timeout=5)
    assert failed.value.errno == errno.ECONNREFUSED
    assert sock.fileno() == -1


@pytest_twisted.inlineCallbacks
def test_connect_socket_closes_the_socket_when_no_protocol_is_built():
    listener = socket.create_server(("127.0.0.1", 0))
    sock = client_socket("127.0.0.1")
    try:
        refusing = protocol.Factory()
        refusing.buildProtocol = lambda addr: None
        with pytest.raises(RuntimeError, match="built no protocol"):
            yield connect_socket(reactor, sock, listener.getsockname(), refusing, timeout=5)
        assert sock.fileno() == -1
    finally:
        listener.close()


@pytest_twisted.inlineCallbacks
def test_connect_socket_closes_the_socket_when_its_transport_cannot_be_built(monkeypatch):
    from ztwisted.sockets import _ConnectedTransport

    def no_room_in_epoll(self):
        raise OSError(errno.ENOSPC, "epoll_ctl: no space left")

    monkeypatch.setattr(_ConnectedTransport, "startReading", no_room_in_epoll)
    listener = socket.create_server(("127.0.0.1", 0))
    sock = client_socket("127.0.0.1")
    try:
        with pytest.raises(OSError, match="no space left"):
            yield connect_socket(reactor, sock, listener.getsockname(), protocol.Factory.forProtocol(protocol.Protocol))
        assert sock.fileno() == -1
    finally:
        listener.close()


@defer.inlineCallbacks
def _until(condition, timeout: float = 5.0):
    from twisted.internet import task

    waited = 0.0
    while not condition():
        assert waited < timeout, "condition not met in time"
        yield task.deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


@pytest_twisted.inlineCallbacks
def test_connect_socket_over_ipv6():
    from twisted.internet.address import IPv6Address

    listener = socket.create_server(("::1", 0), family=socket.AF_INET6)
    port = listener.getsockname()[1]
    try:
        made = yield connect_socket(
            reactor, client_socket("::1"), ("::1", port), protocol.Factory.forProtocol(_Received), timeout=5
        )
        assert made.transport.getPeer() == IPv6Address("TCP", "::1", port)
        made.transport.loseConnection()
    finally:
        listener.close()


@pytest_twisted.inlineCallbacks
def test_a_connect_cancelled_before_its_result_closes_the_socket():
    listener = socket.create_server(("127.0.0.1", 0))
    sock = client_socket("127.0.0.1")
    try:
        connecting = connect_socket(
            reactor, sock, listener.getsockname(), protocol.Factory.forProtocol(_Received), timeout=5
        )
        connecting.cancel()  # the caller went away before the end of this reactor iteration
        with pytest.raises(defer.CancelledError):
            yield connecting
        assert sock.fileno() == -1
    finally:
        listener.close()


def _unread_bytes(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


@pytest_twisted.inlineCallbacks
def test_a_read_takes_up_to_read_size_bytes_at_once():
    from twisted.internet import task

    transport, client = yield _connected_pair()
    try:
        write_through(transport)
        transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * READ_SIZE)
        if transport.getHandle().getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < 4 * READ_SIZE:
            pytest.skip("net.core.rmem_max is too small to let three reads' worth pile up")
        transport.pauseProducing()  # let the bytes pile up in the kernel first
        yield threads.deferToThread(client.sendall, bytes(3 * READ_SIZE))
        deadline = reactor.seconds() + 10
        while _unread_bytes(transport.getHandle()) < 3 * READ_SIZE and reactor.seconds() < deadline:
            yield task.deferLater(reactor, 0.01, lambda: None)
        transport.resumeProducing()
        while sum(transport.protocol.chunks) < 3 * READ_SIZE and reactor.seconds() < deadline:
            yield task.deferLater(reactor, 0.01, lambda: None)
        # Twisted would have read 64 KiB at a time.
        assert transport.protocol.chunks == [READ_SIZE] * 3
    finally:
        client.close()
        transport.abortConnection()


@pytest_twisted.inlineCallbacks
def test_a_write_bigger_than_twisteds_send_limit_goes_to_the_kernel_at_once():
    transport, client = yield _connected_pair()
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2 << 20)
        transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 << 20)
        write_through(transport)
        big = bytes(range(256)) * 2048  # 512 KiB: Twisted sends at most 128 KiB per call
        transport.write(big)
        assert transport.dataBuffer[transport.offset :] == b"" and not transport._tempDataBuffer
        received = yield threads.deferToThread(_read_exactly, client, len(big))
        assert received == big
    finally:
        client.close()
        transport.abortConnection()


def test_one_read_fits_one_data_frame_and_its_tls_write_one_send():
    # Between two ztwisted nodes a read becomes one DATA frame (the peer's frame size is the
    # 1 MiB ztwisted advertises) and one TLS write of 16 KiB records (TLS 1.3: 22 bytes more
    # each), which the write-through transport offers the kernel in one send. With 1 MiB reads
    # it would not (bulk measured 13 % more CPU per MB).
    from ztwisted.h2.settings import H2Settings
    from ztwisted.sockets import _WriteThrough

    frame = READ_SIZE + 9
    records = -(-frame // 16384)
    assert READ_SIZE <= H2Settings().max_frame_size
    assert frame + 22 * records <= _WriteThrough.SEND_LIMIT


_ONE_READ_REPEATEDLY = """
import resource, sys
from ztwisted.sockets import READ_SIZE, keep_read_buffers_in_the_heap

if sys.argv[1] == "tuned" and not keep_read_buffers_in_the_heap():
    print("no mallopt")
    sys.exit(0)


def one_read():
    # What handling one read allocates (the read, its plaintext, a held frame, the payload), freed together.
    read = bytes(READ_SIZE)
    plaintext = bytearray(read)
    held = bytearray(plaintext)
    payload = bytes(held[9:])
    return len(read) + len(plaintext) + len(held) + len(payload)


for _ in range(20):
    one_read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    one_read()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 100)
"""


def _minor_faults_per_read(mode: str) -> str:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _ONE_READ_REPEATEDLY, mode], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.strip()


def test_a_reads_buffers_stop_faulting_in_once_the_heap_keeps_them():
    """In a fresh process: with glibc's defaults each read's freed buffers go back to the kernel and
    fault in again; after keep_read_buffers_in_the_heap() they are reused."""
    tuned = _minor_faults_per_read("tuned")
    if tuned == "no mallopt":
        pytest.skip("this C library has no mallopt")
    assert float(tuned) < 1, f"{tuned} minor page faults per read with the heap keeping freed memory"
    assert float(_minor_faults_per_read("default")) > 50, "glibc's defaults no longer fault (then this is moot)"


class _WritesOnceMoreWhenResumed:
    """A producer that writes once more when resumed, as a partner end may after a half-close was asked for."""

    def __init__(self, transport):
        self.transport = transport
        self.resumed = 0

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        self.resumed += 1
        if self.resumed == 1:
            self.transport.write(b"tail")

    def stopProducing(self):
        pass


def _read_to_eof(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    chunks = []
    while chunk := sock.recv(1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest_twisted.inlineCallbacks
def test_a_half_close_asked_for_with_a_producer_registered_comes_after_what_the_producer_writes_next():
    # Twisted half-closes once its queue is empty, and resumes the producer first: a write
    # the producer then makes must join the queue, or nothing sends the FIN after it.
    transport, client = yield _connected_pair()
    try:
        write_through(transport)
        producer = _WritesOnceMoreWhenResumed(transport)
        transport.registerProducer(producer, True)
        big = bytes(range(256)) * 32768  # 8 MiB: queued mostly, and the producer paused
        transport.write(big)
        assert transport.producerPaused
        transport.loseWriteConnection()
        received = yield threads.deferToThread(_read_to_eof, client)
        assert producer.resumed >= 1
        assert received == big + b"tail", "every byte, then the FIN"
    finally:
        client.close()
        transport.abortConnection()


@implementer(IHalfCloseableProtocol)
class _HalfClosingRecordingLoss(_RecordingLoss):
    def readConnectionLost(self):
        pass

    def writeConnectionLost(self):
        pass


@pytest_twisted.inlineCallbacks
def test_a_connection_closed_after_its_half_close_ends_at_once_with_connection_done():
    transport, client = yield _connected_pair()
    try:
        recorder = _HalfClosingRecordingLoss()
        transport.protocol = recorder
        write_through(transport)
        transport.loseWriteConnection()  # nothing queued: shut down at once
        transport.loseConnection()
        # No reactor turn in between: the socket is closed and the protocol told.
        assert recorder.lost.called and not transport.connected
        assert transport not in reactor.getReaders() and transport not in reactor.getWriters()
        (reason,) = recorder.reasons
        assert reason.check(ConnectionDone)
        # One Failure for all of them, as the reactor's own ends of connections: not a new one
        # (whose first check() names every class of the exception) per connection.
        assert reason is _CONNECTION_DONE
        transport.loseConnection()  # once closed, nothing more happens
        assert len(recorder.reasons) == 1
        client.settimeout(5)
        assert client.recv(100) == b"", "the peer sees the end"
    finally:
        client.close()


@pytest_twisted.inlineCallbacks
def test_a_connection_closed_before_its_half_close_still_writes_what_is_queued_first():
    # Only a connection whose sending side is already shut down ends at once; one with
    # bytes queued ends once Twisted has written them.
    transport, client = yield _connected_pair()
    try:
        recorder = _RecordingLoss()
        transport.protocol = recorder
        big = _write_more_than_the_socket_takes(transport, client)
        transport.loseConnection()
        assert not recorder.lost.called, "the queued bytes come first"
        received = yield threads.deferToThread(_read_to_eof, client)
        assert received == big
        yield recorder.lost
        assert [reason.check(ConnectionDone) for reason in recorder.reasons] == [ConnectionDone]
    finally:
        client.close()


@pytest_twisted.inlineCallbacks
def test_a_connection_closed_while_its_half_close_waits_for_queued_bytes_still_writes_them():
    # loseWriteConnection with bytes queued only asks for the FIN after them: the sending side
    # is not shut down yet, so loseConnection must not end the connection at once either.
    transport, client = yield _connected_pair()
    try:
        recorder = _RecordingLoss()
        transport.protocol = recorder
        big = _write_more_than_the_socket_takes(transport, client)
        transport.loseWriteConnection()
        transport.loseConnection()
        assert not recorder.lost.called, "the queued bytes come first"
        received = yield threads.deferToThread(_read_to_eof, client)
        assert received == big
        yield recorder.lost
    finally:
        client.close()


def test_the_proxys_listeners_keep_one_logger(lean_reactor):
    # Twisted's Port reads its class's ``_logger`` on every round of accepts, a descriptor
    # that builds a new Logger each time.
    port = adopt_listening_socket(lean_reactor, listening_socket("127.0.0.1", 0, reuse_port=False), protocol.Factory())
    try:
        assert port._logger is port._logger
        assert port._logger.source is port
    finally:
        port.stopReading()
        port.socket.close()


def test_a_connect_complete_at_once_reports_after_the_events_of_the_turn_without_a_timed_call(lean_reactor):
    listener = socket.create_server(("127.0.0.1", 0))
    sock = client_socket("127.0.0.1")
    try:
        connecting = connect_socket(
            lean_reactor, sock, listener.getsockname(), protocol.Factory.forProtocol(_Received), timeout=5
        )
        assert lean_reactor.getDelayedCalls() == [], "no timed call (nor the connect timeout) on Twisted's heap"
        assert not connecting.called, "not within the caller's own work"
        lean_reactor.doIteration(0)  # the end of the reactor turn
        made = connecting.result
        assert made.transport.getHandle() is sock
        made.transport.abortConnection()
        lean_reactor.doIteration(0)
    finally:
        listener.close()
        sock.close()


def test_a_connect_cancelled_before_the_end_of_the_turn_builds_no_transport(lean_reactor):
    listener = socket.create_server(("127.0.0.1", 0))
    sock = client_socket("127.0.0.1")
    try:
        built = []
        factory = protocol.Factory.forProtocol(_Received)
        factory.buildProtocol = lambda addr: built.append(addr)
        connecting = connect_socket(lean_reactor, sock, listener.getsockname(), factory, timeout=5)
        connecting.addErrback(lambda failure: failure.trap(defer.CancelledError))
        logged_failures = []
        observer = lambda event: logged_failures.append(event) if "log_failure" in event else None  # noqa: E731
        globalLogPublisher.addObserver(observer)
        try:
            connecting.cancel()
            lean_reactor.doIteration(0)  # the call at the end of the turn was cancelled with it
        finally:
            globalLogPublisher.removeObserver(observer)
        assert built == [] and sock.fileno() == -1
        assert logged_failures == [], "no AlreadyCalledError from a result after the cancel"
    finally:
        listener.close()
