"""The per-pod proxies of in-pod mode: what the node agent's messages do to the node."""

from __future__ import annotations

import attrs
from twisted.internet import defer
from twisted.logger import Logger
from zope.interface import implementer

from ztwisted.identity import DEFAULT_TRUST_DOMAIN
from ztwisted.inpod.client import IPodManager
from ztwisted.interfaces import IDrainEvents
from ztwisted.model import Workload
from ztwisted.network import PodNetwork
from ztwisted.node import Node

log = Logger()


def pod_workload(uid: str, workload_info, mesh, node_name: str | None) -> Workload:
    """The workload a pod's proxy serves: who it is from the agent, the rest from discovery.

    As in ztunnel, the agent's ``workload_info`` alone is enough to start the
    proxy: name, namespace and service account (trust domain
    ``cluster.local``). Discovery (the configuration) adds what the agent does
    not know: addresses, protocol, services, policies. Its entry for the pod is
    the one with the pod's uid or, as ztunnel matches it, the local workload
    with the same name, namespace and service account. Until there is one the
    pod has no known address.
    """
    discovered = mesh.workload_by_uid(uid) or next(
        (
            w
            for w in mesh.local_workloads(node_name)
            if (w.name, w.namespace, w.service_account)
            == (workload_info.name, workload_info.namespace, workload_info.service_account)
        ),
        None,
    )
    if discovered is None:
        return Workload(
            uid=uid,
            name=workload_info.name,
            namespace=workload_info.namespace,
            service_account=workload_info.service_account or "default",
            protocol="HBONE",
            node=node_name or "",
        )
    return attrs.evolve(
        discovered,
        uid=uid,
        name=workload_info.name or discovered.name,
        namespace=workload_info.namespace or discovered.namespace,
        service_account=workload_info.service_account or discovered.service_account,
        trust_domain=discovered.trust_domain or DEFAULT_TRUST_DOMAIN,
    )


@implementer(IPodManager)
@attrs.define(eq=False)
class PodProxies:
    """Serves each pod the node agent adds, inside its network namespace.

    A pod's proxy starts from the agent's ``workload_info`` whether or not
    discovery knows the pod yet; each configuration change refreshes what the
    running pods' proxies know of them (see :func:`pod_workload`).
    """

    node: Node
    events: IDrainEvents
    _running: dict[str, Workload] = attrs.field(init=False, factory=dict)
    #: the node agent's workload info of each running pod, to work out its workload again
    _infos: dict[str, object] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.node.workloads.on_mesh_replaced.append(self.discovery_changed)

    def add_pod(self, uid, workload_info, netns) -> defer.Deferred:
        workloads = self.node.workloads
        workload = pod_workload(uid, workload_info, workloads.mesh, workloads.node_name)
        if not workload.workload_ips:
            log.info(
                "pod {pod} ({uid}) is not known to discovery yet: starting its proxy from the node agent's "
                "workload info; its addresses and services follow when discovery has them",
                pod=f"{workload.namespace}/{workload.name}",
                uid=uid,
            )
        network = PodNetwork(self.node.context.reactor, netns, mark=workloads.host_network.mark)
        log.info(
            "starting the proxy of pod {pod} in {netns}",
            pod=f"{workload.namespace}/{workload.name}",
            netns=network.name,
        )

        def started(result):
            self._running[uid] = workload
            self._infos[uid] = workload_info
            return result

        return self.node.start_pod(workload, network).addCallback(started)

    def discovery_changed(self, mesh) -> None:
        """The configuration changed: running pods' proxies take what discovery now says of them."""
        for uid, info in self._infos.items():
            workload = pod_workload(uid, info, mesh, self.node.workloads.node_name)
            if workload != self._running.get(uid):
                log.info(
                    "pod {pod} ({uid}): discovery updated it (addresses {ips})",
                    pod=f"{workload.namespace}/{workload.name}",
                    uid=uid,
                    ips=[str(ip) for ip in workload.workload_ips],
                )
                self._running[uid] = workload
                self.node.update_pod(workload)

    def remove_pod(self, uid) -> defer.Deferred:
        workload = self._running.pop(uid, None)
        self._infos.pop(uid, None)
        if workload is None:
            return defer.succeed(None)
        return self.events.pod_removed(workload)

    def pod_terminating(self, uid) -> defer.Deferred:
        workload = self._running.get(uid)
        if workload is None:
            return defer.succeed(None)
        return self.events.pod_terminating(workload)

    def running_pods(self) -> set:
        return set(self._running)
