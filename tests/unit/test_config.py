"""Reading ztunnel's local config YAML, its error messages, and reloading."""

import os
import random
import textwrap
from ipaddress import ip_address

import pytest
import pytest_twisted
from twisted.internet import defer, inotify, reactor, task
from twisted.logger import capturedLogs, formatEvent
from twisted.python.filepath import FilePath

from ztwisted.authz import authorize
from ztwisted.config import (
    ConfigError,
    ConfigWatcher,
    EmptyConfigError,
    Problem,
    builtin_example_path,
    load_config,
    parse_config,
)
from ztwisted.identity import SpiffeId
from ztwisted.model import Mesh, ServiceAccountMatch, StringMatch

# The example of /work/shared/specs/hbone.md, "Local configuration file".
SPEC_EXAMPLE = """\
workloads:
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  workloadIps: ["127.0.20.2"]
  protocol: HBONE
  node: node-b
  services: {"default/echo.default.svc.cluster.local": {80: 8080}}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/127.10.0.1"]
  ports: {80: 8080}
policies:
- name: only-clients
  namespace: default
  scope: Namespace
  action: Allow
  rules: [[[{principals: ["spiffe://cluster.local/ns/default/sa/client"]}]]]
"""

# Written the way ztunnel's own examples are (block-style nested rule lists,
# a VIP on a named network, subjectAltNames).
ZTUNNEL_STYLE = """\
workloads:
- uid: cluster1//v1/Pod/default/local
  name: local
  namespace: default
  serviceAccount: default
  workloadIps: ["127.0.0.1"]
  protocol: HBONE
  node: local
  network: ""
  services:
    "default/example.com":
      80: 8080
policies:
  - action: Allow
    rules:
    - - - notDestinationPorts:
          - 9999
    name: deny-9999
    namespace: default
    scope: Namespace
services:
- name: local
  namespace: default
  hostname: example.com
  vips:
    - /127.10.0.1
    - remote/127.10.0.2
  ports:
    80: 8080
  subjectAltNames:
   - spiffe://cluster.local/ns/default/sa/local
"""

GOOD_WORKLOAD = """\
- name: a
  namespace: default
  workloadIps: ["10.0.0.1"]
"""


def error_of(text, source="mesh.yaml"):
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text), source)
    return str(info.value)


# --- what parses ---------------------------------------------------------------


def test_builtin_example_parses_and_describes_two_nodes():
    path = builtin_example_path()
    assert os.path.isfile(path)
    assert path.endswith(os.path.join("ztwisted", "examples", "mesh.yaml"))
    mesh = load_config(path)
    client = mesh.workload_by_ip("127.0.2.1")
    echo = mesh.workload_by_ip("127.0.3.1")
    assert (client.node, str(client.identity)) == ("node-a", "spiffe://cluster.local/ns/default/sa/client")
    assert (echo.node, str(echo.identity), echo.protocol) == (
        "node-b",
        "spiffe://cluster.local/ns/default/sa/echo",
        "HBONE",
    )
    assert mesh.local_workloads(None) == (client, echo)
    dest = mesh.resolve("127.10.0.1", 80)
    assert (dest.kind, dest.workload, dest.ip, dest.port) == ("service", echo, ip_address("127.0.3.1"), 8080)
    assert mesh.service_by_vip("127.10.0.1").hostname == "echo.default.svc.cluster.local"

    def may_reach_echo(source):
        return authorize(
            mesh.policies,
            source=source,
            source_ip=ip_address("127.0.2.1"),
            destination=echo,
            destination_ip=ip_address("127.0.3.1"),
            destination_port=8080,
        ).allowed

    assert may_reach_echo(client.identity)
    assert not may_reach_echo(SpiffeId("cluster.local", "default", "intruder"))
    assert not may_reach_echo(None)


def test_setup_cfg_ships_the_example():
    setup_cfg = os.path.join(os.path.dirname(__file__), "..", "..", "setup.cfg")
    with open(setup_cfg) as f:
        assert "ztwisted = examples/*.yaml" in f.read()


def test_spec_example_parses():
    mesh = parse_config(SPEC_EXAMPLE)
    (server,) = mesh.workloads
    assert server.uid == "cluster1//v1/Pod/default/server"
    assert server.workload_ips == (ip_address("127.0.20.2"),)
    assert server.services == {"default/echo.default.svc.cluster.local": {80: 8080}}
    assert server.trust_domain == "cluster.local"
    assert server.status == "Healthy"
    (svc,) = mesh.services
    assert svc.vips == (("", ip_address("127.10.0.1")),)
    assert svc.ports == {80: 8080}
    (pol,) = mesh.policies
    assert (pol.key, pol.scope, pol.action, pol.dry_run) == ("default/only-clients", "Namespace", "Allow", False)
    assert pol.rules[0][0][0].principals == (StringMatch("exact", "cluster.local/ns/default/sa/client"),)


def test_ztunnel_style_file_parses():
    mesh = parse_config(ZTUNNEL_STYLE)
    assert mesh.policies[0].rules[0][0][0].not_destination_ports == (9999,)
    assert mesh.services[0].vips == (("", ip_address("127.10.0.1")), ("remote", ip_address("127.10.0.2")))
    assert mesh.services[0].subject_alt_names == ("spiffe://cluster.local/ns/default/sa/local",)
    assert mesh.workloads[0].network == ""


@pytest.mark.parametrize("text", ["workloads:\nservices:\npolicies:\n", "workloads: []\n", "{}"])
def test_documents_without_entries_are_an_empty_mesh(text):
    assert parse_config(text) == Mesh()


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_a_file_without_a_document_is_an_error_not_an_empty_mesh(text):
    # Most often a file that a writer has truncated and not yet written.
    with pytest.raises(EmptyConfigError) as raised:
        parse_config(text, "mesh.yaml")
    assert str(raised.value) == (
        "mesh.yaml: (file): no YAML document (the file is empty or holds only comments); "
        "a mesh without workloads is written `workloads: []`"
    )


def test_workload_defaults_and_optional_fields():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - name: a
          namespace: default
          workloadIps: ["10.0.0.1", "fd00::1"]
        - uid: my-uid
          name: b
          namespace: default
          serviceAccount: b-sa
          workloadIps: ["10.0.0.2"]
          trustDomain: ""
          clusterId: c1
          canonicalName: b-app
          canonicalRevision: v2
          status: Unhealthy
          workloadName: b-deploy
          workloadType: deployment
          hostname: b.example
          nativeTunnel: true
          authorizationPolicies: ["default/sel"]
        policies:
        - {name: sel, namespace: default, scope: WorkloadSelector, action: Deny, rules: [], dryRun: true}
        """)
    )
    a, b = mesh.workloads
    assert a.uid == "Kubernetes//v1/Pod/default/a"
    assert (a.service_account, a.protocol, a.node, a.network, a.status) == ("default", "TCP", "", "", "Healthy")
    assert a.workload_ips == (ip_address("10.0.0.1"), ip_address("fd00::1"))
    assert b.uid == "my-uid"
    assert str(b.identity) == "spiffe://cluster.local/ns/default/sa/b-sa"
    assert (b.cluster_id, b.canonical_name, b.canonical_revision, b.status) == ("c1", "b-app", "v2", "Unhealthy")
    assert (b.workload_name, b.workload_type, b.hostname, b.native_tunnel) == (
        "b-deploy",
        "deployment",
        "b.example",
        True,
    )
    assert b.authorization_policies == ("default/sel",)
    assert mesh.policies[0].dry_run is True


def test_uid_default_uses_cluster_id():
    mesh = parse_config("workloads: [{name: a, namespace: ns, clusterId: c9, workloadIps: ['10.0.0.1']}]")
    assert mesh.workloads[0].uid == "c9//v1/Pod/ns/a"


def test_match_forms():
    mesh = parse_config(
        textwrap.dedent("""\
        policies:
        - name: p
          namespace: default
          scope: Global
          action: Allow
          rules:
          - - - principals:
                - "spiffe://cluster.local/ns/default/sa/client"
                - "cluster.local/ns/prod/*"
                - "*/sa/admin"
                - "*"
                - !Prefix "spiffe://td/ns/"
                - !Suffix "/sa/x"
                - !Exact "td/ns/a/sa/b"
                - !Presence
                - {Exact: "spiffe://td/ns/c/sa/d"}
                - {Prefix: "x"}
                - {Suffix: "y"}
                - {Presence: {}}
                notNamespaces: ["kube-*"]
                serviceAccounts: ["default/client", {namespace: prod, serviceAccount: api}]
                notServiceAccounts: ["default/bad"]
                sourceIps: ["10.0.0.0/8", "fd00::/8", "192.0.2.1"]
                notSourceIps: ["10.9.0.0/16"]
                destinationIps: ["127.0.3.0/24"]
                notDestinationIps: ["127.0.3.9"]
                destinationPorts: [80, "8080"]
                notDestinationPorts: [9999]
        """)
    )
    m = mesh.policies[0].rules[0][0][0]
    assert m.principals == (
        StringMatch("exact", "cluster.local/ns/default/sa/client"),
        StringMatch("prefix", "cluster.local/ns/prod/"),
        StringMatch("suffix", "/sa/admin"),
        StringMatch("presence"),
        StringMatch("prefix", "td/ns/"),
        StringMatch("suffix", "/sa/x"),
        StringMatch("exact", "td/ns/a/sa/b"),
        StringMatch("presence"),
        StringMatch("exact", "td/ns/c/sa/d"),
        StringMatch("prefix", "x"),
        StringMatch("suffix", "y"),
        StringMatch("presence"),
    )
    assert m.not_namespaces == (StringMatch("prefix", "kube-"),)
    assert m.service_accounts == (ServiceAccountMatch("default", "client"), ServiceAccountMatch("prod", "api"))
    assert m.not_service_accounts == (ServiceAccountMatch("default", "bad"),)
    assert [str(n) for n in m.source_ips] == ["10.0.0.0/8", "fd00::/8", "192.0.2.1/32"]
    assert [str(n) for n in m.not_source_ips] == ["10.9.0.0/16"]
    assert [str(n) for n in m.destination_ips] == ["127.0.3.0/24"]
    assert [str(n) for n in m.not_destination_ips] == ["127.0.3.9/32"]
    assert m.destination_ports == (80, 8080)
    assert m.not_destination_ports == (9999,)


# --- errors: one line per problem, "<file>: <path>: <message>" -----------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        # bad values
        (
            "workloads:\n" + GOOD_WORKLOAD + "- {name: b, namespace: default, workloadIps: ['10.0.0.300']}",
            "mesh.yaml: workloads[1].workloadIps[0]: '10.0.0.300' is not an IP address",
        ),
        (
            "workloads: [{name: b, namespace: default, workloadIps: [10]}]",
            "mesh.yaml: workloads[0].workloadIps[0]: expected an IP address, got an integer (10)",
        ),
        (
            "workloads: [{name: b, namespace: default, workloadIps: '10.0.0.1'}]",
            "mesh.yaml: workloads[0].workloadIps: expected a list, got a string ('10.0.0.1')",
        ),
        (
            "workloads: [{name: b, namespace: default, workloadIps: ['10.0.0.1'], protocol: HTTP}]",
            "mesh.yaml: workloads[0].protocol: 'HTTP' is not one of HBONE, TCP",
        ),
        (
            "workloads: [{name: b, namespace: default, workloadIps: ['10.0.0.1'], status: 1}]",
            "mesh.yaml: workloads[0].status: an integer (1) is not one of Healthy, Unhealthy",
        ),
        (
            "workloads: [{name: b, namespace: default, workloadIps: ['10.0.0.1'], nativeTunnel: 'yes'}]",
            "mesh.yaml: workloads[0].nativeTunnel: expected true or false, got a string ('yes')",
        ),
        (
            "workloads: [{name: 7, namespace: default, workloadIps: ['10.0.0.1']}]",
            "mesh.yaml: workloads[0].name: expected a string, got an integer (7)",
        ),
        (
            "workloads: [{name: a, namespace: 'my ns', workloadIps: ['10.0.0.1']}]",
            "mesh.yaml: workloads[0].namespace: namespace 'my ns' may only contain letters, digits, '.', '-' and '_'",
        ),
        (
            "workloads: [{name: a, namespace: ns, serviceAccount: 'a/b', workloadIps: ['10.0.0.1']}]",
            (
                "mesh.yaml: workloads[0].serviceAccount: service account 'a/b' may only contain letters, digits, '.', '-'"
                " and '_'"
            ),
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], services: {'echo': {80: 8080}}}]",
            'mesh.yaml: workloads[0].services["echo"]: \'echo\' is not "namespace/hostname"',
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], services: {'ns/echo': {80: 70000}}}]",
            'mesh.yaml: workloads[0].services["ns/echo"][80]: 70000 is not a port number (1-65535)',
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], services: {'ns/echo': {0: 80}}}]",
            'mesh.yaml: workloads[0].services["ns/echo"][0]: 0 is not a port number (1-65535)',
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], authorizationPolicies: [nope]}]",
            "mesh.yaml: workloads[0].authorizationPolicies[0]: 'nope' is not \"namespace/name\"",
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, vips: ['net/1.2.3'], ports: {80: 8080}}]",
            'mesh.yaml: services[0].vips[0]: \'net/1.2.3\' is not "network/ip" (e.g. "/10.0.0.1")',
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: {80: true}}]",
            "mesh.yaml: services[0].ports[80]: expected a port number, got a boolean (true)",
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: [80]}]",
            "mesh.yaml: services[0].ports: expected a mapping, got a list",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Cluster, action: Allow, rules: []}]",
            "mesh.yaml: policies[0].scope: 'Cluster' is not one of Global, Namespace, WorkloadSelector",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: ALLOW, rules: []}]",
            "mesh.yaml: policies[0].action: 'ALLOW' is not one of Allow, Deny",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: [[{sourceIps: []}]]}]",
            "mesh.yaml: policies[0].rules[0][0]: expected a list, got a mapping",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: [[[{sourceIps: ['10.0.0.0/33']}]]]}]",
            "mesh.yaml: policies[0].rules[0][0][0].sourceIps[0]: '10.0.0.0/33' is not an IP address or CIDR range",
        ),
        (
            (
                "policies: [{name: p, namespace: ns, scope: Global, action: Allow,"
                " rules: [[[{notDestinationPorts: [99999]}]]]}]"
            ),
            "mesh.yaml: policies[0].rules[0][0][0].notDestinationPorts[0]: 99999 is not a port number (1-65535)",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: [[[{principals: [{Regex: x}]}]]]}]",
            "mesh.yaml: policies[0].rules[0][0][0].principals[0]: 'Regex' is not one of Exact, Prefix, Suffix, Presence",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: [[[{principals: [{Exact: 3}]}]]]}]",
            "mesh.yaml: policies[0].rules[0][0][0].principals[0]: Exact needs a string, got an integer (3)",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: [[[{serviceAccounts: [sa]}]]]}]",
            "mesh.yaml: policies[0].rules[0][0][0].serviceAccounts[0]: 'sa' is not \"namespace/serviceAccount\"",
        ),
        (
            (
                "policies: [{name: p, namespace: ns, scope: Global, action: Allow,"
                " rules: [[[{serviceAccounts: [{namespace: a}]}]]]}]"
            ),
            (
                "mesh.yaml: policies[0].rules[0][0][0].serviceAccounts[0]: missing 'serviceAccount'; "
                "expected namespace and serviceAccount"
            ),
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, dryRun: 1, rules: []}]",
            "mesh.yaml: policies[0].dryRun: expected true or false, got an integer (1)",
        ),
        # unknown, unsupported and missing keys
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], protocl: HBONE}]",
            "mesh.yaml: workloads[0].protocl: unknown key (did you mean 'protocol'?)",
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], colour: blue}]",
            "mesh.yaml: workloads[0].colour: unknown key",
        ),
        # ztunnel's fields that ztwisted ignores are still checked as ztunnel checks them
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], waypoint: {destination: /10.0.0.9}}]",
            "mesh.yaml: workloads[0].waypoint.hboneMtlsPort: required field is missing",
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: {}, loadBalancer: {mode: Strict, healthPolicy: AllowAll, routingPreferences: [Planet]}}]",
            "mesh.yaml: services[0].loadBalancer.routingPreferences[0]: 'Planet' is not one of Region, Zone, Subzone, Node, Cluster, Network",
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], capacity: -1}]",
            "mesh.yaml: workloads[0].capacity: expected a whole number from 0 to 4294967295, got an integer (-1)",
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: {}, cidrVips: ['/10.0.0.0/8']}]",
            "mesh.yaml: services[0].cidrVips[0]: expected {network: ..., cidr: ...}, got a string ('/10.0.0.0/8')",
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: {}, endpoints: {u: {workloadUid: u, port: {}}}}]",
            'mesh.yaml: services[0].endpoints["u"].status: required field is missing',
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: {}, visibility: Private}]",
            "mesh.yaml: services[0].visibility: 'Private' is not one of Public, Namespace",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: [[[{principal: [x]}]]]}]",
            "mesh.yaml: policies[0].rules[0][0][0].principal: unknown key (did you mean 'principals'?)",
        ),
        ("workload: []", "mesh.yaml: workload: unknown key (did you mean 'workloads'?)"),
        ("workloads: [{name: a, namespace: ns}]", "mesh.yaml: workloads[0].workloadIps: required field is missing"),
        (
            "services: [{name: s, namespace: ns, hostname: h}]",
            "mesh.yaml: services[0].ports: required field is missing",
        ),
        (
            "policies: [{name: p, namespace: ns, scope: Global, action: Allow}]",
            "mesh.yaml: policies[0].rules: required field is missing",
        ),
        # wrong shapes
        ("workloads: {}", "mesh.yaml: workloads: expected a list, got a mapping"),
        ("workloads: [3]", "mesh.yaml: workloads[0]: expected a mapping, got an integer (3)"),
        ("just text", "mesh.yaml: (top level): expected a mapping, got a string ('just text')"),
        (
            "- name: a\n  workloadIp: 127.0.0.1",
            (
                "mesh.yaml: (top level): expected a mapping with workloads, services and policies, got a list "
                "(the old ztunnel format that listed workloads only)"
            ),
        ),
        # YAML itself
        (
            "workloads: [",
            (
                "mesh.yaml: line 1, column 13: invalid YAML: expected the node content, but found "
                "'<stream end>' (while parsing a flow node)"
            ),
        ),
        (
            "workloads:\n- name: a\n  name: b\n",
            "mesh.yaml: line 3, column 3: invalid YAML: duplicate key 'name' (while reading a mapping)",
        ),
        (
            "workloads: !Foo x",
            ("mesh.yaml: line 1, column 12: invalid YAML: could not determine a constructor for the tag '!Foo'"),
        ),
    ],
)
def test_error_messages(text, expected):
    assert error_of(text) == expected


def test_every_problem_is_reported_one_per_line():
    message = error_of("""\
        workloads:
        - name: a
          namespace: default
          workloadIps: ["10.0.0.300", "10.0.0.1"]
          protocol: http
        - name: b
          workloadIps: ["10.0.0.2"]
          extra: 1
        policies:
        - {name: p, namespace: ns, scope: Global, action: Allow, rules: [[[{destinationPorts: [0]}]]]}
        """)
    assert message.splitlines() == [
        "mesh.yaml: workloads[0].workloadIps[0]: '10.0.0.300' is not an IP address",
        "mesh.yaml: workloads[0].protocol: 'http' is not one of HBONE, TCP",
        "mesh.yaml: workloads[1].extra: unknown key",
        "mesh.yaml: workloads[1].namespace: required field is missing",
        "mesh.yaml: policies[0].rules[0][0][0].destinationPorts[0]: 0 is not a port number (1-65535)",
    ]


def test_error_carries_source_and_problems():
    with pytest.raises(ConfigError) as info:
        parse_config("workloads: 1")
    assert info.value.source == "<string>"
    assert info.value.problems == (Problem("workloads", "expected a list, got an integer (1)"),)
    assert str(info.value) == "<string>: workloads: expected a list, got an integer (1)"


def test_load_config_names_the_file_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mesh.yaml").write_text(
        "workloads:\n" + GOOD_WORKLOAD + "- {name: b, namespace: d, workloadIps: [x]}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config("mesh.yaml")
    assert str(info.value) == "mesh.yaml: workloads[1].workloadIps[0]: 'x' is not an IP address"
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "mesh.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'mesh.yaml'}: workloads[1]")


def test_load_config_unreadable_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == f"{missing}: (file): cannot read: No such file or directory"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"workloads: \xff\n")
    with pytest.raises(ConfigError) as info:
        load_config(binary)
    assert str(info.value) == f"{binary}: (file): not UTF-8 text: invalid start byte at byte 11"


# --- ConfigWatcher -------------------------------------------------------------


def mesh_yaml(*names):
    items = "".join(
        f"- {{name: {n}, namespace: default, workloadIps: ['10.0.0.{i + 1}']}}\n" for i, n in enumerate(names)
    )
    return "workloads:\n" + items if names else "workloads: []\n"


class Recorder:
    """Collects watcher callbacks; `next()` is a Deferred for the next one."""

    def __init__(self):
        self.changes = []
        self.errors = []
        self._waiting = []

    def on_change(self, mesh):
        self.changes.append(mesh)
        self._fire(("change", mesh))

    def on_error(self, error):
        self.errors.append(error)
        self._fire(("error", error))

    def _fire(self, event):
        waiting, self._waiting = self._waiting, []
        for d in waiting:
            d.callback(event)

    def next(self, timeout=5):
        d = defer.Deferred()
        self._waiting.append(d)
        return d.addTimeout(timeout, reactor)


def names(mesh):
    return [w.name for w in mesh.workloads]


@pytest.fixture
def watched(tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text(mesh_yaml("a"))
    recorder = Recorder()
    watcher = ConfigWatcher(str(path), recorder.on_change, recorder.on_error, reactor, current=load_config(path))
    watcher.start()
    yield path, watcher, recorder
    watcher.stop()


@pytest_twisted.inlineCallbacks
def test_watcher_good_edit_calls_on_change(watched):
    path, watcher, recorder = watched
    event = recorder.next()
    path.write_text(mesh_yaml("a", "b"))
    kind, mesh = yield event
    assert kind == "change"
    assert names(mesh) == ["a", "b"]
    assert watcher.current is mesh
    assert recorder.errors == []


@pytest_twisted.inlineCallbacks
def test_watcher_bad_edit_calls_on_error_and_keeps_the_last_good_mesh(watched):
    path, watcher, recorder = watched
    before = watcher.current
    event = recorder.next()
    path.write_text("workloads:\n- {name: b, namespace: default, workloadIps: ['10.0.0.300']}\n")
    kind, error = yield event
    assert kind == "error"
    assert isinstance(error, ConfigError)
    assert str(error) == f"{path}: workloads[0].workloadIps[0]: '10.0.0.300' is not an IP address"
    assert watcher.current is before
    assert recorder.changes == []
    # Fixing the file brings the new configuration in.
    event = recorder.next()
    path.write_text(mesh_yaml("c"))
    kind, mesh = yield event
    assert (kind, names(mesh)) == ("change", ["c"])


@pytest_twisted.inlineCallbacks
def test_watcher_sees_atomic_rename_replace(watched):
    path, _watcher, recorder = watched
    event = recorder.next()
    temporary = path.parent / ".mesh.yaml.tmp"
    temporary.write_text(mesh_yaml("renamed"))
    os.replace(temporary, path)
    kind, mesh = yield event
    assert (kind, names(mesh)) == ("change", ["renamed"])
    # The watch survives the replacement: a later edit is seen too.
    event = recorder.next()
    path.write_text(mesh_yaml("again"))
    kind, mesh = yield event
    assert (kind, names(mesh)) == ("change", ["again"])


@pytest_twisted.inlineCallbacks
def test_watcher_ignores_other_files_and_unchanged_content(watched):
    path, _watcher, recorder = watched
    (path.parent / "other.yaml").write_text("not: [valid")
    path.write_text(mesh_yaml("a"))  # same content as before
    yield task.deferLater(reactor, 0.4, lambda: None)
    assert recorder.changes == [] and recorder.errors == []


@pytest.fixture
def clocked(tmp_path):
    """A watcher on a real file, fed inotify events by hand, on a fake clock."""
    path = tmp_path / "mesh.yaml"
    path.write_text(mesh_yaml("a"))
    clock = task.Clock()
    recorder = Recorder()
    watcher = ConfigWatcher(path, recorder.on_change, recorder.on_error, clock, current=load_config(path))

    def event(mask, name=b"mesh.yaml"):
        watcher._notified(None, FilePath(os.fsencode(tmp_path)).child(name), mask)

    return path, watcher, recorder, clock, event


def test_watcher_waits_for_the_writer_to_close_the_file(clocked):
    path, _watcher, recorder, clock, event = clocked
    # `cat > mesh.yaml`, slowly: truncate, write half, pause, write the rest, close.
    path.write_text(mesh_yaml("b"))  # a valid first half of what is coming
    for _ in range(3):
        event(inotify.IN_MODIFY)
        clock.advance(0.5)
    event(inotify.IN_CLOSE_WRITE, b"other.yaml")
    assert recorder.changes == [] and recorder.errors == []
    path.write_text(mesh_yaml("b", "c"))
    event(inotify.IN_CLOSE_WRITE)
    clock.advance(0.1)
    assert [names(mesh) for mesh in recorder.changes] == [["b", "c"]]


def test_watcher_reads_a_file_its_writer_keeps_open_after_a_quiet_while(clocked):
    path, watcher, recorder, clock, event = clocked
    path.write_text(mesh_yaml("b"))
    event(inotify.IN_MODIFY)
    clock.advance(watcher.writer_timeout - 0.01)
    assert recorder.changes == []
    clock.advance(0.01)
    assert [names(mesh) for mesh in recorder.changes] == [["b"]]


def test_watcher_reports_a_file_that_stays_empty(clocked):
    path, watcher, recorder, clock, event = clocked
    before = watcher.current
    path.write_text("")
    event(inotify.IN_CLOSE_WRITE)
    clock.advance(0.1)
    assert recorder.errors == []  # not yet: a writer may be about to write
    clock.advance(watcher.empty_grace)
    assert len(recorder.errors) == 1 and isinstance(recorder.errors[0], EmptyConfigError)
    assert recorder.changes == [] and watcher.current is before
    assert clock.getDelayedCalls() == []


def test_watcher_takes_an_empty_file_for_a_writer_that_has_not_written_yet(clocked):
    path, _watcher, recorder, clock, event = clocked
    # Truncate and close, then write in a second open (`truncate -s0 f; cat new > f`).
    path.write_text("")
    event(inotify.IN_CLOSE_WRITE)
    clock.advance(0.5)
    path.write_text(mesh_yaml("b"))
    event(inotify.IN_MODIFY)
    event(inotify.IN_CLOSE_WRITE)
    clock.advance(0.1)
    assert [names(mesh) for mesh in recorder.changes] == [["b"]]
    assert recorder.errors == []


def test_watcher_reports_a_missing_file(clocked):
    path, _watcher, recorder, clock, event = clocked
    path.unlink()
    event(inotify.IN_MOVED_TO)
    clock.advance(0.1)
    assert len(recorder.errors) == 1
    assert str(recorder.errors[0]).startswith(f"{path}: (file): cannot read")


def test_watcher_stop_cancels_a_pending_reload():
    clock = task.Clock()
    calls = []
    watcher = ConfigWatcher("/nonexistent/mesh.yaml", calls.append, calls.append, clock)
    watcher._notified(None, FilePath(b"/nonexistent/mesh.yaml"), inotify.IN_CLOSE_WRITE)
    watcher.stop()
    clock.advance(1)
    assert calls == [] and clock.getDelayedCalls() == []


def test_watcher_stop_releases_the_inotify_descriptor(tmp_path):
    path = tmp_path / "mesh.yaml"
    path.write_text(mesh_yaml("a"))
    watcher = ConfigWatcher(path, print, print, reactor)
    before = set(reactor.getReaders())
    watcher.start()
    added = set(reactor.getReaders()) - before
    assert len(added) == 1
    (notifier,) = added
    watcher.stop()
    assert notifier not in reactor.getReaders()
    assert notifier.connected == 0


@pytest_twisted.inlineCallbacks
def test_watcher_follows_a_configmap_style_symlink_swap(tmp_path):
    # Kubernetes mounts: mesh.yaml -> ..data/mesh.yaml, ..data -> ..v1; an
    # update writes ..v2 and renames a new symlink over ..data.
    (tmp_path / "..v1").mkdir()
    (tmp_path / "..v1" / "mesh.yaml").write_text(mesh_yaml("v1"))
    os.symlink("..v1", tmp_path / "..data")
    os.symlink("..data/mesh.yaml", tmp_path / "mesh.yaml")
    recorder = Recorder()
    path = tmp_path / "mesh.yaml"
    watcher = ConfigWatcher(path, recorder.on_change, recorder.on_error, reactor, current=load_config(path))
    watcher.start()
    try:
        event = recorder.next()
        (tmp_path / "..v2").mkdir()
        (tmp_path / "..v2" / "mesh.yaml").write_text(mesh_yaml("v2"))
        os.symlink("..v2", tmp_path / "..data_tmp")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        kind, mesh = yield event
        assert (kind, names(mesh)) == ("change", ["v2"])
    finally:
        watcher.stop()


# --- ztunnel's fields that change what ztwisted does --------------------------------------------

SHARED_HOSTNAME = """\
workloads:
- {uid: c, name: client, namespace: web, workloadIps: ["10.0.0.1"], services: {}}
- {uid: s, name: shopper, namespace: shop, workloadIps: ["10.0.0.2"], services: {}}
- {uid: d, name: db-default, namespace: default, workloadIps: ["10.0.1.1"], services: {"default/db.example.com": {5432: 5432}}}
- {uid: e, name: db-ext, namespace: ext, workloadIps: ["10.0.1.2"], services: {"ext/db.example.com": {5432: 5432}}}
- {uid: p, name: db-shop, namespace: shop, workloadIps: ["10.0.1.3"], services: {"shop/db.example.com": {5432: 5432}}}
services:
- {name: db, namespace: default, hostname: db.example.com, vips: ["/10.96.0.1"], ports: {5432: 5432}}
- {name: db, namespace: ext, hostname: db.example.com, vips: ["/10.96.0.1"], ports: {5432: 5432}, canonical: %s}
- {name: db, namespace: shop, hostname: db.example.com, vips: ["/10.96.0.1"], ports: {5432: 5432}, visibility: Namespace}
"""


@pytest.mark.parametrize("canonical", [True, False])
def test_canonical_chooses_among_services_sharing_a_hostname_or_vip_as_in_ztunnel(canonical):
    mesh = parse_config(SHARED_HOSTNAME % str(canonical).lower())
    # A client in a namespace without its own: the canonical one, else the first in the file.
    expected = "ext" if canonical else "default"
    assert mesh.service_by_hostname("db.example.com", client_namespace="web").namespace == expected
    assert mesh.service_by_vip("10.96.0.1", client_namespace="web").namespace == expected
    destination = mesh.resolve("10.96.0.1", 5432, client_namespace="web")
    assert destination.workload.name == f"db-{expected}"
    # A client whose namespace has one always gets its own, canonical or not.
    assert mesh.service_by_hostname("db.example.com", client_namespace="shop").namespace == "shop"
    assert mesh.resolve("10.96.0.1", 5432, client_namespace="shop").workload.name == "db-shop"
    # Naming the namespace still finds exactly that one.
    assert mesh.service_by_hostname("db.example.com", "ext").namespace == "ext"


def test_a_namespace_visibility_service_is_seen_only_from_its_namespace():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - {uid: p, name: db-shop, namespace: shop, workloadIps: ["10.0.1.3"], services: {"shop/db.example.com": {5432: 5432}}}
        services:
        - {name: db, namespace: shop, hostname: db.example.com, vips: ["/10.96.0.1"], ports: {5432: 5432}, visibility: Namespace}
        """)
    )
    (only,) = mesh.services
    assert mesh.service_by_hostname("db.example.com", client_namespace="web") is None
    assert mesh.resolve("10.96.0.1", 5432, client_namespace="web").kind == "passthrough"
    assert mesh.service_by_hostname("db.example.com", client_namespace="shop") is only
    assert mesh.resolve("10.96.0.1", 5432, client_namespace="shop").workload.name == "db-shop"


def warnings_of(text, source="mesh.yaml"):
    with capturedLogs() as events:
        mesh = parse_config(textwrap.dedent(text), source)
    return mesh, [formatEvent(e) for e in events if e.get("log_namespace") == "ztwisted.config"]


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "workloads:\n" + GOOD_WORKLOAD + GOOD_WORKLOAD.replace("10.0.0.1", "10.0.0.2"),
            (
                "mesh.yaml: workloads[0].uid: duplicate uid 'Kubernetes//v1/Pod/default/a' (uid not set: made from "
                "clusterId, namespace and name): workloads[1] replaces this entry, as in ztunnel"
            ),
        ),
        (
            (
                "workloads: [{uid: x, name: a, namespace: ns, workloadIps: ['10.0.0.1']},"
                " {uid: x, name: b, namespace: ns, workloadIps: ['10.0.0.2']}]"
            ),
            "mesh.yaml: workloads[0].uid: duplicate uid 'x': workloads[1] replaces this entry, as in ztunnel",
        ),
        (
            (
                "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1']},"
                " {name: b, namespace: ns, workloadIps: ['10.0.0.2', '10.0.0.1']}]"
            ),
            (
                "mesh.yaml: workloads[1].workloadIps[1]: 10.0.0.1 is also the address of workload 'Kubernetes//v1/Pod/ns/a'; "
                'as in ztunnel, a connection from it is attributed to one of them: a pod (uid with "//Pod/") first, '
                "then HBONE, else the last"
            ),
        ),
        (
            (
                "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1']}]\n"
                "services: [{name: s, namespace: ns, hostname: h, vips: ['/10.0.0.1'], ports: {}}]"
            ),
            (
                "mesh.yaml: services[0].vips[0]: 10.0.0.1 is also the address of workload 'Kubernetes//v1/Pod/ns/a'; "
                "as in ztunnel, connections to it go to the service"
            ),
        ),
        (
            (
                "services: [{name: s, namespace: ns, hostname: h, vips: [/10.96.0.1], ports: {}},"
                " {name: t, namespace: ns, hostname: t, vips: [/10.96.0.1], ports: {}}]"
            ),
            (
                "mesh.yaml: services[1].vips[0]: 10.96.0.1 is also a VIP of service 'ns/h' in the same namespace; as in "
                "ztunnel, this later service takes it"
            ),
        ),
        (
            "services: [{name: s, namespace: ns, hostname: h, ports: {}}, {name: t, namespace: ns, hostname: h, ports: {}}]",
            "mesh.yaml: services[0]: duplicate service 'ns/h': services[1] replaces this entry, as in ztunnel",
        ),
        (
            (
                "policies: [{name: p, namespace: ns, scope: Global, action: Allow, rules: []},"
                " {name: p, namespace: ns, scope: Global, action: Deny, rules: []}]"
            ),
            "mesh.yaml: policies[0]: duplicate policy 'ns/p': policies[1] replaces this entry, as in ztunnel",
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], services: {'ns/echo': {80: 8080}}}]",
            (
                "mesh.yaml: workloads[0].services[\"ns/echo\"]: no service with namespace 'ns' and hostname 'echo' in "
                "services; as in ztunnel, this has no effect"
            ),
        ),
        (
            "workloads: [{name: a, namespace: ns, workloadIps: ['10.0.0.1'], authorizationPolicies: [ns/p]}]",
            "mesh.yaml: workloads[0].authorizationPolicies[0]: no policy 'ns/p' in policies; as in ztunnel, it selects nothing",
        ),
    ],
)
def test_what_ztunnel_accepts_but_is_likely_a_mistake_is_used_with_a_warning(text, expected):
    _mesh, warnings = warnings_of(text)
    assert warnings == [expected]


def test_a_later_entry_replaces_an_earlier_one_with_the_same_key_as_in_ztunnel():
    mesh, _ = warnings_of("""\
        workloads:
        - {uid: x, name: old, namespace: ns, workloadIps: ['10.0.0.1']}
        - {uid: x, name: new, namespace: ns, workloadIps: ['10.0.0.2']}
        services:
        - {name: s, namespace: ns, hostname: h, vips: [/10.96.0.1], ports: {80: 80}}
        - {name: s2, namespace: ns, hostname: h, vips: [/10.96.0.2], ports: {80: 80}}
        policies:
        - {name: p, namespace: ns, scope: Global, action: Allow, rules: []}
        - {name: p, namespace: ns, scope: Global, action: Deny, rules: []}
        """)
    (workload,) = mesh.workloads
    assert workload.name == "new" and mesh.workload_by_ip("10.0.0.1") is None
    (service,) = mesh.services
    assert service.name == "s2" and mesh.service_by_vip("10.96.0.1") is None
    (policy,) = mesh.policies
    assert policy.action == "Deny"


def test_shared_addresses_are_resolved_as_ztunnel_resolves_them():
    mesh, _ = warnings_of("""\
        workloads:
        - {uid: "c1//Pod/ns/pod", name: pod, namespace: ns, workloadIps: ['10.0.0.1'], protocol: HBONE}
        - {uid: "c1//WorkloadEntry/ns/vm", name: vm, namespace: ns, workloadIps: ['10.0.0.1'], protocol: HBONE}
        - {uid: "c1//v1/Pod/ns/tcp", name: tcp, namespace: ns, workloadIps: ['10.0.0.2']}
        - {uid: "c1//v1/Pod/ns/tcp2", name: tcp2, namespace: ns, workloadIps: ['10.0.0.2']}
        - {uid: "c1//v1/Pod/ns/backend", name: backend, namespace: ns, workloadIps: ['10.0.1.1'],
           services: {"ns/h": {80: 8080}}}
        services:
        - {name: s, namespace: ns, hostname: h, vips: [/10.0.0.2, /10.96.0.1], ports: {80: 8080}}
        - {name: t, namespace: ns, hostname: t, vips: [/10.96.0.1], ports: {80: 8080}}
        """)
    # A pod (its uid has "//Pod/", Istio's form; not "//v1/Pod/") before anything else.
    assert mesh.workload_by_ip("10.0.0.1").name == "pod"
    assert mesh.workload_by_ip("10.0.0.2").name == "tcp2"  # equal rank: the last
    # A VIP that is also a workload's address: outbound goes to the service.
    assert mesh.resolve("10.0.0.2", 80).workload.name == "backend"
    # Two services of one namespace at one VIP: the later takes it.
    assert mesh.service_by_vip("10.96.0.1").name == "t"


def test_services_of_different_namespaces_may_share_a_vip_quietly():
    mesh, warnings = warnings_of(SHARED_HOSTNAME % "true")
    assert len(mesh.services) == 3 and warnings == []


def test_endpoints_listed_by_a_service_are_routed_to_with_their_own_ports():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - {uid: w, name: w, namespace: ns, workloadIps: ["10.0.0.7"], status: Unhealthy}
        services:
        - name: s
          namespace: ns
          hostname: s.example.com
          vips: ["/10.96.0.7"]
          ports: {80: 8080}
          endpoints: {w: {workloadUid: w, port: {80: 9090}, status: Unhealthy}}
        """)
    )
    # ztunnel uses a service's own endpoints whatever their status (it filters only workloads' ones).
    destination = mesh.resolve("10.96.0.7", 80)
    assert (destination.kind, destination.workload.uid, destination.port) == ("service", "w", 9090)


def test_host_network_workloads_are_not_found_by_address_nor_served():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - {uid: pod, name: pod, namespace: ns, workloadIps: ["10.0.0.1"]}
        - {uid: agent, name: agent, namespace: kube-system, workloadIps: ["10.0.0.1"], networkMode: HostNetwork}
        """)
    )
    assert mesh.workload_by_ip("10.0.0.1").uid == "pod"
    assert [w.uid for w in mesh.local_workloads(None)] == ["pod"]


def test_ztunnel_fields_without_effect_in_ztwisted_are_accepted():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - uid: w
          namespace: ns
          workloadIps: []
          capacity: 3
          locality: {region: r, zone: z, subzone: s}
          waypoint: {destination: "ns/waypoint.example.com", hboneMtlsPort: 15008}
          networkGateway: {destination: "/10.0.0.9", hboneMtlsPort: 15008}
          applicationTunnel: {protocol: NONE}
          services: {}
        services:
        - name: s
          namespace: ns
          hostname: s.example.com
          vips: []
          cidrVips: [{network: "", cidr: "10.96.0.0/16"}]
          ports: {}
          ipFamilies: Dual
          loadBalancer: {routingPreferences: [], mode: Standard, healthPolicy: AllowAll}
          weightedWaypoints: [{destination: {destination: "/10.0.0.9", hboneMtlsPort: 15008}, weight: 1}]
        """)
    )
    (workload,) = mesh.workloads
    assert (workload.uid, workload.name, workload.workload_ips) == ("w", "", ())


def test_capacity_weighs_a_services_endpoints_as_in_ztunnel():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - {uid: big, name: big, namespace: ns, workloadIps: ["10.0.0.1"], capacity: 3, services: {"ns/s": {80: 80}}}
        - {uid: small, name: small, namespace: ns, workloadIps: ["10.0.0.2"], services: {"ns/s": {80: 80}}}
        - {uid: off, name: off, namespace: ns, workloadIps: ["10.0.0.3"], capacity: 0, services: {"ns/s": {80: 80}}}
        services:
        - {name: s, namespace: ns, hostname: s, vips: ["/10.96.0.1"], ports: {80: 80}}
        """)
    )
    # Every point of the capacity range 0..3 picks an endpoint: three are big's, one is small's.
    picks = [mesh.resolve("10.96.0.1", 80, choice=lambda options, i=i: options[i]).workload.uid for i in range(4)]
    assert picks == ["big", "big", "big", "small"]
    only_off = mesh.resolve("10.96.0.1", 80, choice=random.Random(1).choice)
    assert only_off.kind == "service" and only_off.workload.uid != "off"
    drained = parse_config(
        textwrap.dedent("""\
        workloads:
        - {uid: off, name: off, namespace: ns, workloadIps: ["10.0.0.3"], capacity: 0, services: {"ns/s": {80: 80}}}
        services:
        - {name: s, namespace: ns, hostname: s, vips: ["/10.96.0.1"], ports: {80: 80}}
        """)
    )
    assert drained.resolve("10.96.0.1", 80).kind == "unroutable"


def test_yes_no_on_off_are_strings_as_in_ztunnels_yaml_1_2():
    mesh = parse_config("workloads: [{uid: off, name: no, namespace: on, serviceAccount: yes, workloadIps: []}]")
    (workload,) = mesh.workloads
    assert (workload.uid, workload.name, workload.namespace, workload.service_account) == ("off", "no", "on", "yes")
    assert (
        parse_config("policies: [{name: p, namespace: ns, scope: Global, action: Deny, rules: [], dryRun: true}]")
        .policies[0]
        .dry_run
        is True
    )


def test_load_balancer_passthrough_and_allow_all_as_in_ztunnel():
    mesh = parse_config(
        textwrap.dedent("""\
        workloads:
        - {uid: sick, name: sick, namespace: ns, workloadIps: ["10.0.0.1"], status: Unhealthy,
           services: {"ns/all": {80: 8080}, "ns/healthy": {80: 8080}}}
        services:
        - {name: all, namespace: ns, hostname: all, vips: ["/10.96.0.1"], ports: {80: 8080},
           loadBalancer: {routingPreferences: [], mode: Standard, healthPolicy: AllowAll}}
        - {name: healthy, namespace: ns, hostname: healthy, vips: ["/10.96.0.2"], ports: {80: 8080}}
        - {name: direct, namespace: ns, hostname: direct, vips: ["/10.96.0.3"], ports: {80: 8080},
           loadBalancer: {routingPreferences: [], mode: Passthrough, healthPolicy: OnlyHealthy}}
        """)
    )
    assert mesh.resolve("10.96.0.1", 80).workload.uid == "sick"
    assert mesh.resolve("10.96.0.2", 80).kind == "unroutable"
    direct = mesh.resolve("10.96.0.3", 80)
    assert (direct.kind, direct.ip, direct.port, direct.service.name) == (
        "passthrough",
        ip_address("10.96.0.3"),
        80,
        "direct",
    )
