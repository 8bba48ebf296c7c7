"""A SOCKS5 server protocol (RFC 1928): CONNECT only, "no authentication" only.

The protocol parses the client's greeting and request, asks a
``connect_request`` callback for a sink, and then relays: bytes from the
client go to the sink's ``dataReceived``, and the sink writes to the client
through the transport it was handed in ``attach``.

Deliberate strictness: a request with a non-zero reserved byte, an empty or
non-hostname domain, or port 0 is refused with "general failure" (0x01).
"""

from __future__ import annotations

import enum
import ipaddress
import re
import socket
import struct
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet import defer, error
from twisted.internet.interfaces import (
    IDelayedCall,
    IHalfCloseableProtocol,
    IReactorTime,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from ztwisted.sockets import write_through

SOCKS_VERSION = 5
METHOD_NO_AUTH = 0x00
METHOD_NONE_ACCEPTABLE = 0xFF
CMD_CONNECT = 0x01

HANDSHAKE_TIMEOUT = 10.0
# Early data a client may send before the CONNECT reply; beyond this the
# transport is paused until the sink is attached.
MAX_EARLY_DATA = 64 * 1024

_HOSTNAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")


class AddressType(enum.IntEnum):
    IPV4 = 0x01
    DOMAIN = 0x03
    IPV6 = 0x04


# The request's ATYP byte -> AddressType, without an enum lookup by value per request.
_ADDRESS_TYPES = {member.value: member for member in AddressType}


class Reply(enum.IntEnum):
    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


class Socks5Error(Exception):
    """Raised (or errbacked) by ``connect_request`` to refuse with ``reply_code``."""

    def __init__(self, reply_code: int, message: str) -> None:
        super().__init__(reply_code, message)
        self.reply_code = int(reply_code)
        self.message = message

    def __str__(self) -> str:
        return f"SOCKS5 reply {self.reply_code:#04x}: {self.message}"


@attrs.frozen
class Socks5Request:
    """A parsed CONNECT request."""

    source: tuple[str, int]
    host: str
    port: int
    address_type: AddressType


# Errors from connecting, mapped to the nearest RFC 1928 reply.
_ERROR_REPLIES: tuple[tuple[type[BaseException], Reply], ...] = (
    (error.ConnectionRefusedError, Reply.CONNECTION_REFUSED),
    (error.NoRouteError, Reply.HOST_UNREACHABLE),
    (error.DNSLookupError, Reply.HOST_UNREACHABLE),
    (error.TimeoutError, Reply.HOST_UNREACHABLE),
    (error.TCPTimedOutError, Reply.HOST_UNREACHABLE),
)


class _Malformed(Exception):
    """Client input the protocol refuses; ``reply`` is None when RFC 1928 gives none."""

    def __init__(self, reason: str, problem: str, reply: int | None) -> None:
        super().__init__(problem)
        self.reason = reason
        self.problem = problem
        self.reply = reply


def _parse_greeting(buf: bytes) -> tuple[int, bytes] | None:
    """Return (bytes consumed, offered methods), or None if more bytes are needed."""
    if len(buf) < 2:
        return None
    version, nmethods = buf[0], buf[1]
    if version != SOCKS_VERSION:
        raise _Malformed("bad_version", f"greeting has version {version}, expected 5", None)
    if len(buf) < 2 + nmethods:
        return None
    return 2 + nmethods, buf[2 : 2 + nmethods]


def _parse_request(buf: bytes) -> tuple[int, int, AddressType, str, int] | None:
    """Return (consumed, command, address type, host, port), or None if incomplete."""
    if len(buf) < 4:
        return None
    version, command, reserved, atyp = buf[0], buf[1], buf[2], buf[3]
    if version != SOCKS_VERSION:
        raise _Malformed("bad_version", f"request has version {version}, expected 5", Reply.GENERAL_FAILURE)
    if atyp == AddressType.IPV4:
        end = 4 + 4
    elif atyp == AddressType.IPV6:
        end = 4 + 16
    elif atyp == AddressType.DOMAIN:
        if len(buf) < 5:
            return None
        end = 5 + buf[4]
    else:
        raise _Malformed(
            "bad_address_type",
            f"unknown address type {atyp:#04x}",
            Reply.ADDRESS_TYPE_NOT_SUPPORTED,
        )
    if len(buf) < end + 2:
        return None
    # Checked only now so that the whole request has been read before replying.
    if command != CMD_CONNECT:
        raise _Malformed(
            "unsupported_command",
            f"command {command:#04x} is not supported (only CONNECT)",
            Reply.COMMAND_NOT_SUPPORTED,
        )
    if reserved != 0:
        raise _Malformed(
            "malformed_request",
            f"reserved byte is {reserved:#04x}, expected 0x00",
            Reply.GENERAL_FAILURE,
        )
    (port,) = struct.unpack("!H", buf[end : end + 2])
    address_type = _ADDRESS_TYPES[atyp]
    if address_type == AddressType.IPV4:
        host = socket.inet_ntoa(buf[4:end])  # str(IPv4Address(...)), without the object
    elif address_type == AddressType.IPV6:
        host = str(ipaddress.IPv6Address(buf[4:end]))
    else:
        host = _decode_domain(buf[5:end])
    if port == 0:
        raise _Malformed("malformed_request", "destination port is 0", Reply.GENERAL_FAILURE)
    return end + 2, command, address_type, host, port


def _decode_domain(raw: bytes) -> str:
    if not raw:
        raise _Malformed("malformed_request", "domain name is empty", Reply.GENERAL_FAILURE)
    try:
        name = raw.decode("ascii")
    except UnicodeDecodeError:
        raise _Malformed("malformed_request", f"domain name {raw!r} is not ASCII", Reply.GENERAL_FAILURE) from None
    if not _HOSTNAME.match(name):
        raise _Malformed("malformed_request", f"domain name {name!r} is not a hostname", Reply.GENERAL_FAILURE)
    return name


def reply_bytes(code: int) -> bytes:
    """A reply with BND.ADDR 0.0.0.0:0 (clients of a relay have no use for it)."""
    return bytes([SOCKS_VERSION, code, 0x00, AddressType.IPV4]) + b"\x00" * 6


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _State(enum.Enum):
    GREETING = "greeting"
    REQUEST = "request"
    CONNECTING = "connecting"
    RELAYING = "relaying"
    CLOSED = "closed"


@implementer(IHalfCloseableProtocol)
class Socks5Protocol(Protocol):
    """One SOCKS5 client connection: handshake, then relay to a sink."""

    log = Logger()

    def __init__(
        self,
        connect_request: Callable[[Socks5Request], defer.Deferred[Any]],
        clock: IReactorTime | None = None,
        on_error: Callable[[str], None] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        """``on_error(reason)`` is told a short reason slug for each refused client."""
        if clock is None:
            from twisted.internet import reactor as clock  # type: ignore[assignment]
        self._connect_request = connect_request
        self._clock = clock
        self._on_error = on_error
        self._handshake_timeout = handshake_timeout
        self._state = _State.GREETING
        self._buffer = b""
        self._timer: IDelayedCall | None = None
        self._pending: defer.Deferred[Any] | None = None
        self._sink: Any = None
        self._read_closed = False
        self._paused = False
        self._client = "unknown client"
        self._source: tuple[str, int] = ("", 0)

    # -- Twisted protocol callbacks ---------------------------------------

    def connectionMade(self) -> None:
        # The handshake's replies go out at once, as the relayed data later does
        # (a no-op for the proxy's own listeners, whose connections write through from the start).
        write_through(self.transport)
        peer = self.transport.getPeer()
        host, port = getattr(peer, "host", None), getattr(peer, "port", None)
        if host is not None and port is not None:
            self._source = (host, port)
            self._client = _format_address(host, port)
        else:
            self._client = str(peer)
        self._timer = self._clock.callLater(self._handshake_timeout, self._timed_out)

    def dataReceived(self, data: bytes) -> None:
        if self._state is _State.RELAYING:
            self._sink.dataReceived(data)
            return
        if self._state is _State.CLOSED:
            return
        self._buffer += data
        if self._state is _State.CONNECTING:
            self._limit_early_data()
            return
        try:
            self._advance_handshake()
        except _Malformed as problem:
            self._refuse(problem.reason, problem.problem, problem.reply)
        except Exception:  # noqa: BLE001 - logged; the client must not hang
            # A bug here must not leave the client hanging or escape to the reactor.
            self.log.failure("SOCKS5 client {client}: internal error in handshake", client=self._client)
            self._refuse("internal_error", None, Reply.GENERAL_FAILURE)

    def readConnectionLost(self) -> None:
        if self._state is _State.RELAYING:
            self._sink.readConnectionLost()
        elif self._state is _State.CONNECTING:
            self._read_closed = True
        elif self._state is not _State.CLOSED:
            self._refuse("incomplete_handshake", f"closed its side during the {self._state.value}", None)

    def writeConnectionLost(self) -> None:
        """Not sent for TCP; nothing to do."""

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        state, self._state = self._state, _State.CLOSED
        self._cancel_timer()
        if state is _State.CONNECTING and self._pending is not None:
            pending, self._pending = self._pending, None
            pending.cancel()
        elif state is _State.RELAYING:
            sink, self._sink = self._sink, None
            sink.connectionLost(reason)

    # -- handshake ---------------------------------------------------------

    def _advance_handshake(self) -> None:
        if self._state is _State.GREETING:
            parsed = _parse_greeting(self._buffer)
            if parsed is None:
                return
            consumed, methods = parsed
            self._buffer = self._buffer[consumed:]
            if METHOD_NO_AUTH not in methods:
                offered = ", ".join(f"{m:#04x}" for m in methods) or "none"
                raise _Malformed(
                    "no_acceptable_method",
                    f"offers no acceptable method (offered: {offered}; only 0x00 no-auth)",
                    METHOD_NONE_ACCEPTABLE,
                )
            self.transport.write(bytes([SOCKS_VERSION, METHOD_NO_AUTH]))
            self._state = _State.REQUEST
        if self._state is _State.REQUEST:
            parsed_request = _parse_request(self._buffer)
            if parsed_request is None:
                return
            consumed, _command, address_type, host, port = parsed_request
            self._buffer = self._buffer[consumed:]
            self._cancel_timer()
            self._start_connect(Socks5Request(self._source, host, port, address_type))

    def _start_connect(self, request: Socks5Request) -> None:
        self._state = _State.CONNECTING
        self._limit_early_data()
        pending = defer.maybeDeferred(self._connect_request, request)
        self._pending = pending
        pending.addCallbacks(self._connected, self._connect_failed, errbackArgs=(request,))
        pending.addErrback(self._relay_setup_failed)

    def _connected(self, sink: Any) -> None:
        self._pending = None
        if self._state is not _State.CONNECTING:
            # The client left while connecting and the Deferred ignored cancel().
            sink.connectionLost(Failure(error.ConnectionDone("SOCKS5 client went away")))
            return
        self.transport.write(reply_bytes(Reply.SUCCEEDED))
        self._state = _State.RELAYING
        self._sink = sink
        if self._paused:
            # Resume before attach so a sink that pauses in attach() stays paused.
            self._paused = False
            self.transport.resumeProducing()
        sink.attach(self.transport)
        early, self._buffer = self._buffer, b""
        if early and self._sink is sink:
            sink.dataReceived(early)
        if self._read_closed and self._sink is sink:
            sink.readConnectionLost()

    def _connect_failed(self, failure: Failure, request: Socks5Request) -> None:
        self._pending = None
        if self._state is not _State.CONNECTING:
            return  # the client is gone (we cancelled), nobody to reply to
        destination = _format_address(request.host, request.port)
        if failure.check(Socks5Error):
            code = failure.value.reply_code
            problem = f"CONNECT {destination} refused: {failure.value.message}"
        else:
            code = next((reply for kind, reply in _ERROR_REPLIES if failure.check(kind)), Reply.GENERAL_FAILURE)
            problem = f"CONNECT {destination} failed: {failure.getErrorMessage()}"
            if code == Reply.GENERAL_FAILURE:
                self.log.failure("SOCKS5 client {client}: {problem}", failure, client=self._client, problem=problem)
                problem = None
        self._refuse("connect_failed", problem, code)

    def _relay_setup_failed(self, failure: Failure) -> None:
        self.log.failure("SOCKS5 client {client}: relay setup failed", failure, client=self._client)
        self._on_error_slug("internal_error")
        self.transport.abortConnection()

    def _limit_early_data(self) -> None:
        if not self._paused and len(self._buffer) > MAX_EARLY_DATA:
            self._paused = True
            self.transport.pauseProducing()

    # -- endings -----------------------------------------------------------

    def _refuse(self, reason: str, problem: str | None, reply: int | None) -> None:
        """Log ``problem`` (unless already logged), send ``reply`` if any, and close."""
        if problem is not None:
            # twisted.logger.Logger names this level "warn" (it has no warning()).
            self.log.warn(  # noqa: G010
                "SOCKS5 client {client}: {problem}", client=self._client, problem=problem
            )
        self._on_error_slug(reason)
        self._state = _State.CLOSED
        self._cancel_timer()
        self._buffer = b""
        if reply is not None:
            if reply == METHOD_NONE_ACCEPTABLE:
                self.transport.write(bytes([SOCKS_VERSION, METHOD_NONE_ACCEPTABLE]))
            else:
                self.transport.write(reply_bytes(reply))
        self.transport.loseConnection()

    def _timed_out(self) -> None:
        self._timer = None
        self._refuse(
            "timeout",
            f"handshake not completed within {self._handshake_timeout:g} s (stuck in {self._state.value})",
            None,
        )

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            timer, self._timer = self._timer, None
            if timer.active():
                timer.cancel()

    def _on_error_slug(self, reason: str) -> None:
        if self._on_error is not None:
            try:
                self._on_error(reason)
            except Exception:  # noqa: BLE001 - a metrics hook must not break the relay
                self.log.failure("SOCKS5 on_error hook failed")


class Socks5Factory(Factory):
    """Builds a :class:`Socks5Protocol` per client, all sharing one callback."""

    protocol = Socks5Protocol

    def __init__(
        self,
        connect_request: Callable[[Socks5Request], defer.Deferred[Any]],
        clock: IReactorTime | None = None,
        on_error: Callable[[str], None] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        self.connect_request = connect_request
        self.clock = clock
        self.on_error = on_error
        self.handshake_timeout = handshake_timeout

    def buildProtocol(self, addr: Any) -> Socks5Protocol:
        protocol = self.protocol(self.connect_request, self.clock, self.on_error, self.handshake_timeout)
        protocol.factory = self
        return protocol
