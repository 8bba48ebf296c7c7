"""Authorization policy evaluation, with Istio/ztunnel semantics.

Which policies apply to a destination workload (as ztunnel selects them):
  - scope Global: every workload (istiod gives this scope to policies in the
    root namespace, istio-system);
  - scope Namespace: workloads in the policy's namespace;
  - any policy named in the workload's `authorization_policies` (how
    WorkloadSelector policies reach the workloads they select).
Then: a matching Deny policy denies; else, with no Allow policy, allow; else
some Allow policy must match. Dry-run policies never decide; the ones that
matched are reported in `Decision.dry_run_matches` for logging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from ztwisted.identity import SpiffeId
from ztwisted.model import IPAddress, Match, Policy, Workload


@attrs.frozen
class Decision:
    allowed: bool
    policy: str | None  # "namespace/name" of the deciding policy, if one decided
    reason: str
    dry_run_matches: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.allowed


@attrs.frozen
class Connection:
    """The facts about one connection that policies can test."""

    source: SpiffeId | None
    source_ip: IPAddress
    destination_ip: IPAddress
    destination_port: int

    @property
    def principal(self) -> str:
        """The source identity without "spiffe://", "" when unauthenticated."""
        if self.source is None:
            return ""
        return str(self.source).removeprefix("spiffe://")


def applicable_policies(policies: Iterable[Policy], destination: Workload) -> list[Policy]:
    selected = set(destination.authorization_policies)
    return [
        p
        for p in policies
        if p.scope == "Global" or (p.scope == "Namespace" and p.namespace == destination.namespace) or p.key in selected
    ]


def authorize(
    policies: Iterable[Policy],
    *,
    source: SpiffeId | None,
    source_ip: IPAddress,
    destination: Workload,
    destination_ip: IPAddress,
    destination_port: int,
) -> Decision:
    """Decide whether `source` may connect to `destination`."""
    applicable = applicable_policies(policies, destination)
    if not applicable:  # as the loops below would decide, without a Connection to match against
        return _NO_POLICIES
    conn = Connection(source, source_ip, destination_ip, destination_port)
    dry_run = tuple(p.key for p in applicable if p.dry_run and policy_matches(p, conn))
    enforced = [p for p in applicable if not p.dry_run]
    for p in enforced:
        if p.action == "Deny" and policy_matches(p, conn):
            return Decision(False, p.key, "denied by policy", dry_run)
    allows = [p for p in enforced if p.action == "Allow"]
    if not allows:
        return Decision(True, None, "no allow policies", dry_run)
    for p in allows:
        if policy_matches(p, conn):
            return Decision(True, p.key, "allowed by policy", dry_run)
    return Decision(False, None, "no allow policy matched", dry_run)


_NO_POLICIES = Decision(True, None, "no allow policies")


def policy_matches(policy: Policy, conn: Connection) -> bool:
    """OR over rules, AND over a rule's clauses, OR over a clause's matches.

    As in ztunnel: no rules never matches; an empty clause matches; an empty
    Match matches nothing.
    """
    for rule in policy.rules:
        if all(_clause_matches(clause, conn) for clause in rule):
            return True
    return False


def _clause_matches(clause: tuple[Match, ...], conn: Connection) -> bool:
    if not clause:
        return True
    return any(not m.is_empty() and match_matches(m, conn) for m in clause)


def match_matches(m: Match, conn: Connection) -> bool:
    source = conn.source
    namespace = source.namespace if source is not None else ""
    principal = conn.principal
    return (
        _field(m.destination_ips, m.not_destination_ips, lambda net: conn.destination_ip in net)
        and _field(m.source_ips, m.not_source_ips, lambda net: conn.source_ip in net)
        and _field(m.destination_ports, m.not_destination_ports, lambda p: p == conn.destination_port)
        and _field(
            m.service_accounts,
            m.not_service_accounts,
            lambda sa: (
                source is not None and sa.namespace == source.namespace and sa.service_account == source.service_account
            ),
        )
        # An unauthenticated source has no principal: no principal matcher applies.
        and _field(m.principals, m.not_principals, lambda s: principal != "" and s.matches(principal))
        and _field(m.namespaces, m.not_namespaces, lambda s: s.matches(namespace))
    )


def _field(positive: tuple, negative: tuple, test: Callable[[Any], bool]) -> bool:
    """Any positive value matches (or there are none) and no negative does."""
    if positive and not any(test(v) for v in positive):
        return False
    return not any(test(v) for v in negative)
