"""The mesh as ztwisted sees it: workloads, services, policies and lookups.

Plain immutable data. `ztwisted.config` builds it from YAML (and reports
problems with file positions); this module only offers construction helpers
and the lookups the proxy needs. Addresses form one flat space, whatever the
network; as in ztunnel, workloads may share an address (one is chosen), and a
VIP may be shared by services of different namespaces and be a workload's
address too (a connection to it goes to the service).
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from ztwisted.identity import DEFAULT_TRUST_DOMAIN, SpiffeId

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


K = TypeVar("K")
V = TypeVar("V")


class FrozenMap(Mapping[K, V]):
    """A read-only, hashable mapping (so frozen model objects stay hashable)."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._data: dict[K, V] = dict(data)
        self._hash: int | None = None

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    # The dict's own (read-only) views and lookups: Mapping's generic ones are Python code
    # over __iter__ and __getitem__, run for every tunnel (a workload's services and ports).
    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key, default=None):
        return self._data.get(key, default)

    def keys(self):
        return self._data.keys()

    def items(self):
        return self._data.items()

    def values(self):
        return self._data.values()

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


#: ``ipaddress.ip_address``, remembered: a node parses the same few addresses (its
#: workloads', its peers', their ports' authorities) several times for every connection,
#: and parsing was a visible part of a short connection's cost. Bounded; a string that
#: is not an address raises ValueError as before (and is not remembered).
parse_ip = functools.lru_cache(maxsize=4096)(ipaddress.ip_address)


def _ip(value: Any) -> IPAddress:
    return value if isinstance(value, (ipaddress.IPv4Address, ipaddress.IPv6Address)) else parse_ip(value)


def _ips(values: Iterable[Any]) -> tuple[IPAddress, ...]:
    return tuple(_ip(v) for v in values)


def _nets(values: Iterable[Any]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(v, strict=False) for v in values)


def _port_map(value: Mapping[int, int]) -> FrozenMap[int, int]:
    return value if isinstance(value, FrozenMap) else FrozenMap(value)


def _service_port_maps(value: Mapping[str, Mapping[int, int]]) -> FrozenMap[str, FrozenMap[int, int]]:
    return FrozenMap((key, _port_map(ports)) for key, ports in value.items())


def _vips(values: Iterable[Any]) -> tuple[tuple[str, IPAddress], ...]:
    """Accept (network, ip) pairs or bare IPs (network "")."""
    out = []
    for v in values:
        if isinstance(v, tuple):
            out.append((v[0], _ip(v[1])))
        else:
            out.append(("", _ip(v)))
    return tuple(out)


def _tuple(values: Iterable[Any]) -> tuple:
    return tuple(values)


# A connection asks for its workloads' identities several times; building (and validating)
# a SpiffeId each time was a visible part of its cost. Identities are immutable, so shared.
_spiffe_id = functools.lru_cache(maxsize=1024)(SpiffeId)


@attrs.frozen
class Workload:
    """One workload (a pod, in Kubernetes terms)."""

    uid: str
    name: str
    namespace: str
    service_account: str = "default"
    workload_ips: tuple[IPAddress, ...] = attrs.field(default=(), converter=_ips)
    protocol: str = "TCP"  # "HBONE" or "TCP"
    node: str = ""
    network: str = ""
    # "namespace/hostname" -> {service port: target port}
    services: FrozenMap[str, FrozenMap[int, int]] = attrs.field(factory=FrozenMap, converter=_service_port_maps)
    trust_domain: str = DEFAULT_TRUST_DOMAIN
    canonical_name: str = ""
    canonical_revision: str = ""
    status: str = "Healthy"  # "Healthy" or "Unhealthy"
    cluster_id: str = "Kubernetes"
    workload_name: str = ""
    workload_type: str = ""
    hostname: str = ""
    native_tunnel: bool = False
    network_mode: str = "Standard"  # "HostNetwork": its IPs are the node's, so nobody is found by them
    capacity: int = 1  # its weight among a service's endpoints
    # "namespace/name" keys of WorkloadSelector policies that select this workload
    authorization_policies: tuple[str, ...] = attrs.field(default=(), converter=_tuple)

    @property
    def identity(self) -> SpiffeId:
        return _spiffe_id(self.trust_domain or DEFAULT_TRUST_DOMAIN, self.namespace, self.service_account)

    @property
    def healthy(self) -> bool:
        return self.status == "Healthy"

    def ip_for(self, family_of: IPAddress | None = None) -> IPAddress | None:
        """The workload IP to dial: same family as `family_of` if possible."""
        if family_of is not None:
            for ip in self.workload_ips:
                if ip.version == family_of.version:
                    return ip
        return self.workload_ips[0] if self.workload_ips else None


@attrs.frozen
class Service:
    """A service: VIPs in front of the workloads that list it in `services`."""

    name: str
    namespace: str
    hostname: str
    vips: tuple[tuple[str, IPAddress], ...] = attrs.field(default=(), converter=_vips)
    ports: FrozenMap[int, int] = attrs.field(factory=FrozenMap, converter=_port_map)
    subject_alt_names: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    #: preferred among services sharing a hostname or VIP (see :func:`best_service`)
    canonical: bool = False
    visibility: str = "Public"  # "Public", or "Namespace": only clients in its namespace see it
    # ztunnel's loadBalancer: "Passthrough" sends connections to the VIP itself (no endpoint is
    # chosen); healthPolicy "AllowAll" makes unhealthy workloads endpoints too
    load_balancer_mode: str = "Standard"
    health_policy: str = "OnlyHealthy"
    # endpoints listed on the service itself: workload uid -> (service port -> target port, status)
    endpoints: FrozenMap[str, tuple[FrozenMap[int, int], str]] = attrs.field(
        factory=FrozenMap,
        converter=lambda value: FrozenMap((uid, (_port_map(ports), status)) for uid, (ports, status) in value.items()),
    )

    @property
    def key(self) -> str:
        """The "namespace/hostname" key workloads use to join this service."""
        return f"{self.namespace}/{self.hostname}"

    def visible_to(self, client_namespace: str | None) -> bool:
        return client_namespace is None or self.visibility != "Namespace" or self.namespace == client_namespace


def _address_rank(workload: Workload) -> tuple[bool, bool]:
    """Which of the workloads sharing an address it belongs to (ztunnel's ranking; higher wins)."""
    return "//Pod/" in workload.uid, workload.protocol == "HBONE"


def best_service(candidates: Iterable[Service], client_namespace: str | None = None) -> Service | None:
    """ztunnel's choice among services that share a hostname or a VIP (``ServiceMatch``).

    Services the client may not see are skipped; then one in the client's own
    namespace wins, else the last one marked ``canonical``, else the first.
    """
    chosen: Service | None = None
    for service in candidates:
        if not service.visible_to(client_namespace):
            continue
        if client_namespace is not None and service.namespace == client_namespace:
            return service
        if service.canonical or chosen is None:
            chosen = service
    return chosen


@attrs.frozen
class StringMatch:
    """One string matcher of a policy: exact, prefix, suffix or presence."""

    kind: str  # "exact" | "prefix" | "suffix" | "presence"
    value: str = ""

    @classmethod
    def parse(cls, pattern: str) -> StringMatch:
        """Istio's wildcard syntax: "*" (any non-empty), "abc*", "*abc", or exact."""
        if pattern == "*":
            return cls("presence")
        if pattern.endswith("*"):
            return cls("prefix", pattern[:-1])
        if pattern.startswith("*"):
            return cls("suffix", pattern[1:])
        return cls("exact", pattern)

    def matches(self, text: str) -> bool:
        if self.kind == "exact":
            return text == self.value
        if self.kind == "prefix":
            return text.startswith(self.value)
        if self.kind == "suffix":
            return text.endswith(self.value)
        return text != ""

    def __str__(self) -> str:
        return {"exact": "{}", "prefix": "{}*", "suffix": "*{}", "presence": "*"}[self.kind].format(self.value)


@attrs.frozen
class ServiceAccountMatch:
    namespace: str
    service_account: str


def _string_matches(values: Iterable[Any]) -> tuple[StringMatch, ...]:
    return tuple(v if isinstance(v, StringMatch) else StringMatch.parse(v) for v in values)


def _principal_matches(values: Iterable[Any]) -> tuple[StringMatch, ...]:
    return tuple(normalize_principal(v) for v in _string_matches(values))


def normalize_principal(match: StringMatch) -> StringMatch:
    """Principals are compared without "spiffe://" (as istiod sends them)."""
    if match.value.startswith("spiffe://"):
        return attrs.evolve(match, value=match.value.removeprefix("spiffe://"))
    return match


def _service_accounts(values: Iterable[Any]) -> tuple[ServiceAccountMatch, ...]:
    out = []
    for v in values:
        if isinstance(v, str):
            ns, _, sa = v.partition("/")
            v = ServiceAccountMatch(ns, sa)
        out.append(v)
    return tuple(out)


def _ports(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class Match:
    """All fields present must match (AND); within a field any value (OR).

    Each `not_` twin must match none of its values. Plain strings are accepted
    for convenience and read with Istio's wildcard syntax.
    """

    namespaces: tuple[StringMatch, ...] = attrs.field(default=(), converter=_string_matches)
    not_namespaces: tuple[StringMatch, ...] = attrs.field(default=(), converter=_string_matches)
    service_accounts: tuple[ServiceAccountMatch, ...] = attrs.field(default=(), converter=_service_accounts)
    not_service_accounts: tuple[ServiceAccountMatch, ...] = attrs.field(default=(), converter=_service_accounts)
    principals: tuple[StringMatch, ...] = attrs.field(default=(), converter=_principal_matches)
    not_principals: tuple[StringMatch, ...] = attrs.field(default=(), converter=_principal_matches)
    source_ips: tuple[IPNetwork, ...] = attrs.field(default=(), converter=_nets)
    not_source_ips: tuple[IPNetwork, ...] = attrs.field(default=(), converter=_nets)
    destination_ips: tuple[IPNetwork, ...] = attrs.field(default=(), converter=_nets)
    not_destination_ips: tuple[IPNetwork, ...] = attrs.field(default=(), converter=_nets)
    destination_ports: tuple[int, ...] = attrs.field(default=(), converter=_ports)
    not_destination_ports: tuple[int, ...] = attrs.field(default=(), converter=_ports)

    def is_empty(self) -> bool:
        return not any(attrs.astuple(self, recurse=False))


# rules: OR of clauses; clause: AND of match groups; match group: OR of Match.
MatchGroup = tuple[Match, ...]
Clause = tuple[MatchGroup, ...]
Rules = tuple[Clause, ...]


def _rules(value: Iterable[Iterable[Iterable[Match]]]) -> Rules:
    return tuple(tuple(tuple(group) for group in clause) for clause in value)


@attrs.frozen
class Policy:
    """An authorization policy (ztunnel's `Authorization`)."""

    name: str
    namespace: str
    scope: str  # "Global" | "Namespace" | "WorkloadSelector"
    action: str  # "Allow" | "Deny"
    rules: Rules = attrs.field(default=(), converter=_rules)
    dry_run: bool = False

    @property
    def key(self) -> str:
        """ "namespace/name", the key workloads' `authorizationPolicies` use."""
        return f"{self.namespace}/{self.name}"


@attrs.frozen
class Destination:
    """Where an outbound connection to (ip, port) should go.

    kind:
      "service"     ip was a service VIP; `workload` is the chosen endpoint and
                    (ip, port) its address and target port
      "workload"    ip was a workload's own address
      "passthrough" ip is not in the mesh, or is the VIP of a service in Passthrough
                    mode (`service`); (ip, port) is the original address
      "unroutable"  ip was a VIP but nothing can serve it; see `reason`
    """

    kind: str
    ip: IPAddress
    port: int
    workload: Workload | None = None
    service: Service | None = None
    reason: str = ""


@attrs.frozen
class MeshDiff:
    """What a reload changed, workloads compared by uid."""

    removed: tuple[Workload, ...]
    added: tuple[Workload, ...]
    changed: tuple[tuple[Workload, Workload], ...]  # (old, new)
    services_changed: bool
    policies_changed: bool

    def __bool__(self) -> bool:
        return bool(self.removed or self.added or self.changed or self.services_changed or self.policies_changed)


def unique_key(entry: Workload | Service | Policy) -> tuple[str, str]:
    """What no two entries of a mesh may share: a workload's uid, a service's or a policy's key.

    Nothing else is unique: as in ztunnel, workloads may share an address and
    services of different namespaces a VIP (see :class:`Mesh`). The local
    config's checks and the xDS client's both go by this.
    """
    if isinstance(entry, Workload):
        return "workload uid", entry.uid
    if isinstance(entry, Service):
        return "service", entry.key
    return "policy", entry.key


@attrs.frozen
class Mesh:
    """Everything the local configuration describes, with lookups.

    Construction checks uniqueness (uids, service keys, policy keys) and
    raises ValueError; `ztwisted.config` checks first, with file positions.
    """

    workloads: tuple[Workload, ...] = attrs.field(default=(), converter=_tuple)
    services: tuple[Service, ...] = attrs.field(default=(), converter=_tuple)
    policies: tuple[Policy, ...] = attrs.field(default=(), converter=_tuple)
    _by_uid: dict[str, Workload] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _by_ip: dict[IPAddress, Workload] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _by_vip: dict[IPAddress, list[Service]] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _by_key: dict[str, Service] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _by_hostname: dict[str, list[Service]] = attrs.field(init=False, eq=False, repr=False, hash=False)
    _policies_by_key: dict[str, Policy] = attrs.field(init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        seen: set[tuple[str, str]] = set()
        for entry in (*self.workloads, *self.services, *self.policies):
            kind, key = unique_key(entry)
            if (kind, key) in seen:
                raise ValueError(f"duplicate {kind} {key!r}")
            seen.add((kind, key))
        by_uid: dict[str, Workload] = {}
        by_ip: dict[IPAddress, Workload] = {}
        for w in self.workloads:
            by_uid[w.uid] = w
            if w.network_mode == "HostNetwork":
                continue  # ztunnel does not index them by address either
            for ip in w.workload_ips:
                # Several may share an address; ztunnel's choice: a Kubernetes pod, in HBONE, the last.
                if ip not in by_ip or _address_rank(w) >= _address_rank(by_ip[ip]):
                    by_ip[ip] = w
        by_vip: dict[IPAddress, list[Service]] = {}
        by_key: dict[str, Service] = {}
        by_hostname: dict[str, list[Service]] = {}
        for s in self.services:
            by_key[s.key] = s
            by_hostname.setdefault(s.hostname, []).append(s)
            for _network, ip in s.vips:
                # Services may share a VIP, as in ztunnel: one per namespace (a later one takes
                # the earlier one's place); best_service chooses for each client.
                sharing = by_vip.setdefault(ip, [])
                same_namespace = [k for k, other in enumerate(sharing) if other.namespace == s.namespace]
                if same_namespace:
                    sharing[same_namespace[0]] = s
                else:
                    sharing.append(s)
        policies: dict[str, Policy] = {}
        for p in self.policies:
            policies[p.key] = p
        object.__setattr__(self, "_by_uid", by_uid)
        object.__setattr__(self, "_by_ip", by_ip)
        object.__setattr__(self, "_by_vip", by_vip)
        object.__setattr__(self, "_by_key", by_key)
        object.__setattr__(self, "_by_hostname", by_hostname)
        object.__setattr__(self, "_policies_by_key", policies)

    def workload_by_ip(self, ip: IPAddress | str) -> Workload | None:
        return self._by_ip.get(_ip(ip))

    def workload_by_uid(self, uid: str) -> Workload | None:
        return self._by_uid.get(uid)

    def service_by_vip(self, ip: IPAddress | str, client_namespace: str | None = None) -> Service | None:
        """The service at VIP `ip`; several may share it: the best for a client in `client_namespace`."""
        return best_service(self._by_vip.get(_ip(ip), ()), client_namespace)

    def service_by_hostname(
        self, hostname: str, namespace: str | None = None, client_namespace: str | None = None
    ) -> Service | None:
        """The service with that hostname in `namespace`, if given; else the best for a client in
        `client_namespace` among those sharing the hostname (see :func:`best_service`)."""
        if namespace is not None:
            return self._by_key.get(f"{namespace}/{hostname}")
        return best_service(self._by_hostname.get(hostname, ()), client_namespace)

    def policy(self, key: str) -> Policy | None:
        """The policy with key "namespace/name"."""
        return self._policies_by_key.get(key)

    def local_workloads(self, node: str | None) -> tuple[Workload, ...]:
        """Workloads this node serves. No node given (None or "") means all.

        A ``HostNetwork`` workload is never one: its addresses are its node's,
        and it is outside the mesh's capture (as in ztunnel).
        """
        return tuple(w for w in self.workloads if (not node or w.node == node) and w.network_mode != "HostNetwork")

    def endpoints(self, service: Service, service_port: int | None = None) -> list[tuple[Workload, int]]:
        """Healthy workloads behind `service`, each with its target port.

        `service_port` defaults to the service's first declared port. The
        target port comes from the workload's own port map for the service,
        else from the service's. A port the service does not declare has no
        endpoints.
        """
        if service_port is None:
            if not service.ports:
                return []
            service_port = next(iter(service.ports))
        if service_port not in service.ports:
            return []
        out = []
        for w in self.workloads:
            ports = w.services.get(service.key)
            healthy = w.healthy or service.health_policy == "AllowAll"
            if ports is None and w.uid in service.endpoints:
                # Listed by the service itself (ztunnel's `endpoints`): ztunnel uses such an
                # endpoint whatever its status says (it filters by health only the ones that
                # workloads bring), and so does ztwisted.
                ports, healthy = service.endpoints[w.uid][0], True
            if ports is None or not healthy or not w.workload_ips:
                continue
            out.append((w, ports.get(service_port, service.ports[service_port])))
        return out

    def resolve(
        self,
        ip: IPAddress | str,
        port: int,
        choice: Callable[[Sequence[tuple[Workload, int]]], tuple[Workload, int]] = random.choice,
        client_namespace: str | None = None,
    ) -> Destination:
        """Where a connection to ip:port from a client in `client_namespace` goes: a service endpoint,
        a workload, or out."""
        ip = _ip(ip)
        service = self.service_by_vip(ip, client_namespace)
        if service is not None:
            if service.load_balancer_mode == "Passthrough":
                return Destination("passthrough", ip, port, service=service)
            if port not in service.ports:
                return Destination(
                    "unroutable", ip, port, service=service, reason=f"service {service.hostname} has no port {port}"
                )
            # ztunnel weighs endpoints by capacity: one with capacity 0 is never chosen.
            endpoints = [e for e in self.endpoints(service, port) if e[0].capacity > 0]
            if not endpoints:
                return Destination(
                    "unroutable",
                    ip,
                    port,
                    service=service,
                    reason=f"service {service.hostname} has no healthy endpoints",
                )
            workload, target_port = _weighted(endpoints, choice)
            return Destination("service", workload.ip_for(ip), target_port, workload=workload, service=service)
        workload = self._by_ip.get(ip)
        if workload is not None:
            return Destination("workload", ip, port, workload=workload)
        return Destination("passthrough", ip, port)


def _weighted(
    endpoints: Sequence[tuple[Workload, int]], choice: Callable[[Sequence[Any]], Any]
) -> tuple[Workload, int]:
    """One endpoint, with a chance in proportion to its workload's capacity (ztunnel's rule)."""
    capacities = [workload.capacity for workload, _ in endpoints]
    if len(set(capacities)) == 1:
        return choice(endpoints)
    cumulative = list(itertools.accumulate(capacities))
    return endpoints[bisect.bisect_right(cumulative, choice(range(cumulative[-1])))]


def diff(old: Mesh, new: Mesh) -> MeshDiff:
    """Workloads removed, added and changed (by uid) from `old` to `new`."""
    old_by_uid = {w.uid: w for w in old.workloads}
    new_by_uid = {w.uid: w for w in new.workloads}
    return MeshDiff(
        removed=tuple(w for uid, w in old_by_uid.items() if uid not in new_by_uid),
        added=tuple(w for uid, w in new_by_uid.items() if uid not in old_by_uid),
        changed=tuple(
            (w, new_by_uid[uid]) for uid, w in old_by_uid.items() if uid in new_by_uid and new_by_uid[uid] != w
        ),
        services_changed=old.services != new.services,
        policies_changed=old.policies != new.policies,
    )
