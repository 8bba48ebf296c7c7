"""One node: the mesh it knows, its local workloads' listeners, the outbound pool.

This is the composition root, and the facade that admin endpoints (and,
later, drain strategies) act through.
"""

from __future__ import annotations

import os
import random

from twisted.application import service
from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger

from ztwisted.ca import CertificateStore
from ztwisted.drain.admin import drain_admin_routes
from ztwisted.drain.coordinator import DrainCoordinator
from ztwisted.drain.facade import DrainFacade, drain_all
from ztwisted.h2.connection import H2Settings
from ztwisted.hbone.inbound import InboundHBONE, InboundPlaintext
from ztwisted.hbone.outbound import Outbound
from ztwisted.model import Mesh, diff
from ztwisted.network import HostNetwork
from ztwisted.sockets import log_listening

log = Logger()

DEFAULT_DRAIN_TIMEOUT = 5.0
#: under a real node agent's 5 s Ack timeout
DEFAULT_POD_DRAIN_TIMEOUT = 3.0
#: after pod_drain_timeout, how long the node waits for a strategy before closing the pod itself
POD_DRAIN_GRACE = 0.25


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
    """The listeners of one local workload: inbound on each of its IPs, and in a pod also outbound (15001)."""

    def __init__(self, node: Node, workload, network):
        self.workload = workload
        self.network = network
        self.hbone = InboundHBONE(node, workload, network)
        self.plaintext = InboundPlaintext(node, workload, network)
        self.ports = []
        #: every listener is open (readiness reports a local workload whose listeners are not)
        self.listening = False
        self._closed = False
        in_pod = not isinstance(network, HostNetwork)
        # A pod's namespace holds only its own addresses; its redirect rules send to them or to loopback.
        addresses = ["0.0.0.0"] if in_pod else [str(ip) for ip in workload.workload_ips]
        self.wanted = [(ip, node.hbone_port, self.hbone.factory(), "HBONE inbound") for ip in addresses]
        if node.plaintext_port is not None:
            self.wanted += [(ip, node.plaintext_port, self.plaintext, "plaintext inbound") for ip in addresses]
        self.redirect = None
        if in_pod and node.pod_outbound_port is not None:
            self.redirect = node.outbound.redirect_factory(source=workload)
            self.wanted.append(("0.0.0.0", node.pod_outbound_port, self.redirect, "redirected outbound"))

    def update(self, workload) -> None:
        """What the node knows of the workload changed (discovery): new connections see the new one."""
        self.workload = self.hbone.workload = self.plaintext.workload = workload
        if self.redirect is not None:
            self.redirect.source = workload

    def start(self) -> defer.Deferred:
        """Open every listener; fails (closing the ones opened) if any cannot be opened."""
        opening = [
            self.network.listen(ip, port, factory).addCallback(self._opened, purpose)
            for ip, port, factory, purpose in self.wanted
        ]
        done = defer.gatherResults(opening, consumeErrors=True)

        def opened(result):
            self.listening = not self._closed
            return result

        def failed(failure):
            self.stop_listening()
            return failure.value.subFailure if isinstance(failure.value, defer.FirstError) else failure

        return done.addCallbacks(opened, failed)

    def _opened(self, port, purpose: str) -> None:
        if self._closed:
            port.stopListening()
            return
        self.ports.append(port)
        where = "" if isinstance(self.network, HostNetwork) else f" in {self.network.name}"
        log_listening(port, f"{purpose} of {self.workload.namespace}/{self.workload.name}", where)

    def stop_listening(self) -> defer.Deferred:
        self._closed = True
        self.listening = False
        ports, self.ports = self.ports, []
        return defer.gatherResults([defer.maybeDeferred(port.stopListening) for port in ports])

    def drain(self, graceful: bool, deadline: float | None) -> defer.Deferred:
        """End the HBONE connections (gracefully or not); plaintext ones have no graceful end but their own."""
        if not graceful:
            self.plaintext.connections.abort_all()
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
        strategies=(),
        hbone_port: int = 15008,
        plaintext_port: int | None = 15006,
        connect_timeout: float = 10.0,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        pod_drain_timeout: float = DEFAULT_POD_DRAIN_TIMEOUT,
        keepalive: tuple[float, float] = (10.0, 20.0),
        config_source: str = "<built-in example>",
        inpod: bool = False,
        packet_mark: int | None = None,
        pod_outbound_port: int | None = 15001,
        random_seed: int | None = None,
        certificates=None,
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
        self.pod_drain_timeout = pod_drain_timeout
        self.config_source = config_source
        #: every random choice the proxy makes (endpoints, jitter); seeded for reproducible runs
        self.random = random.Random(random_seed)
        self.inpod = inpod
        self.pod_outbound_port = pod_outbound_port
        self.host_network = HostNetwork(reactor, mark=packet_mark)
        self._pods: dict[str, object] = {}
        self._networks: dict[str, object] = {}
        # A remote CA's client (ztwisted.xds.certificates) when given; else issued here by the local CA.
        self.certificates = certificates if certificates is not None else CertificateStore(certificate_authority, reactor)
        #: called whenever the local workloads may have changed (e.g. to request their certificates)
        self.on_local_workloads_changed: list = []
        interval, timeout = keepalive
        self.server_h2_settings = H2Settings.server(keepalive_interval=interval, keepalive_timeout=timeout)
        self.client_h2_settings = H2Settings.client(keepalive_interval=interval, keepalive_timeout=timeout)
        self.outbound = Outbound(self)
        self.listeners: dict[str, WorkloadListeners] = {}
        self.coordinator = DrainCoordinator(strategies, DrainFacade(self), metrics, reactor)
        self._removed_uids: set[str] = set()
        self._local_by_ip: dict | None = None
        self._pending: set[str] = set()
        #: callables returning what else readiness waits for (e.g. the node agent's snapshot)
        self.readiness_checks: list = []
        #: extra /config_dump sections: name -> callable returning JSON-ready data
        self.dump_sections: dict = {}
        #: callables told of every new configuration (``observer(mesh)``), after the node applied it
        self.mesh_observers: list = []
        self._stopping: defer.Deferred | None = None
        self._strategies_stopping: defer.Deferred | None = None
        self._drain_deadline: float | None = None

    # -- lifecycle ------------------------------------------------------------

    def startService(self) -> None:
        self.coordinator.attach()
        self._start_listeners(self.local_workloads())
        super().startService()
        log.info(
            "node proxy ready: {count} local workloads, drain strategies {strategies}",
            count=len(self.local_workloads()),
            strategies=self.coordinator.names,
        )

    def stopService(self) -> defer.Deferred:
        """Proxy stopping: stop accepting, let the strategies act, then drain what is left up to the deadline."""
        stopped_children = defer.maybeDeferred(super().stopService)
        drained = self.begin_proxy_drain()
        done = defer.DeferredList([stopped_children, drained], consumeErrors=True)
        done.addCallback(lambda _: self.certificates.stop())
        return done

    def begin_proxy_drain(self) -> defer.Deferred:
        """The *proxy stopping* event (SIGTERM, ``POST /quitquitquit``, ``POST /drain``); runs once."""
        if self._stopping is not None:
            return _follow(self._stopping)
        log.info("proxy stopping: draining connections (deadline {deadline} s)", deadline=self.drain_timeout)
        self._pending.add("draining")
        self._drain_deadline = self.reactor.seconds() + self.drain_timeout
        listeners = list(self.listeners.values())
        stopped = [listener.stop_listening() for listener in listeners]
        strategies_done = self.coordinator.proxy_stopping()
        # A strategy cannot hold the process past the deadline; stop_now cancels it sooner.
        strategies_done.addTimeout(self.drain_timeout, self.reactor)
        self._strategies_stopping = strategies_done
        strategies_done.addErrback(lambda failure: None)

        strategies_done.addCallback(lambda _: defer.Deferred.fromCoroutine(self._drain_until_idle(listeners)))
        self._stopping = defer.DeferredList([*stopped, strategies_done], consumeErrors=True)
        self._stopping.addCallback(lambda _: log.info("proxy drain complete"))
        return _follow(self._stopping)

    async def _drain_until_idle(self, listeners) -> None:
        """Drain until no connection is left, new ones included (the pool may open some for
        app connections accepted before the stop); at the deadline, end the rest at once."""
        apps = [self.outbound.app_connections, *(listener.plaintext.connections for listener in listeners)]
        while True:
            connections = [c for listener in listeners for c in listener.hbone.connections] + self.outbound.pool.connections()
            if not connections and not any(apps):
                return
            left = self.drain_time_left()
            if left <= 0:
                for connection in connections:
                    connection.drain(graceful=False)
                for live in apps:
                    live.abort_all()
                return
            waits = [c.drain(graceful=True, deadline=left) for c in connections]
            waits += [ended for live in apps for ended in live.ended()]
            waited = defer.DeferredList(waits)
            if waited.called:
                # Everything listed says it is done but has not left the lists yet: look again shortly.
                await deferLater(self.reactor, min(left, 0.05), lambda: None)
                continue
            try:
                await waited.addTimeout(left, self.reactor)
            except defer.TimeoutError:
                pass

    def drain_time_left(self) -> float:
        if self._drain_deadline is None:
            return self.drain_timeout
        return max(0.0, self._drain_deadline - self.reactor.seconds())

    def stop_now(self) -> None:
        """A second SIGTERM/SIGINT: end every connection at once."""
        log.info("stopping at once: aborting every connection")
        self._drain_deadline = self.reactor.seconds()
        if self._strategies_stopping is not None and not self._strategies_stopping.called:
            self._strategies_stopping.cancel()
        for listener in self.listeners.values():
            for connection in list(listener.hbone.connections):
                connection.drain(graceful=False)
        for connection in self.outbound.pool.connections():
            connection.drain(graceful=False)

    def quit(self) -> None:
        """``POST /quitquitquit``: stop the process the way SIGTERM does."""
        self.reactor.stop()

    # -- the mesh and pod lifecycle -----------------------------------------------

    def local_workloads(self):
        if self.inpod:
            return tuple(self._pods.values())
        return tuple(w for w in self.mesh.local_workloads(self.node_name) if w.uid not in self._removed_uids)

    def network_of(self, workload):
        """Where ``workload``'s sockets live: its pod's network namespace, or the host's."""
        return self._networks.get(workload.uid, self.host_network)

    def local_workload_by_ip(self, ip):
        """The local workload with address ``ip`` (a string), if any; looked up per connection."""
        if self._local_by_ip is None:
            self._local_by_ip = {str(address): w for w in self.local_workloads() for address in w.workload_ips}
        return self._local_by_ip.get(str(ip))

    def _local_workloads_changed(self) -> None:
        self._local_by_ip = None
        for hook in self.on_local_workloads_changed:
            hook()

    def local_workload(self, uid_or_name: str):
        """A local workload by uid, or by ``name`` / ``namespace/name``."""
        for workload in self.local_workloads():
            if uid_or_name in (workload.uid, workload.name, f"{workload.namespace}/{workload.name}"):
                return workload
        return None

    def pod_terminating(self, workload) -> defer.Deferred:
        return self.coordinator.pod_terminating(workload)

    def start_pod(self, workload, network) -> defer.Deferred:
        """In-pod mode: serve a pod the node agent added, with listeners in its network namespace."""
        self._pods[workload.uid] = workload
        self._local_workloads_changed()
        self._networks[workload.uid] = network

        def failed(failure):
            self._pods.pop(workload.uid, None)
            self._local_workloads_changed()
            self._networks.pop(workload.uid, None)
            return failure

        return self._start_listener(workload).addErrback(failed)

    def update_pod(self, workload) -> None:
        """In-pod mode: discovery changed what is known of a running pod (its addresses, services...)."""
        if workload.uid not in self._pods:
            return
        self._pods[workload.uid] = workload
        self._local_workloads_changed()
        listeners = self.listeners.get(workload.uid)
        if listeners is not None:
            listeners.update(workload)

    def remove_pod(self, workload, *, forget: bool = True) -> defer.Deferred:
        """*pod removed*: the strategies act, then what is left of the pod is closed.

        ``forget=False`` keeps it local (a changed workload that is restarted).
        """
        if forget:
            self._removed_uids.add(workload.uid)
            self._local_workloads_changed()
        removing = self.coordinator.pod_removed(workload)
        # The node agent waits for this; a strategy gets pod_drain_timeout (its own deadline acts first).
        removing.addTimeout(self.pod_drain_timeout + POD_DRAIN_GRACE, self.reactor)
        removing.addErrback(lambda failure: None)
        removing.addCallback(lambda _: self._close_pod(workload, forget))
        return removing

    def _close_pod(self, workload, forget: bool) -> defer.Deferred:
        listener = self.listeners.pop(workload.uid, None)
        closing = []
        if listener is not None:
            closing = [listener.stop_listening(), listener.drain(graceful=False, deadline=None)]
        if forget:
            # The pod's own pooled connections have no users left.
            from_pod = [c for ip in workload.workload_ips for c in self.outbound.pool.connections(source_ip=str(ip))]
            closing.append(drain_all(from_pod, graceful=False, deadline=None))
        done = defer.DeferredList(closing)
        if forget and self._pods.pop(workload.uid, None) is not None:
            self._local_workloads_changed()
            network = self._networks.pop(workload.uid, None)
            done.addBoth(lambda result: (network.close(), result)[1])
        return done

    def apply_mesh(self, mesh: Mesh) -> None:
        """Switch to a new configuration (a reload); removed workloads raise drain events."""
        old_local = {w.uid: w for w in self.local_workloads()}
        changes = diff(self.mesh, mesh)
        self.mesh = mesh
        self._local_workloads_changed()
        for observer in self.mesh_observers:
            observer(mesh)
        if not self.running:
            return
        if self.inpod:
            # Local pods come and go through the node agent, not the file.
            for workload in changes.removed:
                if workload.uid not in old_local:
                    self.coordinator.destination_removed(workload)
            return
        new_local = {w.uid: w for w in self.local_workloads()}
        for old, new in changes.changed:
            if old.uid in old_local:
                self.remove_pod(old, forget=False).addCallback(lambda _, uid=new.uid: self._start_listeners_for(uid))
        changed = {old.uid for old, _ in changes.changed}
        for uid, workload in old_local.items():
            if uid not in new_local and uid not in changed:
                # If a later reload brings it back before its listeners are closed, they reopen then.
                self.remove_pod(workload).addCallback(lambda _, uid=uid: self._start_listeners_for(uid))
        # A workload the admin API removed stays removed while the file lists it; once the file
        # drops it, adding it back serves it again.
        self._removed_uids &= {w.uid for w in mesh.workloads}
        self._local_workloads_changed()
        for workload in changes.removed:
            if workload.uid not in old_local:
                self.coordinator.destination_removed(workload)
        self._start_listeners([w for uid, w in new_local.items() if uid not in self.listeners and uid not in changed])

    def _start_listeners_for(self, uid: str) -> None:
        if self._stopping is not None:
            return  # the proxy is draining: it opens nothing new
        workload = next((w for w in self.local_workloads() if w.uid == uid), None)
        if workload is not None and uid not in self.listeners:
            self._start_listeners([workload])

    def _start_listeners(self, workloads) -> defer.Deferred:
        """Start listeners for each workload; a failure is logged and does not stop the others."""
        return defer.DeferredList([self._start_listener(w).addErrback(lambda failure: None) for w in workloads])

    def _start_listener(self, workload) -> defer.Deferred:
        listeners = WorkloadListeners(self, workload, self.network_of(workload))
        self.listeners[workload.uid] = listeners

        def failed(failure):
            if self.listeners.get(workload.uid) is listeners:
                del self.listeners[workload.uid]
            log.error(
                "workload {namespace}/{name} is not served ({network}): {error}",
                namespace=workload.namespace,
                name=workload.name,
                network=listeners.network.name,
                error=failure.getErrorMessage(),
            )
            return failure

        return listeners.start().addErrback(failed)

    # -- admin facade -----------------------------------------------------------

    def readiness(self) -> list[str]:
        pending = set(self._pending)
        for workload in self.local_workloads():
            listeners = self.listeners.get(workload.uid)
            if listeners is None or not listeners.listening:
                pending.add(f"listeners of {workload.namespace}/{workload.name}")
        for check in self.readiness_checks:
            pending.update(check())
        return sorted(pending)

    def admin_routes(self) -> dict:
        return drain_admin_routes(self)

    def config_dump(self) -> dict:
        local = {w.uid for w in self.local_workloads()}
        # In-pod: pods served under a uid the configuration lacks (added before discovery knew them,
        # or found there by name, namespace and service account) are listed too.
        undiscovered = [w for w in self.local_workloads() if self.mesh.workload_by_uid(w.uid) is None]
        return {
            "node": self.node_name,
            "config_source": self.config_source,
            "workloads": [_workload_dump(w, w.uid in local) for w in (*self.mesh.workloads, *undiscovered)],
            "services": [_service_dump(s, self.mesh) for s in self.mesh.services],
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
            **{name: section() for name, section in self.dump_sections.items()},
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
        "status": workload.status,
        "networkMode": workload.network_mode,
        "capacity": workload.capacity,
        "identity": str(workload.identity),
        "local": local,
    }


def _service_dump(service, mesh) -> dict:
    # As ztunnel lists them: the ones the service names, then the healthy workloads that join it.
    endpoints = {
        uid: {"workloadUid": uid, "port": {str(k): v for k, v in ports.items()}, "status": status}
        for uid, (ports, status) in service.endpoints.items()
    }
    for workload in mesh.workloads:
        ports = workload.services.get(service.key)
        if ports is not None and (workload.healthy or service.health_policy == "AllowAll"):
            endpoints[workload.uid] = {
                "workloadUid": workload.uid, "port": {str(k): v for k, v in ports.items()}, "status": workload.status}
    return {
        "name": service.name,
        "namespace": service.namespace,
        "hostname": service.hostname,
        "vips": [f"{network}/{ip}" for network, ip in service.vips],
        "ports": {str(k): v for k, v in service.ports.items()},
        "canonical": service.canonical,
        "visibility": service.visibility,
        "endpoints": endpoints,
    }


def _follow(deferred: defer.Deferred) -> defer.Deferred:
    """A new Deferred that fires with ``deferred``'s result, leaving ``deferred`` untouched."""
    follower = defer.Deferred()
    deferred.addBoth(lambda result: (follower.callback(None), result)[1])
    return follower
