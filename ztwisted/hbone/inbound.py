"""Inbound: HBONE (15008) and plaintext (15006) listeners of one local workload."""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory

from ztwisted.authz import authorize
from ztwisted.context import NodeSettings, ProxyContext
from ztwisted.h2.connection import HBONEConnection, Stream
from ztwisted.hbone.tracking import ConnectionRecord, LiveConnections, track_hbone_connection
from ztwisted.metrics import ConnectionLabels
from ztwisted.model import Workload, parse_ip
from ztwisted.network import HostNetwork, PodNetwork
from ztwisted.sockets import factory_for, original_destination
from ztwisted.splice import TCPEnd, splice
from ztwisted.tls import ServerTLS, peer_identity, tls_factory

log = Logger()


#: longer than any ``[ipv6]:port`` (45 + 2 + 6 characters)
_LONGEST_AUTHORITY = 64


def parse_authority(authority: str) -> tuple[str, int] | None:
    """``ip:port`` or ``[ipv6]:port`` -> (ip, port), the IP written canonically; None when it is neither."""
    # A peer chooses what it sends: what cannot be a workload's address (too long, an IPv6
    # zone ID) is neither parsed nor remembered, so no peer can fill the cache with big keys.
    if len(authority) > _LONGEST_AUTHORITY or "%" in authority:
        return None
    return _parse_authority(authority)


# Remembered: a client sends the same few authorities again and again (~3 us each to parse and
# print back). Bounded, as a peer chooses what it sends.
@functools.lru_cache(maxsize=1024)
def _parse_authority(authority: str) -> tuple[str, int] | None:
    host, sep, port_text = authority.rpartition(":")
    # ASCII digits only: str.isdigit also takes "²" (which int() refuses) and "٨٠" (which it reads as 80)
    if not sep or not (port_text.isascii() and port_text.isdigit()):
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = parse_ip(host)
    except ValueError:
        return None
    port = int(port_text)
    if not 0 < port < 65536:
        return None
    return str(ip), port


#: ztunnel's own ports (15001 redirected outbound, 15006 plaintext inbound, 15008
#: HBONE, 15080 SOCKS5): as ztunnel's ``illegal_ports``, a connection to one of them
#: on a local workload is refused, wherever the node serves them.
PROXY_PORTS = frozenset({15001, 15006, 15008, 15080})


def illegal_ports(settings: NodeSettings) -> frozenset[int]:
    """Ports no inbound connection may reach: a CONNECT to the proxy's own port would
    nest a tunnel that reaches the app from the node's address, past source-IP rules."""
    own = {settings.hbone_port, settings.plaintext_port, settings.pod_outbound_port}
    return PROXY_PORTS | {port for port in own if port is not None}


SELF_CALL = "self-call: port {port} is the proxy's own"


def forwarded_for(header: str | None) -> str | None:
    """The ``for=`` address of a ``Forwarded`` header (RFC 7239), unquoted."""
    if not header:
        return None
    for element in header.split(","):
        for pair in element.split(";"):
            name, _, value = pair.strip().partition("=")
            if name.lower() == "for" and value:
                return value.strip('"')
    return None


def _inbound_service(mesh, workload, port: int):
    """The service a connection to ``workload``'s ``port`` most likely came through (ztunnel's guess)."""
    for key, ports in workload.services.items():
        if port in ports.values():
            namespace, _, hostname = key.partition("/")
            return mesh.service_by_hostname(hostname, namespace)
    return None


def _denial(decision) -> str:
    """The access log's error for a denied connection: the deciding policy, or why none allowed it."""
    return f"denied by policy {decision.policy}" if decision.policy else decision.reason


class _InboundTLSFactory(TLSMemoryBIOFactory):
    """Closes a connection at once while the workload has no certificate to present (one from a
    remote CA may still be on its way), instead of failing inside the TLS setup."""

    def __init__(self, server_tls: ServerTLS, is_client: bool, wrapped_factory, clock):
        super().__init__(server_tls, is_client, wrapped_factory, clock=clock)
        self._server_tls = server_tls

    def buildProtocol(self, addr):
        try:
            self._server_tls.context()
        except Exception as e:
            log.info("closing the connection from {peer}: {error}", peer=f"{addr.host}:{addr.port}", error=str(e))
            return None
        return super().buildProtocol(addr)


def serves_address(workload, network, ip: str, arrived_at: Callable[[], str]) -> bool:
    """Whether a connection for ``ip`` that arrived at the local address ``arrived_at()`` is for ``workload``.

    A pod the node agent added before discovery described it has no known
    address yet; its listeners are inside its own network namespace, so the
    address a connection arrived at there is the pod's own, and only that one
    is served (never a relay to elsewhere). Only then is ``arrived_at`` called
    (for an HBONE tunnel it asks the kernel: a ``getsockname``).
    """
    address = parse_ip(ip)
    if workload.workload_ips:
        return address in workload.workload_ips
    return not isinstance(network, HostNetwork) and address == parse_ip(arrived_at())


@attrs.define(eq=False)
class InboundHBONE:
    """Serves CONNECT tunnels to one local workload, with that workload's certificate."""

    context: ProxyContext
    workload: Workload
    network: HostNetwork | PodNetwork
    connections: set[HBONEConnection] = attrs.field(init=False, factory=set)
    _tls: ServerTLS = attrs.field(init=False)
    #: the node's settings do not change while it runs: worked out once, not per tunnel
    _illegal_ports: frozenset[int] = attrs.field(
        init=False, default=attrs.Factory(lambda self: illegal_ports(self.context.settings), takes_self=True)
    )

    @_tls.default
    def _server_tls(self) -> ServerTLS:
        # The workload may be updated by discovery (in-pod mode); new connections take its identity then.
        return ServerTLS(
            lambda: self.context.certificates.get(self.workload.identity), trust_domain=self.workload.trust_domain
        )

    def factory(self) -> TLSMemoryBIOFactory:
        return tls_factory(
            self._tls, False, _ConnectionFactory(self), self.context.reactor, factory_class=_InboundTLSFactory
        )

    def _connection_made(self, connection: HBONEConnection) -> None:
        track_hbone_connection(self.context.metrics, connection, "inbound")
        self.connections.add(connection)
        connection.closed.addBoth(lambda reason: self.connections.discard(connection))
        connection.ready.addErrback(self._handshake_failed, connection)

    def _handshake_failed(self, failure, connection: HBONEConnection) -> None:
        self.context.metrics.tls_handshake_failures.labels(reason="inbound").inc()
        log.info(
            "inbound TLS handshake to {workload} from {peer} failed: {why}",
            workload=self.workload.name,
            peer=connection.peer_text(),
            why=failure.getErrorMessage(),
        )

    def _tunnel_requested(self, connection: HBONEConnection, stream: Stream) -> None:
        authority = stream.headers.get(":authority", "")
        target = parse_authority(authority)
        # The HBONE connection's peer: for its address in the record and for the policy.
        peer = connection.transport.getPeer()
        record = self._record(connection, peer, stream, authority, target)
        refusal = self._refusal(connection, peer, authority, target)
        if refusal is not None:
            status, flags, reason = refusal
            record.refused(flags, reason)
            stream.refuse(status)
            return
        self._connect_app(stream, record, *target)

    def _record(self, connection: HBONEConnection, peer, stream: Stream, authority: str, target) -> ConnectionRecord:
        """The metrics and access-log record of one tunnel, whatever becomes of it."""
        mesh = self.context.mesh
        source_identity = connection.peer_identity
        service = _inbound_service(mesh, self.workload, target[1]) if target is not None else None
        return ConnectionRecord(
            self.context.metrics,
            self.context.reactor,
            ConnectionLabels.for_connection(
                "destination",
                source=mesh.workload_by_ip(peer.host),
                destination=self.workload,
                service=service,
                source_identity=source_identity,
                destination_identity=self.workload.identity,
                mutual_tls=True,
            ),
            **{
                "direction": "inbound",
                # The connection's own peer: the Forwarded header is the client's claim, kept apart.
                "src.addr": f"{peer.host}:{peer.port}",
                "src.forwarded": forwarded_for(stream.headers.get("forwarded")),
                "src.identity": str(source_identity),
                "dst.addr": authority,
                "dst.service": service.hostname if service is not None else None,
                "dst.workload": self.workload.name,
                "dst.namespace": self.workload.namespace,
                "dst.identity": str(self.workload.identity),
            },
        )

    def _refusal(self, connection: HBONEConnection, peer, authority: str, target) -> tuple[int, str, str] | None:
        """Why this tunnel is refused, as (HTTP status, response flags, reason), or None to open it."""
        if target is None:
            return 400, "-", f"bad authority {authority!r}"
        ip, port = target
        if not serves_address(self.workload, self.network, ip, lambda: connection.transport.getHost().host):
            return 400, "-", f"{ip} is not a workload served here"
        if port in self._illegal_ports:
            # ztunnel answers a call to its own ports 503 (it fails to pick an upstream).
            return 503, "-", SELF_CALL.format(port=port)
        decision = authorize(
            self.context.mesh.policies,
            source=connection.peer_identity,
            source_ip=parse_ip(peer.host),
            destination=self.workload,
            destination_ip=parse_ip(ip),
            destination_port=port,
        )
        if not decision.allowed:
            return 401, "DENY", _denial(decision)
        return None

    def _connect_app(self, stream: Stream, record: ConnectionRecord, ip: str, port: int) -> None:
        app = TCPEnd()
        connecting = self.network.connect(ip, port, factory_for(app), timeout=self.context.connect_timeout)

        def connected(_):
            if stream.done:
                # The peer gave up on the tunnel while we were connecting.
                app.abort()
                return
            stream.accept()
            record.finish_when_done(splice(stream, app), stream, app)

        def failed(failure):
            record.refused("CONNECT", f"connect to {ip}:{port} failed: {failure.getErrorMessage()}")
            stream.refuse(503)

        connecting.addCallbacks(connected, failed)


class _ConnectionFactory(Factory):
    def __init__(self, inbound: InboundHBONE):
        self.inbound = inbound

    def buildProtocol(self, addr):
        context = self.inbound.context
        connection = HBONEConnection(
            client=False,
            clock=context.reactor,
            settings=context.server_h2_settings,
            on_tunnel_request=self.inbound._tunnel_requested,
            get_peer_identity=peer_identity,
        )
        self.inbound._connection_made(connection)
        return connection


class InboundPlaintext(Factory):
    """15006: traffic to a local workload from outside the mesh, redirected here by iptables."""

    def __init__(self, context: ProxyContext, workload, network):
        self.context = context
        self.workload = workload
        self.network = network
        self.connections = LiveConnections()

    def buildProtocol(self, addr):
        return _PlaintextInbound(self)


class _PlaintextInbound(TCPEnd):
    def __init__(self, factory: InboundPlaintext):
        super().__init__()
        self.inbound = factory

    def connectionLost(self, reason=None) -> None:
        super().connectionLost(reason)
        self.inbound.connections.remove(self)

    def connectionMade(self) -> None:
        self.inbound.connections.add(self)
        self.transport.pauseProducing()
        destination = self._destination()
        if destination is None:
            self.transport.loseConnection()
            return
        ip, port = destination
        record = self._record(ip, port)
        refusal = self._refusal(ip, port)
        if refusal is not None:
            record.refused(*refusal)
            self.transport.loseConnection()
            return
        self._connect_upstream(record, ip, port)
        super().connectionMade()

    def _destination(self) -> tuple[str, int] | None:
        """Where iptables sent this connection, if it is for this workload (else logged, None)."""
        workload = self.inbound.workload
        destination = original_destination(self.transport)
        local = self.transport.getHost()
        if destination is None or destination == (local.host, local.port):
            peer = self.transport.getPeer()
            log.warn(
                "plaintext inbound connection from {peer} to {workload} was not redirected: no original destination",
                peer=f"{peer.host}:{peer.port}",
                workload=workload.name,
            )
            return None
        ip, _port = destination
        if not serves_address(workload, self.inbound.network, ip, lambda: local.host):
            log.warn("plaintext inbound to {ip}: not workload {workload}", ip=ip, workload=workload.name)
            return None
        return destination

    def _record(self, ip: str, port: int) -> ConnectionRecord:
        """The metrics and access-log record of this connection, whatever becomes of it."""
        workload = self.inbound.workload
        peer = self.transport.getPeer()
        return ConnectionRecord(
            self.inbound.context.metrics,
            self.inbound.context.reactor,
            ConnectionLabels.for_connection(
                "destination", destination=workload, destination_identity=workload.identity
            ),
            **{
                "direction": "inbound",
                "src.addr": f"{peer.host}:{peer.port}",
                "dst.addr": f"{ip}:{port}",
                "dst.workload": workload.name,
            },
        )

    def _refusal(self, ip: str, port: int) -> tuple[str, str] | None:
        """Why this connection is refused, as (response flags, reason), or None to forward it."""
        context = self.inbound.context
        if port in illegal_ports(context.settings):
            return "-", SELF_CALL.format(port=port)
        # Istio's semantics for traffic from outside the mesh: no peer identity, so only
        # rules that need none (source IPs, ports, ...) can match it.
        decision = authorize(
            context.mesh.policies,
            source=None,
            source_ip=parse_ip(self.transport.getPeer().host),
            destination=self.inbound.workload,
            destination_ip=parse_ip(ip),
            destination_port=port,
        )
        if not decision.allowed:
            return "DENY", _denial(decision)
        return None

    def _connect_upstream(self, record: ConnectionRecord, ip: str, port: int) -> None:
        upstream = TCPEnd()

        def connected(_):
            record.finish_when_done(splice(self, upstream), self, upstream)
            self.transport.resumeProducing()

        def failed(failure):
            record.refused("CONNECT", failure.getErrorMessage())
            self.abort()

        connecting = self.inbound.network.connect(
            ip, port, factory_for(upstream), timeout=self.inbound.context.connect_timeout
        )
        connecting.addCallbacks(connected, failed)
