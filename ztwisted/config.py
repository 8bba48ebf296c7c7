"""Read ztunnel's local configuration YAML (`LOCAL_XDS_PATH`) into a `Mesh`.

The format follows ztunnel's `LocalConfig`: top-level `workloads`, `services`,
`policies`; camelCase keys; unknown keys are errors. Every problem in a file is
reported, one per line, each as `<file>: <path.to.field>: <message>` (YAML
syntax errors put `line L, column C` in the path's place). Checks across
entries (duplicate uids or IPs, references to services and policies) run
once every entry is valid by itself.

ztunnel's fields are all accepted; those ztwisted does not implement are
checked and then dropped (marked below). Files ztunnel accepts are accepted;
what is likely a mistake (duplicate keys, shared addresses, references to
entries the file lacks) gets ztunnel's meaning and a logged warning with its
position. Where ztwisted is stricter or kinder than ztunnel
(docs/configuration.rst lists it for users):
  - `uid` may be omitted: it defaults to `<clusterId>//v1/Pod/<namespace>/<name>`;
  - unknown keys in a policy match are errors (ztunnel ignores them);
  - namespaces, service accounts and trust domains must fit in a SPIFFE ID;
  - policy string matches may be written as Istio patterns ("abc*", "*abc",
    "*"), as `{Exact: ...}`/`{Prefix: ...}`/... maps, or with ztunnel's
    `!Exact`/`!Prefix`/`!Suffix`/`!Presence` tags; principals may carry the
    `spiffe://` prefix or not.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Callable, Hashable
from importlib import resources
from typing import Any

import attrs
import yaml
from twisted.internet import inotify
from twisted.logger import Logger
from twisted.python.filepath import FilePath

from ztwisted.identity import InvalidSpiffeId, SpiffeId
from ztwisted.model import (
    Match,
    Mesh,
    Policy,
    Service,
    ServiceAccountMatch,
    StringMatch,
    Workload,
    normalize_principal,
    unique_key,
)

__all__ = [
    "ConfigError",
    "ConfigWatcher",
    "EmptyConfigError",
    "Problem",
    "builtin_example_path",
    "load_config",
    "parse_config",
]


log = Logger(namespace="ztwisted.config")


@attrs.frozen
class Problem:
    path: str
    message: str


class ConfigError(Exception):
    """A configuration file that cannot be used; str() lists every problem."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {p.path}: {p.message}" for p in self.problems))


class EmptyConfigError(ConfigError):
    """A file without a YAML document: empty, blank or only comments.

    Never an empty mesh (that is ``workloads: []``): an empty file is far more
    often one that a writer has truncated and not written yet.
    """

    def __init__(self, source: str) -> None:
        super().__init__(
            source,
            [
                Problem(
                    "(file)",
                    "no YAML document (the file is empty or holds only comments); "
                    "a mesh without workloads is written `workloads: []`",
                )
            ],
        )


def builtin_example_path() -> str:
    """Path of the example mesh shipped with ztwisted (used without --config)."""
    return str(resources.files("ztwisted") / "examples" / "mesh.yaml")


def load_config(path: str | os.PathLike[str]) -> Mesh:
    """Read and check the file at `path`; raises ConfigError (named as given)."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(source, [Problem("(file)", f"cannot read: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        raise ConfigError(source, [Problem("(file)", f"not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    return parse_config(text, source)


def parse_config(text: str, source: str = "<string>") -> Mesh:
    """Check YAML text and build the Mesh; raises ConfigError."""
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(source, [_yaml_problem(e)]) from None
    if data is None:
        raise EmptyConfigError(source)
    reader = _Reader()
    mesh = reader.mesh(data)
    if reader.problems:
        raise ConfigError(source, reader.problems)
    for warning in reader.warnings:
        log.warn("{source}: {path}: {message}", source=source, path=warning.path, message=warning.message)
    assert mesh is not None
    return mesh


# --- YAML -------------------------------------------------------------------


@attrs.frozen
class _Tagged:
    """A `!Exact`-style tagged scalar, as serde_yaml writes enum variants."""

    tag: str
    value: Any


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                continue  # unhashable; the base class reports it
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# ztunnel reads YAML 1.2 (serde_yaml): only true and false are booleans, so `name: no` or
# `namespace: on` are strings there. PyYAML follows YAML 1.1 (yes/no/on/off too); use 1.2's rule.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _tagged(tag: str) -> Callable[[yaml.SafeLoader, yaml.Node], _Tagged]:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> _Tagged:
        if isinstance(node, yaml.ScalarNode):
            return _Tagged(tag, loader.construct_scalar(node))
        return _Tagged(tag, None)

    return construct


for _tag in ("Exact", "Prefix", "Suffix", "Presence"):
    _Loader.add_constructor(f"!{_tag}", _tagged(_tag))


def _yaml_problem(e: yaml.YAMLError) -> Problem:
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(file)"
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return Problem(where, f"invalid YAML: {problem}" + (f" ({context})" if context else ""))


# --- checking ---------------------------------------------------------------


class _Bad(Exception):
    """A value is wrong; the message says why (the caller knows where)."""


_INVALID = object()  # stands for a value whose problem is already recorded


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, _Tagged):
        return f"a !{value.tag} tag"
    return type(value).__name__


def _key_path(path: str, key: Any) -> str:
    if isinstance(key, int) and not isinstance(key, bool):
        return f"{path}[{key}]"
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _map_key_path(path: str, key: Any) -> str:
    """Map keys are data, not field names: always in brackets."""
    if isinstance(key, str):
        return f'{path}["{key}"]'
    return f"{path}[{key!r}]"


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise _Bad(f"expected a string, got {_describe(value)}")
    return value


def _nonempty_string(value: Any) -> str:
    if _string(value) == "":
        raise _Bad("must not be empty")
    return value


def _identity_part(which: str) -> Callable[[Any], str]:
    """A trust domain, namespace or service account usable in a SPIFFE ID."""

    def check(value: Any) -> str:
        parts = {"trust domain": "cluster.local", "namespace": "default", "service account": "default"}
        parts[which] = _string(value)
        try:
            SpiffeId(*parts.values())
        except InvalidSpiffeId as e:
            raise _Bad(str(e)) from None
        return value

    return check


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false, got {_describe(value)}")
    return value


def _port(value: Any) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"expected a port number, got {_describe(value)}")
    if not 1 <= value <= 65535:
        raise _Bad(f"{value} is not a port number (1-65535)")
    return value


def _ip_address(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if not isinstance(value, str):
        raise _Bad(f"expected an IP address, got {_describe(value)}")
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise _Bad(f"{value!r} is not an IP address") from None


def _cidr(value: Any) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    if not isinstance(value, str):
        raise _Bad(f"expected an IP address or CIDR range, got {_describe(value)}")
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise _Bad(f"{value!r} is not an IP address or CIDR range") from None


def _vip(value: Any) -> tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """ "network/ip" (network may be empty: "/10.0.0.1"), or a bare IP."""
    if not isinstance(value, str):
        raise _Bad(f'expected "network/ip", got {_describe(value)}')
    network, _slash, ip = value.rpartition("/")
    try:
        return network, ipaddress.ip_address(ip)
    except ValueError:
        raise _Bad(f'{value!r} is not "network/ip" (e.g. "/10.0.0.1")') from None


def _count(value: Any) -> int:
    """ztunnel's u32."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0xFFFFFFFF:
        raise _Bad(f"expected a whole number from 0 to 4294967295, got {_describe(value)}")
    return value


def _port_or_zero(value: Any) -> int:
    return 0 if value == 0 and not isinstance(value, bool) else _port(value)


def _optional_port(value: Any) -> int | None:
    return None if value is None else _port_or_zero(value)


def _nonempty_string_key(value: Any) -> str:
    return _nonempty_string(value)


def _network_cidr(value: Any) -> str:
    """ztunnel's NetworkCidr: {network: ..., cidr: "10.96.0.0/16"}."""
    if not isinstance(value, dict) or set(value) != {"network", "cidr"}:
        raise _Bad(f"expected {{network: ..., cidr: ...}}, got {_describe(value)}")
    _string(value["network"])
    try:
        ipaddress.ip_network(_string(value["cidr"]), strict=False)
    except ValueError:
        raise _Bad(f"{value['cidr']!r} is not a CIDR range") from None
    return value


def _enum(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices or not isinstance(value, str):
            shown = repr(value) if isinstance(value, str) else _describe(value)
            raise _Bad(f"{shown} is not one of {', '.join(choices)}")
        return value

    return check


def _namespaced_hostname(value: Any) -> str:
    namespace, slash, hostname = _string(value).partition("/")
    if not slash or not namespace or not hostname or "/" in hostname:
        raise _Bad(f'{value!r} is not "namespace/hostname"')
    return value


def _policy_key(value: Any) -> str:
    namespace, slash, name = _string(value).partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise _Bad(f'{value!r} is not "namespace/name"')
    return value


def _string_match(value: Any) -> StringMatch:
    kinds = {"Exact": "exact", "Prefix": "prefix", "Suffix": "suffix", "Presence": "presence"}
    if isinstance(value, str):
        return StringMatch.parse(value)
    if isinstance(value, _Tagged):
        tag, arg = value.tag, value.value
    elif isinstance(value, dict) and len(value) == 1:
        tag, arg = next(iter(value.items()))
        if tag not in kinds:
            raise _Bad(f"{tag!r} is not one of {', '.join(kinds)}")
    else:
        raise _Bad(f"expected a string or one of {{Exact|Prefix|Suffix|Presence: ...}}, got {_describe(value)}")
    if tag == "Presence":
        return StringMatch("presence")
    if not isinstance(arg, str):
        raise _Bad(f"{tag} needs a string, got {_describe(arg)}")
    return StringMatch(kinds[tag], arg)


def _principal(value: Any) -> StringMatch:
    return normalize_principal(_string_match(value))


def _service_account(value: Any) -> ServiceAccountMatch:
    """{namespace: ns, serviceAccount: sa} (ztunnel), or "ns/sa" (Istio)."""
    if isinstance(value, str):
        namespace, slash, account = value.partition("/")
        if not slash or not namespace or not account:
            raise _Bad(f'{value!r} is not "namespace/serviceAccount"')
        return ServiceAccountMatch(namespace, account)
    if isinstance(value, dict):
        unknown = sorted(str(k) for k in value if k not in ("namespace", "serviceAccount"))
        if unknown:
            raise _Bad(f"unknown key {unknown[0]!r}; expected namespace and serviceAccount")
        try:
            return ServiceAccountMatch(_string(value["namespace"]), _string(value["serviceAccount"]))
        except KeyError as e:
            raise _Bad(f"missing {e.args[0]!r}; expected namespace and serviceAccount") from None
    raise _Bad(f'expected {{namespace: ..., serviceAccount: ...}} or "ns/sa", got {_describe(value)}')


@attrs.frozen
class _Field:
    attr: str | None  # None: a ztunnel field that is checked, then dropped (no effect in ztwisted)
    read: Callable[[_Shapes, Any, str], Any]
    required: bool = False


class _Shapes:
    """Walks YAML data, collecting Problems instead of stopping at the first.

    The generic shapes every section is made of; the sections' readers below
    build on them, and :class:`_Reader` puts the sections together.
    """

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.warnings: list[Problem] = []

    def problem(self, path: str, message: str) -> object:
        self.problems.append(Problem(path, message))
        return _INVALID

    def warning(self, path: str, message: str) -> None:
        """Something ztunnel accepts that is likely a mistake: logged, the file is used."""
        self.warnings.append(Problem(path, message))

    # generic shapes: each returns a reader(reader, value, path) -> value or _INVALID

    @staticmethod
    def scalar(check: Callable[[Any], Any]) -> Callable[[_Shapes, Any, str], Any]:
        def read(reader: _Shapes, value: Any, path: str) -> Any:
            try:
                return check(value)
            except _Bad as e:
                return reader.problem(path, str(e))

        return read

    @staticmethod
    def list_of(
        item: Callable[[_Shapes, Any, str], Any], *, nonempty: bool = False, null_is_empty: bool = False
    ) -> Callable[[_Shapes, Any, str], Any]:
        def read(reader: _Shapes, value: Any, path: str) -> Any:
            if value is None and null_is_empty:
                return ()
            if not isinstance(value, list):
                return reader.problem(path, f"expected a list, got {_describe(value)}")
            if nonempty and not value:
                return reader.problem(path, "must list at least one entry")
            items = [item(reader, v, f"{path}[{i}]") for i, v in enumerate(value)]
            return _INVALID if any(v is _INVALID for v in items) else tuple(items)

        return read

    @staticmethod
    def map_of(
        key: Callable[[Any], Any], item: Callable[[_Shapes, Any, str], Any]
    ) -> Callable[[_Shapes, Any, str], Any]:
        def read(reader: _Shapes, value: Any, path: str) -> Any:
            if not isinstance(value, dict):
                return reader.problem(path, f"expected a mapping, got {_describe(value)}")
            out = {}
            for k, v in value.items():
                where = _map_key_path(path, k)
                try:
                    checked = key(k)
                except _Bad as e:
                    out[k] = reader.problem(where, str(e))
                    continue
                out[checked] = item(reader, v, where)
            return _INVALID if any(v is _INVALID for v in out.values()) else out

        return read

    def record(
        self, value: Any, path: str, fields: dict[str, _Field], unsupported: frozenset[str] = frozenset()
    ) -> dict[str, Any] | None:
        """Check a mapping against `fields`: attrs values by name, or None if bad.

        Optional fields that are absent are left out (the model's default applies).
        """
        if not isinstance(value, dict):
            self.problem(path or "(top level)", f"expected a mapping, got {_describe(value)}")
            return None
        before = len(self.problems)
        for key in value:
            if key in fields:
                continue
            if key in unsupported:
                self.problem(_key_path(path, key), "not supported by ztwisted")
            else:
                close = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.problem(_key_path(path, key), f"unknown key{hint}")
        out: dict[str, Any] = {}
        for key, field in fields.items():
            where = _key_path(path, key)
            if key in value:
                out[field.attr] = field.read(self, value[key], where)
            elif field.required:
                self.problem(where, "required field is missing")
        return out if len(self.problems) == before else None

    # ztunnel's GatewayAddress is a shape of both workloads and services (waypoints)

    def gateway_address(self, value: Any, path: str) -> Any:
        """ztunnel's GatewayAddress: a "network/ip" or "namespace/hostname" destination and a port."""
        if value is None:
            return None
        fields = self.record(
            value,
            path,
            {
                "destination": _Field("destination", self.scalar(_string), required=True),
                "hboneMtlsPort": _Field("port", self.scalar(_port_or_zero), required=True),
            },
        )
        return _INVALID if fields is None else fields


class _WorkloadReader(_Shapes):
    """The ``workloads`` section."""

    def __init__(self) -> None:
        super().__init__()
        self._derived_uids: set[int] = set()  # id() of workloads whose uid was not given

    def workload(self, value: Any, path: str) -> Workload | object:
        s = self.scalar
        fields = self.record(
            value,
            path,
            {
                "uid": _Field("uid", s(_nonempty_string)),
                "name": _Field("name", s(_string)),
                "namespace": _Field("namespace", s(_identity_part("namespace")), required=True),
                "serviceAccount": _Field("service_account", s(_identity_part("service account"))),
                "workloadIps": _Field("workload_ips", self.list_of(s(_ip_address)), required=True),
                "protocol": _Field("protocol", s(_enum("HBONE", "TCP"))),
                "node": _Field("node", s(_string)),
                "network": _Field("network", s(_string)),
                "services": _Field("services", self.map_of(_namespaced_hostname, self.map_of(_port, s(_port)))),
                "trustDomain": _Field("trust_domain", s(_identity_part("trust domain"))),
                "canonicalName": _Field("canonical_name", s(_string)),
                "canonicalRevision": _Field("canonical_revision", s(_string)),
                "status": _Field("status", s(_enum("Healthy", "Unhealthy"))),
                "clusterId": _Field("cluster_id", s(_string)),
                "workloadName": _Field("workload_name", s(_string)),
                "workloadType": _Field("workload_type", s(_string)),
                "hostname": _Field("hostname", s(_string)),
                "nativeTunnel": _Field("native_tunnel", s(_bool)),
                "authorizationPolicies": _Field("authorization_policies", self.list_of(s(_policy_key))),
                "networkMode": _Field("network_mode", s(_enum("Standard", "HostNetwork"))),
                "capacity": _Field("capacity", s(_count)),
                # Accepted and checked as ztunnel does, without effect in ztwisted (docs/configuration.rst).
                "waypoint": _Field(None, _Shapes.gateway_address),
                "networkGateway": _Field(None, _Shapes.gateway_address),
                "applicationTunnel": _Field(None, _WorkloadReader.application_tunnel),
                "locality": _Field(None, _WorkloadReader.locality),
            },
        )
        if fields is None:
            return _INVALID
        fields.pop(None, None)
        fields.setdefault("name", "")
        if not fields.get("trust_domain"):
            fields.pop("trust_domain", None)  # empty means cluster.local
        if not fields.get("cluster_id"):
            fields.pop("cluster_id", None)
        if "uid" not in fields:
            cluster = fields.get("cluster_id", "Kubernetes")
            fields["uid"] = f"{cluster}//v1/Pod/{fields['namespace']}/{fields['name']}"
            workload = Workload(**fields)
            self._derived_uids.add(id(workload))
            return workload
        return Workload(**fields)

    def application_tunnel(self, value: Any, path: str) -> Any:
        if value is None:
            return None
        fields = self.record(
            value,
            path,
            {
                "protocol": _Field("protocol", self.scalar(_enum("NONE", "PROXY")), required=True),
                "port": _Field("port", self.scalar(_optional_port)),
            },
        )
        return _INVALID if fields is None else fields

    def locality(self, value: Any, path: str) -> Any:
        s = self.scalar
        fields = self.record(
            value,
            path,
            {
                "region": _Field("region", s(_string), required=True),
                "zone": _Field("zone", s(_string), required=True),
                "subzone": _Field("subzone", s(_string), required=True),
            },
        )
        return _INVALID if fields is None else fields


class _ServiceReader(_Shapes):
    """The ``services`` section."""

    def service(self, value: Any, path: str) -> Service | object:
        s = self.scalar
        fields = self.record(
            value,
            path,
            {
                "name": _Field("name", s(_nonempty_string), required=True),
                "namespace": _Field("namespace", s(_nonempty_string), required=True),
                "hostname": _Field("hostname", s(_nonempty_string), required=True),
                "vips": _Field("vips", self.list_of(s(_vip))),
                "ports": _Field("ports", self.map_of(_port, s(_port)), required=True),
                "subjectAltNames": _Field("subject_alt_names", self.list_of(s(_string))),
                "canonical": _Field("canonical", s(_bool)),
                "visibility": _Field("visibility", s(_enum("Public", "Namespace"))),
                "endpoints": _Field("endpoints", self.map_of(_nonempty_string_key, _ServiceReader.endpoint)),
                "loadBalancer": _Field("load_balancer", _ServiceReader.load_balancer),
                # Accepted and checked as ztunnel does, without effect in ztwisted (docs/configuration.rst).
                "cidrVips": _Field(None, self.list_of(s(_network_cidr))),
                "waypoint": _Field(None, _Shapes.gateway_address),
                "weightedWaypoints": _Field(None, self.list_of(_ServiceReader.weighted_waypoint)),
                "ipFamilies": _Field(None, s(_enum("Dual", "IPv4", "IPv6"))),
            },
        )
        if fields is None:
            return _INVALID
        fields.pop(None, None)
        balancer = fields.pop("load_balancer", None)
        if balancer is not None:
            # routingPreferences (and so Strict and Failover) need locality: not implemented
            fields["load_balancer_mode"] = balancer["mode"]
            fields["health_policy"] = balancer["health"]
        return Service(**fields)

    def endpoint(self, value: Any, path: str) -> tuple[Any, str] | object:
        """One of a service's ``endpoints`` (keyed by workload uid): its port map and status."""
        fields = self.record(
            value,
            path,
            {
                "workloadUid": _Field("uid", self.scalar(_nonempty_string), required=True),
                "port": _Field("ports", self.map_of(_port, self.scalar(_port)), required=True),
                "status": _Field("status", self.scalar(_enum("Healthy", "Unhealthy")), required=True),
            },
        )
        return _INVALID if fields is None else (fields["ports"], fields["status"])

    def weighted_waypoint(self, value: Any, path: str) -> Any:
        fields = self.record(
            value,
            path,
            {
                "destination": _Field("destination", _Shapes.gateway_address, required=True),
                "weight": _Field("weight", self.scalar(_count), required=True),
            },
        )
        return _INVALID if fields is None else fields

    def load_balancer(self, value: Any, path: str) -> Any:
        if value is None:
            return None
        s = self.scalar
        fields = self.record(
            value,
            path,
            {
                "routingPreferences": _Field(
                    "routing",
                    self.list_of(s(_enum("Region", "Zone", "Subzone", "Node", "Cluster", "Network"))),
                    required=True,
                ),
                "mode": _Field("mode", s(_enum("Standard", "Strict", "Failover", "Passthrough")), required=True),
                "healthPolicy": _Field("health", s(_enum("OnlyHealthy", "AllowAll")), required=True),
            },
        )
        return _INVALID if fields is None else fields


class _PolicyReader(_Shapes):
    """The ``policies`` section."""

    def policy(self, value: Any, path: str) -> Policy | object:
        s = self.scalar
        match = _PolicyReader.match
        fields = self.record(
            value,
            path,
            {
                "name": _Field("name", s(_nonempty_string), required=True),
                "namespace": _Field("namespace", s(_nonempty_string), required=True),
                "scope": _Field("scope", s(_enum("Global", "Namespace", "WorkloadSelector")), required=True),
                "action": _Field("action", s(_enum("Allow", "Deny")), required=True),
                "rules": _Field("rules", self.list_of(self.list_of(self.list_of(match))), required=True),
                "dryRun": _Field("dry_run", s(_bool)),
            },
        )
        return _INVALID if fields is None else Policy(**fields)

    def match(self, value: Any, path: str) -> Match | object:
        s = self.scalar
        fields: dict[str, _Field] = {}
        for key, attr, item in (
            ("namespaces", "namespaces", _string_match),
            ("serviceAccounts", "service_accounts", _service_account),
            ("principals", "principals", _principal),
            ("sourceIps", "source_ips", _cidr),
            ("destinationIps", "destination_ips", _cidr),
            ("destinationPorts", "destination_ports", _port),
        ):
            fields[key] = _Field(attr, self.list_of(s(item)))
            fields["not" + key[0].upper() + key[1:]] = _Field("not_" + attr, self.list_of(s(item)))
        checked = self.record(value, path, fields)
        return _INVALID if checked is None else Match(**checked)


class _Reader(_WorkloadReader, _ServiceReader, _PolicyReader):
    """The whole file: its sections, then the checks across them."""

    def mesh(self, data: Any) -> Mesh | None:
        if isinstance(data, list):
            self.problem(
                "(top level)",
                "expected a mapping with workloads, services and policies, "
                "got a list (the old ztunnel format that listed workloads only)",
            )
            return None
        top = self.record(
            data,
            "",
            {
                "workloads": _Field("workloads", self.list_of(_WorkloadReader.workload, null_is_empty=True)),
                "services": _Field("services", self.list_of(_ServiceReader.service, null_is_empty=True)),
                "policies": _Field("policies", self.list_of(_PolicyReader.policy, null_is_empty=True)),
            },
        )
        if top is None:
            return None
        workloads, services, policies = (top.get(k, ()) for k in ("workloads", "services", "policies"))
        return Mesh(*_CrossChecks(self.warning, self._derived_uids)(workloads, services, policies))


@attrs.define(eq=False)
class _CrossChecks:
    """Checks across entries, run once every entry is valid by itself.

    What ztunnel makes of entries that collide or refer to nothing, each with
    a warning: ztunnel accepts such files. A later workload, service or policy
    with the same key replaces the earlier one; addresses may be shared (see
    ``Mesh``); references to what the file lacks have no effect.
    """

    warning: Callable[[str, str], None]
    #: id() of the workloads whose uid was made up (their duplicates say so)
    _derived_uids: set[int]

    def __call__(
        self, workloads: tuple[Workload, ...], services: tuple[Service, ...], policies: tuple[Policy, ...]
    ) -> tuple[tuple[Workload, ...], tuple[Service, ...], tuple[Policy, ...]]:
        # The same rule as Mesh and the xDS client: only these keys are unique (model.unique_key).
        workloads = self._last_wins(
            workloads,
            "workloads",
            unique_key,
            lambda w, i: (
                f"duplicate uid {w.uid!r}"
                + (" (uid not set: made from clusterId, namespace and name)" if id(w) in self._derived_uids else "")
            ),
            "uid",
        )
        services = self._last_wins(services, "services", unique_key, lambda s, i: f"duplicate service {s.key!r}")
        policies = self._last_wins(policies, "policies", unique_key, lambda p, i: f"duplicate policy {p.key!r}")
        self._shared_addresses(workloads, services)
        self._references(workloads, services, policies)
        return workloads, services, policies

    def _shared_addresses(self, workloads: tuple[Workload, ...], services: tuple[Service, ...]) -> None:
        ips: dict[Any, str] = {}
        for i, w in enumerate(workloads):
            for j, ip in enumerate(() if w.network_mode == "HostNetwork" else w.workload_ips):
                if ip in ips:
                    self.warning(
                        f"workloads[{i}].workloadIps[{j}]",
                        f"{ip} is also the address of {ips[ip]}; as in ztunnel, a connection from it is "
                        'attributed to one of them: a pod (uid with "//Pod/") first, then HBONE, else the last',
                    )
                ips.setdefault(ip, f"workload {w.uid!r}")
        vips: dict[Any, dict[str, str]] = {}  # VIP -> namespace -> the service that has it there
        for i, svc in enumerate(services):
            for j, (_network, ip) in enumerate(svc.vips):
                if ip in ips:
                    self.warning(
                        f"services[{i}].vips[{j}]",
                        f"{ip} is also the address of {ips[ip]}; as in ztunnel, connections to it go to the service",
                    )
                owners = vips.setdefault(ip, {})
                if svc.namespace in owners:
                    self.warning(
                        f"services[{i}].vips[{j}]",
                        f"{ip} is also a VIP of {owners[svc.namespace]} in the same namespace; as in ztunnel, "
                        "this later service takes it",
                    )
                owners[svc.namespace] = f"service {svc.key!r}"

    def _references(
        self, workloads: tuple[Workload, ...], services: tuple[Service, ...], policies: tuple[Policy, ...]
    ) -> None:
        service_keys = {svc.key for svc in services}
        policy_keys = {p.key for p in policies}
        for i, w in enumerate(workloads):
            for key in w.services:
                if key not in service_keys:
                    namespace, _, hostname = key.partition("/")
                    self.warning(
                        _map_key_path(f"workloads[{i}].services", key),
                        f"no service with namespace {namespace!r} and hostname {hostname!r} in services; "
                        "as in ztunnel, this has no effect",
                    )
            for j, key in enumerate(w.authorization_policies):
                if key not in policy_keys:
                    self.warning(
                        f"workloads[{i}].authorizationPolicies[{j}]",
                        f"no policy {key!r} in policies; as in ztunnel, it selects nothing",
                    )

    def _last_wins(
        self,
        entries: tuple,
        section: str,
        key: Callable[[Any], Hashable],
        describe: Callable[[Any, int], str],
        field: str | None = None,
    ) -> tuple:
        """``entries`` without those a later entry with the same key replaces (ztunnel's rule), warned about."""
        last = {key(entry): i for i, entry in enumerate(entries)}
        for i, entry in enumerate(entries):
            if last[key(entry)] != i:
                where = f"{section}[{i}]" + (f".{field}" if field else "")
                self.warning(
                    where, f"{describe(entry, i)}: {section}[{last[key(entry)]}] replaces this entry, as in ztunnel"
                )
        return tuple(entry for i, entry in enumerate(entries) if last[key(entry)] == i)


# --- reloading --------------------------------------------------------------


def _reactor_or_global(reactor: Any) -> Any:
    if reactor is None:
        from twisted.internet import reactor
    return reactor


@attrs.define(eq=False)
class ConfigWatcher:
    """Reload a config file when it changes on disk.

    Watches the file's directory (editors replace files by rename, which a
    watch on the file itself would miss). A good file that differs from the
    last good one goes to `on_change(mesh)`; a bad one goes to
    `on_error(ConfigError)` and `current` keeps the last good mesh.

    A writer that truncates the file and then writes it (`cat > file`, many
    editors' "save") leaves it empty or half written until it closes it: a
    read in between would apply part of a configuration, or none. So the file
    is read `delay` seconds after a writer closed it (IN_CLOSE_WRITE) or a
    finished file was renamed over it (IN_MOVED_TO); while a writer still has
    it open (IN_CREATE, IN_MODIFY), only after `writer_timeout` seconds
    without events. A file without a YAML document is read once more
    `empty_grace` seconds later (or at the writer's next event) before it is
    reported as an error.
    """

    # A Kubernetes ConfigMap volume updates `name -> ..data/name` by renaming
    # the `..data` symlink: that rename is the only event such an update makes.
    _CONFIGMAP_LINK = b"..data"
    _WRITING = inotify.IN_CREATE | inotify.IN_MODIFY
    _WRITTEN = inotify.IN_CLOSE_WRITE | inotify.IN_MOVED_TO
    _MASK = _WRITING | _WRITTEN

    path: str = attrs.field(converter=os.fspath)
    on_change: Callable[[Mesh], Any]
    on_error: Callable[[ConfigError], Any]
    _reactor: Any = attrs.field(default=None, converter=_reactor_or_global)
    #: the last good mesh
    current: Mesh | None = attrs.field(default=None, kw_only=True)
    delay: float = attrs.field(default=0.1, kw_only=True)
    writer_timeout: float = attrs.field(default=2.0, kw_only=True)
    empty_grace: float = attrs.field(default=1.0, kw_only=True)
    _file: FilePath = attrs.field(init=False)
    #: the file's name in its directory, as inotify reports it
    _name: bytes = attrs.field(init=False)
    _notifier: inotify.INotify | None = attrs.field(init=False, default=None)
    #: the read that is due (an IDelayedCall)
    _pending: Any = attrs.field(init=False, default=None)
    #: the last read found no YAML document (a writer may be between truncating and writing)
    _empty_seen: bool = attrs.field(init=False, default=False)

    @_file.default
    def _absolute_file(self) -> FilePath:
        return FilePath(os.path.abspath(self.path))

    @_name.default
    def _file_name(self) -> bytes:
        return os.fsencode(self._file.basename())

    def start(self) -> None:
        if self._notifier is not None:
            return
        notifier = inotify.INotify(reactor=self._reactor)
        notifier.startReading()
        try:
            notifier.watch(self._file.parent(), mask=self._MASK, callbacks=[self._notified])
        except Exception:
            notifier.loseConnection()
            raise
        self._notifier = notifier

    def stop(self) -> None:
        self._cancel_pending()
        if self._notifier is not None:
            self._notifier.loseConnection()
            self._notifier = None

    def reload(self) -> None:
        """Parse the file now and report the outcome (also used by the timer)."""
        self._cancel_pending()
        try:
            mesh = load_config(self.path)
        except EmptyConfigError as e:
            if not self._empty_seen:
                self._empty_seen = True  # likely a writer between truncating and writing: look again
                self._read_in(self.empty_grace)
                return
            self._empty_seen = False
            self.on_error(e)
            return
        except ConfigError as e:
            self._empty_seen = False
            self.on_error(e)
            return
        self._empty_seen = False
        if mesh == self.current:
            return
        self.current = mesh
        self.on_change(mesh)

    def _notified(self, _ignored: Any, filepath: FilePath, mask: int) -> None:
        name = filepath.asBytesMode().basename()
        if name == self._name and mask & self._WRITING:
            self._read_in(self.writer_timeout)
        elif name in (self._name, self._CONFIGMAP_LINK) and mask & self._WRITTEN:
            self._read_in(self.delay)

    def _read_in(self, seconds: float) -> None:
        if self._pending is not None and self._pending.active():
            self._pending.reset(seconds)
        else:
            self._pending = self._reactor.callLater(seconds, self.reload)

    def _cancel_pending(self) -> None:
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
