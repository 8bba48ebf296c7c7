"""ztunnel and ztwisted in every pairing, measured in one run, with ztunnel <-> ztunnel as the anchor.

    python benchmarks/ztunnel_pairs.py [--quick] [--runs N] [--out FILE] [--json FILE] [--net N]

As root (network namespaces). Each pair is a client node A and a server
node B, each proxy in a network namespace of its own, joined by veth pairs
to a router namespace; the client app (``load.py``, the same clients as
``run.py``) runs in node A's namespace and enters through node A's SOCKS5
port, the echo and sink apps run in node B's (``paths.NamespacedPair``, which
``run.py``'s ``ztunnel`` path uses too).

ztunnel runs in dedicated mode (one workload per instance, as its
``Development.md`` runs it without a cluster), with ``FAKE_CA=true``; the
ztwisted nodes get a plug-in CA that signs with the same test root, so every
pairing trusts every other. Each measure is ``run.py``'s (bulk, short
connections, ping-pong, setup, proxy CPU from ``/proc/PID/stat``); pairs are
interleaved (run 1 of every pair, then run 2...) and the report gives
medians and ratios to ztunnel <-> ztunnel.

ztunnel runs ``ZTUNNEL_WORKER_THREADS`` Tokio workers (default: a quarter of
the cores, at least 2); ztwisted is one process with one reactor thread, so
every ztunnel pairing also runs with 1 worker.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from paths import NamespacedPair, default_worker_threads
from run import FULL, METRICS, QUICK, _fmt, _median, machine, measure, warm_up

from ztwisted.tools.lab.netns import Namespaces
from ztwisted.tools.lab.ztunnel_peer import find_ztunnel, write_plugin_ca

ANCHOR = "ztunnel-ztunnel"


def ratio(value: float | None, anchor: float | None) -> str:
    if not value or not anchor:
        return "-"
    return f"{value / anchor:.2f}x"


def table(medians: dict[str, dict], names: list[str]) -> str:
    head = ["metric", *names, *(f"{n} / {ANCHOR}" for n in names if n != ANCHOR)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, unit, _higher in METRICS:
        row = [f"{label} ({unit})"] + [_fmt(medians[n].get(key)) for n in names]
        row += [ratio(medians[n].get(key), medians[ANCHOR].get(key)) for n in names if n != ANCHOR]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="run.py's --quick settings")
    parser.add_argument("--runs", type=int, help="repetitions of every pair (default: run.py's, 3)")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--json", type=Path, help="write every run's raw numbers here")
    parser.add_argument("--net", type=int, default=42, help="addresses 10.NET.0.0/16 and 127.NET.0.0/16 (default 42)")
    parser.add_argument(
        "--pairs",
        default="ztunnel-ztunnel,ztunnel-ztunnel-1w,ztwisted-ztwisted,ztunnel-ztwisted,"
        "ztunnel-ztwisted-1w,ztwisted-ztunnel,ztwisted-ztunnel-1w",
        help="comma-separated; -1w: ztunnel with ZTUNNEL_WORKER_THREADS=1 (default: all)",
    )
    parser.add_argument("--workdir", type=Path, help="keep configs and logs here (default: a temporary directory)")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    if args.runs:
        settings["runs"] = args.runs
    names = [n.strip() for n in args.pairs.split(",") if n.strip()]
    if ANCHOR not in names:
        names.insert(0, ANCHOR)
    install = find_ztunnel()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ztunnel-pairs-"))
    state_dir = workdir / "state"
    write_plugin_ca(install, state_dir / "ca")
    namespaces = Namespaces(args.net)
    pairs = []
    for index, name in enumerate(names, start=1):
        a, b = name.removesuffix("-1w").split("-")
        if {a, b} - {"ztunnel", "ztwisted"}:
            parser.error(f"unknown pair {name!r}")
        workers = 1 if name.endswith("-1w") else (default_worker_threads() if "ztunnel" in (a, b) else None)
        pairs.append(
            NamespacedPair(
                index,
                a,
                b,
                workers,
                net=args.net,
                namespaces=namespaces,
                workdir=workdir,
                state_dir=state_dir,
                install=install,
            )
        )
    runs: dict[str, list[dict]] = {p.name: [] for p in pairs}
    began = time.monotonic()
    started = []
    try:
        for pair in pairs:
            pair.start()
            started.append(pair)
            pair.call(lambda pair=pair: warm_up(pair))
        # Interleaved, so that drift and the neighbours' load hit every pair alike.
        for run in range(settings["runs"]):
            for pair in pairs:
                t0 = time.monotonic()
                result = pair.call(lambda pair=pair: measure(pair, settings, pair.apps))
                runs[pair.name].append(result)
                print(
                    f"run {run + 1} {pair.name:22s} {time.monotonic() - t0:5.1f} s  "
                    + "  ".join(f"{k}={_fmt(v)}" for k, v in result.items() if k != "cpu_cores"),
                    file=sys.stderr,
                )
    finally:
        for pair in reversed(started):
            pair.stop()
        namespaces.destroy()
    elapsed = time.monotonic() - began
    medians = {n: {k: _median(r.get(k) for r in runs[n]) for k, *_ in METRICS} for n in runs}
    info = machine()
    others = {n: _median(max(phase["others"] for phase in r["cpu_cores"].values()) for r in runs[n]) for n in runs}
    report = [
        f"Measured {info['date']} on {info['nproc']} cores ({info['cpu']}), Linux {info['kernel']}, "
        f"{info['interpreter']}, Twisted {info['twisted']}, pyOpenSSL {info['pyopenssl']} ({info['openssl']}); "
        f"ztunnel {install.ztunnel}; ztwisted from {info['ztwisted']}. Client, proxies and apps share those cores.",
        "",
        f"Settings: {'--quick' if args.quick else 'full'}; median of {settings['runs']} interleaved runs; "
        f"bulk {settings['bulk_mb']} MB; short connections for {settings['conns_seconds']} s; {settings['pingpong']} "
        f"ping-pongs; {settings['setup']} sequential new connections. ztunnel's default worker threads here: "
        f"{default_worker_threads()}. Whole run {elapsed:.0f} s.",
        "",
        table(medians, list(runs)),
        "",
        "Other programs' load while measuring (cores, median over runs of the busiest phase): "
        + ", ".join(f"{n} {v:.2f}" for n, v in others.items()),
        "",
    ]
    errors = {n: sum(r["conn_errors"] for r in runs[n]) for n in runs}
    if any(errors.values()):
        report += [f"Failed short connections: {errors}", ""]
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "settings": settings,
                    "runs": runs,
                    "medians": medians,
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "pairs": {p.name: p.description for p in pairs},
                },
                indent=2,
            )
        )
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("ztunnel_pairs.py needs root (network namespaces)")
    sys.exit(main())
