"""Outbound: app connections (SOCKS5 15080, redirected 15001) to HBONE tunnels or plain TCP."""

from __future__ import annotations

import errno
import functools

import attrs
from hpack import NeverIndexedHeaderTuple
from twisted.internet import defer, error
from twisted.internet.protocol import Factory, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from ztwisted.context import ProxyContext
from ztwisted.h2.connection import ConnectionGone, HBONEConnection, TunnelError, TunnelRefused
from ztwisted.hbone.pool import ConnectionPool, PoolKey
from ztwisted.hbone.socks5 import Reply, Socks5Error, Socks5Factory, Socks5Protocol
from ztwisted.hbone.tracking import ConnectionRecord, LiveConnections, track_hbone_connection
from ztwisted.metrics import ConnectionLabels
from ztwisted.model import parse_ip
from ztwisted.sockets import factory_for, original_destination
from ztwisted.splice import TCPEnd, splice
from ztwisted.tls import ClientTLS, peer_identity, tls_factory

log = Logger()

HBONE_PORT = 15008


class OutboundRefused(Socks5Error):
    """An outbound connection that the proxy will not carry; ``reply_code`` is the SOCKS5 answer."""


@attrs.define(eq=False)
class Outbound:
    """Routes an app's connection: resolve, then HBONE through the pool or plain TCP."""

    context: ProxyContext
    #: app connections accepted on SOCKS5 and redirect listeners (a drain waits for them)
    app_connections: LiveConnections = attrs.field(init=False, factory=LiveConnections)
    pool: ConnectionPool = attrs.field(init=False)

    @pool.default
    def _new_pool(self) -> ConnectionPool:
        return ConnectionPool(
            self.context.reactor,
            self._connect_hbone,
            connect_timeout=self.context.connect_timeout,
            on_connection_opened=self._connection_opened,
        )

    def _connection_opened(self, key: PoolKey, connection: HBONEConnection) -> None:
        self.context.metrics.pool_connections_opened.inc()
        track_hbone_connection(self.context.metrics, connection, "outbound")

    def connect(
        self, app: TCPEnd, source: tuple[str, int], host: str, port: int, source_workload=None
    ) -> defer.Deferred:
        """Open the upstream for ``app`` and splice them; fires when the upstream is open.

        The source workload is the local workload whose IP ``app`` comes from,
        unless the listener already knows it (a pod's own 15001).
        """
        # Callbacks, not a coroutine: a coroutine's start and its resumption through Deferreds
        # cost more than the steps themselves (as in ConnectionPool.open_tunnel).
        try:
            source_workload, destination, destination_ip, hbone = self._route(source, host, port, source_workload)
        except Exception:
            return defer.fail()
        record = self._record(source, source_workload, destination, destination_ip, hbone)
        try:
            opening = self._open_upstream(source_workload, source, destination, destination_ip, hbone)
        except Exception:
            opening = defer.fail()

        def opened(upstream):
            record.finish_when_done(splice(app, upstream), app, upstream)
            return upstream

        def refused(failure: Failure) -> Failure:
            e = failure.value
            record.refused("CONNECT", str(e))
            # The refusal keeps ``e`` as its cause; e's traceback holds the frames that hold
            # ``failure``: a cycle only the cyclic collector would free (~80 objects per refused
            # connection). What is logged of it is its message.
            e.__traceback__ = None
            refusal = _as_refusal(e)
            refusal.__cause__ = e
            return Failure(refusal)

        return opening.addCallbacks(opened, refused)

    def _route(self, source, host: str, port: int, source_workload):
        """(source workload, destination, its IP as text, whether by HBONE); raises OutboundRefused."""
        context = self.context
        source_ip = source[0]
        if source_workload is None:
            source_workload = context.local_workload_by_ip(source_ip)
        if source_workload is None:
            log.warn("refusing outbound connection from {source}: no local workload has that address", source=source_ip)
            raise OutboundRefused(Reply.NOT_ALLOWED, f"{source_ip} is not a local workload")
        ip = self._resolve_host(host, source_workload.namespace)
        destination = context.mesh.resolve(
            ip, port, choice=context.random.choice, client_namespace=source_workload.namespace
        )
        if destination.kind == "unroutable":
            raise OutboundRefused(Reply.HOST_UNREACHABLE, destination.reason)
        target = destination.workload
        hbone = target is not None and target.protocol == "HBONE"
        # Once: an IP address object prints itself slowly.
        return source_workload, destination, str(destination.ip), hbone

    def _open_upstream(self, source_workload, source, destination, destination_ip: str, hbone: bool) -> defer.Deferred:
        """Fires with the upstream end: an HBONE tunnel through the pool, or a plain TCP connection."""
        if hbone:
            return self._open_tunnel(source_workload, source, destination, destination_ip)
        upstream = TCPEnd()
        connecting = self.context.network_of(source_workload).connect(
            destination_ip,
            destination.port,
            factory_for(upstream),
            source_ip=source[0],
            timeout=self.context.connect_timeout,
        )
        return connecting.addCallback(lambda _: upstream)

    def _record(self, source, source_workload, destination, destination_ip: str, hbone: bool) -> ConnectionRecord:
        """The metrics and access-log record of one outbound connection, whatever becomes of it."""
        context = self.context
        source_ip, source_port = source
        target = destination.workload
        return ConnectionRecord(
            context.metrics,
            context.reactor,
            ConnectionLabels.for_connection(
                "source",
                source=source_workload,
                destination=target,
                service=destination.service,
                source_identity=source_workload.identity,
                destination_identity=target.identity if target is not None else None,
                mutual_tls=hbone,
            ),
            **{
                "direction": "outbound",
                "src.addr": f"{source_ip}:{source_port}",
                "src.workload": source_workload.name,
                "src.namespace": source_workload.namespace,
                "src.identity": str(source_workload.identity),
                "dst.addr": f"{destination_ip}:{destination.port}",
                "dst.hbone_addr": f"{destination_ip}:{HBONE_PORT}" if hbone else None,
                "dst.service": destination.service.hostname if destination.service is not None else None,
                "dst.workload": target.name if target is not None else None,
                "dst.namespace": target.namespace if target is not None else None,
                "dst.identity": str(target.identity) if hbone else None,
            },
        )

    def _resolve_host(self, host: str, client_namespace: str):
        try:
            return parse_ip(host)
        except ValueError:
            pass
        service = self.context.mesh.service_by_hostname(host, client_namespace=client_namespace)
        if service is None or not service.vips:
            raise OutboundRefused(Reply.HOST_UNREACHABLE, f"no service has the hostname {host!r}")
        return service.vips[0][1]

    def _open_tunnel(self, source_workload, source, destination, destination_ip: str) -> defer.Deferred:
        expected = {str(destination.workload.identity)}
        if destination.service is not None:
            expected.update(destination.service.subject_alt_names)
        key = PoolKey(
            source_identity=str(source_workload.identity),
            destination_identities=expected,
            destination=(destination_ip, HBONE_PORT),
            source_ip=source[0],
        )
        authority = _authority(destination_ip, destination.port)
        return self.pool.open_tunnel(key, authority, tunnel_headers(source_workload, source))

    def _connect_hbone(self, key: PoolKey) -> defer.Deferred:
        context = self.context
        certificate = context.certificates.get(key.source_identity)
        creator = ClientTLS(certificate, key.destination_identities)
        connection = HBONEConnection(
            client=True,
            clock=context.reactor,
            settings=context.client_h2_settings,
            get_peer_identity=peer_identity,
        )
        factory = tls_factory(creator, True, factory_for(connection), context.reactor)
        factory.noisy = False
        ip, port = key.destination
        source = context.local_workload_by_ip(key.source_ip)
        network = context.network_of(source) if source is not None else context.host_network
        connecting = network.connect(ip, port, factory, source_ip=key.source_ip, timeout=context.connect_timeout)
        connecting.addCallback(lambda _: connection.ready)
        return connecting

    # -- listeners --------------------------------------------------------------

    def socks5_factory(self) -> Socks5Factory:
        def connect_request(request):
            app = TCPEnd()
            opening = self.connect(app, request.source, request.host, request.port)
            opening.addCallback(lambda _: app)
            return opening

        return _TrackedSocks5Factory(
            self.app_connections,
            connect_request,
            self.context.reactor,
            on_error=lambda reason: self.context.metrics.socks5_errors.labels(reason=reason).inc(),
        )

    def redirect_factory(self, source=None) -> Factory:
        """15001: redirected app connections; ``source`` is the pod whose listener it is, if known."""
        return _RedirectFactory(self, source)


def _as_refusal(e: Exception) -> Exception:
    if isinstance(e, Socks5Error):
        return e
    if isinstance(e, TunnelRefused):
        reply = Reply.NOT_ALLOWED if e.status in (401, 403) else Reply.CONNECTION_REFUSED
        return Socks5Error(reply, str(e))
    if isinstance(e, error.ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED:
        return Socks5Error(Reply.CONNECTION_REFUSED, str(e))
    if getattr(e, "errno", None) == errno.ENETUNREACH:
        return Socks5Error(Reply.NETWORK_UNREACHABLE, str(e))
    if isinstance(e, (error.TimeoutError, defer.TimeoutError, error.NoRouteError, TimeoutError)) or getattr(
        e, "errno", None
    ) in (errno.EHOSTUNREACH, errno.ETIMEDOUT):
        return Socks5Error(Reply.HOST_UNREACHABLE, str(e))
    if isinstance(e, (TunnelError, ConnectionGone)):
        return Socks5Error(Reply.GENERAL_FAILURE, str(e))
    return Socks5Error(Reply.GENERAL_FAILURE, f"{type(e).__name__}: {e}")


def tunnel_headers(source_workload, source: tuple[str, int]) -> list[tuple[str, str]]:
    """The CONNECT's headers after ``:method`` and ``:authority``, sent as they are (lowercase names)."""
    # Different for every connection: in the HPACK table it would only push out the
    # headers that repeat and lengthen every lookup (a "never indexed" literal).
    headers = [NeverIndexedHeaderTuple("forwarded", f'for="{_authority(*source)}"')]
    baggage = _baggage(source_workload)
    if baggage:
        headers.append(("baggage", baggage))
    return headers


def _authority(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _baggage(workload) -> str:
    return _baggage_of(
        workload.namespace, workload.name, workload.canonical_name, getattr(workload, "canonical_revision", None)
    )


@functools.lru_cache(maxsize=1024)  # a node's few local workloads, each on every connection it makes
def _baggage_of(namespace: str | None, name: str | None, canonical_name: str | None, revision: str | None) -> str:
    # Stripped, as h2's normalization (not used for the CONNECT) would: a hand-written config's
    # "client-1 " would otherwise be a header value a peer rejects with the whole connection.
    def text(value: str | None) -> str:
        return (value or "").strip()

    name = text(name)
    items = {
        "k8s.namespace.name": text(namespace),
        "k8s.pod.name": name,
        "service.name": text(canonical_name) or name,
        "service.version": text(revision),
    }
    return ",".join(f"{key}={value}" for key, value in items.items() if value)


class _TrackedSocks5(Socks5Protocol):
    """A SOCKS5 client the proxy drain waits for (its factory's ``live`` set)."""

    def connectionMade(self) -> None:
        self.factory.live.add(self)
        super().connectionMade()

    def connectionLost(self, reason=connectionDone) -> None:
        super().connectionLost(reason)
        self.factory.live.remove(self)


class _TrackedSocks5Factory(Socks5Factory):
    protocol = _TrackedSocks5

    def __init__(self, live: LiveConnections, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live = live


class _RedirectFactory(Factory):
    def __init__(self, outbound: Outbound, source=None):
        self.outbound = outbound
        self.source = source

    def buildProtocol(self, addr):
        return _RedirectedApp(self.outbound, self.source)


class _RedirectedApp(TCPEnd):
    """15001: an app connection redirected by iptables; its original destination says where to."""

    def __init__(self, outbound: Outbound, source=None):
        super().__init__()
        self.outbound = outbound
        self.source = source

    def connectionMade(self) -> None:
        self.outbound.app_connections.add(self)
        super().connectionMade()
        self.transport.pauseProducing()
        destination = original_destination(self.transport)
        local = self.transport.getHost()
        peer = self.transport.getPeer()
        if destination is None or destination == (local.host, local.port):
            log.warn(
                "outbound connection from {peer} was not redirected: no original destination",
                peer=f"{peer.host}:{peer.port}",
            )
            self.transport.loseConnection()
            return
        opening = self.outbound.connect(self, (peer.host, peer.port), *destination, source_workload=self.source)
        opening.addCallback(lambda _: self.transport.resumeProducing())
        opening.addErrback(self._failed, destination)

    def connectionLost(self, reason=None) -> None:
        super().connectionLost(reason)
        self.outbound.app_connections.remove(self)

    def _failed(self, failure, destination) -> None:
        log.info(
            "outbound connection to {dst} failed: {why}",
            dst="{}:{}".format(*destination),
            why=failure.getErrorMessage(),
        )
        self.abort()
