"""Before/after of proxy CPU per short connection: both installs' node pairs up at once, load alternating.

    python benchmarks/ab_conns.py BEFORE_PYTHON AFTER_PYTHON [--slices 16] [--seconds 2] [--net 41]

`ab.py` compares whole `run.py --quick` runs, a minute apart; on a shared
machine their proxy CPU per short connection moves by 10-20 % from run to
run, more than a change to one connection's work does. Here both ztwisted
installs run their node pair side by side (the "after" pair on
127.NET.12.x/13.x) with their own echo app, and `load.py`'s short
connections (2 processes x 8 threads, as `run.py`) alternate between them in
slices of a few seconds (before, after, after, before, ...). Each slice gives
the two nodes' CPU per connection (`/proc/PID/stat`); the result is the
median of the paired changes, so the machine's drift hits both sides alike.
Each Python must have its own ztwisted installed (its `twistd` is used).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import load
from paths import MESH, Addresses, Apps, Ztwisted
from run import cpu_seconds, warm_up

from ztwisted.ca import CertificateAuthority
from ztwisted.tools.harness import NodeProcess, twistd_command


class _SecondAddresses(Addresses):
    """The same layout on other /24s of the network, for the second pair."""

    def __init__(self, net: int):
        super().__init__(net)
        self.client, self.app = f"127.{net}.12.1", f"127.{net}.13.1"
        self.node_a, self.node_b = f"127.{net}.12.254", f"127.{net}.13.254"


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

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "mesh.yaml"
        config.write_text(MESH.format(client=self.addresses.client, app=self.addresses.app))
        for name, ip in (("node-b", self.addresses.node_b), ("node-a", self.addresses.node_a)):
            node = _InstallNode(
                self.workdir / name,
                name=name,
                control_ip=ip,
                config=config,
                node=name,
                state_dir=self.state_dir,
                twistd=self.twistd,
            )
            self.nodes.append(node)
            node.start()


def cpu_per_connection(pair: _InstallPair, seconds: float) -> float:
    pids = pair.pids().values()
    before = sum(cpu_seconds(pid) for pid in pids)
    result = load.short_connections(pair.echo, seconds, 2, 8)
    if result["errors"]:
        raise RuntimeError(f"{result['errors']} short connections failed: {result['first_error']}")
    return (sum(cpu_seconds(pid) for pid in pids) - before) / result["ok"] * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the Python of the 'before' install")
    parser.add_argument("after", help="the Python of the 'after' install")
    parser.add_argument("--slices", type=int, default=16, help="slices per side (default 16)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of load per slice (default 2)")
    parser.add_argument("--net", type=int, default=41)
    args = parser.parse_args()
    if args.slices < 2:
        parser.error("--slices must be at least 2")
    workdir = Path(tempfile.mkdtemp(prefix="ztwisted-ab-conns-"))
    state_dir = workdir / "state"
    CertificateAuthority.load_or_create_dev(state_dir)
    sides = {
        "before": (Addresses(args.net), args.before),
        "after": (_SecondAddresses(args.net), args.after),
    }
    started: list = []
    cpu: dict[str, list[float]] = {"before": [], "after": []}
    try:
        pairs = {}
        for label, (addresses, python) in sides.items():
            apps = Apps(addresses)
            started.append(apps)
            apps.start()
            pairs[label] = _InstallPair(addresses, workdir / label, state_dir, python)
            started.append(pairs[label])
            pairs[label].start()
            warm_up(pairs[label])
        for index in range(args.slices):
            for label in ("before", "after") if index % 2 == 0 else ("after", "before"):
                cpu[label].append(cpu_per_connection(pairs[label], args.seconds))
            print(
                f"slice {index + 1}: before {cpu['before'][-1]:.0f} us, after {cpu['after'][-1]:.0f} us",
                file=sys.stderr,
            )
    finally:
        for item in reversed(started):
            item.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    changes = [after / before - 1 for before, after in zip(cpu["before"], cpu["after"], strict=True)]
    print("| proxy CPU per short connection (both nodes) | before | after | paired change |")
    print("|---|---|---|---|")
    print(
        f"| median of {args.slices} interleaved slices of {args.seconds:g} s | "
        f"{statistics.median(cpu['before']):,.0f} us | {statistics.median(cpu['after']):,.0f} us | "
        f"{100 * statistics.median(changes):+.1f} % (mean {100 * statistics.mean(changes):+.1f} %, "
        f"sd {100 * statistics.stdev(changes):.1f} %) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
