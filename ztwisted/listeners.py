"""The listeners of one local workload."""

from __future__ import annotations

from typing import Any

import attrs
from twisted.internet import defer

from ztwisted.context import ProxyContext
from ztwisted.hbone.inbound import InboundHBONE, InboundPlaintext
from ztwisted.hbone.outbound import Outbound
from ztwisted.model import Workload
from ztwisted.network import HostNetwork, PodNetwork
from ztwisted.sockets import log_listening


@attrs.define(eq=False)
class WorkloadListeners:
    """Inbound on each of a workload's IPs (15008, 15006), and in a pod also outbound (15001)."""

    context: ProxyContext
    outbound: Outbound
    workload: Workload
    network: HostNetwork | PodNetwork
    hbone: InboundHBONE = attrs.field(init=False)
    plaintext: InboundPlaintext = attrs.field(init=False)
    #: in a pod, its own 15001 (its redirect rules send its outbound connections there)
    redirect: Any = attrs.field(init=False, default=None)
    #: what to open: (ip, port, factory, purpose) each
    wanted: list[tuple[str, int, Any, str]] = attrs.field(init=False, factory=list)
    ports: list = attrs.field(init=False, factory=list)
    #: every listener is open (readiness reports a local workload whose listeners are not)
    listening: bool = attrs.field(init=False, default=False)
    _closed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self.hbone = InboundHBONE(self.context, self.workload, self.network)
        self.plaintext = InboundPlaintext(self.context, self.workload, self.network)
        settings = self.context.settings
        in_pod = not isinstance(self.network, HostNetwork)
        # A pod's namespace holds only its own addresses; its redirect rules send to them or to loopback.
        addresses = ["0.0.0.0"] if in_pod else [str(ip) for ip in self.workload.workload_ips]
        self.wanted = [(ip, settings.hbone_port, self.hbone.factory(), "HBONE inbound") for ip in addresses]
        if settings.plaintext_port is not None:
            self.wanted += [(ip, settings.plaintext_port, self.plaintext, "plaintext inbound") for ip in addresses]
        if in_pod and settings.pod_outbound_port is not None:
            self.redirect = self.outbound.redirect_factory(source=self.workload)
            self.wanted.append(("0.0.0.0", settings.pod_outbound_port, self.redirect, "redirected outbound"))

    def update(self, workload: Workload) -> None:
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
