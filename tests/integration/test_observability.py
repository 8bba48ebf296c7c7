"""What operators see: config_dump, Prometheus metrics, readiness, quitquitquit, access and JSON logs."""

from __future__ import annotations

import json
import os
import re
import socket
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import CLIENT_IP, ECHO_VIP, SERVER_IP, SINK_IP, TwoNodes
from tests.support import ReplyAfterEofServer, echo_through, wait_until
from ztwisted.tools.harness import socks5_connect

pytestmark = pytest.mark.integration

ECHO_HOST = "echo.default.svc.cluster.local"
CLIENT_ID = "spiffe://cluster.local/ns/default/sa/client"
ECHO_ID = "spiffe://cluster.local/ns/default/sa/echo"


def echo(nodes, size: int = 10_000, host: str = ECHO_HOST, port: int = 80) -> int:
    """One echo through both nodes; returns the local port the app connection used."""
    payload = os.urandom(size)
    with socks5_connect(nodes.a.socks5, CLIENT_IP, host, port) as sock:
        local_port = sock.getsockname()[1]
        assert echo_through(sock, payload, timeout=10) == payload
    return local_port


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of every sample called ``name`` in a Prometheus text exposition."""
    found = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found.append((sample.labels, sample.value))
    return found


def matching(text: str, name: str, **labels) -> float:
    return sum(value for got, value in samples(text, name) if all(got.get(k) == v for k, v in labels.items()))


def closed_on_both(nodes, count: int = 1) -> None:
    """Metrics and access logs are written when a connection ends: wait for both sides."""
    wait_until(
        lambda: (
            nodes.a.metric("istio_tcp_connections_closed_total", reporter="source") >= count
            and nodes.b.metric("istio_tcp_connections_closed_total", reporter="destination") >= count
        ),
        what=f"{count} closed connection(s) on both nodes",
    )


# -- /config_dump -----------------------------------------------------------------


def test_config_dump_has_workloads_services_pool_and_certificates(two_nodes):
    echo(two_nodes)
    a, b = two_nodes.a.config_dump(), two_nodes.b.config_dump()

    assert a["node"] == "node-a" and b["node"] == "node-b"
    assert a["config_source"] == str(two_nodes.config)
    workloads = {w["name"]: w for w in a["workloads"]}
    assert set(workloads) == {"client", "echo", "sink"}
    assert workloads["client"]["local"] and not workloads["echo"]["local"]
    assert workloads["echo"]["workloadIps"] == [SERVER_IP]
    assert workloads["echo"]["identity"] == ECHO_ID
    assert workloads["echo"]["protocol"] == "HBONE"
    assert {w["name"] for w in b["workloads"] if w["local"]} == {"echo", "sink"}

    (service,) = a["services"]
    assert service["hostname"] == ECHO_HOST
    assert service["vips"] == [f"/{ECHO_VIP}"]
    assert service["ports"] == {"80": 8080}

    (entry,) = a["pool"]
    assert entry["source"] == CLIENT_ID
    assert entry["destination"] == f"{SERVER_IP}:15008"
    assert entry["destination_identities"] == [ECHO_ID]
    assert entry["source_ip"] == CLIENT_IP
    assert entry["usable"] is True and entry["goaway_received"] is False
    assert b["pool"] == []
    assert {i["workload"] for i in b["inbound"]} == {"echo", "sink"}

    now = datetime.now(UTC)
    for dump, identity in ((a, CLIENT_ID), (b, ECHO_ID)):
        certificates = {c["identity"]: c for c in dump["certificates"]}
        assert identity in certificates, dump["certificates"]
        certificate = certificates[identity]
        expiration = datetime.fromisoformat(certificate["expiration"])
        not_before = datetime.fromisoformat(certificate["not_before"])
        assert not_before <= now < expiration <= now + timedelta(hours=24, minutes=1)
        assert re.fullmatch(r"[0-9a-f]+", certificate["serial"])


# -- /metrics and /stats/prometheus ------------------------------------------------


def test_istio_tcp_metrics_with_labels_on_both_reporters(two_nodes):
    size = 123_457
    echo(two_nodes, size)
    closed_on_both(two_nodes)

    source = {
        "reporter": "source",
        "source_workload": "client",
        "source_workload_namespace": "default",
        "source_principal": CLIENT_ID,
        "destination_workload": "echo",
        "destination_workload_namespace": "default",
        "destination_principal": ECHO_ID,
        "destination_service": ECHO_HOST,
        "request_protocol": "tcp",
        "response_flags": "-",
        "connection_security_policy": "mutual_tls",
    }
    destination = dict(source, reporter="destination")
    del destination["destination_service"]  # see test_destination_reporter_names_the_service

    for node, labels in ((two_nodes.a, source), (two_nodes.b, destination)):
        for path in ("/metrics", "/stats/prometheus"):
            status, body = node.http("metrics", path)
            assert status == 200, (node.name, path)
            text = body.decode()
            assert matching(text, "istio_tcp_connections_opened_total", **labels) == 1, (node.name, path, text)
            assert matching(text, "istio_tcp_connections_closed_total", **labels) == 1, (node.name, path)
            # The echo carries `size` bytes each way.
            assert matching(text, "istio_tcp_sent_bytes_total", **labels) == size, (node.name, path)
            assert matching(text, "istio_tcp_received_bytes_total", **labels) == size, (node.name, path)
            # Every series has the full label set, and no *_created series are exposed.
            for got, _ in samples(text, "istio_tcp_connections_opened_total"):
                assert set(got) == set(source), got
            assert "_created" not in text


# ztwisted/hbone/inbound.py `_tunnel_requested` builds the destination-side labels without a
# service, so reporter="destination" series say destination_service="unknown". ztunnel guesses
# the service (proxy::guess_inbound_service): the first of the workload's services with a target
# port equal to the tunnel's destination port. Fix: parse the authority before creating the
# ConnectionRecord, pick that service from `self.workload.services` / `mesh.service_by_hostname`,
# and pass it as `service=` (and as "dst.service" in the access-log fields).
def test_destination_reporter_names_the_service(two_nodes):
    echo(two_nodes)
    closed_on_both(two_nodes)
    text = two_nodes.b.metrics()
    assert (
        matching(text, "istio_tcp_connections_opened_total", reporter="destination", destination_service=ECHO_HOST) == 1
    )


def test_plain_destination_is_not_mutual_tls(two_nodes):
    """A connection to an address outside the mesh is passed through and labelled so."""
    with socket.socket() as outside:
        outside.bind((SINK_IP.rsplit(".", 1)[0] + ".200", 0))
        outside.listen(1)
        host, port = outside.getsockname()
        with socks5_connect(two_nodes.a.socks5, CLIENT_IP, host, port) as sock:
            conn, _ = outside.accept()
            conn.close()
            sock.settimeout(5)
            assert sock.recv(1) == b""
    wait_until(
        lambda: two_nodes.a.metric("istio_tcp_connections_closed_total", connection_security_policy="unknown") == 1,
        what="the passthrough connection to close",
    )
    assert (
        two_nodes.a.metric("istio_tcp_connections_opened_total", reporter="source", destination_workload="unknown") == 1
    )


# -- readiness and quitquitquit ---------------------------------------------------


def test_readiness_says_ready(two_nodes):
    for node in (two_nodes.a, two_nodes.b):
        assert node.http("readiness", "/healthz/ready") == (200, b"ready\n")


def test_quitquitquit_makes_the_process_exit(two_nodes):
    node = two_nodes.a
    status, body = node.http("admin", "/quitquitquit", method="POST")
    assert (status, body) == (200, b"OK\n")
    assert node.process.wait(15) == 0
    assert any("quitquitquit" in e.get("message", "") for e in node.log_events())
    # Node-b is unaffected.
    assert two_nodes.b.http("readiness", "/healthz/ready") == (200, b"ready\n")


def test_quitquitquit_needs_post(two_nodes):
    status, _ = two_nodes.a.http("admin", "/quitquitquit")
    assert status == 405
    assert two_nodes.a.process.poll() is None


# -- access log and JSON lines -------------------------------------------------------


def access_events(node, direction: str) -> list[dict]:
    return [e for e in node.log_events() if e.get("scope") == "access" and e.get("direction") == direction]


def test_one_access_log_event_per_connection_on_both_nodes(two_nodes):
    replier = ReplyAfterEofServer(SERVER_IP, 8081)
    try:
        ports = [echo(two_nodes, 5_000), echo(two_nodes, 7_000, SERVER_IP, 8080)]
        payload = os.urandom(3_000)
        with socks5_connect(two_nodes.a.socks5, CLIENT_IP, SERVER_IP, 8081) as sock:
            ports.append(sock.getsockname()[1])
            assert echo_through(sock, payload, timeout=10) == payload
    finally:
        replier.close()
    sizes = [5_000, 7_000, 3_000]
    closed_on_both(two_nodes, 3)
    wait_until(
        lambda: len(access_events(two_nodes.a, "outbound")) >= 3 and len(access_events(two_nodes.b, "inbound")) >= 3,
        what="three access-log events per node",
    )

    outbound = access_events(two_nodes.a, "outbound")
    inbound = access_events(two_nodes.b, "inbound")
    assert len(outbound) == 3 and len(inbound) == 3
    for event, port, size in zip(outbound, ports, sizes, strict=True):
        assert event["message"] == "connection complete"
        assert event["level"] == "info" and "error" not in event, event
        assert event["src.addr"] == f"{CLIENT_IP}:{port}"
        assert event["src.workload"] == "client"
        assert event["src.identity"] == CLIENT_ID
        assert event["dst.identity"] == ECHO_ID
        assert event["dst.workload"] == "echo"
        assert event["dst.hbone_addr"] == f"{SERVER_IP}:15008"
        assert (event["bytes_sent"], event["bytes_recv"]) == (size, size)
        assert re.fullmatch(r"\d+ms", event["duration"])
    assert outbound[0]["dst.service"] == ECHO_HOST
    assert [e["dst.addr"] for e in outbound] == [f"{SERVER_IP}:8080", f"{SERVER_IP}:8080", f"{SERVER_IP}:8081"]
    for event, size in zip(inbound, sizes, strict=True):
        assert event["level"] == "info" and "error" not in event, event
        assert event["src.identity"] == CLIENT_ID
        assert event["dst.identity"] == ECHO_ID
        assert (event["bytes_sent"], event["bytes_recv"]) == (size, size)
        assert re.fullmatch(r"\d+ms", event["duration"])
    assert [e["dst.addr"] for e in inbound] == [f"{SERVER_IP}:8080", f"{SERVER_IP}:8080", f"{SERVER_IP}:8081"]


def test_inbound_access_log_keeps_the_forwarded_client_apart(two_nodes):
    """node-a's Forwarded header names the app's connection; node-b logs it as ``src.forwarded``
    (a claim), its ``src.addr`` is node-a's own connection."""
    port = echo(two_nodes)
    closed_on_both(two_nodes)
    (event,) = wait_until(lambda: access_events(two_nodes.b, "inbound"), what="the inbound access-log event")
    assert event["src.forwarded"] == f"{CLIENT_IP}:{port}"
    host, _, peer_port = event["src.addr"].rpartition(":")
    assert peer_port.isdigit() and int(peer_port) != port and host.startswith("127.")


def test_text_log_format_gives_access_lines_the_json_fields(tmp_path, echo_app):
    nodes = TwoNodes(tmp_path)
    nodes.b.extra_args = ("--log-format", "text")
    nodes.start()
    try:
        port = echo(nodes, 10_000)
        (line,) = wait_until(
            lambda: [line for line in nodes.b.log_path.read_text().splitlines() if "[access#" in line],
            what="node-b's access-log line",
        )
    finally:
        nodes.stop()
    assert "[access#info] connection complete src.addr=" in line, line
    fields = dict(field.split("=", 1) for field in line.split(" connection complete ", 1)[1].split(" "))
    assert fields["src.forwarded"] == f"{CLIENT_IP}:{port}"
    assert fields["src.identity"] == CLIENT_ID and fields["dst.identity"] == ECHO_ID
    assert fields["dst.addr"] == f"{SERVER_IP}:8080" and fields["dst.workload"] == "echo"
    assert fields["dst.service"] == ECHO_HOST and fields["direction"] == "inbound"
    assert (fields["bytes_sent"], fields["bytes_recv"]) == ("10000", "10000")
    assert re.fullmatch(r"\d+ms", fields["duration"]) and fields["outcome"] == "closed"


def test_json_log_lines_all_parse(two_nodes):
    echo(two_nodes)
    closed_on_both(two_nodes)
    for node in (two_nodes.a, two_nodes.b):
        lines = [line for line in node.log_path.read_text().splitlines() if line.strip()]
        assert len(lines) > 5
        for line in lines:
            event = json.loads(line)
            assert {"time", "level", "scope", "message"} <= set(event), line
            datetime.fromisoformat(event["time"].replace("Z", "+00:00"))
