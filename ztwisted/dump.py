"""``/config_dump``: the node's configuration and state as JSON-ready data."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ztwisted.node import Node
from ztwisted.view import NodeView


@attrs.define
class ConfigDump:
    """Workloads, services, policies, the pool, inbound connections and certificates, plus extra sections."""

    node: Node
    view: NodeView
    node_name: str | None
    config_source: str = "<built-in example>"
    #: extra sections: name -> callable returning JSON-ready data (e.g. the node agent's status)
    sections: dict[str, Callable[[], object]] = attrs.field(factory=dict)

    def __call__(self) -> dict:
        mesh = self.node.workloads.mesh
        local_workloads = self.node.workloads.all()
        local = {w.uid for w in local_workloads}
        # In-pod: pods served under a uid the configuration lacks (added before discovery knew them,
        # or found there by name, namespace and service account) are listed too.
        undiscovered = [w for w in local_workloads if mesh.workload_by_uid(w.uid) is None]
        return {
            "node": self.node_name,
            "config_source": self.config_source,
            "workloads": [_workload_dump(w, w.uid in local) for w in (*mesh.workloads, *undiscovered)],
            "services": [_service_dump(s, mesh) for s in mesh.services],
            "policies": [
                {"name": p.name, "namespace": p.namespace, "scope": p.scope, "action": p.action} for p in mesh.policies
            ],
            "pool": self.node.outbound.pool.snapshot(),
            "inbound": [
                {
                    "workload": listeners.workload.name,
                    "connections": len(self.view.inbound_connections(listeners.workload)),
                }
                for listeners in self.node.listeners.values()
            ],
            "certificates": [_certificate_dump(c) for c in self.node.context.certificates.all()],
            **{name: section() for name, section in self.sections.items()},
        }


def _certificate_dump(certificate) -> dict:
    return {
        "identity": str(certificate.identity),
        "serial": format(certificate.certificate().serial_number, "x"),
        "not_before": certificate.not_before.isoformat(),
        "expiration": certificate.not_after.isoformat(),
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
                "workloadUid": workload.uid,
                "port": {str(k): v for k, v in ports.items()},
                "status": workload.status,
            }
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
