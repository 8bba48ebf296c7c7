"""Tests for the SOCKS5 server protocol: exact bytes on the wire."""

from __future__ import annotations

import ipaddress
import socket

import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, error, reactor, task, threads
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from ztwisted.hbone.socks5 import (
    MAX_EARLY_DATA,
    AddressType,
    Reply,
    Socks5Error,
    Socks5Factory,
    Socks5Protocol,
    Socks5Request,
    _parse_request,
    reply_bytes,
)

GREETING = b"\x05\x01\x00"
METHOD_OK = b"\x05\x00"
CONNECT_IPV4 = b"\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x50"  # 127.0.0.1:80
SUCCESS = b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"


class RecordingSink:
    def __init__(self) -> None:
        self.transport = None
        self.data: list[bytes] = []
        self.read_closed = False
        self.lost: Failure | None = None

    def attach(self, transport) -> None:
        self.transport = transport

    def dataReceived(self, data: bytes) -> None:
        self.data.append(data)

    def readConnectionLost(self) -> None:
        self.read_closed = True

    def connectionLost(self, reason) -> None:
        self.lost = reason


class Harness:
    """A protocol on a StringTransport whose connect callback is under test control."""

    def __init__(self, result=None) -> None:
        self.clock = task.Clock()
        self.requests: list[Socks5Request] = []
        self.pending: list[defer.Deferred] = []
        self.cancelled: list[Socks5Request] = []
        self.errors: list[str] = []
        self.events: list[dict] = []
        self.protocol = Socks5Protocol(self._connect, clock=self.clock, on_error=self.errors.append)
        self.protocol.log = Logger(namespace="test", observer=self.events.append)
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", "10.0.0.5", 40000))
        self.protocol.makeConnection(self.transport)

    def _connect(self, request: Socks5Request) -> defer.Deferred:
        self.requests.append(request)
        d: defer.Deferred = defer.Deferred(lambda _: self.cancelled.append(request))
        self.pending.append(d)
        return d

    def feed(self, data: bytes, bytewise: bool = False) -> None:
        if bytewise:
            for i in range(len(data)):
                self.protocol.dataReceived(data[i : i + 1])
        else:
            self.protocol.dataReceived(data)

    def output(self) -> bytes:
        value = self.transport.value()
        self.transport.clear()
        return value

    def messages(self) -> list[str]:
        from twisted.logger import formatEvent

        return [formatEvent(e) for e in self.events]


def test_connect_ipv4_success_relays_both_ways():
    h = Harness()
    h.feed(GREETING)
    assert h.output() == METHOD_OK
    h.feed(CONNECT_IPV4)
    assert h.output() == b""
    assert h.requests == [Socks5Request(("10.0.0.5", 40000), "127.0.0.1", 80, AddressType.IPV4)]
    sink = RecordingSink()
    h.pending[0].callback(sink)
    assert h.output() == SUCCESS
    assert sink.transport is h.transport
    h.feed(b"hello")
    assert sink.data == [b"hello"]
    h.protocol.readConnectionLost()
    assert sink.read_closed
    h.protocol.connectionLost(Failure(error.ConnectionDone()))
    assert sink.lost is not None and sink.lost.check(error.ConnectionDone)
    assert not h.transport.disconnecting
    assert h.errors == []


def test_byte_by_byte_domain_request():
    h = Harness()
    request = b"\x05\x01\x00\x03\x0bexample.com\x01\xbb"
    h.feed(GREETING + request, bytewise=True)
    assert h.output() == METHOD_OK
    assert h.requests == [Socks5Request(("10.0.0.5", 40000), "example.com", 443, AddressType.DOMAIN)]


def test_byte_by_byte_ipv6_request():
    h = Harness()
    request = b"\x05\x01\x00\x04" + b"\x20\x01\x0d\xb8" + b"\x00" * 11 + b"\x01" + b"\x1f\x90"
    h.feed(GREETING, bytewise=True)
    h.feed(request, bytewise=True)
    assert h.requests[0].host == "2001:db8::1"
    assert h.requests[0].port == 8080
    assert h.requests[0].address_type is AddressType.IPV6


def test_offered_methods_may_include_others():
    h = Harness()
    h.feed(b"\x05\x03\x02\x01\x00")
    assert h.output() == METHOD_OK


def test_bytes_after_request_in_same_read_are_forwarded_in_order():
    h = Harness()
    h.feed(GREETING + CONNECT_IPV4 + b"early-")
    h.feed(b"data")
    h.protocol.readConnectionLost()
    sink = RecordingSink()
    h.pending[0].callback(sink)
    assert h.output() == METHOD_OK + SUCCESS
    assert b"".join(sink.data) == b"early-data"
    assert sink.read_closed
    h.feed(b"!")
    assert sink.data[-1] == b"!"


def test_synchronous_sink_gets_same_read_payload():
    sink = RecordingSink()
    protocol = Socks5Protocol(lambda request: defer.succeed(sink), clock=task.Clock())
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(GREETING + CONNECT_IPV4 + b"GET / HTTP/1.0\r\n\r\n")
    assert transport.value() == METHOD_OK + SUCCESS
    assert b"".join(sink.data) == b"GET / HTTP/1.0\r\n\r\n"


def test_large_early_data_pauses_reading_until_attached():
    h = Harness()
    h.feed(GREETING + CONNECT_IPV4)
    h.feed(b"x" * (MAX_EARLY_DATA + 1))
    assert h.transport.producerState == "paused"
    sink = RecordingSink()
    h.pending[0].callback(sink)
    assert h.transport.producerState == "producing"
    assert len(b"".join(sink.data)) == MAX_EARLY_DATA + 1


@pytest.mark.parametrize(
    "code",
    [
        Reply.GENERAL_FAILURE,
        Reply.NOT_ALLOWED,
        Reply.NETWORK_UNREACHABLE,
        Reply.HOST_UNREACHABLE,
        Reply.CONNECTION_REFUSED,
        Reply.ADDRESS_TYPE_NOT_SUPPORTED,
    ],
)
def test_socks5_error_sends_its_reply_code_and_closes(code):
    h = Harness()
    h.feed(GREETING + CONNECT_IPV4)
    h.output()
    h.pending[0].errback(Socks5Error(code, "policy says no"))
    assert h.output() == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
    assert h.transport.disconnecting
    assert h.errors == ["connect_failed"]
    assert any("10.0.0.5:40000" in m and "policy says no" in m and "127.0.0.1:80" in m for m in h.messages())
    h.feed(b"ignored after close")
    assert h.output() == b""


@pytest.mark.parametrize(
    "exc, code",
    [
        (error.ConnectionRefusedError(), Reply.CONNECTION_REFUSED),
        (error.DNSLookupError("nope"), Reply.HOST_UNREACHABLE),
        (error.TimeoutError(), Reply.HOST_UNREACHABLE),
        (error.NoRouteError(), Reply.HOST_UNREACHABLE),
        (RuntimeError("bug"), Reply.GENERAL_FAILURE),
    ],
)
def test_connect_errors_map_to_reply_codes(exc, code):
    h = Harness()
    h.feed(GREETING + CONNECT_IPV4)
    h.output()
    h.pending[0].errback(exc)
    assert h.output() == reply_bytes(code)
    assert h.transport.disconnecting


def test_callback_raising_synchronously_is_general_failure():
    def broken(request):
        raise ValueError("no node")

    protocol = Socks5Protocol(broken, clock=task.Clock())
    events: list[dict] = []
    protocol.log = Logger(observer=events.append)
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.dataReceived(GREETING + CONNECT_IPV4)
    assert transport.value() == METHOD_OK + reply_bytes(Reply.GENERAL_FAILURE)
    assert transport.disconnecting
    assert any("log_failure" in e for e in events)


def test_wrong_greeting_version_closes_without_reply():
    h = Harness()
    h.feed(b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00")  # a SOCKS4 CONNECT
    assert h.output() == b""
    assert h.transport.disconnecting
    assert h.errors == ["bad_version"]
    assert any("10.0.0.5:40000" in m and "version 4" in m for m in h.messages())


@pytest.mark.parametrize("greeting", [b"\x05\x01\x02", b"\x05\x00", b"\x05\x02\x01\x02"])
def test_no_acceptable_method(greeting):
    h = Harness()
    h.feed(greeting, bytewise=True)
    assert h.output() == b"\x05\xff"
    assert h.transport.disconnecting
    assert h.errors == ["no_acceptable_method"]
    assert any("no acceptable method" in m for m in h.messages())


@pytest.mark.parametrize("command", [0x02, 0x03, 0x09])
def test_unsupported_command(command):
    h = Harness()
    h.feed(GREETING)
    h.output()
    h.feed(bytes([5, command, 0, 1, 127, 0, 0, 1, 0, 80]), bytewise=True)
    assert h.output() == b"\x05\x07\x00\x01\x00\x00\x00\x00\x00\x00"
    assert h.transport.disconnecting
    assert h.requests == []


def test_unknown_address_type_replies_at_once():
    h = Harness()
    h.feed(GREETING)
    h.output()
    h.feed(b"\x05\x01\x00\x02")
    assert h.output() == b"\x05\x08\x00\x01\x00\x00\x00\x00\x00\x00"
    assert h.transport.disconnecting
    assert h.errors == ["bad_address_type"]


@pytest.mark.parametrize(
    "request_bytes, problem",
    [
        (b"\x04\x01\x00\x01\x7f\x00\x00\x01\x00\x50", "version 4"),
        (b"\x05\x01\x01\x01\x7f\x00\x00\x01\x00\x50", "reserved byte"),
        (b"\x05\x01\x00\x01\x7f\x00\x00\x01\x00\x00", "port is 0"),
        (b"\x05\x01\x00\x03\x00\x00\x50", "domain name is empty"),
        (b"\x05\x01\x00\x03\x03\xff\xfe\xfd\x00\x50", "not ASCII"),
        (b"\x05\x01\x00\x03\x05a b c\x00\x50", "not a hostname"),
        (b"\x05\x01\x00\x03\x05a\r\nbc\x00\x50", "not a hostname"),
    ],
)
def test_malformed_requests_get_general_failure(request_bytes, problem):
    h = Harness()
    h.feed(GREETING)
    h.output()
    h.feed(request_bytes, bytewise=True)
    assert h.output() == reply_bytes(Reply.GENERAL_FAILURE)
    assert h.transport.disconnecting
    assert h.requests == []
    assert any(problem in m and "10.0.0.5:40000" in m for m in h.messages())


def test_handshake_timeout_closes_idle_client():
    h = Harness()
    h.feed(b"\x05")
    h.clock.advance(9.9)
    assert not h.transport.disconnecting
    h.clock.advance(0.1)
    assert h.transport.disconnecting
    assert h.output() == b""
    assert h.errors == ["timeout"]
    assert any("10 s" in m for m in h.messages())


def test_timeout_stops_once_request_is_read():
    h = Harness()
    h.feed(GREETING + CONNECT_IPV4)
    h.clock.advance(60)
    assert not h.transport.disconnecting
    assert h.clock.getDelayedCalls() == []


def test_client_leaving_while_connecting_cancels_the_connect():
    h = Harness()
    h.feed(GREETING + CONNECT_IPV4)
    h.protocol.connectionLost(Failure(error.ConnectionLost()))
    assert h.cancelled == [h.requests[0]]
    assert h.output() == METHOD_OK


def test_connection_lost_during_greeting_cancels_timer():
    h = Harness()
    h.feed(b"\x05")
    h.protocol.connectionLost(Failure(error.ConnectionLost()))
    assert h.clock.getDelayedCalls() == []
    h.clock.advance(60)
    assert h.errors == [] and h.messages() == [] and h.output() == b""


def _factory_client(factory, port: int = 1) -> tuple[Socks5Protocol, StringTransport]:
    """A client of ``factory``'s listener, connected: (its protocol, its transport)."""
    protocol = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", port))
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport


def _factory_clients(factory, count: int) -> list[StringTransport]:
    return [_factory_client(factory, port + 1)[1] for port in range(count)]


def test_a_listeners_handshakes_time_out_each_after_its_own_time():
    clock = task.Clock()
    factory = Socks5Factory(lambda r: defer.Deferred(), clock=clock, handshake_timeout=3)
    first, second = _factory_clients(factory, 2)
    clock.advance(1)
    (third,) = _factory_clients(factory, 1)
    clock.advance(1.9)
    assert not any(t.disconnecting for t in (first, second, third))
    clock.advance(0.1)  # 3 s after the first two
    assert first.disconnecting and second.disconnecting and not third.disconnecting
    clock.advance(0.9)
    assert not third.disconnecting
    clock.advance(0.1)  # 3 s after the third
    assert third.disconnecting


def test_a_handshake_that_completed_is_not_timed_out_by_the_shared_timer():
    clock = task.Clock()
    factory = Socks5Factory(lambda r: defer.Deferred(), clock=clock, handshake_timeout=3)
    early, early_transport = _factory_client(factory)
    _, waiting = _factory_client(factory, 2)
    early.dataReceived(GREETING + CONNECT_IPV4)
    clock.advance(3)
    assert waiting.disconnecting
    assert not early_transport.disconnecting
    clock.advance(30)
    assert not early_transport.disconnecting


def test_half_close_during_handshake_closes():
    h = Harness()
    h.feed(b"\x05\x01")
    h.protocol.readConnectionLost()
    assert h.transport.disconnecting
    assert h.errors == ["incomplete_handshake"]


def test_sink_attach_failure_aborts_and_is_logged():
    class BadSink(RecordingSink):
        def attach(self, transport):
            raise RuntimeError("attach broke")

    h = Harness()
    h.feed(GREETING + CONNECT_IPV4)
    h.pending[0].callback(BadSink())
    assert h.transport.disconnecting
    assert any(e.get("log_failure") is not None and e["log_failure"].check(RuntimeError) for e in h.events)
    assert h.errors == ["internal_error"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_never_raises(data):
    h = Harness()
    h.feed(data, bytewise=True)
    h.clock.advance(11)
    assert h.transport.disconnecting or h.requests
    out = h.output()
    # At most a method reply, then at most one failure reply.
    failures = {METHOD_OK + reply_bytes(code) for code in (1, 7, 8)}
    assert out in {b"", METHOD_OK, b"\x05\xff"} | failures


def test_factory_builds_configured_protocols():
    clock = task.Clock()
    factory = Socks5Factory(lambda r: defer.Deferred(), clock=clock, handshake_timeout=3)
    protocol, transport = _factory_client(factory)
    clock.advance(3)
    assert transport.disconnecting
    assert protocol.factory is factory


class EchoSink(RecordingSink):
    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data.upper())

    def readConnectionLost(self) -> None:
        self.transport.loseConnection()


def _blocking_socks_client(port: int) -> tuple[bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(GREETING)
        method = sock.recv(2)
        sock.sendall(b"\x05\x01\x00\x03\x09localhost\x1f\x90" + b"ping")
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(100):
            received += chunk
        return method, received


@pytest_twisted.inlineCallbacks
def test_real_tcp_round_trip():
    requests: list[Socks5Request] = []

    def connect(request):
        requests.append(request)
        return defer.succeed(EchoSink())

    port = reactor.listenTCP(0, Socks5Factory(connect), interface="127.0.0.1")
    try:
        method, received = yield threads.deferToThread(_blocking_socks_client, port.getHost().port)
    finally:
        yield port.stopListening()
    assert method == METHOD_OK
    assert received == SUCCESS + b"PING"
    assert requests[0].host == "localhost" and requests[0].port == 8080
    assert requests[0].source[0] == "127.0.0.1"


class _CapturingSocks5Factory(Socks5Factory):
    def __init__(self, connect_request) -> None:
        super().__init__(connect_request)
        self.built: defer.Deferred = defer.Deferred()

    def buildProtocol(self, addr):
        protocol = super().buildProtocol(addr)
        reactor.callLater(0, self.built.callback, protocol)  # once Twisted has connected it to its transport
        return protocol


def _recv_now(sock: socket.socket, size: int) -> bytes:
    """What the kernel already holds for ``sock``: no waiting, so no reactor turn in between."""
    sock.setblocking(False)
    try:
        return sock.recv(size)
    except BlockingIOError:
        return b""


@pytest_twisted.inlineCallbacks
def test_replies_are_sent_before_the_reactor_runs_again():
    """Method selection and CONNECT replies go out at once (write-through), on any TCP listener."""
    pending: defer.Deferred = defer.Deferred()
    factory = _CapturingSocks5Factory(lambda request: pending)
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # Twisted's own: not write-through by itself
    client = socket.create_connection(("127.0.0.1", port.getHost().port), timeout=5)
    try:
        protocol = yield factory.built
        # The bytes are handed to the protocol directly; its reply must already be in the kernel when it returns.
        protocol.dataReceived(GREETING)
        assert _recv_now(client, 100) == METHOD_OK
        protocol.dataReceived(CONNECT_IPV4)
        sink = RecordingSink()
        pending.callback(sink)
        assert _recv_now(client, 100) == SUCCESS
        assert sink.transport is protocol.transport
    finally:
        client.close()
        protocol.transport.abortConnection()
        yield port.stopListening()


@pytest.mark.parametrize("packed", [b"\x00\x00\x00\x00", b"\x0a\x00\x00\x05", b"\x7f\x00\x00\x01", b"\xff\xff\xff\xff"])
def test_an_ipv4_destination_reads_as_ipaddress_writes_it(packed):
    consumed, _command, address_type, host, port = _parse_request(b"\x05\x01\x00\x01" + packed + b"\x1f\x90")
    assert (consumed, address_type, host, port) == (10, AddressType.IPV4, str(ipaddress.IPv4Address(packed)), 8080)
    assert type(address_type) is AddressType
