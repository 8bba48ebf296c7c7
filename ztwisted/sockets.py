"""Sockets the reactor cannot make by itself: SO_REUSEPORT listeners, original destinations."""

from __future__ import annotations

import ipaddress
import socket
import struct

from twisted.application import strports
from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP6ClientEndpoint

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h; IP6T_SO_ORIGINAL_DST has the same number


def listening_socket(ip: str, port: int, *, reuse_port: bool = True, backlog: int = 1024, mark: int | None = None) -> socket.socket:
    """A bound, listening, non-blocking TCP socket.

    SO_REUSEPORT lets a new proxy process share the ports of the running one
    (restart without loss), as ztunnel's listeners do.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        sock.bind((ip, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_tcp(reactor, ip: str, port: int, factory, **options):
    """Listen on ``ip:port`` with :func:`listening_socket`; returns the IListeningPort."""
    sock = listening_socket(ip, port, **options)
    try:
        return reactor.adoptStreamPort(sock.fileno(), sock.family, factory)
    finally:
        sock.close()  # the reactor holds its own duplicate


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


def connect_tcp(reactor, ip: str, port: int, factory, *, source_ip: str | None = None, timeout: float = 10.0) -> defer.Deferred:
    """Connect to ``ip:port``, leaving from ``source_ip`` when given (keeps the workload's address)."""
    version = ipaddress.ip_address(ip).version
    endpoint_type = TCP6ClientEndpoint if version == 6 else TCP4ClientEndpoint
    bind = (source_ip, 0) if source_ip is not None else None
    return endpoint_type(reactor, ip, port, timeout=timeout, bindAddress=bind).connect(factory)


class ReusePortService(Service):
    """A TCP listener service with SO_REUSEPORT (so a new process can share its port)."""

    def __init__(self, reactor, ip: str, port: int, factory, backlog: int = 1024):
        self.reactor = reactor
        self.ip = ip
        self.port = port
        self.factory = factory
        self.backlog = backlog
        self.listening_port = None

    def privilegedStartService(self):
        self.listening_port = listen_tcp(self.reactor, self.ip, self.port, self.factory, backlog=self.backlog)
        super().privilegedStartService()

    def startService(self):
        if self.listening_port is None:
            self.listening_port = listen_tcp(self.reactor, self.ip, self.port, self.factory, backlog=self.backlog)
        super().startService()

    def stopService(self):
        super().stopService()
        port, self.listening_port = self.listening_port, None
        if port is not None:
            return defer.maybeDeferred(port.stopListening)


def listener_service(description: str, factory, reactor):
    """A service for an endpoint description: TCP ones get SO_REUSEPORT, others go through strports."""
    parts = description.split(":")
    if parts[0] in ("tcp", "tcp6") and len(parts) >= 2 and parts[1].isdigit():
        options = dict(part.split("=", 1) for part in parts[2:] if "=" in part)
        known = {"interface", "backlog"}
        if set(options) <= known and all("=" in part for part in parts[2:]):
            default_ip = "::" if parts[0] == "tcp6" else "0.0.0.0"
            return ReusePortService(
                reactor, options.get("interface", default_ip), int(parts[1]), factory, int(options.get("backlog", 1024))
            )
    return strports.service(description, factory, reactor=reactor)


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
