"""Pauses of Python's cyclic garbage collector in both ztwisted nodes under short connections.

Starts a node pair as ``run.py`` does (``paths.Ztwisted``) with ``gc_hook/`` on their
PYTHONPATH, opens a few connections to warm up, then times every collection during
``--seconds`` of short connections (16 clients) and prints, per node and generation, how
many collections ran, their median and longest pause and their total. For a before/after,
run it with each install's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import load
from paths import Addresses, Apps, Ztwisted

from ztwisted.ca import CertificateAuthority

HOOK = Path(__file__).resolve().parent / "gc_hook"


def _node_pauses(trace_dir: Path, pid: int, timeout: float = 10.0) -> dict:
    path = trace_dir / f"gc-{pid}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {pid} wrote no GC timings (is gc_hook on its PYTHONPATH?)")
        time.sleep(0.05)
    return json.loads(path.read_text())  # renamed into place whole by the hook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--net", type=int, default=66, help="use addresses in 127.NET.0.0/16 (default 66)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of short connections (default 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ztwisted-gc-") as tmp:
        workdir = Path(tmp)
        trace_dir = workdir / "trace"
        trace_dir.mkdir()
        os.environ["ZTWISTED_GC_TRACE_DIR"] = str(trace_dir)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")]))
        addresses = Addresses(args.net)
        state = workdir / "state"
        CertificateAuthority.load_or_create_dev(state)
        apps = Apps(addresses)
        apps.start()
        pair = Ztwisted(addresses, workdir, state)
        try:
            pair.start()
            load.setup(pair.echo, 50)
            for pid in pair.pids().values():
                os.kill(pid, signal.SIGUSR1)
            result = load.short_connections(pair.echo, args.seconds, 2, 8)
            for pid in pair.pids().values():
                os.kill(pid, signal.SIGUSR2)
            report = {name: _node_pauses(trace_dir, pid) for name, pid in pair.pids().items()}
        finally:
            pair.stop()
            apps.stop()
    print(
        f"{result['ok']} short connections in {args.seconds:g} s ({result['per_second']:.0f}/s), {result['errors']} errors"
    )
    print(
        "| node | start-up objects frozen | generation | collections | median pause (µs) | longest (µs) | total (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, node in sorted(report.items()):
        for generation, pauses in sorted(node["pauses_ns"].items()):
            pauses = sorted(pauses)
            median = pauses[len(pauses) // 2] / 1e3 if pauses else 0
            longest = pauses[-1] / 1e3 if pauses else 0
            print(
                f"| {name} | {node['frozen']:,} | {generation} | {len(pauses)} | {median:,.0f} | {longest:,.0f} "
                f"| {sum(pauses) / 1e6:,.1f} |"
            )


if __name__ == "__main__":
    sys.exit(main())
