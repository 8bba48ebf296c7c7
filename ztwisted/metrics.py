"""Prometheus metrics: ztunnel's ``istio_tcp_*`` names plus ``ztwisted_*`` ones.

One :class:`Metrics` owns a private registry, so tests and several nodes in
one process never share counters.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

UNKNOWN = "unknown"
# The classic text format: what render() produces and every scraper accepts.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TRAFFIC_LABELS = (
    "reporter",
    "source_workload",
    "source_workload_namespace",
    "source_principal",
    "destination_workload",
    "destination_workload_namespace",
    "destination_principal",
    "destination_service",
    "request_protocol",
    "response_flags",
    "connection_security_policy",
)


def _workload_label(workload: Any) -> str | None:
    """ztunnel's ``*_workload`` label: the workload's ``workloadName`` (its deployment, say).

    Where that is not set ztunnel says "unknown"; ztwisted falls back to the
    workload's own ``name``, which identifies it better.
    """
    return getattr(workload, "workload_name", "") or getattr(workload, "name", None)


def _label(value: object) -> str:
    if value is None or value == "":
        return UNKNOWN
    return str(value)


@attrs.frozen
class ConnectionLabels:
    """The istio_tcp_* label set of one connection; missing values render as "unknown"."""

    reporter: str = "source"  # "source" (outbound side) or "destination" (inbound side)
    source_workload: str | None = None
    source_workload_namespace: str | None = None
    source_principal: str | None = None
    destination_workload: str | None = None
    destination_workload_namespace: str | None = None
    destination_principal: str | None = None
    destination_service: str | None = None
    request_protocol: str = "tcp"
    response_flags: str = "-"  # "-", "DENY" (policy), "CONNECT" (upstream connect failed)
    connection_security_policy: str = UNKNOWN  # "mutual_tls" or "unknown"

    @classmethod
    def for_connection(
        cls,
        reporter: str,
        source: Any = None,
        destination: Any = None,
        service: Any = None,
        source_identity: object = None,
        destination_identity: object = None,
        response_flags: str = "-",
        mutual_tls: bool = False,
    ) -> ConnectionLabels:
        """Build labels from workload/service objects.

        Workloads are read through ``workload_name`` (else ``name``) and
        ``namespace``, a service through ``hostname``; identities through
        ``str()``. Any may be None.
        """
        if reporter not in ("source", "destination"):
            raise ValueError(f"reporter must be 'source' or 'destination', not {reporter!r}")
        return cls(
            reporter=reporter,
            source_workload=_workload_label(source),
            source_workload_namespace=getattr(source, "namespace", None),
            source_principal=None if source_identity is None else str(source_identity),
            destination_workload=_workload_label(destination),
            destination_workload_namespace=getattr(destination, "namespace", None),
            destination_principal=(None if destination_identity is None else str(destination_identity)),
            destination_service=getattr(service, "hostname", None),
            response_flags=response_flags,
            connection_security_policy="mutual_tls" if mutual_tls else UNKNOWN,
        )

    def with_flags(self, response_flags: str) -> ConnectionLabels:
        return attrs.evolve(self, response_flags=response_flags)

    def as_dict(self) -> dict[str, str]:
        return {name: _label(getattr(self, name)) for name in TRAFFIC_LABELS}


@attrs.define(eq=False)
class _WithoutCreated:
    """Presents a registry without the ``*_created`` series prometheus_client adds.

    ztunnel exports no such series; dropping them keeps the exposed names
    exactly the documented ones.
    """

    _registry: CollectorRegistry

    def collect(self) -> Iterator[Any]:
        for family in self._registry.collect():
            trimmed = copy.copy(family)
            trimmed.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield trimmed


@attrs.frozen
class TrafficSeries:
    """The four istio_tcp_* series of one label set (see :meth:`Metrics.traffic`)."""

    _opened: Any
    _closed: Any
    _sent: Any
    _received: Any

    def opened(self) -> None:
        self._opened.inc()

    def closed(self) -> None:
        self._closed.inc()

    def bytes(self, sent: int = 0, received: int = 0) -> None:
        """Count bytes as ztunnel's counters name them (no reporter-dependent flip)."""
        if sent < 0 or received < 0:
            raise ValueError(f"byte counts cannot be negative (sent={sent}, received={received})")
        if sent:
            self._sent.inc(sent)
        if received:
            self._received.inc(received)


class Metrics:
    """All of a node's metrics, on a private registry."""

    content_type = CONTENT_TYPE

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, tuple[type, tuple[str, ...], Any]] = {}
        self._traffic_series: dict[ConnectionLabels, TrafficSeries] = {}

        self.connections_opened = self.counter(
            "istio_tcp_connections_opened_total", "The total number of TCP connections opened", TRAFFIC_LABELS
        )
        self.connections_closed = self.counter(
            "istio_tcp_connections_closed_total", "The total number of TCP connections closed", TRAFFIC_LABELS
        )
        self.received_bytes = self.counter(
            "istio_tcp_received_bytes_total",
            "The size of total bytes received during request in case of a TCP connection",
            TRAFFIC_LABELS,
        )
        self.sent_bytes = self.counter(
            "istio_tcp_sent_bytes_total",
            "The size of total bytes sent during response in case of a TCP connection",
            TRAFFIC_LABELS,
        )

        self.config_reloads = self.counter("ztwisted_config_reloads_total", "Configuration reloads applied")
        self.config_reload_errors = self.counter(
            "ztwisted_config_reload_errors_total", "Configuration reloads rejected (the previous configuration stays)"
        )
        self.hbone_connections = self.gauge(
            "ztwisted_hbone_connections", "Open HBONE (HTTP/2 over mTLS) connections", ("direction",)
        )
        self.pool_connections_opened = self.counter(
            "ztwisted_pool_connections_opened_total", "HBONE connections the outbound pool opened"
        )
        self.tls_handshake_failures = self.counter(
            "ztwisted_tls_handshake_failures_total", "Failed TLS handshakes", ("reason",)
        )
        self.socks5_errors = self.counter(
            "ztwisted_socks5_errors_total", "SOCKS5 clients refused or failed", ("reason",)
        )

    # -- istio_tcp_* helpers -------------------------------------------------

    def opened(self, labels: ConnectionLabels) -> None:
        self.traffic(labels).opened()

    def closed(self, labels: ConnectionLabels) -> None:
        self.traffic(labels).closed()

    def bytes(self, labels: ConnectionLabels, sent: int = 0, received: int = 0) -> None:
        """Count bytes as ztunnel's counters name them (no reporter-dependent flip)."""
        self.traffic(labels).bytes(sent, received)

    def traffic(self, labels: ConnectionLabels) -> TrafficSeries:
        """The istio_tcp_* series of one label set, resolved once.

        prometheus_client's ``labels()`` validates and looks up its eleven
        values on every call; a connection updates four series (a
        connection's record looks its series up once, when it opens). The
        cache holds no more than prometheus_client itself keeps (a child per
        label set, never removed).
        """
        series = self._traffic_series.get(labels)
        if series is None:
            values = labels.as_dict()
            series = TrafficSeries(
                opened=self.connections_opened.labels(**values),
                closed=self.connections_closed.labels(**values),
                sent=self.sent_bytes.labels(**values),
                received=self.received_bytes.labels(**values),
            )
            self._traffic_series[labels] = series
        return series

    # -- create-or-return ----------------------------------------------------

    def counter(self, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
        """The counter ``name`` (exposed exactly so; ``_total`` is added if missing)."""
        if not name.endswith("_total"):
            name += "_total"
        return self._get_or_create(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
        return self._get_or_create(Gauge, name, doc, labels)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Iterable[str] = (),
        buckets: Iterable[float] | None = None,
    ) -> Histogram:
        extra = {} if buckets is None else {"buckets": tuple(buckets)}
        return self._get_or_create(Histogram, name, doc, labels, **extra)

    def _get_or_create(self, kind: type, name: str, doc: str, labels: Iterable[str], **extra: Any) -> Any:
        labelnames = tuple(labels)
        existing = self._metrics.get(name)
        if existing is not None:
            existing_kind, existing_labels, metric = existing
            if existing_kind is not kind or existing_labels != labelnames:
                raise ValueError(
                    f"metric {name!r} already exists as a {existing_kind.__name__} with "
                    f"labels {list(existing_labels)}; asked for a {kind.__name__} with "
                    f"labels {list(labelnames)}"
                )
            return metric
        metric = kind(name, doc, labelnames, registry=self.registry, **extra)
        self._metrics[name] = (kind, labelnames, metric)
        return metric

    # -- exposition ----------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text format of every metric here."""
        return generate_latest(_WithoutCreated(self.registry))  # type: ignore[arg-type]

    def sample(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The current value of one series (for tests and the admin endpoints)."""
        return self.registry.get_sample_value(name, dict(labels or {}))
