"""Before/after of proxy CPU per short connection (or per MB of bulk, or per pinned ping-pong): both installs' node pairs up at once, load alternating.

    python benchmarks/ab_conns.py BEFORE_PYTHON AFTER_PYTHON [--slices 16] [--seconds 2] [--net 41]
    python benchmarks/ab_conns.py BEFORE_PYTHON AFTER_PYTHON --sequential N [--slices 16] [--net 41]
    python benchmarks/ab_conns.py BEFORE_PYTHON AFTER_PYTHON --load bulk [--slices 16] [--bulk-mb 100] [--net 41]
    python benchmarks/ab_conns.py BEFORE_PYTHON AFTER_PYTHON --load pingpong [--slices 16] [--round-trips 3000] [--net 41]

`ab.py` compares whole `run.py --quick` runs, a minute apart; on a shared
machine their proxy CPU per short connection moves by 10-20 % from run to
run, more than a change to one connection's work does. Here four ztwisted
node pairs run side by side, each with its own echo app, in the order
before, after, after, before (on 127.NET.2/3.x, .12/13.x, .22/23.x and
.32/33.x, so that neither the order they started in nor their addresses
favour one install), and `load.py`'s short connections (2 processes x 8
threads, as `run.py`) go to each pair in turn in slices of a few seconds.
Each slice gives every pair's CPU per connection (its two nodes,
`/proc/PID/stat`), and the slice's change is the mean of the "after" pairs
over the mean of the "before" pairs; the result is the median over slices,
so the machine's drift hits both sides alike. With `--sequential N`, each
slice instead makes N connections one after another to each pair (one
client, `load.setup`): proxy CPU per connection without concurrency, and
the time until the first echo (SOCKS5 handshake, tunnel, app connect, one
echo). With ``--load bulk`` a slice is one `load.bulk` transfer of
``--bulk-mb`` MB through each pair in turn, and each of its two figures,
throughput (MB/s) and proxy CPU per MB, is compared the same way. With
``--load pingpong`` a slice is ``--round-trips`` 64-byte echoes on one
connection through each pair in turn, with the client, the pair's nodes and
its app pinned to one CPU (as `run.py`'s pinned ping-pong): p50, p99 and
proxy CPU per round trip. Each
Python must have its own ztwisted installed (its `twistd` runs the nodes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import interpreter
import load
from paths import Addresses, Apps, Ztwisted
from run import PINGPONG_WARMUP, _fmt, cpu_seconds, pinned_to_one_cpu, warm_up

from ztwisted.ca import CertificateAuthority
from ztwisted.tools.harness import NodeProcess, twistd_command


class _ShiftedAddresses(Addresses):
    """The same layout on the /24s ``first`` and ``first + 1`` of the network, for the other pairs."""

    def __init__(self, net: int, first: int):
        super().__init__(net)
        self.client, self.app = f"127.{net}.{first}.1", f"127.{net}.{first + 1}.1"
        self.node_a, self.node_b = f"127.{net}.{first}.254", f"127.{net}.{first + 1}.254"


class _InstallNode(NodeProcess):
    """A node run by the ``twistd`` of a given install instead of this Python's."""

    def __init__(self, *args, twistd: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.twistd = twistd

    def command(self) -> list[str]:
        return [self.twistd, *super().command()[len(twistd_command()) :]]


class _InstallPair(Ztwisted):
    def __init__(self, addresses: Addresses, workdir: Path, state_dir: Path, python: str):
        super().__init__(addresses, workdir, state_dir)
        self.twistd = str(Path(python).with_name("twistd"))

    def node_process(self, workdir: Path, **options) -> NodeProcess:
        return _InstallNode(workdir, twistd=self.twistd, **options)


def cpu_per_connection(pair: _InstallPair, seconds: float) -> dict[str, float]:
    pids = pair.pids().values()
    before = sum(cpu_seconds(pid) for pid in pids)
    result = load.short_connections(pair.echo, seconds, 2, 8)
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} short connections failed: {result['first_error']}")
    return {
        "proxy CPU per short connection (both nodes), us": (sum(cpu_seconds(pid) for pid in pids) - before)
        / result["ok"]
        * 1e6
    }


def bulk_figures(pair: _InstallPair, megabytes: int) -> dict[str, float]:
    pids = pair.pids().values()
    before = sum(cpu_seconds(pid) for pid in pids)
    throughput = load.bulk(pair.sink, megabytes * 1_000_000)
    return {
        "bulk throughput, 1 connection, MB/s": throughput,
        "proxy CPU per MB of bulk (both nodes), ms": (sum(cpu_seconds(pid) for pid in pids) - before) / megabytes * 1e3,
    }


def pinned_pingpong(pair: _InstallPair, apps: Apps, count: int) -> dict[str, float]:
    """``count`` 64-byte echoes, all pinned to one CPU: p50, p99 and proxy CPU per round trip."""
    pids = pair.pids().values()
    with pinned_to_one_cpu([*pids, apps.process.pid]):
        before = sum(cpu_seconds(pid) for pid in pids)
        rtts = sorted(load.pingpong(pair.echo, count, warmup=PINGPONG_WARMUP))
        used = sum(cpu_seconds(pid) for pid in pids) - before
    return {
        "pinned ping-pong round trip, p50, us": load.percentile(rtts, 50) / 1e3,
        "pinned ping-pong round trip, p99, us": load.percentile(rtts, 99) / 1e3,
        "proxy CPU per pinned round trip (both nodes), us": used / (count + PINGPONG_WARMUP) * 1e6,
    }


def sequential(pair: _InstallPair, count: int) -> dict[str, float]:
    """``count`` connections one after another (``load.setup``): proxy CPU per connection, p50 until the first echo."""
    pids = pair.pids().values()
    before = sum(cpu_seconds(pid) for pid in pids)
    _, first_echo = load.setup(pair.echo, count)
    return {
        "proxy CPU per sequential connection (both nodes), us": (sum(cpu_seconds(pid) for pid in pids) - before)
        / count
        * 1e6,
        "time until the first echo, p50, us": statistics.median(first_echo) / 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the Python of the 'before' install")
    parser.add_argument("after", help="the Python of the 'after' install")
    parser.add_argument(
        "--load", choices=("conns", "bulk", "pingpong"), default="conns", help="what each slice runs (default conns)"
    )
    parser.add_argument("--slices", type=int, default=16, help="slices per side (default 16)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of short connections per slice (default 2)")
    parser.add_argument(
        "--bulk-mb", type=int, default=100, help="MB sent through each pair per bulk slice (default 100)"
    )
    parser.add_argument(
        "--round-trips", type=int, default=3000, help="pinned ping-pongs per pair per pingpong slice (default 3000)"
    )
    parser.add_argument("--net", type=int, default=41)
    parser.add_argument(
        "--sequential",
        type=int,
        metavar="N",
        help="with --load conns: N connections one after another per pair and slice instead (one client,"
        " no concurrency); proxy CPU per connection and the p50 time until the first echo",
    )
    args = parser.parse_args()
    if args.slices < 2:
        parser.error("--slices must be at least 2")
    if args.load == "bulk":
        slice_figures, slice_text = (lambda pair, apps: bulk_figures(pair, args.bulk_mb)), f"{args.bulk_mb} MB of bulk"
    elif args.load == "pingpong":
        slice_figures = lambda pair, apps: pinned_pingpong(pair, apps, args.round_trips)  # noqa: E731
        slice_text = f"{args.round_trips} pinned ping-pongs"
    elif args.sequential:
        count = args.sequential
        slice_figures, slice_text = (lambda pair, apps: sequential(pair, count)), f"{count} sequential connections"
    else:
        slice_figures, slice_text = (lambda pair, apps: cpu_per_connection(pair, args.seconds)), f"{args.seconds:g} s"
    workdir = Path(tempfile.mkdtemp(prefix="ztwisted-ab-conns-"))
    state_dir = workdir / "state"
    CertificateAuthority.load_or_create_dev(state_dir)
    slots = [
        ("before", Addresses(args.net), args.before),
        ("after", _ShiftedAddresses(args.net, 12), args.after),
        ("after", _ShiftedAddresses(args.net, 22), args.after),
        ("before", _ShiftedAddresses(args.net, 32), args.before),
    ]
    started: list = []
    # figure -> side -> one mean per slice; figure -> one paired change per slice
    means: dict[str, dict[str, list[float]]] = {}
    changes: dict[str, list[float]] = {}
    try:
        pairs = []
        for index, (label, addresses, python) in enumerate(slots):
            apps = Apps(addresses)
            started.append(apps)
            apps.start()
            pair = _InstallPair(addresses, workdir / f"{index}-{label}", state_dir, python)
            started.append(pair)
            pair.start()
            warm_up(pair)
            pairs.append((label, pair, apps))
        for index in range(args.slices):
            used: dict[str, dict[str, list[float]]] = {}
            for label, pair, apps in pairs if index % 2 == 0 else reversed(pairs):
                for figure, value in slice_figures(pair, apps).items():
                    used.setdefault(figure, {"before": [], "after": []})[label].append(value)
            for figure, sides in used.items():
                before, after = statistics.mean(sides["before"]), statistics.mean(sides["after"])
                means.setdefault(figure, {"before": [], "after": []})
                means[figure]["before"].append(before)
                means[figure]["after"].append(after)
                changes.setdefault(figure, []).append(after / before - 1)
                print(f"slice {index + 1}: {figure}: before {_fmt(before)}, after {_fmt(after)}", file=sys.stderr)
    finally:
        for item in reversed(started):
            item.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"Before: {interpreter.describe(args.before)}\nAfter: {interpreter.describe(args.after)}\n")
    print(f"Median of {args.slices} interleaved slices of {slice_text} per pair:\n")
    print("| figure | before | after | paired change |")
    print("|---|---|---|---|")
    for figure, sides in means.items():
        print(
            f"| {figure} | {_fmt(statistics.median(sides['before']))} | {_fmt(statistics.median(sides['after']))} | "
            f"{100 * statistics.median(changes[figure]):+.1f} % (mean {100 * statistics.mean(changes[figure]):+.1f} %, "
            f"sd {100 * statistics.stdev(changes[figure]):.1f} %) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
