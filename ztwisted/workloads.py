"""Which workloads this node serves, and where each one's sockets live."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ztwisted.model import Mesh, Workload
from ztwisted.network import HostNetwork, PodNetwork


@attrs.define
class LocalWorkloads:
    """The node's view of the mesh: the current configuration, and which of its workloads are local.

    In local-config mode the local workloads are those the configuration
    places on ``node_name``; in in-pod mode they are the pods the node agent
    added (:meth:`add_pod`), each with its own network namespace.
    """

    mesh: Mesh
    node_name: str | None
    host_network: HostNetwork
    inpod: bool = False
    _pods: dict[str, Workload] = attrs.field(factory=dict)
    _networks: dict[str, PodNetwork] = attrs.field(factory=dict)
    _removed_uids: set[str] = attrs.field(factory=set)
    _by_ip: dict[str, Workload] | None = None
    #: called whenever the local workloads may have changed (e.g. to request their certificates)
    on_local_workloads_changed: list[Callable[[], object]] = attrs.field(factory=list)
    #: told of every new configuration (``observer(mesh)``), once it is the current one
    on_mesh_replaced: list[Callable[[Mesh], object]] = attrs.field(factory=list)

    def all(self) -> tuple[Workload, ...]:
        if self.inpod:
            return tuple(self._pods.values())
        return tuple(w for w in self.mesh.local_workloads(self.node_name) if w.uid not in self._removed_uids)

    def by_ip(self, ip) -> Workload | None:
        """The local workload with address ``ip`` (a string), if any; looked up per connection."""
        if self._by_ip is None:
            self._by_ip = {str(address): w for w in self.all() for address in w.workload_ips}
        return self._by_ip.get(str(ip))

    def find(self, uid_or_name: str) -> Workload | None:
        """A local workload by uid, or by ``name`` / ``namespace/name``."""
        for workload in self.all():
            if uid_or_name in (workload.uid, workload.name, f"{workload.namespace}/{workload.name}"):
                return workload
        return None

    def network_of(self, workload: Workload) -> HostNetwork | PodNetwork:
        """Where ``workload``'s sockets live: its pod's network namespace, or the host's."""
        return self._networks.get(workload.uid, self.host_network)

    def add_pod(self, workload: Workload, network: PodNetwork) -> None:
        self._pods[workload.uid] = workload
        self._networks[workload.uid] = network
        self._changed()

    def update_pod(self, workload: Workload) -> bool:
        """What discovery says of a served pod changed; False if it is not served (any more)."""
        if workload.uid not in self._pods:
            return False
        self._pods[workload.uid] = workload
        self._changed()
        return True

    def withdraw(self, workload: Workload) -> None:
        """No longer local from now on (a pod being removed); its pod network stays until :meth:`forget`.

        In in-pod mode nothing is recorded: the node agent's pods are the local
        ones and a removed pod is listed until :meth:`forget`. A record there
        would never end (only a reloaded configuration ends withdrawals, and
        pods come and go without the configuration listing them), and would grow
        with every pod the node ever served.
        """
        if not self.inpod:
            self._removed_uids.add(workload.uid)
        self._changed()

    def forget(self, workload: Workload) -> PodNetwork | None:
        """Drop an in-pod workload; returns its network, which the caller closes."""
        if self._pods.pop(workload.uid, None) is None:
            return None
        self._changed()
        return self._networks.pop(workload.uid, None)

    def replace_mesh(self, mesh: Mesh) -> None:
        """A reloaded configuration (withdrawn workloads stay withdrawn until :meth:`end_withdrawals`)."""
        self.mesh = mesh
        self._changed()
        for observer in self.on_mesh_replaced:
            observer(mesh)

    def end_withdrawals(self) -> None:
        """A workload withdrawn while the configuration listed it (by the admin API) stays
        withdrawn; once the configuration drops it, adding it back serves it again."""
        self._removed_uids &= {w.uid for w in self.mesh.workloads}
        self._changed()

    def _changed(self) -> None:
        self._by_ip = None
        for hook in self.on_local_workloads_changed:
            hook()
