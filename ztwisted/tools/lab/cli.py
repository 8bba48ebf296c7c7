"""``ztunnel-lab``: run the drain lab from the command line.

::

    ztunnel-lab run --strategies immediate,goaway-on-start,last-mile,client-evict,client-evict+last-mile \\
                    [--mode loopback|netns] [--client-proxy ztwisted|ztunnel] [--seed N] [--duration SECONDS] [--out DIR]
    ztunnel-lab cleanup     # remove blackhole routes a killed run left behind
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import attr
from twisted.python import usage

from ztwisted.tools.lab.chart import render_svg
from ztwisted.tools.lab.clients import Traffic
from ztwisted.tools.lab.mesh import Addresses
from ztwisted.tools.lab.netns import leftover_namespaces
from ztwisted.tools.lab.report import ProgressLine, format_table, write_json
from ztwisted.tools.lab.runner import run_lab
from ztwisted.tools.lab.scenario import DEFAULT_STRATEGIES, LabConfig, LabError, Timeline
from ztwisted.tools.lab.teardown import TeardownUnavailable, remove_leftovers

NEVER = "never"


def _seconds_or_never(value: str) -> float | str:
    return NEVER if value == NEVER else _seconds(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value.rstrip("s"))
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if seconds < 0:
        raise ValueError(f"{value!r} is negative")
    return seconds


def _positive(kind):
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a {kind.__name__}") from None
        if number <= 0:
            raise ValueError(f"{value!r} must be positive")
        return number

    return parse


DEFAULT_TIMELINE = Timeline()
DEFAULT_TRAFFIC = Traffic()


class RunOptions(usage.Options):
    """``ztunnel-lab run``."""

    longdesc = (
        "Run the scenario once per strategy, with fresh proxies each time; print a table, "
        "and with --out write results.json, drain-lab.svg, table.txt and the proxies' logs."
    )
    optParameters = [
        ["strategies", None, ",".join(DEFAULT_STRATEGIES), "Comma-separated; combine ztwisted strategies with '+'."],
        [
            "mode",
            None,
            "loopback",
            "loopback: pods on 127.x addresses, discovery from local config files; netns: pods "
            "in network namespaces, discovery and certificates from a lab ztunnel-control-plane (root).",
        ],
        [
            "client-proxy",
            None,
            "ztwisted",
            "Node A, the client pods' node: ztwisted or Istio's real ztunnel (needs "
            "--mode netns and the cached build of tests/peers/ztunnel_build.py); node B is always ztwisted.",
        ],
        ["seed", None, 1, "Seeds the apps' request schedules and payloads.", int],
        [
            "duration",
            None,
            None,
            f"Seconds of traffic per strategy; the default timeline ({DEFAULT_TIMELINE.nominal:g} s) is scaled to it.",
            _positive(float),
        ],
        [
            "warmup",
            None,
            None,
            f"Seconds before B1 starts terminating (default {DEFAULT_TIMELINE.warmup:g}).",
            _seconds,
        ],
        [
            "unready-after",
            None,
            None,
            "Seconds after 'terminating' when node A's discovery stops using B1 as an "
            f"endpoint, or 'never' (default {DEFAULT_TIMELINE.unready_after:g}).",
            _seconds_or_never,
        ],
        [
            "grace",
            None,
            None,
            f"Seconds from 'terminating' to B1's app exit (default {DEFAULT_TIMELINE.grace:g}).",
            _seconds,
        ],
        [
            "observe",
            None,
            None,
            f"Seconds of traffic after B1 is removed (default {DEFAULT_TIMELINE.observe:g}).",
            _seconds,
        ],
        ["out", None, None, "Directory for results.json, drain-lab.svg, table.txt and logs.", Path],
        ["net", None, 91, "Use addresses 127.NET.0.0/16.", int],
        ["keepalive-interval", None, 2.0, "Proxies' HBONE keepalive interval.", _positive(float)],
        ["keepalive-timeout", None, 3.0, "Proxies' HBONE keepalive timeout.", _positive(float)],
        ["pod-drain-timeout", None, 3.0, "Proxies' --pod-drain-timeout.", _positive(float)],
        [
            "pool-connections",
            None,
            DEFAULT_TRAFFIC.pool_connections,
            "Keep-alive connections of the pooling app.",
            _positive(int),
        ],
        ["pool-rate", None, DEFAULT_TRAFFIC.pool_rate, "Requests/s per pooled connection.", _positive(float)],
        ["request-rate", None, DEFAULT_TRAFFIC.request_rate, "Requests/s of the per-request app.", _positive(float)],
    ]
    optFlags = [
        ["no-teardown", None, "Do not approximate the network teardown."],
        ["records", None, "Put every request's record in results.json."],
        ["quiet", None, "No progress display."],
    ]

    def postOptions(self) -> None:
        if self["mode"] not in ("loopback", "netns"):
            raise usage.UsageError(f"--mode must be loopback or netns, not {self['mode']!r}")
        if self["client-proxy"] not in ("ztwisted", "ztunnel"):
            raise usage.UsageError(f"--client-proxy must be ztwisted or ztunnel, not {self['client-proxy']!r}")


class CleanupOptions(usage.Options):
    """``ztunnel-lab cleanup``."""

    longdesc = "Remove what a killed run left: blackhole routes in 127.NET.0.0/16, ztwNET-* namespaces."
    optParameters = [["net", None, 91, "The run's --net.", int]]


class LabOptions(usage.Options):
    """``ztunnel-lab``: the subcommands, in twistd's option conventions."""

    synopsis = "ztunnel-lab"
    longdesc = "Measure ztwisted's drain strategies on live traffic through one pod shutdown."
    subCommands = [
        ["run", None, RunOptions, "Run the scenario once per strategy."],
        ["cleanup", None, CleanupOptions, "Remove what a killed run left behind."],
    ]

    def postOptions(self) -> None:
        if self.subCommand is None:
            raise usage.UsageError("name a command")


def timeline_from(options: RunOptions) -> Timeline:
    timeline = Timeline() if options["duration"] is None else Timeline().scaled(options["duration"])
    overrides = {name: options[name] for name in ("warmup", "grace", "observe") if options[name] is not None}
    if options["unready-after"] is not None:
        overrides["unready_after"] = None if options["unready-after"] == NEVER else options["unready-after"]
    return attr.evolve(timeline, **overrides)


def config_from(options: RunOptions) -> LabConfig:
    try:
        Addresses(options["net"])
    except ValueError as e:
        raise LabError(str(e)) from None
    if options["client-proxy"] == "ztunnel" and options["mode"] != "netns":
        raise LabError("--client-proxy ztunnel needs --mode netns (ztunnel serves pods in their network namespaces)")
    work = options["out"] / "work" if options["out"] is not None else None
    return LabConfig(
        strategies=[name.strip() for name in options["strategies"].split(",") if name.strip()],
        mode=options["mode"],
        client_proxy=options["client-proxy"],
        seed=options["seed"],
        timeline=timeline_from(options),
        traffic=attr.evolve(
            Traffic(),
            pool_connections=options["pool-connections"],
            pool_rate=options["pool-rate"],
            request_rate=options["request-rate"],
        ),
        keepalive_interval=options["keepalive-interval"],
        keepalive_timeout=options["keepalive-timeout"],
        pod_drain_timeout=options["pod-drain-timeout"],
        net=options["net"],
        teardown=not options["no-teardown"],
        workdir=work,
    )


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = LabOptions()
    try:
        options.parseOptions(argv)
    except usage.UsageError as error:
        print(f"{options}\nztunnel-lab: {error}", file=sys.stderr)
        return 2
    if options.subCommand == "cleanup":
        return _cleanup(options.subOptions["net"])
    return _run(options.subOptions, argv)


def _cleanup(net: int) -> int:
    try:
        removed = remove_leftovers(Addresses(net).network)
    except (TeardownUnavailable, ValueError) as e:
        print(f"ztunnel-lab: {e}", file=sys.stderr)
        return 2
    print("removed blackhole routes: " + (", ".join(removed) or "none"))
    namespaces = leftover_namespaces(net)
    for name in namespaces:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    print("removed network namespaces: " + (", ".join(namespaces) or "none"))
    return 0


def _run(options: RunOptions, argv: list[str]) -> int:
    # SIGTERM unwinds like Ctrl-C, so proxies stop and blackhole routes go away.
    signal.signal(signal.SIGTERM, _terminate)
    progress = None if options["quiet"] else ProgressLine()
    try:
        config = config_from(options)
        results = run_lab(config, progress, command="ztunnel-lab " + shlex.join(argv), keep_records=options["records"])
    except LabError as e:
        if progress is not None:
            progress.done()
        print(f"ztunnel-lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if progress is not None:
            progress.done()
        print("ztunnel-lab: interrupted; proxies stopped and routes removed", file=sys.stderr)
        return 130
    if progress is not None:
        progress.done()
    table = format_table(results)
    print(table)
    out = options["out"]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(results, out / "results.json")
        (out / "drain-lab.svg").write_text(render_svg(results))
        (out / "table.txt").write_text(table + "\n")
        print(f"\nwrote {out / 'results.json'}, {out / 'drain-lab.svg'}, {out / 'table.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
