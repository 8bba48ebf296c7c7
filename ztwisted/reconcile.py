"""A reloaded configuration, applied to a running node: which workloads come, change and go."""

from __future__ import annotations

import attrs

from ztwisted.interfaces import IDrainEvents
from ztwisted.model import Mesh, diff
from ztwisted.node import Node


@attrs.define
class MeshReconciler:
    """Switches the node to a new mesh; a removed or changed local workload is a *pod removed*
    event, a removed remote one a *destination removed* event (both raised on ``events``).

    While the proxy is stopping, it opens no listener: a removed workload that a
    reload brings back, or a new one, stays closed.
    """

    node: Node
    events: IDrainEvents

    def apply_mesh(self, mesh: Mesh) -> None:
        workloads = self.node.workloads
        old_local = {w.uid: w for w in workloads.all()}
        changes = diff(workloads.mesh, mesh)
        workloads.replace_mesh(mesh)
        if not self.node.running:
            return
        if not workloads.inpod:  # in-pod, local pods come and go through the node agent, not the file
            self._reconcile_local(old_local, changes)
        for workload in changes.removed:
            if workload.uid not in old_local:
                self.events.destination_removed(workload)

    def _reconcile_local(self, old_local: dict, changes) -> None:
        workloads = self.node.workloads
        new_local = {w.uid: w for w in workloads.all()}
        changed = {old.uid for old, _ in changes.changed}
        for old, new in changes.changed:
            if old.uid in old_local:
                self.events.pod_removed(old, forget=False).addCallback(lambda _, uid=new.uid: self._restart(uid))
        for uid, workload in old_local.items():
            if uid not in new_local and uid not in changed:
                # If a later reload brings it back before its listeners are closed, they reopen then.
                self.events.pod_removed(workload).addCallback(lambda _, uid=uid: self._restart(uid))
        workloads.end_withdrawals()
        self._start([w for uid, w in new_local.items() if uid not in self.node.listeners and uid not in changed])

    def _restart(self, uid: str) -> None:
        workload = next((w for w in self.node.workloads.all() if w.uid == uid), None)
        if workload is not None and uid not in self.node.listeners:
            self._start([workload])

    def _start(self, workloads) -> None:
        if self.events.stopping:
            return  # the proxy is draining: it opens nothing new
        self.node.start_listeners(workloads)
