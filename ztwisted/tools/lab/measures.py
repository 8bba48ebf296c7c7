"""From one strategy's raw observations to its measures and chart series.

The *termination window* runs from the "terminating" event to the end of
traffic; counts marked ``in_window`` only look at it.
"""

from __future__ import annotations

import math

from ztwisted.tools.lab.clients import FAILURE_KINDS, RequestRecord
from ztwisted.tools.lab.probes import delta, total

BIN = 0.5  # seconds per bar of the request-rate series


def event_time(events: list[dict], name: str) -> float | None:
    return next((e["t"] for e in events if e["name"] == name), None)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def request_counts(records: list[RequestRecord]) -> dict:
    failed_by = dict.fromkeys(FAILURE_KINDS, 0)
    for record in records:
        if not record.ok:
            failed_by[record.failure or "error"] += 1
    succeeded = sum(1 for record in records if record.ok)
    return {
        "sent": len(records),
        "succeeded": succeeded,
        "failed": len(records) - succeeded,
        "failed_by": failed_by,
    }


def byte_counts(records: list[RequestRecord]) -> dict:
    sent = sum(r.bytes_sent for r in records)
    echoed = sum(r.bytes_echoed for r in records)
    payload = sum(r.payload_bytes for r in records)
    return {
        "payload": payload,  # what the apps meant to send
        "sent": sent,  # written to a connection
        "echoed": echoed,  # came back intact
        "lost": sent - echoed,  # written, never echoed
        "unsent": payload - sent,  # the request failed before its payload was written
    }


def latency_summary(values: list[float]) -> dict:
    return {
        "count": len(values),
        "p50_ms": _ms(percentile(values, 50)),
        "p99_ms": _ms(percentile(values, 99)),
        "max_ms": _ms(max(values) if values else None),
    }


def pool_leftovers(pool: list[dict], gone_at: float | None) -> dict:
    """Node A's pooled connections to B1 once B1 is gone (its network torn down), and when the last closed.

    ``last_closed_after_s`` is the first poll that saw none minus ``gone_at``
    (resolution: the poll interval); None if some were still open at the end.
    """
    if gone_at is None or not pool:
        return {"open_at_gone": None, "last_closed_after_s": None, "still_open_at_end": None}
    after = [sample for sample in pool if sample["t"] >= gone_at]
    if not after:
        return {"open_at_gone": None, "last_closed_after_s": None, "still_open_at_end": None}
    open_at_gone = after[0]["b1"]
    still_open = after[-1]["b1"]
    last_closed = None
    if still_open == 0:
        last_open_index = max((i for i, s in enumerate(after) if s["b1"] > 0), default=None)
        last_closed = 0.0 if last_open_index is None else round(after[last_open_index + 1]["t"] - gone_at, 3)
    return {
        "open_at_gone": open_at_gone,
        "max_after_gone": max(s["b1"] for s in after),
        "last_closed_after_s": last_closed,
        "still_open_at_end": still_open,
    }


def openings_seen(pool: list[dict], start: float | None) -> dict[str, int]:
    """Rises in node A's pooled connections per destination from ``start`` on, as the polls saw them.

    A lower bound: a connection that opened and closed (or replaced another)
    between two polls is not seen; the metric gives the exact total.
    """
    seen = {"b1": 0, "b2": 0}
    if start is None:
        return seen
    previous = None
    for sample in pool:
        if previous is not None and sample["t"] >= start:
            for which in seen:
                seen[which] += max(0, sample[which] - previous[which])
        previous = sample
    return seen


def wire_openings(connections: list[dict], start: float | None, *, attempts: bool = False) -> dict[str, int]:
    """Node A's HBONE connections to each destination first seen on the wire from ``start`` on (a lower bound).

    Only the established ones, or with ``attempts`` every connect, including
    those that never got an answer (to a pod whose network is gone).
    """
    seen = {"b1": 0, "b2": 0}
    for connection in connections:
        if start is not None and connection["first_seen"] >= start and (attempts or connection["established"]):
            seen[connection["destination"]] = seen.get(connection["destination"], 0) + 1
    return seen


def series(records: list[RequestRecord], pool: list[dict], end: float) -> dict:
    """Requests per second succeeded and failed (by when they ended), and node A's open HBONE connections.

    ``end`` is when traffic stopped: the bins are the whole ones before it;
    requests that ended later count in the last.
    """
    bins = max(1, int(end / BIN))
    succeeded = [0] * bins
    failed = [0] * bins
    for record in records:
        index = min(bins - 1, max(0, int((record.ended or 0) / BIN)))
        (succeeded if record.ok else failed)[index] += 1
    return {
        "bin_s": BIN,
        "succeeded_per_s": [round(n / BIN, 2) for n in succeeded],
        "failed_per_s": [round(n / BIN, 2) for n in failed],
        "hbone_a_to_b1": [[s["t"], s["b1"]] for s in pool],
        "hbone_a_to_b2": [[s["t"], s["b2"]] for s in pool],
    }


def measure(raw: dict) -> dict:
    """The measures of one strategy run (JSON-ready)."""
    records: list[RequestRecord] = raw["records"]
    events = raw["events"]
    terminating = event_time(events, "terminating")
    stopped = event_time(events, "traffic-stop")
    in_window = [r for r in records if terminating is not None and (r.started or r.planned) >= terminating]
    opening = [r for r in in_window if r.new_connection and r.tunnel_open is not None]
    first_bytes = [r.first_byte for r in in_window if r.new_connection and r.first_byte is not None]
    scrapes = raw["scrapes"]
    # what each node's metrics counted during the termination window
    window = {node: delta(scrapes["after"][node], scrapes["before"][node]) for node in ("a", "b")}
    return {
        "requests": {
            **request_counts(records),
            "per_app": {
                app: request_counts([r for r in records if r.app == app]) for app in sorted({r.app for r in records})
            },
            "in_window": request_counts(in_window),
            "by_phase": _by_phase(records, events),
        },
        "bytes": byte_counts(records),
        "answered_by": _answered_by(records),
        "hbone": _hbone_in_window(raw, window, terminating),
        "tunnel_open": latency_summary([r.tunnel_open for r in opening]),
        "first_response_byte": latency_summary(first_bytes),
        "pool_to_b1": pool_leftovers(raw["pool"], event_time(events, "teardown")),
        "delete_to_ack_s": raw["ack"]["delete_to_ack_s"],
        "delete_status": raw["ack"]["status"],
        "cpu_s": _cpu_seconds(scrapes),
        "drain_events": {node: _drain_events(window[node]) for node in ("a", "b")},
        "apps": raw["apps"],
        "b1_exit": raw["b1_exit"],
        "window_s": None if terminating is None or stopped is None else round(stopped - terminating, 3),
    }


def _answered_by(records: list[RequestRecord]) -> dict[str, int]:
    """Succeeded requests per server pod that answered them."""
    answered_by: dict[str, int] = {}
    for record in records:
        if record.ok:
            answered_by[record.server] = answered_by.get(record.server, 0) + 1
    return dict(sorted(answered_by.items()))


def _hbone_in_window(raw: dict, window: dict[str, dict[str, float]], terminating: float | None) -> dict:
    """Node A's HBONE connections to node B during the termination window: opened, handshakes, and how they ended."""
    scrapes = raw["scrapes"]
    # Node B (always ztwisted) counts the HBONE connections it accepted: those closed plus the change in
    # those open; its handshake failures are labelled reason="inbound".
    accepted_by_b = total(window["b"], "ztwisted_hbone_connections_closed_total", direction="inbound") + (
        total(scrapes["after"]["b"], "ztwisted_hbone_connections", direction="inbound")
        - total(scrapes["before"]["b"], "ztwisted_hbone_connections", direction="inbound")
    )
    failed_at_b = total(window["b"], "ztwisted_tls_handshake_failures_total", reason="inbound")
    if raw.get("client_proxy", "ztwisted") == "ztwisted":
        counted_at = "node A's metrics (ztwisted_pool_connections_opened_total)"
        opened = total(window["a"], "ztwisted_pool_connections_opened_total")
        handshake_failures = total(window["a"], "ztwisted_tls_handshake_failures_total")
    else:  # ztunnel counts no pool connections: node B's side of them
        counted_at = "node B's metrics (HBONE connections accepted, inbound TLS handshake failures)"
        opened, handshake_failures = accepted_by_b, failed_at_b
    wire = raw.get("wire_connections") or []
    from_wire = raw.get("pool_source") == "wire"
    return {
        "counted_at": counted_at,
        "opened_by_a_in_window": int(opened),
        "tls_handshakes_by_a_in_window": int(opened + handshake_failures),
        "accepted_by_b_in_window": int(accepted_by_b),
        "tls_handshake_failures_at_b_in_window": int(failed_at_b),
        "opened_seen_by_destination": (
            wire_openings(wire, terminating) if from_wire else openings_seen(raw["pool"], terminating)
        ),
        "connect_attempts_seen_by_destination": wire_openings(wire, terminating, attempts=True) if wire else None,
        "seen_on": "the client pods' TCP tables" if from_wire else "node A's /config_dump pool",
        "closed_in_window": {
            "a": _ended_by(window["a"], "outbound"),
            "b": _ended_by(window["b"], "inbound"),
        },
    }


def _cpu_seconds(scrapes: dict) -> dict[str, dict[str, float]]:
    """CPU seconds each node's proxy used over the whole run and over the termination window."""
    return {
        node: {
            "run": round(scrapes["after"]["cpu"][node] - scrapes["start"]["cpu"][node], 3),
            "window": round(scrapes["after"]["cpu"][node] - scrapes["before"]["cpu"][node], 3),
        }
        for node in ("a", "b")
    }


PHASES = ("traffic-start", "terminating", "app-exit", "teardown", "removed")


def _by_phase(records: list[RequestRecord], events: list[dict]) -> dict:
    """Requests counted by the last of :data:`PHASES` that happened before each one started."""
    starts = sorted((t, name) for name in PHASES if (t := event_time(events, name)) is not None)
    phases: dict[str, list[RequestRecord]] = {name: [] for _, name in starts}
    for record in records:
        began = record.started if record.started is not None else record.planned
        current = next((name for t, name in reversed(starts) if began >= t), None)
        if current is not None:
            phases[current].append(record)
    return {f"from {name}": request_counts(chosen) for name, chosen in phases.items()}


def _ended_by(window: dict[str, float], direction: str) -> dict[str, int]:
    prefix = "ztwisted_hbone_connections_closed_total{"
    out = {}
    for key, value in window.items():
        if key.startswith(prefix) and f'direction="{direction}"' in key:
            ended_by = key.split('ended_by="', 1)[1].split('"', 1)[0]
            out[ended_by] = int(value)
    return dict(sorted(out.items()))


def _drain_events(window: dict[str, float]) -> dict[str, int]:
    """``{"strategy:event": count}`` delivered during the window."""
    prefix = "ztwisted_drain_events_total{"
    out = {}
    for key, value in window.items():
        if key.startswith(prefix):
            event = key.split('event="', 1)[1].split('"', 1)[0]
            strategy = key.split('strategy="', 1)[1].split('"', 1)[0]
            out[f"{strategy}:{event}"] = int(value)
    return dict(sorted(out.items()))
