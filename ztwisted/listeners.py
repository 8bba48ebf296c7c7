"""The listeners of one local workload."""

from __future__ import annotations

from twisted.internet import defer

from ztwisted.context import ProxyContext
from ztwisted.hbone.inbound import InboundHBONE, InboundPlaintext
from ztwisted.hbone.outbound import Outbound
from ztwisted.model import Workload
from ztwisted.network import HostNetwork, PodNetwork


class WorkloadListeners:
    """Inbound on each of a workload's IPs (15008, 15006), and in a pod also outbound (15001)."""

    def __init__(self, context: ProxyContext, outbound: Outbound, workload: Workload, network: HostNetwork | PodNetwork):
        self.workload = workload
        self.network = network
        self.hbone = InboundHBONE(context, workload, network)
        self.plaintext = InboundPlaintext(context, workload, network)
        self.ports = []
        self._closed = False
        settings = context.settings
        in_pod = not isinstance(network, HostNetwork)
        # A pod's namespace holds only its own addresses; its redirect rules send to them or to loopback.
        addresses = ["0.0.0.0"] if in_pod else [str(ip) for ip in workload.workload_ips]
        self.wanted = [(ip, settings.hbone_port, self.hbone.factory()) for ip in addresses]
        if settings.plaintext_port is not None:
            self.wanted += [(ip, settings.plaintext_port, self.plaintext) for ip in addresses]
        if in_pod and settings.pod_outbound_port is not None:
            self.wanted.append(("0.0.0.0", settings.pod_outbound_port, outbound.redirect_factory(source=workload)))

    def start(self) -> defer.Deferred:
        """Open every listener; fails (closing the ones opened) if any cannot be opened."""
        opening = [self.network.listen(ip, port, factory).addCallback(self._opened) for ip, port, factory in self.wanted]
        done = defer.gatherResults(opening, consumeErrors=True)

        def failed(failure):
            self.stop_listening()
            return failure.value.subFailure if isinstance(failure.value, defer.FirstError) else failure

        return done.addErrback(failed)

    def _opened(self, port) -> None:
        if self._closed:
            port.stopListening()
        else:
            self.ports.append(port)

    def stop_listening(self) -> defer.Deferred:
        self._closed = True
        ports, self.ports = self.ports, []
        return defer.gatherResults([defer.maybeDeferred(port.stopListening) for port in ports])
