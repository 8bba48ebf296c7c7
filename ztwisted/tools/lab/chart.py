"""The lab's chart, as hand-written SVG: per strategy, requests per second succeeded and failed, and
node A's open HBONE connections to B1 and B2, with the lifecycle events marked."""

from __future__ import annotations

import math
from collections.abc import Callable
from xml.sax.saxutils import escape, quoteattr

import attrs

WIDTH = 960
LEFT = 64
RIGHT = 24
HEADER = 58
TITLE_H = 20
LABEL_ROW = 12
LABEL_ROWS = 3
RATE_H = 110
GAP = 10
CONN_H = 56
AXIS_H = 22
PANEL_GAP = 18

SUCCEEDED = "#2e7d32"
FAILED = "#d32f2f"
TO_B1 = "#ef6c00"
TO_B2 = "#1565c0"
EVENT = "#757575"
CHAR_W = 6.0  # average width of a 10 px character, for laying out labels
MARKED = ("terminating", "unready", "app-exit", "delete", "ack", "teardown", "removed")


def _nice(value: float) -> float:
    """A round number at least ``value`` (1, 2, 5 x 10^n)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * 10**exponent >= value:
            return step * 10**exponent
    return 10 ** (exponent + 1)


class _Svg:
    def __init__(self):
        self.parts: list[str] = []

    def add(self, element: str, **attributes) -> None:
        self.parts.append(
            f"<{element} "
            + " ".join(f"{k.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for k, v in attributes.items())
            + "/>"
        )

    def text(self, x: float, y: float, text: str, **attributes) -> None:
        attrs = " ".join(f"{k.rstrip('_').replace('_', '-')}={quoteattr(str(v))}" for k, v in attributes.items())
        self.parts.append(f'<text x="{x:.1f}" y="{y:.1f}" {attrs}>{escape(text)}</text>')


def render_svg(results: dict) -> str:
    strategies = results["strategies"]
    end = max((_end(s) for s in strategies), default=1.0)
    end = max(5.0, float(math.ceil(end)))
    rate_max = _nice(
        max(
            (
                a + b
                for s in strategies
                for a, b in zip(s["series"]["succeeded_per_s"], s["series"]["failed_per_s"], strict=False)
            ),
            default=1,
        )
    )
    conn_max = max(
        [2, *(n for s in strategies for key in ("hbone_a_to_b1", "hbone_a_to_b2") for _, n in s["series"][key])]
    )
    panel_h = TITLE_H + LABEL_ROWS * LABEL_ROW + RATE_H + GAP + CONN_H + AXIS_H
    height = HEADER + len(strategies) * (panel_h + PANEL_GAP)
    plot_w = WIDTH - LEFT - RIGHT

    def x_of(t: float) -> float:
        return LEFT + plot_w * min(max(t, 0.0), end) / end

    svg = _Svg()
    lab = results["lab"]
    svg.text(
        LEFT,
        20,
        f"ztunnel-lab: a pod shutdown on live traffic ({lab['mode']} mode, seed {lab['seed']})",
        font_size=15,
        font_weight="bold",
    )
    _legend(svg, LEFT, 42)
    for index, strategy in enumerate(strategies):
        top = HEADER + index * (panel_h + PANEL_GAP)
        _panel(svg, strategy, top, x_of, end, rate_max, conn_max)
    body = "\n".join(svg.parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11">\n'
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="white"/>\n{body}\n</svg>\n'
    )


def _end(strategy: dict) -> float:
    done = [e["t"] for e in strategy["events"] if e["name"] == "traffic-stop"]
    return max(done) if done else len(strategy["series"]["succeeded_per_s"]) * strategy["series"]["bin_s"]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _legend(svg: _Svg, x: float, y: float) -> None:
    items = [
        (SUCCEEDED, "requests/s succeeded", "line"),
        (FAILED, "requests/s failed", "bar"),
        (TO_B1, "HBONE connections A->B1", "line"),
        (TO_B2, "HBONE connections A->B2", "line"),
        (EVENT, "lifecycle event", "dash"),
    ]
    for color, label, kind in items:
        if kind == "bar":
            svg.add("rect", x=x, y=y - 8, width=10, height=9, fill=color)
        else:
            svg.add(
                "line",
                x1=x,
                y1=y - 4,
                x2=x + 14,
                y2=y - 4,
                stroke=color,
                stroke_width=2,
                stroke_dasharray="4 3" if kind == "dash" else "none",
            )
        svg.text(x + 18, y, label)
        x += 28 + 6.6 * len(label)


def _panel(svg: _Svg, strategy: dict, top: float, x_of, end: float, rate_max: float, conn_max: int) -> None:
    """One strategy's panel: its summary line, then the rate plot above the connection plot."""
    svg.text(LEFT, top + 14, _summary(strategy), font_size=12, font_weight="bold")
    panel = _Panel(svg, x_of, top + TITLE_H, rate_max, conn_max)
    panel.frames()
    panel.rate_grid()
    panel.connection_grid()
    panel.time_axis(end)
    panel.request_rates(strategy["series"])
    panel.open_connections(strategy["series"])
    panel.lifecycle_events(strategy["events"])


def _summary(strategy: dict) -> str:
    m = strategy["measures"]
    requests = m["requests"]
    return (
        f"{strategy['name']}  -  {requests['failed']} of {requests['sent']} requests failed, "
        f"{_count(m['hbone']['opened_by_a_in_window'], 'new HBONE connection')}, Del->Ack "
        f"{'-' if m['delete_to_ack_s'] is None else format(m['delete_to_ack_s'] * 1000, '.0f') + ' ms'}"
    )


def _polyline(svg: _Svg, points: list[tuple[float, float]], color: str, width: float) -> None:
    svg.add(
        "polyline",
        points=" ".join(f"{x:.1f},{y:.1f}" for x, y in points),
        fill="none",
        stroke=color,
        stroke_width=width,
    )


@attrs.frozen
class _Panel:
    """Where one panel's parts go, top to bottom: event labels, the rate plot, the connection plot, the time axis.

    ``x_of`` maps seconds to x, the same for every panel so that they line up.
    """

    svg: _Svg
    x_of: Callable[[float], float]
    labels_top: float
    rate_max: float
    conn_max: int

    @property
    def rate_top(self) -> float:
        return self.labels_top + LABEL_ROWS * LABEL_ROW

    @property
    def conn_top(self) -> float:
        return self.rate_top + RATE_H + GAP

    @property
    def axis_y(self) -> float:
        return self.conn_top + CONN_H

    def rate_y(self, rate: float) -> float:
        return self.rate_top + RATE_H * (1 - min(rate, self.rate_max) / self.rate_max)

    def conn_y(self, n: float) -> float:
        return self.conn_top + CONN_H * (1 - n / self.conn_max)

    def frames(self) -> None:
        for y0, h in ((self.rate_top, RATE_H), (self.conn_top, CONN_H)):
            self.svg.add("rect", x=LEFT, y=y0, width=WIDTH - RIGHT - LEFT, height=h, fill="#fafafa", stroke="#bdbdbd")

    def _grid_line(self, y: float, label: str) -> None:
        self.svg.add("line", x1=LEFT, y1=y, x2=WIDTH - RIGHT, y2=y, stroke="#e0e0e0")
        self.svg.text(LEFT - 6, y + 4, label, text_anchor="end", fill="#616161")

    def _y_title(self, top: float, height: float, title: str) -> None:
        middle = top + height / 2
        self.svg.text(14, middle, title, fill="#616161", transform=f"rotate(-90 14 {middle})", text_anchor="middle")

    def rate_grid(self) -> None:
        for fraction in (0.5, 1.0):
            self._grid_line(self.rate_top + RATE_H * (1 - fraction), f"{self.rate_max * fraction:g}")
        self.svg.text(LEFT - 6, self.rate_top + RATE_H + 4, "0", text_anchor="end", fill="#616161")
        self._y_title(self.rate_top, RATE_H, "req/s")

    def connection_grid(self) -> None:
        for n in range(0, self.conn_max + 1, max(1, self.conn_max // 2)):
            self._grid_line(self.conn_y(n), str(n))
        self._y_title(self.conn_top, CONN_H, "HBONE")

    def time_axis(self, end: float) -> None:
        step = 1 if end <= 10 else 2 if end <= 20 else 5
        t = 0.0
        while t <= end + 1e-9:
            x = self.x_of(t)
            self.svg.add("line", x1=x, y1=self.axis_y, x2=x, y2=self.axis_y + 4, stroke="#616161")
            self.svg.text(x, self.axis_y + 15, f"{t:g}", text_anchor="middle", fill="#616161")
            t += step
        self.svg.text(LEFT - 6, self.axis_y + 15, "s", text_anchor="end", fill="#616161")

    def request_rates(self, series: dict) -> None:
        """Failed requests per second as bars, succeeded ones as a step line."""
        width = series["bin_s"]
        for i, rate in enumerate(series["failed_per_s"]):
            if rate:
                x0, x1 = self.x_of(i * width), self.x_of((i + 1) * width)
                h = max(3.0, RATE_H * min(rate, self.rate_max) / self.rate_max)  # a lone failure stays visible
                self.svg.add(
                    "rect",
                    x=f"{x0:.1f}",
                    y=f"{self.rate_top + RATE_H - h:.1f}",
                    width=f"{max(1.0, x1 - x0 - 1):.1f}",
                    height=f"{h:.1f}",
                    fill=FAILED,
                )
        points = []
        for i, rate in enumerate(series["succeeded_per_s"]):
            y = self.rate_y(rate)
            points += [(self.x_of(i * width), y), (self.x_of((i + 1) * width), y)]
        if points:
            _polyline(self.svg, points, SUCCEEDED, 1.6)

    def open_connections(self, series: dict) -> None:
        """Open HBONE connections A->B1 and A->B2, as step lines from the pool polls.

        A->B1 is drawn 1.5 px higher so that it stays visible where both counts are equal.
        """
        for key, color, offset in (("hbone_a_to_b2", TO_B2, 0.0), ("hbone_a_to_b1", TO_B1, 1.5)):
            samples = series[key]
            if not samples:
                continue
            points = []
            previous_y = None
            for t, n in samples:
                y = self.conn_y(n) - offset
                if previous_y is not None:
                    points.append((self.x_of(t), previous_y))
                points.append((self.x_of(t), y))
                previous_y = y
            _polyline(self.svg, points, color, 1.8)

    def lifecycle_events(self, events: list[dict]) -> None:
        """A dashed line through both plots per event, labelled in the first row above that is free at its x."""
        row_ends = [-1e9] * LABEL_ROWS
        for x, names in self._event_groups(events):
            label = " / ".join(names)
            row = next((r for r in range(LABEL_ROWS) if row_ends[r] < x - 2), LABEL_ROWS - 1)
            row_ends[row] = x + CHAR_W * len(label)
            label_y = self.labels_top + (row + 1) * LABEL_ROW - 2
            self.svg.add(
                "line",
                x1=f"{x:.1f}",
                y1=label_y + 2,
                x2=f"{x:.1f}",
                y2=self.axis_y,
                stroke=EVENT,
                stroke_dasharray="4 3",
            )
            self.svg.text(x + 2, label_y, label, fill="#424242", font_size=10)

    def _event_groups(self, events: list[dict]) -> list[tuple[float, list[str]]]:
        """The marked events by x; events a few pixels apart share one line and one label."""
        groups: list[tuple[float, list[str]]] = []
        for event in sorted((e for e in events if e["name"] in MARKED), key=lambda e: e["t"]):
            x = self.x_of(event["t"])
            if groups and x - groups[-1][0] < 6:
                groups[-1][1].append(event["name"])
            else:
                groups.append((x, [event["name"]]))
        return groups
