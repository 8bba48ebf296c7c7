"""``ztunnel-lab``: run the drain lab from the command line.

::

    ztunnel-lab run --strategies immediate,goaway-on-start,last-mile,client-evict,client-evict+last-mile \\
                    [--mode loopback|netns] [--client-proxy ztwisted|ztunnel] [--seed N] [--duration SECONDS] [--out DIR]
    ztunnel-lab cleanup     # remove blackhole routes a killed run left behind
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import attr

from ztwisted.lab.chart import render_svg
from ztwisted.lab.clients import Traffic
from ztwisted.lab.mesh import Addresses
from ztwisted.lab.netns import leftover_namespaces
from ztwisted.lab.report import ProgressLine, format_table, write_json
from ztwisted.lab.runner import run_lab
from ztwisted.lab.scenario import DEFAULT_STRATEGIES, LabConfig, LabError, Timeline
from ztwisted.lab.teardown import TeardownUnavailable, remove_leftovers

_UNSET = object()


def _seconds_or_never(value: str) -> float | None:
    if value == "never":
        return None
    return _seconds(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value.rstrip("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return seconds


def _positive(kind):
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a {kind.__name__}") from None
        if number <= 0:
            raise argparse.ArgumentTypeError(f"{value!r} must be positive")
        return number

    return parse


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="ztunnel-lab",
        description="Measure ztwisted's drain strategies on live traffic through one pod shutdown.",
    )
    commands = top.add_subparsers(dest="command", required=True)
    default = Timeline()
    run = commands.add_parser(
        "run",
        help="run the scenario once per strategy",
        description="Run the scenario once per strategy, with fresh proxies each time; print a table, "
        "and with --out write results.json, drain-lab.svg, table.txt and the proxies' logs.",
    )
    run.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                     help="comma-separated; combine ztwisted strategies with '+' (default: %(default)s)")
    run.add_argument("--mode", choices=("loopback", "netns"), default="loopback",
                     help="loopback: pods on 127.x addresses, discovery from local config files (default); netns: pods in "
                          "network namespaces, discovery and certificates from a lab ztunnel-control-plane (root)")
    run.add_argument("--client-proxy", choices=("ztwisted", "ztunnel"), default="ztwisted",
                     help="node A, the client pods' node: ztwisted (default) or Istio's real ztunnel (needs --mode "
                     "netns and the cached build of tests/peers/ztunnel_build.py); node B is always ztwisted")
    run.add_argument("--seed", type=int, default=1, help="seeds the apps' request schedules and payloads (default: 1)")
    run.add_argument("--duration", type=_positive(float), default=None,
                     help=f"seconds of traffic per strategy; the default timeline ({default.nominal:g} s) is scaled to it")
    run.add_argument("--warmup", type=_seconds, help=f"seconds before B1 starts terminating (default {default.warmup:g})")
    run.add_argument("--unready-after", type=_seconds_or_never, default=_UNSET,
                     help="seconds after 'terminating' when node A's discovery stops using B1 as an endpoint, or "
                     f"'never' (B1 stays one until removed) (default {default.unready_after:g})")
    run.add_argument("--grace", type=_seconds, help=f"seconds from 'terminating' to B1's app exit (default {default.grace:g})")
    run.add_argument("--observe", type=_seconds, help=f"seconds of traffic after B1 is removed (default {default.observe:g})")
    run.add_argument("--out", type=Path, help="directory for results.json, drain-lab.svg, table.txt and logs")
    run.add_argument("--net", type=int, default=91, help="use addresses 127.NET.0.0/16 (default: 91)")
    run.add_argument("--keepalive-interval", type=_positive(float), default=2.0, help="proxies' HBONE keepalive interval (default: 2)")
    run.add_argument("--keepalive-timeout", type=_positive(float), default=3.0, help="proxies' HBONE keepalive timeout (default: 3)")
    run.add_argument("--pod-drain-timeout", type=_positive(float), default=3.0, help="proxies' --pod-drain-timeout (default: 3)")
    traffic = Traffic()
    run.add_argument("--pool-connections", type=_positive(int), default=traffic.pool_connections,
                     help="keep-alive connections of the pooling app (default: %(default)s)")
    run.add_argument("--pool-rate", type=_positive(float), default=traffic.pool_rate,
                     help="requests/s per pooled connection (default: %(default)s)")
    run.add_argument("--request-rate", type=_positive(float), default=traffic.request_rate,
                     help="requests/s of the per-request app (default: %(default)s)")
    run.add_argument("--no-teardown", action="store_true", help="do not approximate the network teardown")
    run.add_argument("--records", action="store_true", help="put every request's record in results.json")
    run.add_argument("--quiet", action="store_true", help="no progress display")

    cleanup = commands.add_parser(
        "cleanup", help="remove what a killed run left: blackhole routes in 127.NET.0.0/16, ztwNET-* namespaces"
    )
    cleanup.add_argument("--net", type=int, default=91)
    return top


def timeline_from(args) -> Timeline:
    timeline = Timeline() if args.duration is None else Timeline().scaled(args.duration)
    overrides = {name: getattr(args, name) for name in ("warmup", "grace", "observe") if getattr(args, name) is not None}
    if args.unready_after is not _UNSET:
        overrides["unready_after"] = args.unready_after
    return attr.evolve(timeline, **overrides)


def config_from(args) -> LabConfig:
    try:
        Addresses(args.net)
    except ValueError as e:
        raise LabError(str(e)) from None
    if args.client_proxy == "ztunnel" and args.mode != "netns":
        raise LabError("--client-proxy ztunnel needs --mode netns (ztunnel serves pods in their network namespaces)")
    work = args.out / "work" if args.out is not None else None
    return LabConfig(
        strategies=[name.strip() for name in args.strategies.split(",") if name.strip()],
        mode=args.mode,
        client_proxy=args.client_proxy,
        seed=args.seed,
        timeline=timeline_from(args),
        traffic=attr.evolve(Traffic(), pool_connections=args.pool_connections, pool_rate=args.pool_rate,
                            request_rate=args.request_rate),
        keepalive_interval=args.keepalive_interval,
        keepalive_timeout=args.keepalive_timeout,
        pod_drain_timeout=args.pod_drain_timeout,
        net=args.net,
        teardown=not args.no_teardown,
        workdir=work,
    )


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command == "cleanup":
        try:
            removed = remove_leftovers(Addresses(args.net).network)
        except (TeardownUnavailable, ValueError) as e:
            print(f"ztunnel-lab: {e}", file=sys.stderr)
            return 2
        print("removed blackhole routes: " + (", ".join(removed) or "none"))
        namespaces = leftover_namespaces(args.net)
        for name in namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        print("removed network namespaces: " + (", ".join(namespaces) or "none"))
        return 0
    # SIGTERM unwinds like Ctrl-C, so proxies stop and blackhole routes go away.
    signal.signal(signal.SIGTERM, _terminate)
    progress = None if args.quiet else ProgressLine()
    try:
        config = config_from(args)
        results = run_lab(config, progress, command="ztunnel-lab " + shlex.join(argv), keep_records=args.records)
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
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(results, args.out / "results.json")
        (args.out / "drain-lab.svg").write_text(render_svg(results))
        (args.out / "table.txt").write_text(table + "\n")
        print(f"\nwrote {args.out / 'results.json'}, {args.out / 'drain-lab.svg'}, {args.out / 'table.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
