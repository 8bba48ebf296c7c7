"""xDS resources <-> the domain model (``ztwisted.model``).

The proxy reads ``istio.workload.Address`` (a workload or a service) and
``istio.security.Authorization`` resources into the same model objects the
local config builds; the lab control plane turns a model back into
resources. A resource ztwisted cannot honour is an :class:`InvalidResource`
naming the field, which the xDS client NACKs.
"""

from __future__ import annotations

import ipaddress

from ztwisted.identity import DEFAULT_TRUST_DOMAIN
from ztwisted.model import Match, Mesh, Policy, Service, ServiceAccountMatch, StringMatch, Workload
from ztwisted.xds import authorization_pb2, workload_pb2

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE = "type.googleapis.com/istio.security.Authorization"

_SCOPES = {
    authorization_pb2.GLOBAL: "Global",
    authorization_pb2.NAMESPACE: "Namespace",
    authorization_pb2.WORKLOAD_SELECTOR: "WorkloadSelector",
}
_ACTIONS = {authorization_pb2.ALLOW: "Allow", authorization_pb2.DENY: "Deny"}
_PROTOCOLS = {workload_pb2.NONE: "TCP", workload_pb2.HBONE: "HBONE"}


# Resources are kept by their xDS name, as ztunnel keeps them (istiod names a workload by its uid,
# a service "namespace/hostname", a policy "namespace/name"); the name is not checked against the content.


class InvalidResource(ValueError):
    """A resource the proxy rejects; ``str()`` names the resource and the field."""


def _ip(data: bytes, where: str):
    if len(data) not in (4, 16):
        raise InvalidResource(f"{where}: {len(data)} bytes is not an IPv4 (4) or IPv6 (16) address")
    return ipaddress.ip_address(data)


# -- resources -> model ----------------------------------------------------------


def workload_from_proto(w: workload_pb2.Workload, name: str = "") -> Workload:
    where = f"workload {w.uid or name or w.name!r}"
    if not w.uid:
        raise InvalidResource(f"{where}: uid is empty")
    if not w.name or not w.namespace:
        raise InvalidResource(f"{where}: name and namespace are required")
    for field in ("waypoint", "network_gateway", "application_tunnel"):
        if w.HasField(field):
            raise InvalidResource(f"{where}: {field} is not supported by ztwisted")
    if w.tunnel_protocol not in _PROTOCOLS:
        raise InvalidResource(
            f"{where}: tunnel_protocol {workload_pb2.TunnelProtocol.Name(w.tunnel_protocol)} is not supported"
        )
    ips = [_ip(address, f"{where}: addresses[{i}]") for i, address in enumerate(w.addresses)]
    if w.network_mode == workload_pb2.HOST_NETWORK:
        # Host-network pods share their node's address, which ztunnel does not look them up by; in
        # ztwisted's model an address belongs to one workload, so they come without one (and so are
        # no service endpoint here, a known difference).
        ips = []
    services = {}
    for key, port_list in w.services.items():
        if "/" not in key:
            raise InvalidResource(f"{where}: services key {key!r} is not namespace/hostname")
        services[key] = {p.service_port: p.target_port for p in port_list.ports}
    return Workload(
        uid=w.uid,
        name=w.name,
        namespace=w.namespace,
        service_account=w.service_account or "default",
        workload_ips=ips,
        protocol=_PROTOCOLS[w.tunnel_protocol],
        node=w.node,
        network=w.network,
        services=services,
        trust_domain=w.trust_domain or DEFAULT_TRUST_DOMAIN,
        canonical_name=w.canonical_name,
        canonical_revision=w.canonical_revision,
        status="Healthy" if w.status == workload_pb2.HEALTHY else "Unhealthy",
        cluster_id=w.cluster_id or "Kubernetes",
        workload_name=w.workload_name,
        workload_type=workload_pb2.WorkloadType.Name(w.workload_type).lower(),
        hostname=w.hostname,
        native_tunnel=w.native_tunnel,
        authorization_policies=tuple(w.authorization_policies),
    )


def service_from_proto(s: workload_pb2.Service, name: str = "") -> Service:
    where = f"service {s.namespace}/{s.hostname}"
    if not s.hostname or not s.namespace:
        raise InvalidResource(f"service {name!r}: hostname and namespace are required")
    if s.HasField("waypoint") or s.weighted_waypoints:
        raise InvalidResource(f"{where}: waypoint is not supported by ztwisted")
    vips = [(a.network, _ip(a.address, f"{where}: addresses[{i}]")) for i, a in enumerate(s.addresses)]
    ports = {}
    for i, port in enumerate(s.ports):
        if not 0 < port.service_port < 65536 or not 0 <= port.target_port < 65536:
            raise InvalidResource(f"{where}: ports[{i}]: {port.service_port}->{port.target_port} is not a port mapping")
        ports[port.service_port] = port.target_port
    return Service(
        name=s.name,
        namespace=s.namespace,
        hostname=s.hostname,
        vips=vips,
        ports=ports,
        subject_alt_names=tuple(s.subject_alt_names),
    )


def address_from_proto(address: workload_pb2.Address, name: str) -> Workload | Service:
    kind = address.WhichOneof("type")
    if kind == "workload":
        return workload_from_proto(address.workload, name)
    if kind == "service":
        return service_from_proto(address.service, name)
    raise InvalidResource(f"address {name!r}: neither a workload nor a service")


def _string_match(m: authorization_pb2.StringMatch) -> StringMatch:
    kind = m.WhichOneof("match_type")
    if kind is None:
        raise InvalidResource("an empty string match")
    return StringMatch(kind, "" if kind == "presence" else getattr(m, kind))


def _cidr(a: authorization_pb2.Address, where: str):
    ip = _ip(a.address, where)
    try:
        return ipaddress.ip_network(f"{ip}/{a.length}", strict=False)
    except ValueError as e:
        raise InvalidResource(f"{where}: {e}") from None


def _match_from_proto(m: authorization_pb2.Match, where: str) -> Match:
    if m.extensions:
        raise InvalidResource(f"{where}: extensions are not supported by ztwisted")
    return Match(
        namespaces=[_string_match(x) for x in m.namespaces],
        not_namespaces=[_string_match(x) for x in m.not_namespaces],
        service_accounts=[ServiceAccountMatch(x.namespace, x.serviceAccount) for x in m.service_accounts],
        not_service_accounts=[ServiceAccountMatch(x.namespace, x.serviceAccount) for x in m.not_service_accounts],
        principals=[_string_match(x) for x in m.principals],
        not_principals=[_string_match(x) for x in m.not_principals],
        source_ips=[_cidr(x, f"{where}.source_ips") for x in m.source_ips],
        not_source_ips=[_cidr(x, f"{where}.not_source_ips") for x in m.not_source_ips],
        destination_ips=[_cidr(x, f"{where}.destination_ips") for x in m.destination_ips],
        not_destination_ips=[_cidr(x, f"{where}.not_destination_ips") for x in m.not_destination_ips],
        destination_ports=list(m.destination_ports),
        not_destination_ports=list(m.not_destination_ports),
    )


def policy_from_proto(a: authorization_pb2.Authorization, name: str = "") -> Policy:
    where = f"authorization {a.namespace}/{a.name}"
    if not a.name:
        raise InvalidResource(f"authorization {name!r}: name is empty")
    if a.scope not in _SCOPES:
        raise InvalidResource(f"{where}: unknown scope {a.scope}")
    if a.action not in _ACTIONS:
        raise InvalidResource(f"{where}: unknown action {a.action}")
    if a.extensions:
        raise InvalidResource(f"{where}: extensions are not supported by ztwisted")
    rules = []
    for r, rule in enumerate(a.rules):
        clauses = []
        for c, clause in enumerate(rule.clauses):
            clauses.append(
                tuple(
                    _match_from_proto(m, f"{where}: rules[{r}].clauses[{c}].matches[{i}]")
                    for i, m in enumerate(clause.matches)
                )
            )
        rules.append(tuple(clauses))
    return Policy(
        name=a.name,
        namespace=a.namespace,
        scope=_SCOPES[a.scope],
        action=_ACTIONS[a.action],
        rules=rules,
        dry_run=a.dry_run,
    )


# -- model -> resources (the lab control plane) ------------------------------------


def workload_to_proto(w: Workload) -> workload_pb2.Workload:
    message = workload_pb2.Workload(
        uid=w.uid,
        name=w.name,
        namespace=w.namespace,
        service_account=w.service_account,
        addresses=[ip.packed for ip in w.workload_ips],
        tunnel_protocol=workload_pb2.HBONE if w.protocol == "HBONE" else workload_pb2.NONE,
        node=w.node,
        network=w.network,
        trust_domain=w.trust_domain,
        canonical_name=w.canonical_name,
        canonical_revision=w.canonical_revision,
        status=workload_pb2.HEALTHY if w.healthy else workload_pb2.UNHEALTHY,
        cluster_id=w.cluster_id,
        workload_name=w.workload_name,
        hostname=w.hostname,
        native_tunnel=w.native_tunnel,
        authorization_policies=list(w.authorization_policies),
    )
    if w.workload_type.upper() in workload_pb2.WorkloadType.keys():
        message.workload_type = workload_pb2.WorkloadType.Value(w.workload_type.upper())
    for key, ports in w.services.items():
        message.services[key].ports.extend(
            workload_pb2.Port(service_port=sp, target_port=tp) for sp, tp in ports.items()
        )
    return message


def service_to_proto(s: Service) -> workload_pb2.Service:
    return workload_pb2.Service(
        name=s.name,
        namespace=s.namespace,
        hostname=s.hostname,
        addresses=[workload_pb2.NetworkAddress(network=network, address=ip.packed) for network, ip in s.vips],
        ports=[workload_pb2.Port(service_port=sp, target_port=tp) for sp, tp in s.ports.items()],
        subject_alt_names=list(s.subject_alt_names),
    )


def _string_match_to_proto(m: StringMatch) -> authorization_pb2.StringMatch:
    if m.kind == "presence":
        message = authorization_pb2.StringMatch()
        message.presence.SetInParent()
        return message
    return authorization_pb2.StringMatch(**{m.kind: m.value})


def _cidrs_to_proto(networks) -> list[authorization_pb2.Address]:
    return [authorization_pb2.Address(address=n.network_address.packed, length=n.prefixlen) for n in networks]


def _match_to_proto(m: Match) -> authorization_pb2.Match:
    return authorization_pb2.Match(
        namespaces=[_string_match_to_proto(x) for x in m.namespaces],
        not_namespaces=[_string_match_to_proto(x) for x in m.not_namespaces],
        service_accounts=[
            authorization_pb2.ServiceAccountMatch(namespace=x.namespace, serviceAccount=x.service_account)
            for x in m.service_accounts
        ],
        not_service_accounts=[
            authorization_pb2.ServiceAccountMatch(namespace=x.namespace, serviceAccount=x.service_account)
            for x in m.not_service_accounts
        ],
        principals=[_string_match_to_proto(x) for x in m.principals],
        not_principals=[_string_match_to_proto(x) for x in m.not_principals],
        source_ips=_cidrs_to_proto(m.source_ips),
        not_source_ips=_cidrs_to_proto(m.not_source_ips),
        destination_ips=_cidrs_to_proto(m.destination_ips),
        not_destination_ips=_cidrs_to_proto(m.not_destination_ips),
        destination_ports=list(m.destination_ports),
        not_destination_ports=list(m.not_destination_ports),
    )


def policy_to_proto(p: Policy) -> authorization_pb2.Authorization:
    scopes = {v: k for k, v in _SCOPES.items()}
    actions = {v: k for k, v in _ACTIONS.items()}
    return authorization_pb2.Authorization(
        name=p.name,
        namespace=p.namespace,
        scope=scopes[p.scope],
        action=actions[p.action],
        dry_run=p.dry_run,
        rules=[
            authorization_pb2.Rule(
                clauses=[authorization_pb2.Clause(matches=[_match_to_proto(m) for m in group]) for group in clause]
            )
            for clause in p.rules
        ],
    )


def mesh_resources(mesh: Mesh) -> dict[str, dict[str, object]]:
    """type URL -> resource name -> message, as istiod would name them."""
    addresses: dict[str, object] = {}
    for w in mesh.workloads:
        addresses[w.uid] = workload_pb2.Address(workload=workload_to_proto(w))
    for s in mesh.services:
        addresses[s.key] = workload_pb2.Address(service=service_to_proto(s))
    policies = {p.key: policy_to_proto(p) for p in mesh.policies}
    return {ADDRESS_TYPE: addresses, AUTHORIZATION_TYPE: policies}
