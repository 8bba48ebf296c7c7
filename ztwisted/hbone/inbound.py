"""Inbound: HBONE (15008) and plaintext (15006) listeners of one local workload."""

from __future__ import annotations

import ipaddress

from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory

from ztwisted.authz import authorize
from ztwisted.h2.connection import HBONEConnection, Stream
from ztwisted.hbone.tracking import ConnectionRecord, LiveConnections, track_hbone_connection
from ztwisted.metrics import ConnectionLabels
from ztwisted.sockets import factory_for, original_destination
from ztwisted.splice import TCPEnd, splice
from ztwisted.tls import ServerTLS, peer_identity, tls_factory

log = Logger()


def parse_authority(authority: str) -> tuple[str, int] | None:
    """``ip:port`` or ``[ipv6]:port`` -> (ip, port); None when it is neither."""
    host, sep, port_text = authority.rpartition(":")
    if not sep or not port_text.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    port = int(port_text)
    if not 0 < port < 65536:
        return None
    return str(ip), port


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


class InboundHBONE:
    """Serves CONNECT tunnels to one local workload, with that workload's certificate."""

    def __init__(self, node, workload, network):
        self.node = node
        self.workload = workload
        self.network = network
        self.connections: set[HBONEConnection] = set()
        self._tls = ServerTLS(lambda: node.certificates.get(workload.identity), trust_domain=workload.trust_domain)

    def factory(self) -> TLSMemoryBIOFactory:
        return tls_factory(self._tls, False, _ConnectionFactory(self))

    def _connection_made(self, connection: HBONEConnection) -> None:
        track_hbone_connection(self.node.metrics, connection, "inbound")
        self.connections.add(connection)
        connection.closed.addBoth(lambda reason: self.connections.discard(connection))
        connection.ready.addErrback(self._handshake_failed, connection)

    def _handshake_failed(self, failure, connection: HBONEConnection) -> None:
        self.node.metrics.tls_handshake_failures.labels(reason="inbound").inc()
        log.info(
            "inbound TLS handshake to {workload} from {peer} failed: {why}",
            workload=self.workload.name,
            peer=connection._peer_text(),
            why=failure.getErrorMessage(),
        )

    def _tunnel_requested(self, connection: HBONEConnection, stream: Stream) -> None:
        mesh = self.node.mesh
        authority = stream.headers.get(":authority", "")
        peer = connection.transport.getPeer()
        source_ip = peer.host
        source_identity = connection.peer_identity
        target = parse_authority(authority)
        service = _inbound_service(mesh, self.workload, target[1]) if target is not None else None
        record = ConnectionRecord(
            self.node.metrics,
            self.node.reactor,
            ConnectionLabels.for_connection(
                "destination",
                source=mesh.workload_by_ip(source_ip),
                destination=self.workload,
                service=service,
                source_identity=source_identity,
                destination_identity=self.workload.identity,
                mutual_tls=True,
            ),
            **{
                "direction": "inbound",
                "src.addr": forwarded_for(stream.headers.get("forwarded")) or f"{peer.host}:{peer.port}",
                "src.identity": str(source_identity),
                "dst.addr": authority,
                "dst.service": service.hostname if service is not None else None,
                "dst.workload": self.workload.name,
                "dst.namespace": self.workload.namespace,
                "dst.identity": str(self.workload.identity),
            },
        )
        if target is None:
            record.refused("-", f"bad authority {authority!r}")
            stream.refuse(400)
            return
        ip, port = target
        if ipaddress.ip_address(ip) not in self.workload.workload_ips:
            record.refused("-", f"{ip} is not a workload served here")
            stream.refuse(400)
            return
        decision = authorize(
            mesh.policies,
            source=source_identity,
            source_ip=ipaddress.ip_address(source_ip),
            destination=self.workload,
            destination_ip=ipaddress.ip_address(ip),
            destination_port=port,
        )
        if not decision.allowed:
            record.refused("DENY", f"denied by policy {decision.policy}")
            stream.refuse(401)
            return
        app = TCPEnd()
        connecting = self.network.connect(ip, port, factory_for(app), timeout=self.node.connect_timeout)

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
        node = self.inbound.node
        connection = HBONEConnection(
            client=False,
            clock=node.reactor,
            settings=node.server_h2_settings,
            on_tunnel_request=self.inbound._tunnel_requested,
            get_peer_identity=peer_identity,
        )
        self.inbound._connection_made(connection)
        return connection


class InboundPlaintext(Factory):
    """15006: traffic to a local workload from outside the mesh, redirected here by iptables."""

    def __init__(self, node, workload, network):
        self.node = node
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
        node, workload = self.inbound.node, self.inbound.workload
        destination = original_destination(self.transport)
        local = self.transport.getHost()
        peer = self.transport.getPeer()
        if destination is None or destination == (local.host, local.port):
            log.warn(
                "plaintext inbound connection from {peer} to {workload} was not redirected: no original destination",
                peer=f"{peer.host}:{peer.port}",
                workload=workload.name,
            )
            self.transport.loseConnection()
            return
        ip, port = destination
        if ipaddress.ip_address(ip) not in workload.workload_ips:
            log.warn("plaintext inbound to {ip}: not workload {workload}", ip=ip, workload=workload.name)
            self.transport.loseConnection()
            return
        record = ConnectionRecord(
            node.metrics,
            node.reactor,
            ConnectionLabels.for_connection("destination", destination=workload, destination_identity=workload.identity),
            **{"direction": "inbound", "src.addr": f"{peer.host}:{peer.port}", "dst.addr": f"{ip}:{port}", "dst.workload": workload.name},
        )
        upstream = TCPEnd()

        def connected(_):
            record.finish_when_done(splice(self, upstream), self, upstream)
            self.transport.resumeProducing()

        def failed(failure):
            record.refused("CONNECT", failure.getErrorMessage())
            self.abort()

        self.inbound.network.connect(ip, port, factory_for(upstream), timeout=node.connect_timeout).addCallbacks(
            connected, failed
        )
        super().connectionMade()
