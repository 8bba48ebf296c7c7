"""Tests for the metrics registry and its exposed names."""

from __future__ import annotations

import re

import attrs
import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from ztwisted.metrics import TRAFFIC_LABELS, ConnectionLabels, Metrics


@attrs.frozen
class FakeWorkload:
    name: str
    namespace: str
    workload_name: str = ""


@attrs.frozen
class FakeService:
    hostname: str


def exposed_names(text: str) -> set[str]:
    """Sample names (the part before ``{`` or the value) of every sample line."""
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_istio_counter_names_are_exact():
    metrics = Metrics()
    labels = ConnectionLabels()
    metrics.opened(labels)
    metrics.closed(labels)
    metrics.bytes(labels, sent=10, received=20)
    text = metrics.render().decode()
    assert exposed_names(text) >= {
        "istio_tcp_connections_opened_total",
        "istio_tcp_connections_closed_total",
        "istio_tcp_received_bytes_total",
        "istio_tcp_sent_bytes_total",
    }
    assert "# TYPE istio_tcp_connections_opened_total counter" in text
    assert "_created" not in text
    assert "_total_total" not in text


def test_missing_labels_are_unknown_and_all_labels_present():
    metrics = Metrics()
    metrics.opened(ConnectionLabels())
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    (sample,) = families["istio_tcp_connections_opened"].samples
    assert set(sample.labels) == set(TRAFFIC_LABELS)
    assert sample.labels["source_workload"] == "unknown"
    assert sample.labels["destination_principal"] == "unknown"
    assert sample.labels["reporter"] == "source"
    assert sample.labels["request_protocol"] == "tcp"
    assert sample.labels["response_flags"] == "-"
    assert sample.labels["connection_security_policy"] == "unknown"
    assert sample.value == 1


def test_labels_from_workloads_and_identities():
    labels = ConnectionLabels.for_connection(
        "destination",
        source=FakeWorkload("client", "ns-a"),
        destination=FakeWorkload("server", "ns-b"),
        service=FakeService("echo.ns-b.svc.cluster.local"),
        source_identity="spiffe://cluster.local/ns/ns-a/sa/client",
        destination_identity="spiffe://cluster.local/ns/ns-b/sa/server",
        mutual_tls=True,
    )
    assert labels.as_dict() == {
        "reporter": "destination",
        "source_workload": "client",
        "source_workload_namespace": "ns-a",
        "source_principal": "spiffe://cluster.local/ns/ns-a/sa/client",
        "destination_workload": "server",
        "destination_workload_namespace": "ns-b",
        "destination_principal": "spiffe://cluster.local/ns/ns-b/sa/server",
        "destination_service": "echo.ns-b.svc.cluster.local",
        "request_protocol": "tcp",
        "response_flags": "-",
        "connection_security_policy": "mutual_tls",
    }
    assert labels.with_flags("DENY").as_dict()["response_flags"] == "DENY"


def test_workload_labels_are_the_workload_name_as_in_ztunnel():
    """ztunnel labels ``source_workload``/``destination_workload`` with ``workloadName``, not the pod name."""
    labels = ConnectionLabels.for_connection(
        "source",
        source=FakeWorkload("client-7d9f-abcde", "ns-a", workload_name="client"),
        destination=FakeWorkload("server-0", "ns-b", workload_name="server"),
    ).as_dict()
    assert (labels["source_workload"], labels["destination_workload"]) == ("client", "server")


def test_for_connection_rejects_unknown_reporter():
    with pytest.raises(ValueError, match="reporter must be"):
        ConnectionLabels.for_connection("sideways")


def test_bytes_counts_sent_and_received_separately():
    metrics = Metrics()
    labels = ConnectionLabels(source_workload="a")
    metrics.bytes(labels, sent=5)
    metrics.bytes(labels, sent=7, received=3)
    values = labels.as_dict()
    assert metrics.sample("istio_tcp_sent_bytes_total", values) == 12
    assert metrics.sample("istio_tcp_received_bytes_total", values) == 3
    with pytest.raises(ValueError, match="negative"):
        metrics.bytes(labels, sent=-1)


def test_ztwisted_metrics_are_exposed():
    metrics = Metrics()
    metrics.config_reloads.inc()
    metrics.config_reload_errors.inc()
    metrics.hbone_connections.labels(direction="inbound").inc()
    metrics.hbone_connections.labels(direction="outbound").inc(2)
    metrics.pool_connections_opened.inc()
    metrics.tls_handshake_failures.labels(reason="bad_certificate").inc()
    metrics.socks5_errors.labels(reason="timeout").inc()
    text = metrics.render().decode()
    assert exposed_names(text) >= {
        "ztwisted_config_reloads_total",
        "ztwisted_config_reload_errors_total",
        "ztwisted_hbone_connections",
        "ztwisted_pool_connections_opened_total",
        "ztwisted_tls_handshake_failures_total",
        "ztwisted_socks5_errors_total",
    }
    assert 'ztwisted_hbone_connections{direction="outbound"} 2.0' in text
    assert 'ztwisted_socks5_errors_total{reason="timeout"} 1.0' in text


def test_registries_are_private():
    first, second = Metrics(), Metrics()
    first.config_reloads.inc()
    assert first.sample("ztwisted_config_reloads_total") == 1
    assert second.sample("ztwisted_config_reloads_total") == 0


def test_create_or_return_shares_one_metric():
    metrics = Metrics()
    a = metrics.counter("ztwisted_widgets_total", "Widgets", ["kind"])
    b = metrics.counter("ztwisted_widgets", "Widgets", ["kind"])
    assert a is b and isinstance(a, Counter)
    assert metrics.counter("istio_tcp_sent_bytes_total", "x", TRAFFIC_LABELS) is metrics.sent_bytes
    g = metrics.gauge("ztwisted_level", "Level")
    assert metrics.gauge("ztwisted_level", "Level") is g and isinstance(g, Gauge)
    h = metrics.histogram("ztwisted_drain_seconds", "Drain time", buckets=[1, 5])
    assert metrics.histogram("ztwisted_drain_seconds", "Drain time") is h
    assert isinstance(h, Histogram)
    h.observe(2)
    text = metrics.render().decode()
    assert 'ztwisted_drain_seconds_bucket{le="5.0"} 1.0' in text
    assert "ztwisted_drain_seconds_created" not in text


def test_conflicting_redefinition_is_a_clear_error():
    metrics = Metrics()
    metrics.counter("ztwisted_things_total", "Things", ["a"])
    with pytest.raises(ValueError, match="already exists as a Counter with labels"):
        metrics.counter("ztwisted_things_total", "Things", ["b"])
    with pytest.raises(ValueError, match="asked for a Gauge"):
        metrics.gauge("ztwisted_hbone_connections", "x")


def test_content_type_is_prometheus_text():
    assert Metrics().content_type.startswith("text/plain; version=0.0.4")
