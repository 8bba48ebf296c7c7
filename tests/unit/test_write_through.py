"""ztwisted.sockets.write_through on real TCP connections of the running reactor."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor, threads

from ztwisted.sockets import READ_SIZE, write_through

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
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        write_through(transport)
        producer = RecordingEnd()  # the partner end whose reads a full queue must stop
        transport.registerProducer(producer, True)
        big = bytes(range(256)) * 1024  # 256 KiB: more than a read, far more than the socket buffers hold
        transport.write(big)
        assert transport._tempDataLen > 0 or len(transport.dataBuffer) > transport.offset, "nothing was queued"
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


@pytest_twisted.inlineCallbacks
def test_other_transports_are_left_alone():
    from twisted.internet.testing import StringTransport

    transport = StringTransport()
    write_through(transport)
    transport.write(b"x")
    assert transport.value() == b"x"
    assert type(transport) is StringTransport
    yield defer.succeed(None)


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
