"""The lab's results as a terminal table and as JSON, and the progress line shown while it runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (
    ("strategy", "<"),
    ("sent", ">"),
    ("failed", ">"),
    ("failed how", "<"),
    ("bytes lost", ">"),
    ("new HBONE/TLS", ">"),
    ("to B1/B2", ">"),
    ("open p99/max ms", ">"),
    ("B1 conns at gone", ">"),
    ("last closed", ">"),
    ("Del->Ack ms", ">"),
    ("CPU A/B s", ">"),
)

LEGEND = """\
sent/failed: requests of both client apps; failed how: reset, timeout, refused, closed (EOF mid-request), corrupt
bytes lost: payload bytes written but never echoed back
new HBONE/TLS: HBONE connections / TLS handshakes node A opened from "terminating" to the end of traffic (counted
  by node A, or by node B's inbound metrics when node A is ztunnel); to B1/B2: of those, the ones seen appear per
  destination (node A's pool polls, or in netns mode the client pods' TCP tables; a lower bound)
open p99/max: for connections opened in that window, connect through SOCKS5 until the tunnel is open (loopback
  mode), or connect until the first response byte (netns mode, where the redirect accepts at once)
B1 conns at gone: node A's pooled connections to B1 when its network was torn down; last closed: seconds after that
Del->Ack: how long node B took to answer the pod's deletion; CPU: each proxy's user+system seconds during the run"""


def _failed_how(failed_by: dict) -> str:
    parts = [f"{kind} {count}" for kind, count in failed_by.items() if count]
    return ", ".join(parts) or "-"


def _pair(a, b, unit: str = "") -> str:
    def show(value):
        return "-" if value is None else f"{value:g}{unit}"

    return f"{show(a)}/{show(b)}"


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for strategy in results["strategies"]:
        m = strategy["measures"]
        requests = m["requests"]
        pool = m["pool_to_b1"]
        if pool["still_open_at_end"]:
            last_closed = f"open ({pool['still_open_at_end']})"
        elif pool["last_closed_after_s"] is None:
            last_closed = "-"
        else:
            last_closed = f"{pool['last_closed_after_s']:.1f} s"
        ack = m["delete_to_ack_s"]
        # Through SOCKS5 the app sees when the tunnel is open; behind a redirect only its first response byte.
        opening = m["tunnel_open"] if m["tunnel_open"]["count"] else m["first_response_byte"]
        rows.append(
            [
                strategy["name"],
                str(requests["sent"]),
                str(requests["failed"]),
                _failed_how(requests["failed_by"]),
                str(m["bytes"]["lost"]),
                f"{m['hbone']['opened_by_a_in_window']}/{m['hbone']['tls_handshakes_by_a_in_window']}",
                "{b1}/{b2}".format(**m["hbone"]["opened_seen_by_destination"]),
                _pair(opening["p99_ms"], opening["max_ms"]),
                "-" if pool["open_at_gone"] is None else str(pool["open_at_gone"]),
                last_closed,
                "-" if ack is None else f"{ack * 1000:.0f}",
                _pair(m["cpu_s"]["a"]["run"], m["cpu_s"]["b"]["run"]),
            ]
        )
    return rows


def format_table(results: dict, legend: bool = True) -> str:
    rows = table_rows(results)
    headers = [name for name, _ in COLUMNS]
    widths = [
        max(len(headers[i]), *(len(row[i]) for row in rows)) if rows else len(headers[i]) for i in range(len(headers))
    ]

    def line(cells):
        return "  ".join(
            cell.ljust(width) if align == "<" else cell.rjust(width)
            for cell, width, (_, align) in zip(cells, widths, COLUMNS, strict=True)
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths]), *(line(row) for row in rows)]
    lab = results["lab"]
    out.append("")
    out.append(
        f"mode {lab['mode']}, node A {lab.get('client_proxy', 'ztwisted')}, seed {lab['seed']}, keepalive {lab['proxies']['keepalive_interval_s']:g}+"
        f"{lab['proxies']['keepalive_timeout_s']:g} s, pod drain timeout {lab['proxies']['pod_drain_timeout_s']:g} s"
    )
    for approximation in lab["approximations"]:
        out.append(f"approximated: {approximation}")
    if legend:
        out.append("")
        out.append(LEGEND)
    return "\n".join(out)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


class ProgressLine:
    """One line that says which strategy and phase is running; a line per phase when not on a terminal."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last_phase = None
        self._width = 0

    def __call__(self, index: int, count: int, strategy: str, phase: str, t: float, ok: int, failed: int) -> None:
        text = f"[{index + 1}/{count}] {strategy}: {phase}  t={t:5.1f} s  ok {ok}  failed {failed}"
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
            self.stream.flush()
        elif (strategy, phase) != self._last_phase:
            self.stream.write(text + "\n")
            self.stream.flush()
        self._last_phase = (strategy, phase)

    def done(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
