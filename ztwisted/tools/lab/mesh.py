"""The lab's mesh: addresses, and the local-config YAML each node reads (its "discovery").

Node A and node B read separate files, so discovery can change for one node
alone: marking B1 not ready is news for A's load balancing only, while node B
keeps serving it until it is deleted.
"""

from __future__ import annotations

import os
from pathlib import Path

import attr
import yaml

SERVICE_HOST = "echo.default.svc.cluster.local"
SERVICE_PORT = 80
APP_PORT = 8080


@attr.s(frozen=True)
class Addresses:
    """Everything lives in 127.<net>.0.0/16."""

    net: int = attr.ib(default=91)

    @net.validator
    def _check(self, _, value):
        if not 1 <= value <= 254:
            raise ValueError(f"--net must be 1..254 (addresses are 127.<net>.x.y), not {value}")

    def _ip(self, c: int, d: int) -> str:
        return f"127.{self.net}.{c}.{d}"

    @property
    def network(self) -> str:
        return f"127.{self.net}.0.0/16"

    @property
    def pool_client(self) -> str:
        return self._ip(2, 1)

    @property
    def request_client(self) -> str:
        return self._ip(2, 2)

    @property
    def b1(self) -> str:
        return self._ip(3, 1)

    @property
    def b2(self) -> str:
        return self._ip(3, 2)

    @property
    def vip(self) -> str:
        return self._ip(10, 1)

    @property
    def node_a(self) -> str:
        return self._ip(2, 254)

    @property
    def node_b(self) -> str:
        return self._ip(3, 254)


def _workload(name: str, ip: str, node: str, *, server: bool = False, healthy: bool = True) -> dict:
    workload = {
        "uid": f"lab//v1/Pod/default/{name}",
        "name": name,
        "namespace": "default",
        # Explicit: ztunnel takes a missing trust domain as an empty one (spiffe:///ns/...), ztwisted as cluster.local.
        "trustDomain": "cluster.local",
        "serviceAccount": "echo" if server else "client",
        "workloadIps": [ip],
        "protocol": "HBONE",
        "node": node,
        "workloadName": "echo" if server else name,
        "canonicalName": "echo" if server else name,
    }
    # ztunnel's local config requires the field on every workload, ztwisted's does not.
    workload["services"] = {f"default/{SERVICE_HOST}": {SERVICE_PORT: APP_PORT}} if server else {}
    if not healthy:
        workload["status"] = "Unhealthy"
    return workload


def mesh_document(addresses: Addresses, *, b1: str = "ready") -> dict:
    """The mesh with B1 ``ready``, ``unready`` (an endpoint no more) or ``gone``."""
    workloads = [
        _workload("client-pool", addresses.pool_client, "node-a"),
        _workload("client-req", addresses.request_client, "node-a"),
    ]
    if b1 != "gone":
        workloads.append(_workload("b1", addresses.b1, "node-b", server=True, healthy=b1 == "ready"))
    workloads.append(_workload("b2", addresses.b2, "node-b", server=True))
    return {
        "workloads": workloads,
        "services": [
            {
                "name": "echo",
                "namespace": "default",
                "hostname": SERVICE_HOST,
                "vips": [f"/{addresses.vip}"],
                "ports": {SERVICE_PORT: APP_PORT},
            }
        ],
    }


def write_mesh(path: Path, addresses: Addresses, *, b1: str = "ready") -> None:
    """Replace the file by rename, as a ConfigMap update does (one inotify event, never half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(yaml.safe_dump(mesh_document(addresses, b1=b1), sort_keys=False))
    os.replace(temporary, path)
