"""The per-pod proxies of in-pod mode: what the node agent's messages do to the node."""

from __future__ import annotations

import attr
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


class UnknownPod(Exception):
    """The node agent added a pod that the configuration does not describe."""


@implementer(IPodManager)
class PodProxies:
    """Serves each pod the node agent adds, inside its network namespace.

    The pod's addresses, protocol and services come from the configuration
    (matched by uid, as ztunnel matches them from discovery); its identity
    comes from the agent's ``workload_info``.
    """

    def __init__(self, node: Node, events: IDrainEvents):
        self.node = node
        self.events = events
        self._running: dict[str, Workload] = {}

    def add_pod(self, uid, workload_info, netns) -> defer.Deferred:
        configured = self.node.workloads.mesh.workload_by_uid(uid)
        if configured is None:
            return defer.fail(UnknownPod(f"pod {uid} ({workload_info.namespace}/{workload_info.name}) is not in the configuration"))
        workload = attr.evolve(
            configured,
            name=workload_info.name or configured.name,
            namespace=workload_info.namespace or configured.namespace,
            service_account=workload_info.service_account or configured.service_account,
            trust_domain=configured.trust_domain or DEFAULT_TRUST_DOMAIN,
        )
        network = PodNetwork(self.node.context.reactor, netns, mark=self.node.workloads.host_network.mark)
        log.info("starting the proxy of pod {pod} in {netns}", pod=f"{workload.namespace}/{workload.name}", netns=network.name)

        def started(result):
            self._running[uid] = workload
            return result

        return self.node.start_pod(workload, network).addCallback(started)

    def remove_pod(self, uid) -> defer.Deferred:
        workload = self._running.pop(uid, None)
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
