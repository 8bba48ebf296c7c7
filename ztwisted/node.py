"""One node: its local workloads' listeners and the outbound side, as a Twisted service.

The node does not drain: drain events and the clean-up after them belong
to :mod:`ztwisted.drain.controller`, which acts on the node only through its
view (:class:`ztwisted.view.NodeView`). ``tap.py`` composes the two.
"""

from __future__ import annotations

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger

from ztwisted.context import ProxyContext
from ztwisted.hbone.outbound import Outbound
from ztwisted.listeners import WorkloadListeners
from ztwisted.model import Workload
from ztwisted.network import PodNetwork
from ztwisted.readiness import Readiness

log = Logger()


class Node(service.MultiService):
    """Opens and closes the listeners of the local workloads; its children are the node-wide listeners."""

    def __init__(self, context: ProxyContext, readiness: Readiness | None = None):
        super().__init__()
        self.context = context
        self.workloads = context.workloads
        self.readiness = readiness if readiness is not None else Readiness()
        self.readiness.checks.append(self.workloads_not_listening)
        self.outbound = Outbound(context)
        self.listeners: dict[str, WorkloadListeners] = {}

    def startService(self) -> None:
        self.start_listeners(self.workloads.all())
        super().startService()

    def workloads_not_listening(self) -> list[str]:
        """For readiness: the local workloads whose listeners are not (all) open."""
        pending = []
        for workload in self.workloads.all():
            listeners = self.listeners.get(workload.uid)
            if listeners is None or not listeners.listening:
                pending.append(f"listeners of {workload.namespace}/{workload.name}")
        return pending

    def stopService(self) -> defer.Deferred:
        """Stops the children (a drain controller among them), then certificate renewal."""
        stopped = defer.maybeDeferred(super().stopService)
        return stopped.addBoth(lambda _: self.context.certificates.stop())

    def start_pod(self, workload: Workload, network: PodNetwork) -> defer.Deferred:
        """In-pod mode: serve a pod the node agent added, with listeners in its network namespace."""
        self.workloads.add_pod(workload, network)

        def failed(failure):
            self.workloads.forget(workload)  # the caller keeps the namespace
            return failure

        return self.start_listener(workload).addErrback(failed)

    def update_pod(self, workload: Workload) -> None:
        """In-pod mode: discovery changed what is known of a running pod (its addresses, services...)."""
        if not self.workloads.update_pod(workload):
            return
        listeners = self.listeners.get(workload.uid)
        if listeners is not None:
            listeners.update(workload)

    def close_workload(self, workload: Workload, forget: bool) -> defer.Deferred:
        """Close ``workload``'s listeners; with ``forget``, drop its pod network and stop renewing
        its certificate. Connections are the drain controller's (they are ended before this)."""
        listeners = self.listeners.pop(workload.uid, None)
        done = listeners.stop_listening() if listeners is not None else defer.succeed(None)
        if forget:
            network = self.workloads.forget(workload)
            if network is not None:
                done.addBoth(lambda result: (network.close(), result)[1])
            self._forget_certificate(workload)
        return done

    def _forget_certificate(self, workload: Workload) -> None:
        """Stop renewing a removed workload's certificate, unless another local workload shares its identity."""
        if all(other.identity != workload.identity for other in self.workloads.all()):
            self.context.certificates.discard(workload.identity)

    def start_listeners(self, workloads) -> defer.Deferred:
        """Start listeners for each workload; a failure is logged and does not stop the others."""
        return defer.DeferredList([self.start_listener(w).addErrback(lambda failure: None) for w in workloads])

    def start_listener(self, workload: Workload) -> defer.Deferred:
        listeners = WorkloadListeners(self.context, self.outbound, workload, self.workloads.network_of(workload))
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
