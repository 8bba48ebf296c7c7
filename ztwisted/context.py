"""What the data path (inbound, outbound, the pool) needs of its node, typed, in one object."""

from __future__ import annotations

import random

import attrs
from twisted.internet.interfaces import IReactorTime

from ztwisted.ca import CertificateStore
from ztwisted.h2.connection import H2Settings
from ztwisted.metrics import Metrics
from ztwisted.model import Mesh, Workload
from ztwisted.network import HostNetwork, PodNetwork
from ztwisted.workloads import LocalWorkloads


@attrs.frozen
class NodeSettings:
    """The node's ports and timeouts, from the command line."""

    hbone_port: int = 15008
    plaintext_port: int | None = 15006
    #: in a pod's namespace, the redirected outbound port (15001); None: none
    pod_outbound_port: int | None = 15001
    connect_timeout: float = 10.0
    #: seconds without frames before a PING, and to wait for its answer
    keepalive: tuple[float, float] = (10.0, 20.0)

    @property
    def server_h2_settings(self) -> H2Settings:
        interval, timeout = self.keepalive
        return H2Settings.server(keepalive_interval=interval, keepalive_timeout=timeout)

    @property
    def client_h2_settings(self) -> H2Settings:
        interval, timeout = self.keepalive
        return H2Settings.client(keepalive_interval=interval, keepalive_timeout=timeout)


@attrs.define
class ProxyContext:
    """The shared parts of one node that its listeners and its pool work with."""

    reactor: IReactorTime
    metrics: Metrics
    certificates: CertificateStore
    workloads: LocalWorkloads
    settings: NodeSettings = attrs.field(factory=NodeSettings)
    #: every random choice the proxy makes (endpoints, jitter); seeded for reproducible runs
    random: random.Random = attrs.field(factory=random.Random)
    server_h2_settings: H2Settings = attrs.field(
        default=attrs.Factory(lambda self: self.settings.server_h2_settings, takes_self=True)
    )
    client_h2_settings: H2Settings = attrs.field(
        default=attrs.Factory(lambda self: self.settings.client_h2_settings, takes_self=True)
    )

    @property
    def mesh(self) -> Mesh:
        """The current configuration (it changes on a reload: read it per connection)."""
        return self.workloads.mesh

    @property
    def connect_timeout(self) -> float:
        return self.settings.connect_timeout

    @property
    def host_network(self) -> HostNetwork:
        return self.workloads.host_network

    def local_workload_by_ip(self, ip) -> Workload | None:
        return self.workloads.by_ip(ip)

    def network_of(self, workload: Workload) -> HostNetwork | PodNetwork:
        return self.workloads.network_of(workload)
