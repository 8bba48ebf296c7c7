"""Run the lab: every strategy through the same scenario, one after another, with fresh proxies each."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attr

from ztwisted import __version__
from ztwisted.drain.registry import installed_strategies
from ztwisted.tools.lab.measures import event_time, measure, series
from ztwisted.tools.lab.mesh import Addresses
from ztwisted.tools.lab.netns import NetnsAddresses, check_netns_mode
from ztwisted.tools.lab.probes import total
from ztwisted.tools.lab.scenario import LabConfig, LabError, Progress, Strategy, StrategyRun

#: what a seed cannot pin down, said in every result
NOT_DETERMINISTIC = (
    "timing: thread and process scheduling, so when requests start and end relative to the lifecycle events shifts by milliseconds",
    "ephemeral ports, TLS keys and PING payloads",
)

# progress(strategy index, strategy count, strategy name, phase, seconds, ok, failed)
LabProgress = Callable[[int, int, str, str, float, int, int], None]


def parse_strategies(names) -> list[Strategy]:
    installed = installed_strategies()
    strategies = [Strategy.parse(name, installed) for name in names]
    seen = set()
    for strategy in strategies:
        if strategy.name in seen:
            raise LabError(f"strategy {strategy.name} is listed twice")
        seen.add(strategy.name)
    if not strategies:
        raise LabError("name at least one strategy with --strategies")
    return strategies


def run_lab(
    config: LabConfig, progress: LabProgress | None = None, *, command: str | None = None, keep_records: bool = False
) -> dict:
    """Run every strategy of ``config``; returns the JSON-ready results."""
    check_config(config)
    strategies = parse_strategies(config.strategies)
    started = time.time()
    results = []
    with _workdir(config.workdir) as workdir:
        for index, strategy in enumerate(strategies):
            report = _strategy_progress(progress, index, len(strategies), strategy.name)
            run = StrategyRun(config, strategy, workdir / "runs" / strategy.name, workdir / "state", report)
            results.append(strategy_result(run.run(), keep_records=keep_records))
    return {
        "lab": _lab_description(
            config,
            strategies,
            results,
            command=command,
            started=started,
            workdir=None if config.workdir is None else str(workdir),
        ),
        "strategies": results,
    }


def check_config(config: LabConfig) -> None:
    """LabError if ``config`` cannot run here: a bad timeline, proxy or mode, or netns mode without its tools."""
    config.timeline.check()
    if config.client_proxy not in ("ztwisted", "ztunnel"):
        raise LabError(f"--client-proxy must be ztwisted or ztunnel, not {config.client_proxy!r}")
    if config.client_proxy == "ztunnel" and config.mode != "netns":
        raise LabError("--client-proxy ztunnel needs --mode netns (ztunnel serves pods in their network namespaces)")
    if config.mode == "netns":
        check_netns_mode()
    elif config.mode != "loopback":
        raise LabError(f"--mode must be loopback or netns, not {config.mode!r}")


@contextlib.contextmanager
def _workdir(configured: Path | None) -> Iterator[Path]:
    """The configured working directory, or a temporary one that goes when the runs are done."""
    if configured is not None:
        workdir = Path(configured)
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir
        return
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-lab-"))
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _strategy_progress(progress: LabProgress | None, index: int, count: int, name: str) -> Progress:
    """One strategy run's progress callback: ``progress`` told which strategy of how many it is."""

    def report(phase, t, ok, failed):
        if progress is not None:
            progress(index, count, name, phase, t, ok, failed)

    return report


def _lab_description(
    config: LabConfig,
    strategies: list[Strategy],
    results: list[dict],
    *,
    command: str | None,
    started: float,
    workdir: str | None,
) -> dict:
    """The results' ``lab`` part: how the lab ran (settings, addresses, machine, time) and what it approximated."""
    approximations = list(dict.fromkeys(a for result in results for a in result["approximations"]))
    if config.client_proxy == "ztunnel":
        from ztwisted.tools.lab.ztunnel_client import ZTUNNEL_NOTES

        approximations += ZTUNNEL_NOTES
    return {
        "command": command,
        "mode": config.mode,
        "client_proxy": config.client_proxy,
        "seed": config.seed,
        "strategies": [s.name for s in strategies],
        "timeline_s": config.timeline.as_json(),
        "traffic": attr.asdict(config.traffic),
        "proxies": {
            "keepalive_interval_s": config.keepalive_interval,
            "keepalive_timeout_s": config.keepalive_timeout,
            "pod_drain_timeout_s": config.pod_drain_timeout,
            "drain_timeout_s": config.drain_timeout,
        },
        "addresses": _addresses(NetnsAddresses(config.net) if config.mode == "netns" else Addresses(config.net)),
        "machine": machine(),
        "started_at": datetime.datetime.fromtimestamp(started, datetime.UTC).isoformat(timespec="seconds"),
        "took_s": round(time.time() - started, 1),
        "workdir": workdir,
        "approximations": approximations,
        "not_deterministic": list(NOT_DETERMINISTIC),
    }


def strategy_result(raw: dict, *, keep_records: bool = False) -> dict:
    records = raw["records"]
    end = event_time(raw["events"], "traffic-stop") or max((r.ended or 0 for r in records), default=0)
    result = {
        "name": raw["strategy"],
        "components": raw["components"],
        "delete_before_teardown": raw["delete_before_teardown"],
        "events": raw["events"],
        "measures": measure(raw),
        "pool_source": raw["pool_source"],
        # node A's HBONE connections as the client pods' TCP tables showed them (netns mode)
        "wire_connections": raw["wire_connections"],
        "series": series(records, raw["pool"], end),
        "scrapes": raw["scrapes"],
        "metrics_during": [_during(sample) for sample in raw["metrics"]],
        "approximations": raw["approximations"],
        "failures": [r.as_json() for r in records if not r.ok][:100],
        "sampler_errors": raw["sampler_errors"],
        "logs": raw["logs"],
    }
    if keep_records:
        result["records"] = [r.as_json() for r in records]
    return result


def _during(sample: dict) -> dict:
    """The few series worth a timeline, from one periodic scrape."""
    a, b = sample["a"], sample["b"]
    return {
        "t": sample["t"],
        "cpu_s": {node: round(seconds, 3) for node, seconds in sample["cpu"].items()},
        "a_pool_opened_total": total(a, "ztwisted_pool_connections_opened_total"),
        "a_hbone_outbound_open": total(a, "ztwisted_hbone_connections", direction="outbound"),
        "b_hbone_inbound_open": total(b, "ztwisted_hbone_connections", direction="inbound"),
    }


def _addresses(addresses) -> dict:
    names = ("pool_client", "request_client", "b1", "b2", "vip", "node_a", "node_b")
    return {name: getattr(addresses, name) for name in names}


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "ztwisted": __version__,
    }
