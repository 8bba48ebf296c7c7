"""ztunnel and ztwisted in every pairing, measured in one run, with ztunnel <-> ztunnel as the anchor.

    python benchmarks/ztunnel_pairs.py [--quick] [--runs N] [--out FILE] [--json FILE] [--net N]

As root (network namespaces). Each pair is a client node A and a server
node B, each proxy in a network namespace of its own (ztunnel binds 15001,
15006 and 15008 on the wildcard address, its admin and SOCKS5 ports on
localhost), joined by veth pairs to a router namespace:

- node A's namespace holds the ``client`` workload's address 10.<net>.2.<i>;
  the client app (``load.py``, the same clients as ``run.py``) runs there on
  a thread that entered it, and reaches node A through its SOCKS5 port
  (ztunnel: ``127.0.0.1:15080``, ``UNSTABLE_ENABLE_SOCKS5``; ztwisted: its
  control IP ``127.<net>.2.254:15080``), asking for the echo workload's
  address; the short-connection worker processes start from that thread and
  so are in the namespace too;
- node B's namespace holds the ``echo`` workload's address 10.<net>.3.<i>
  and the echo and sink apps (``apps.py``, listening on all of its
  addresses: ztunnel's inbound connects to the app on localhost, ztwisted's
  on the workload address).

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
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from paths import ECHO_PORT, SINK_PORT, Apps, BenchPath
from run import FULL, METRICS, QUICK, _fmt, _median, machine, measure, warm_up

from ztwisted.netns import call_in_netns
from ztwisted.tools.harness import NodeProcess
from ztwisted.tools.lab.netns import Namespaces
from ztwisted.tools.lab.ztunnel_peer import ZtunnelPeer, find_ztunnel, write_plugin_ca

MESH = textwrap.dedent(
    """\
    workloads:
    - uid: cluster1//v1/Pod/default/client
      name: client
      namespace: default
      serviceAccount: client
      trustDomain: cluster.local
      workloadIps: ["{client}"]
      protocol: HBONE
      node: node-a
      services: {{}}
    - uid: cluster1//v1/Pod/default/echo
      name: echo
      namespace: default
      serviceAccount: echo
      trustDomain: cluster.local
      workloadIps: ["{app}"]
      protocol: HBONE
      node: node-b
      services: {{}}
    """
)
ANCHOR = "ztunnel-ztunnel"


def default_worker_threads() -> int:
    """ztunnel's worker count with no ZTUNNEL_WORKER_THREADS and no CPU limit (its src/config.rs)."""
    return max(math.ceil((os.cpu_count() or 1) * 0.25), 2)


class PairAddresses:
    """Run ``i``'s workload addresses; ``app`` is where the apps listen (all of node B's addresses)."""

    def __init__(self, net: int, i: int):
        self.client = f"10.{net}.2.{i}"
        self.echo = f"10.{net}.3.{i}"
        self.app = "0.0.0.0"
        self.node_a = f"127.{net}.2.254"
        self.node_b = f"127.{net}.3.254"


class Pair(BenchPath):
    """Node A (``ztunnel`` or ``ztwisted``) -> HBONE -> node B, each in its own namespace."""

    def __init__(
        self,
        index: int,
        a: str,
        b: str,
        workers: int | None,
        *,
        net: int,
        namespaces: Namespaces,
        workdir: Path,
        state_dir: Path,
        install,
    ):
        self.a, self.b, self.workers = a, b, workers
        suffix = "" if workers is None or "ztunnel" not in (a, b) else f" ({workers} worker{'s' * (workers > 1)})"
        self.name = f"{a}-{b}{'-1w' if workers == 1 else ''}"
        self.description = f"client -> SOCKS5 {a} -> HBONE -> {b} -> echo{suffix}"
        self.addresses = PairAddresses(net, index)
        self.namespaces = namespaces
        self.ns_a, self.ns_b = f"p{index}a", f"p{index}b"
        self.workdir = workdir / self.name
        self.state_dir = state_dir
        self.install = install
        socks5 = ["127.0.0.1", 15080] if a == "ztunnel" else [self.addresses.node_a, 15080]
        self.echo = {"connect": [self.addresses.echo, ECHO_PORT], "source_ip": self.addresses.client, "socks5": socks5}
        self.sink = {"connect": [self.addresses.echo, SINK_PORT], "source_ip": self.addresses.client, "socks5": socks5}
        self.proxies: dict[str, object] = {}
        self.apps: Apps | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.namespaces.add_pod(self.ns_a, self.addresses.client)
        self.namespaces.add_pod(self.ns_b, self.addresses.echo)
        mesh = self.workdir / "mesh.yaml"
        mesh.write_text(MESH.format(client=self.addresses.client, app=self.addresses.echo))
        self.apps = call_in_netns(self.namespaces.path(self.ns_b), lambda: _started(Apps(self.addresses)))
        for role, kind, ns, workload, control_ip in (
            ("node-b", self.b, self.ns_b, "default/echo/echo", self.addresses.node_b),
            ("node-a", self.a, self.ns_a, "default/client/client", self.addresses.node_a),
        ):
            if kind == "ztunnel":
                # Without ENABLE_ORIG_SRC=false, ztunnel (as root) connects to the app from the client's
                # address, whose answers would leave for the router: a node needs istio-cni's rules for that.
                env = {"ENABLE_ORIG_SRC": "false"}
                if self.workers:
                    env["ZTUNNEL_WORKER_THREADS"] = str(self.workers)
                proxy = ZtunnelPeer(
                    role,
                    netns=self.namespaces.name(ns),
                    config=mesh,
                    workdir=self.workdir,
                    workload=workload,
                    install=self.install,
                    env=env,
                )
            else:
                proxy = NodeProcess(
                    self.workdir / role,
                    name=role,
                    control_ip=control_ip,
                    config=mesh,
                    node=role,
                    state_dir=self.state_dir,
                    netns=self.namespaces.name(ns),
                )
            self.proxies[role] = proxy
            proxy.start()

    def stop(self) -> None:
        for proxy in reversed(list(self.proxies.values())):
            try:
                proxy.stop()
            except RuntimeError:
                proxy.kill()
        if self.apps is not None:
            self.apps.stop()

    def pids(self) -> dict[str, int]:
        return {f"{role}-{self.a if role == 'node-a' else self.b}": p.process.pid for role, p in self.proxies.items()}

    def in_client_namespace(self, function, timeout: float = 900.0):
        """Run ``function`` where the client app lives (its worker processes start there too)."""
        return call_in_netns(self.namespaces.path(self.ns_a), function, timeout=timeout)


def _started(apps: Apps) -> Apps:
    apps.start()
    return apps


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
            Pair(
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
        namespaces.add_router()
        for pair in pairs:
            pair.start()
            started.append(pair)
            pair.in_client_namespace(lambda pair=pair: warm_up(pair))
        # Interleaved, so that drift and the neighbours' load hit every pair alike.
        for run in range(settings["runs"]):
            for pair in pairs:
                t0 = time.monotonic()
                result = pair.in_client_namespace(lambda pair=pair: measure(pair, settings, pair.apps))
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
    medians = {n: {k: _median(r[k] for r in runs[n]) for k, *_ in METRICS} for n in runs}
    info = machine()
    others = {n: _median(max(phase["others"] for phase in r["cpu_cores"].values()) for r in runs[n]) for n in runs}
    report = [
        f"Measured {info['date']} on {info['nproc']} cores ({info['cpu']}), Linux {info['kernel']}, "
        f"Python {info['python']}, Twisted {info['twisted']}, pyOpenSSL {info['pyopenssl']} ({info['openssl']}); "
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
