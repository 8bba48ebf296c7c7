"""What the lab reads from the proxies while a run goes on: metrics, node A's pool, CPU time.

:class:`Sampler` polls node A's ``/config_dump`` pool section (open HBONE
connections per destination) every ``interval`` seconds, and both nodes'
``/metrics`` and CPU time every ``metrics_every`` polls. :func:`scrape`
reads the metrics the lab compares before, during and after a run.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

from ztwisted.tools.workers import Workers

#: the series the lab keeps from each scrape (all labels kept)
KEPT_METRICS = (
    "ztwisted_pool_connections_opened_total",
    "ztwisted_hbone_connections",
    "ztwisted_hbone_connections_closed_total",
    "ztwisted_tls_handshake_failures_total",
    "ztwisted_socks5_errors_total",
    "ztwisted_drain_events_total",
    "ztwisted_drain_duration_seconds_sum",
    "ztwisted_drain_duration_seconds_count",
    "ztwisted_config_reloads_total",
    "istio_tcp_connections_opened_total",
    "istio_tcp_connections_closed_total",
    "istio_tcp_sent_bytes_total",
    "istio_tcp_received_bytes_total",
)
# The istio_tcp_* label sets are long; the lab sums them over these labels only.
SUMMED_BY = {
    "istio_tcp_connections_opened_total": ("reporter", "destination_workload", "response_flags"),
    "istio_tcp_connections_closed_total": ("reporter", "destination_workload", "response_flags"),
    "istio_tcp_sent_bytes_total": ("reporter", "destination_workload"),
    "istio_tcp_received_bytes_total": ("reporter", "destination_workload"),
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{'name{a="x",b="y"}': value}`` for :data:`KEPT_METRICS`."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in KEPT_METRICS:
            continue
        name, label_text, value = match.groups()
        labels = dict(_LABEL.findall(label_text or ""))
        if name in SUMMED_BY:
            labels = {k: v for k, v in labels.items() if k in SUMMED_BY[name]}
        key = series_key(name, labels)
        values[key] = values.get(key, 0.0) + float(value)
    return values


def series_key(name: str, labels: dict[str, str] | None = None) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value
        for key, value in values.items()
        if (key == name or key.startswith(name + "{")) and all(w in key for w in wanted)
    )


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counters' change from ``before`` to ``after`` (series that did not change left out)."""
    changed = {}
    for key, value in after.items():
        difference = value - before.get(key, 0.0)
        if abs(difference) > 1e-9:
            changed[key] = round(difference, 6)
    return changed


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def b1_in_config_dump(node, ip: str) -> str | None:
    """What ``node``'s /config_dump says of the workload at ``ip``: ``ready``, ``unready`` (Unhealthy), ``gone``.

    ztwisted's and ztunnel's dumps both list ``workloads`` with ``workloadIps``
    and ``status``. None if the dump cannot be read.
    """
    try:
        status, body = node.http("admin", "/config_dump")
        workloads = json.loads(body).get("workloads", []) if status == 200 else None
    except (OSError, ValueError):
        return None
    if workloads is None:
        return None
    found = [w for w in workloads if ip in w.get("workloadIps", [])]
    if not found:
        return "gone"
    return "unready" if any(w.get("status") == "Unhealthy" for w in found) else "ready"


def fetch(url: str, timeout: float = 3.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


class Sampler:
    """Background polling of node A's pool and both nodes' metrics and CPU.

    With ``wire`` (a started :class:`ztwisted.tools.lab.wire.WireWatch`), node A's
    connections per destination are those the client pods' TCP tables show;
    node A's ``/config_dump`` pool, when it has one (ztwisted), still gives
    the draining and stream counts.
    """

    def __init__(
        self, clock, node_a, node_b, *, b1_ip: str, b2_ip: str, interval: float = 0.2, metrics_every: int = 5, wire=None
    ):
        self.clock = clock
        self.nodes = {"a": node_a, "b": node_b}
        self.b1_ip = b1_ip
        self.b2_ip = b2_ip
        self.wire = wire
        self.interval = interval
        self.metrics_every = metrics_every
        #: {"t", "b1", "b2", "b1_draining"}: node A's pooled connections per destination
        self.pool: list[dict] = []
        #: {"t", "a": {...}, "b": {...}, "cpu": {"a": s, "b": s}}
        self.metrics: list[dict] = []
        self.errors: list[str] = []
        self._workers = Workers()

    def start(self) -> Sampler:
        self._workers.spawn(self._run, name="lab-sampler")
        return self

    def stop(self) -> None:
        self._workers.stop(10)

    def scrape(self) -> dict:
        """Both nodes' metrics and CPU time now."""
        sample = {"t": round(self.clock(), 4), "cpu": {}}
        for name, node in self.nodes.items():
            sample[name] = parse_metrics(node.http("metrics", "/metrics")[1].decode())
            sample["cpu"][name] = cpu_seconds(node.process.pid)
        return sample

    def pool_now(self) -> dict:
        counts = {"t": round(self.clock(), 4), "b1": 0, "b2": 0, "b1_draining": 0, "streams_b1": 0}
        if self.wire is not None:
            read_at, held = self.wire.open_now()
            if read_at is not None:
                counts["t"] = read_at
            counts.update(held)
        if not getattr(self.nodes["a"], "has_pool_dump", True):
            return counts
        dump = json.loads(self.nodes["a"].http("admin", "/config_dump")[1])
        for entry in dump.get("pool", []):
            ip = entry.get("destination", "").rsplit(":", 1)[0]
            which = "b1" if ip == self.b1_ip else "b2" if ip == self.b2_ip else None
            if which is None:
                continue
            if self.wire is None:
                counts[which] += 1
            if which == "b1":
                counts["streams_b1"] += entry.get("streams", 0)
                if not entry.get("usable", True):
                    counts["b1_draining"] += 1
        return counts

    def _run(self) -> None:
        polls = 0
        next_at = time.monotonic()
        while not self._workers.stopping.is_set():
            try:
                self.pool.append(self.pool_now())
                if polls % self.metrics_every == 0:
                    self.metrics.append(self.scrape())
            except (OSError, ValueError, urllib.error.URLError) as e:
                if len(self.errors) < 20:
                    self.errors.append(f"{self.clock():.2f} s: {type(e).__name__}: {e}")
            polls += 1
            next_at += self.interval
            self._workers.stopping.wait(max(0.0, next_at - time.monotonic()))
