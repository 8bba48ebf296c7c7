"""One node: the mesh it knows, its local workloads' listeners, the outbound pool.

This is the composition root, and the facade that admin endpoints (and,
later, drain strategies) act through.
"""

from __future__ import annotations

import ipaddress
import os

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger

from ztwisted.ca import CertificateStore
from ztwisted.h2.connection import H2Settings
from ztwisted.hbone.inbound import InboundHBONE, InboundPlaintext
from ztwisted.hbone.outbound import Outbound
from ztwisted.model import Mesh, diff
from ztwisted.sockets import listen_tcp

log = Logger()

DEFAULT_DRAIN_TIMEOUT = 5.0


def drain_timeout_from_environment(environ=os.environ) -> float:
    """ztunnel's rule for the process drain deadline (see docs/draining.rst)."""
    explicit = environ.get("CONNECTION_TERMINATION_DEADLINE")
    if explicit:
        return float(explicit.rstrip("s"))
    grace = environ.get("TERMINATION_GRACE_PERIOD_SECONDS")
    if grace:
        seconds = int(grace)
        return float(max(1, seconds - 5 if seconds > 10 else seconds - 1))
    return DEFAULT_DRAIN_TIMEOUT


class WorkloadListeners:
    """The inbound listeners of one local workload, on each of its IPs."""

    def __init__(self, node: Node, workload):
        self.workload = workload
        self.hbone = InboundHBONE(node, workload)
        self.plaintext = InboundPlaintext(node, workload)
        self.ports = []
        for ip in workload.workload_ips:
            self.ports.append(listen_tcp(node.reactor, str(ip), node.hbone_port, self.hbone.factory()))
            if node.plaintext_port is not None:
                self.ports.append(listen_tcp(node.reactor, str(ip), node.plaintext_port, self.plaintext))

    def stop_listening(self) -> defer.Deferred:
        ports, self.ports = self.ports, []
        return defer.gatherResults([defer.maybeDeferred(port.stopListening) for port in ports])

    def drain(self, graceful: bool, deadline: float | None) -> defer.Deferred:
        return defer.gatherResults(
            [connection.drain(graceful=graceful, deadline=deadline) for connection in list(self.hbone.connections)]
        )


class Node(service.MultiService):
    def __init__(
        self,
        reactor,
        *,
        mesh: Mesh,
        node_name: str | None,
        certificate_authority,
        metrics,
        hbone_port: int = 15008,
        plaintext_port: int | None = 15006,
        connect_timeout: float = 10.0,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        keepalive: tuple[float, float] = (10.0, 20.0),
        config_source: str = "<built-in example>",
    ):
        super().__init__()
        self.reactor = reactor
        self.mesh = mesh
        self.node_name = node_name
        self.metrics = metrics
        self.hbone_port = hbone_port
        self.plaintext_port = plaintext_port
        self.connect_timeout = connect_timeout
        self.drain_timeout = drain_timeout
        self.config_source = config_source
        self.certificates = CertificateStore(certificate_authority, reactor)
        interval, timeout = keepalive
        self.server_h2_settings = H2Settings.server(keepalive_interval=interval, keepalive_timeout=timeout)
        self.client_h2_settings = H2Settings.client(keepalive_interval=interval, keepalive_timeout=timeout)
        self.outbound = Outbound(self)
        self.listeners: dict[str, WorkloadListeners] = {}
        self._local_by_ip: dict = {}
        self._pending: set[str] = {"listeners"}

    # -- lifecycle ------------------------------------------------------------

    def startService(self) -> None:
        self._start_listeners(self.local_workloads())
        self._pending.discard("listeners")
        super().startService()

    def stopService(self) -> defer.Deferred:
        """Proxy stopping: stop accepting, drain gracefully, force what is left at the deadline."""
        log.info("proxy stopping: draining connections (deadline {deadline} s)", deadline=self.drain_timeout)
        stopped_children = defer.maybeDeferred(super().stopService)
        listeners = list(self.listeners.values())
        self.listeners.clear()
        draining = [listener.stop_listening() for listener in listeners]
        draining += [listener.drain(True, self.drain_timeout) for listener in listeners]
        draining.append(self.outbound.pool.close_all(graceful=True, deadline=self.drain_timeout))
        done = defer.DeferredList([stopped_children, *draining], consumeErrors=True)
        done.addCallback(lambda _: self.certificates.stop())
        return done

    def quit(self) -> None:
        """``POST /quitquitquit``: stop the process the way SIGTERM does."""
        self.reactor.stop()

    # -- the mesh ---------------------------------------------------------------

    def local_workloads(self):
        return self.mesh.local_workloads(self.node_name)

    def local_workload_by_ip(self, ip):
        workload = self.mesh.workload_by_ip(ip)
        if workload is None or workload.uid not in {w.uid for w in self.local_workloads()}:
            return None
        return workload

    def apply_mesh(self, mesh: Mesh) -> None:
        """Switch to a new configuration (a reload): listeners follow the local workloads."""
        old = self.mesh
        self.mesh = mesh
        if not self.running:
            return
        changes = diff(old, mesh)
        local_uids = {w.uid for w in self.local_workloads()}
        gone = [w for w in changes.removed] + [old_w for old_w, new_w in changes.changed]
        for workload in gone:
            listener = self.listeners.pop(workload.uid, None)
            if listener is not None:
                self._remove_listener(listener)
        started = [w for w in changes.added] + [new_w for old_w, new_w in changes.changed]
        self._start_listeners([w for w in started if w.uid in local_uids and w.uid not in self.listeners])
        for uid in list(self.listeners):
            if uid not in local_uids:
                self._remove_listener(self.listeners.pop(uid))

    def _start_listeners(self, workloads) -> None:
        for workload in workloads:
            try:
                self.listeners[workload.uid] = WorkloadListeners(self, workload)
            except OSError as e:
                log.error(
                    "cannot listen for workload {name} on {ips}: {error}",
                    name=workload.name,
                    ips=", ".join(str(ip) for ip in workload.workload_ips),
                    error=e,
                )

    def _remove_listener(self, listener: WorkloadListeners) -> None:
        # Until the drain strategies decide otherwise: ztunnel's behaviour, close at once.
        listener.stop_listening()
        listener.drain(graceful=False, deadline=None)

    # -- admin facade -----------------------------------------------------------

    def readiness(self) -> list[str]:
        return sorted(self._pending)

    def admin_routes(self) -> dict:
        return {}

    def config_dump(self) -> dict:
        local = {w.uid for w in self.local_workloads()}
        return {
            "node": self.node_name,
            "config_source": self.config_source,
            "workloads": [_workload_dump(w, w.uid in local) for w in self.mesh.workloads],
            "services": [_service_dump(s) for s in self.mesh.services],
            "policies": [{"name": p.name, "namespace": p.namespace, "scope": p.scope, "action": p.action} for p in self.mesh.policies],
            "pool": self.outbound.pool.snapshot(),
            "inbound": [
                {"workload": listener.workload.name, "connections": len(listener.hbone.connections)}
                for listener in self.listeners.values()
            ],
            "certificates": [
                {
                    "identity": str(c.identity),
                    "serial": format(c.certificate().serial_number, "x"),
                    "not_before": c.not_before.isoformat(),
                    "expiration": c.not_after.isoformat(),
                }
                for c in self.certificates.all()
            ],
        }


def _workload_dump(workload, local: bool) -> dict:
    return {
        "uid": workload.uid,
        "name": workload.name,
        "namespace": workload.namespace,
        "serviceAccount": workload.service_account,
        "workloadIps": [str(ip) for ip in workload.workload_ips],
        "protocol": workload.protocol,
        "node": workload.node,
        "identity": str(workload.identity),
        "local": local,
    }


def _service_dump(service) -> dict:
    return {
        "name": service.name,
        "namespace": service.namespace,
        "hostname": service.hostname,
        "vips": [f"{network}/{ip}" for network, ip in service.vips],
        "ports": {str(k): v for k, v in service.ports.items()},
    }


def ip_of(text: str):
    return ipaddress.ip_address(text)
