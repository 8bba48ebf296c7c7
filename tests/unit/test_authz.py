"""Authorization policy evaluation (Istio/ztunnel semantics)."""

from ipaddress import ip_address

import pytest

from ztwisted.authz import authorize
from ztwisted.identity import SpiffeId
from ztwisted.model import Match, Policy, StringMatch, Workload

CLIENT = SpiffeId("cluster.local", "default", "client")
OTHER = SpiffeId("cluster.local", "prod", "other")
FOREIGN = SpiffeId("example.org", "default", "client")

ECHO = Workload(
    uid="Kubernetes//v1/Pod/default/echo",
    name="echo",
    namespace="default",
    service_account="echo",
    workload_ips=["127.0.3.1"],
    protocol="HBONE",
    authorization_policies=["default/selected"],
)


def policy(rules, *, action="Allow", scope="Namespace", namespace="default", name="p", dry_run=False):
    return Policy(name=name, namespace=namespace, scope=scope, action=action, rules=rules, dry_run=dry_run)


def one(**match):
    """A rule list holding a single Match."""
    return [[[Match(**match)]]]


def check(
    policies, source=CLIENT, source_ip="127.0.2.1", destination=ECHO, destination_ip="127.0.3.1", destination_port=8080
):
    return authorize(
        policies,
        source=source,
        source_ip=ip_address(source_ip),
        destination=destination,
        destination_ip=ip_address(destination_ip),
        destination_port=destination_port,
    )


def test_no_policies_allow():
    d = check([])
    assert d.allowed and d.policy is None and d.reason == "no allow policies"
    assert bool(d) is True


def test_allow_policy_that_matches_allows_and_is_named():
    d = check([policy(one(principals=["spiffe://cluster.local/ns/default/sa/client"]), name="echo-allow")])
    assert d.allowed
    assert d.policy == "default/echo-allow"
    assert d.reason == "allowed by policy"


def test_allow_policy_that_does_not_match_denies():
    d = check([policy(one(principals=["cluster.local/ns/default/sa/client"]))], source=OTHER)
    assert not d.allowed
    assert d.policy is None
    assert d.reason == "no allow policy matched"


def test_any_allow_policy_may_match():
    pols = [
        policy(one(namespaces=["prod"]), name="a"),
        policy(one(namespaces=["default"]), name="b"),
    ]
    assert check(pols).policy == "default/b"
    assert check(pols, source=OTHER).policy == "default/a"


def test_deny_wins_over_allow():
    pols = [
        policy(one(namespaces=["default"]), name="allow"),
        policy(one(destination_ports=[8080]), action="Deny", name="deny"),
    ]
    d = check(pols)
    assert not d.allowed
    assert d.policy == "default/deny"
    assert d.reason == "denied by policy"
    assert check(pols, destination_port=9090).allowed


def test_deny_policy_alone_does_not_require_an_allow():
    pols = [policy(one(namespaces=["prod"]), action="Deny")]
    assert check(pols).allowed
    assert not check(pols, source=OTHER).allowed


def test_scope_selection():
    allow_prod_only = one(namespaces=["prod"])
    # Namespace scope in another namespace: does not apply.
    assert check([policy(allow_prod_only, namespace="other")]).allowed
    # Namespace scope in the destination's namespace: applies.
    assert not check([policy(allow_prod_only, namespace="default")]).allowed
    # Global applies to every workload, whatever its namespace.
    assert not check([policy(allow_prod_only, scope="Global", namespace="istio-system")]).allowed
    # WorkloadSelector applies only to workloads that list it.
    assert not check([policy(allow_prod_only, scope="WorkloadSelector", name="selected")]).allowed
    assert check([policy(allow_prod_only, scope="WorkloadSelector", name="unselected")]).allowed


def test_dry_run_policies_do_not_decide_but_are_reported():
    pols = [policy(one(namespaces=["default"]), action="Deny", name="would-deny", dry_run=True)]
    d = check(pols)
    assert d.allowed
    assert d.dry_run_matches == ("default/would-deny",)
    assert check(pols, source=OTHER).dry_run_matches == ()


def test_rule_structure_or_of_and_of_or():
    # rule 1: (ns default OR ns prod) AND port 80;  rule 2: source 10.0.0.0/8
    rules = [
        [[Match(namespaces=["default"]), Match(namespaces=["prod"])], [Match(destination_ports=[80])]],
        [[Match(source_ips=["10.0.0.0/8"])]],
    ]
    pols = [policy(rules)]
    assert check(pols, destination_port=80).allowed
    assert check(pols, source=OTHER, destination_port=80).allowed
    assert not check(pols, destination_port=81).allowed
    assert check(pols, destination_port=81, source_ip="10.1.2.3").allowed


def test_empty_structures_like_ztunnel():
    assert not check([policy([])]).allowed  # no rules: matches nothing
    assert check([policy([[]])]).allowed  # a rule without clauses: matches
    assert check([policy([[[]]])]).allowed  # an empty clause: matches
    assert not check([policy([[[Match()]]])]).allowed  # an empty Match: matches nothing


@pytest.mark.parametrize(
    "match, source, source_ip, dest_ip, port, expected",
    [
        # namespaces / notNamespaces
        ({"namespaces": ["default"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"namespaces": ["default"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"namespaces": ["default"]}, None, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_namespaces": ["default"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_namespaces": ["default"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"not_namespaces": ["default"]}, None, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"namespaces": ["pro*"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, True),
        # serviceAccounts / notServiceAccounts
        ({"service_accounts": ["default/client"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"service_accounts": ["default/client"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"service_accounts": ["default/client"]}, None, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_service_accounts": ["default/client"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_service_accounts": ["default/client"]}, None, "127.0.2.1", "127.0.3.1", 8080, True),
        # principals: with or without spiffe://, exact, prefix, suffix, presence
        ({"principals": ["spiffe://cluster.local/ns/default/sa/client"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"principals": ["cluster.local/ns/default/sa/client"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"principals": ["cluster.local/ns/default/sa/client"]}, FOREIGN, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"principals": ["cluster.local/ns/default/*"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"principals": ["spiffe://cluster.local/ns/default/*"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"principals": ["*/sa/client"]}, FOREIGN, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"principals": ["*/sa/client"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"principals": ["*"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"principals": ["*"]}, None, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"principals": [StringMatch("prefix", "")]}, None, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_principals": ["*"]}, None, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"not_principals": ["*"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_principals": ["cluster.local/ns/default/sa/client"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, True),
        # sourceIps / notSourceIps (CIDRs and single addresses, v4 and v6)
        ({"source_ips": ["127.0.2.0/24"]}, CLIENT, "127.0.2.77", "127.0.3.1", 8080, True),
        ({"source_ips": ["127.0.2.0/24"]}, CLIENT, "127.0.4.1", "127.0.3.1", 8080, False),
        ({"source_ips": ["127.0.2.1"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"source_ips": ["fd00::/8"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"source_ips": ["fd00::/8"]}, CLIENT, "fd00::1", "127.0.3.1", 8080, True),
        ({"not_source_ips": ["127.0.2.0/24"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_source_ips": ["127.0.2.0/24"]}, CLIENT, "10.0.0.1", "127.0.3.1", 8080, True),
        # destinationIps / notDestinationIps
        ({"destination_ips": ["127.0.3.1/32"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"destination_ips": ["127.0.3.1/32"]}, CLIENT, "127.0.2.1", "127.0.3.2", 8080, False),
        ({"not_destination_ips": ["127.0.3.0/24"]}, CLIENT, "127.0.2.1", "127.0.3.9", 8080, False),
        ({"not_destination_ips": ["127.0.3.0/24"]}, CLIENT, "127.0.2.1", "127.0.4.9", 8080, True),
        # destinationPorts / notDestinationPorts
        ({"destination_ports": [80, 8080]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"destination_ports": [80]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"not_destination_ports": [9999]}, CLIENT, "127.0.2.1", "127.0.3.1", 9999, False),
        ({"not_destination_ports": [9999]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        # a field and its twin together; several fields AND together
        ({"namespaces": ["*"], "not_namespaces": ["prod"]}, OTHER, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"namespaces": ["*"], "not_namespaces": ["prod"]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
        ({"namespaces": ["default"], "destination_ports": [80]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, False),
        ({"namespaces": ["default"], "destination_ports": [8080]}, CLIENT, "127.0.2.1", "127.0.3.1", 8080, True),
    ],
)
def test_match_truth_table(match, source, source_ip, dest_ip, port, expected):
    d = check([policy(one(**match))], source=source, source_ip=source_ip, destination_ip=dest_ip, destination_port=port)
    assert d.allowed is expected
