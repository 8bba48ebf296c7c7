"""One strategy through one pod shutdown, on live traffic, with real ``twistd ztunnel`` processes.

Node A serves the client pods ``client-pool`` and ``client-req``; node B
serves ``b1`` (the pod that terminates) and ``b2`` (its replacement), both
endpoints of ``echo.default.svc.cluster.local``. The timeline, in seconds
from the start of traffic (see :class:`Timeline`)::

    warm-up -> terminating (B1 keeps serving; node B gets "pod terminating")
            -> unready     (node A's discovery: B1 is no longer an endpoint)
            -> app exit    (B1's app stops accepting, finishes, closes)
            -> delete + teardown  (last-mile: Del, Ack, then the network goes;
                                   the others: the network goes, then Del)
            -> removed     (discovery: B1 is gone; node A: destination removed)
            -> observe     (traffic goes on; leftovers are watched) -> stop
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import attr

from ztwisted.harness import NodeProcess
from ztwisted.lab.clients import Clock, PerRequestApp, PoolingApp, Recorder, Traffic
from ztwisted.lab.mesh import APP_PORT, SERVICE_PORT, Addresses, write_mesh
from ztwisted.lab.probes import Sampler, fetch, parse_metrics, total
from ztwisted.lab.server import ServerApp
from ztwisted.lab.teardown import Blackhole, TeardownUnavailable, blackhole_available

DEFAULT_STRATEGIES = ("immediate", "goaway-on-start", "last-mile", "client-evict", "client-evict+last-mile")


class LabError(Exception):
    """The lab cannot run as asked; the message says why and what to do."""


@attr.s(frozen=True)
class Timeline:
    """Seconds between the lifecycle events (defaults: 20 s of traffic per strategy)."""

    warmup: float = attr.ib(default=3.0)
    #: after "terminating"; None: B1 stays an endpoint until it is removed
    unready_after: float | None = attr.ib(default=1.5)
    grace: float = attr.ib(default=5.0)  # terminating -> app exit
    teardown_after_exit: float = attr.ib(default=0.5)  # app exit -> first of delete/teardown
    removal_after: float = attr.ib(default=1.5)  # delete and teardown done -> discovery removes B1
    observe: float = attr.ib(default=10.0)  # removal -> traffic stops

    @property
    def nominal(self) -> float:
        return self.warmup + self.grace + self.teardown_after_exit + self.removal_after + self.observe

    def scaled(self, duration: float) -> Timeline:
        """The same shape, stretched or squeezed to ``duration`` seconds of traffic."""
        if duration <= 0:
            raise LabError(f"--duration must be positive, not {duration}")
        factor = duration / self.nominal
        changes = {field.name: getattr(self, field.name) for field in attr.fields(Timeline)}
        return Timeline(**{k: (None if v is None else round(v * factor, 4)) for k, v in changes.items()})

    def check(self) -> None:
        for field in attr.fields(Timeline):
            value = getattr(self, field.name)
            if value is not None and value < 0:
                raise LabError(f"timeline: {field.name} must not be negative ({value})")
        if self.unready_after is not None and self.unready_after > self.grace:
            raise LabError(
                f"timeline: unready-after ({self.unready_after} s) must not be later than the app's exit "
                f"(grace {self.grace} s)"
            )

    def as_json(self) -> dict:
        return attr.asdict(self)


@attr.s(frozen=True)
class LabConfig:
    strategies: tuple[str, ...] = attr.ib(default=DEFAULT_STRATEGIES, converter=tuple)
    mode: str = attr.ib(default="loopback")
    seed: int = attr.ib(default=1)
    timeline: Timeline = attr.ib(factory=Timeline)
    traffic: Traffic = attr.ib(factory=Traffic)
    keepalive_interval: float = attr.ib(default=2.0)
    keepalive_timeout: float = attr.ib(default=3.0)
    pod_drain_timeout: float = attr.ib(default=3.0)
    drain_timeout: float = attr.ib(default=1.0)  # when the lab stops the proxies
    net: int = attr.ib(default=91)
    teardown: bool = attr.ib(default=True)  # approximate the network teardown if possible
    workdir: Path | None = attr.ib(default=None)  # logs, configs and the CA; a temporary one if None

    def node_args(self, strategy: Strategy) -> tuple[str, ...]:
        return (
            "--drain-strategy", ",".join(strategy.components),
            "--keepalive-interval", str(self.keepalive_interval),
            "--keepalive-timeout", str(self.keepalive_timeout),
            "--pod-drain-timeout", str(self.pod_drain_timeout),
            "--drain-timeout", str(self.drain_timeout),
        )


@attr.s(frozen=True)
class Strategy:
    """A lab strategy name such as ``client-evict+last-mile``: ztwisted strategies composed with ``+``."""

    name: str = attr.ib()
    components: tuple[str, ...] = attr.ib(converter=tuple)

    @property
    def delete_before_teardown(self) -> bool:
        """Option (2): the node agent's Del arrives while the pod's network still exists."""
        return "last-mile" in self.components

    @classmethod
    def parse(cls, name: str, installed: dict) -> Strategy:
        components = [part.strip() for part in name.replace(",", "+").split("+") if part.strip()]
        unknown = [part for part in components if part not in installed]
        if not components or unknown:
            raise LabError(
                f"unknown drain strategy {', '.join(unknown) or repr(name)} in {name!r}; "
                f"installed: {', '.join(installed)} (combine them with '+')"
            )
        return cls("+".join(components), components)


Progress = Callable[[str, float, int, int], None]  # phase, seconds, ok, failed


class StrategyRun:
    """Runs one strategy's scenario and returns its raw observations (see :func:`measures.measure`)."""

    def __init__(self, config: LabConfig, strategy: Strategy, workdir: Path, state_dir: Path, progress: Progress | None = None):
        self.config = config
        self.strategy = strategy
        self.workdir = workdir
        self.state_dir = state_dir
        self.progress = progress or (lambda *args: None)
        self.addresses = Addresses(config.net)
        self.events: list[dict] = []
        self.approximations: list[str] = []
        self.clock: Clock | None = None
        self.recorder: Recorder | None = None

    # -- helpers -------------------------------------------------------------------

    def event(self, name: str, **details) -> float:
        t = self.clock()
        self.events.append({"t": round(t, 4), "name": name, **details})
        return t

    def wait_until(self, t: float, phase: str) -> None:
        while True:
            now = self.clock()
            self.progress(phase, now, self.recorder.ok, self.recorder.failed)
            if now >= t:
                return
            time.sleep(min(0.25, t - now))

    def _node(self, name: str, control_ip: str, config: Path) -> NodeProcess:
        return NodeProcess(
            self.workdir / name,
            name=name,
            control_ip=control_ip,
            config=config,
            node=name,
            state_dir=self.state_dir,
            extra_args=self.config.node_args(self.strategy),
        )

    # -- the run ---------------------------------------------------------------------

    def run(self) -> dict:
        config, addresses, timeline = self.config, self.addresses, self.config.timeline
        a_mesh = self.workdir / "node-a-discovery" / "mesh.yaml"
        b_mesh = self.workdir / "node-b-discovery" / "mesh.yaml"
        write_mesh(a_mesh, addresses)
        write_mesh(b_mesh, addresses)
        node_a = self._node("node-a", addresses.node_a, a_mesh)
        node_b = self._node("node-b", addresses.node_b, b_mesh)
        blackhole = Blackhole(addresses.b1)
        with contextlib.ExitStack() as cleanup:
            b1 = ServerApp("b1", addresses.b1, APP_PORT).start()
            cleanup.callback(b1.close)
            b2 = ServerApp("b2", addresses.b2, APP_PORT).start()
            cleanup.callback(b2.close)
            cleanup.callback(blackhole.remove)
            self.progress("starting proxies", 0.0, 0, 0)
            for node in (node_b, node_a):
                try:
                    node.start()
                except RuntimeError as e:
                    raise LabError(f"cannot start {node.name} (logs: {node.log_path}): {e}") from None
                cleanup.callback(_stop_node, node)
                _wait_ready(node)

            self.clock = clock = Clock()
            self.recorder = recorder = Recorder(clock)
            sampler = Sampler(clock, node_a, node_b, b1_ip=addresses.b1, b2_ip=addresses.b2).start()
            cleanup.callback(sampler.stop)
            start_scrape = sampler.scrape()
            apps = [
                PoolingApp("client-pool", node_a.socks5, addresses.pool_client, addresses.vip, SERVICE_PORT,
                           config.traffic, recorder, config.seed),
                PerRequestApp("client-req", node_a.socks5, addresses.request_client, addresses.vip, SERVICE_PORT,
                              config.traffic, recorder, config.seed),
            ]
            for app in apps:
                app.start(clock)
                cleanup.callback(app.stop)
            self.event("traffic-start")

            self.wait_until(timeline.warmup, "warm-up")
            before = sampler.scrape()
            status, took = _admin(node_b, "POST", "/workloads/b1/terminating", timeout=30)
            terminating = self.event("terminating", answered_in_s=round(took, 4), status=status)
            if timeline.unready_after is not None:
                self.wait_until(terminating + timeline.unready_after, "terminating (B1 still an endpoint)")
                self._discovery(node_a, [(a_mesh, "unready")], "unready")
            self.wait_until(terminating + timeline.grace, "terminating (grace period)")
            self.event("app-exit")
            exit_report = b1.exit()
            app_exited = self.event("app-exited", **exit_report)
            self.wait_until(app_exited + timeline.teardown_after_exit, "app exited")
            if self.strategy.delete_before_teardown:
                ack = self._delete(node_b)
                self._teardown(blackhole)
            else:
                self._teardown(blackhole)
                ack = self._delete(node_b)
            pod_gone = self.clock()
            self.wait_until(pod_gone + timeline.removal_after, "pod deleted")
            removed = self._discovery(node_a, [(a_mesh, "gone"), (b_mesh, "gone")], "removed")
            self.wait_until(removed + timeline.observe, "observing")

            self.event("traffic-stop")
            self.progress("stopping apps", self.clock(), recorder.ok, recorder.failed)
            for app in apps:
                app.stop()
            after = sampler.scrape()
            sampler.stop()
            self.event("done")
            return {
                "strategy": self.strategy.name,
                "components": list(self.strategy.components),
                "delete_before_teardown": self.strategy.delete_before_teardown,
                "events": self.events,
                "records": recorder.records,
                "pool": sampler.pool,
                "metrics": sampler.metrics,
                "scrapes": {"start": start_scrape, "before": before, "after": after},
                "ack": ack,
                "b1_exit": exit_report,
                "apps": {
                    app.name: {"connections_opened": app.connections_opened, "idle_closes": app.idle_closes}
                    for app in apps
                },
                "approximations": self.approximations,
                "sampler_errors": sampler.errors,
                "logs": {"node-a": str(node_a.log_path), "node-b": str(node_b.log_path)},
            }

    def _discovery(self, node: NodeProcess, changes: list[tuple[Path, str]], name: str) -> float:
        """Edit the nodes' config files; the event's time is the edit, ``applied_in_s`` when node A reloaded."""
        reloads = _reloads(node)
        for path, b1 in changes:
            write_mesh(path, self.addresses, b1=b1)
        t = self.event(name)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if _reloads(node) > reloads:
                self.events[-1]["applied_in_s"] = round(self.clock() - t, 4)
                break
            time.sleep(0.02)
        else:
            self.events[-1]["applied_in_s"] = None
        return t

    def _delete(self, node_b: NodeProcess) -> dict:
        self.event("delete")
        status, took = _admin(node_b, "DELETE", "/workloads/b1", timeout=self.config.pod_drain_timeout + 30)
        self.event("ack", status=status, took_s=round(took, 4))
        return {"status": status, "delete_to_ack_s": round(took, 4)}

    def _teardown(self, blackhole: Blackhole) -> None:
        if not self.config.teardown:
            self.approximations.append("network teardown: skipped (--no-teardown); B1's address stays reachable")
            self.event("teardown", approximated="skipped")
            return
        why = blackhole_available()
        if why is None:
            try:
                blackhole.add()
            except TeardownUnavailable as e:
                why = str(e)
        if why is None:
            self.approximations.append(
                f"network teardown: blackhole route for {blackhole.ip}/32 in the local table (packets to and from B1 "
                "dropped, established connections included; a new connect() fails at once with EINVAL instead of "
                "timing out; node B's listeners on B1's address stay open until the pod is deleted)"
            )
            self.event("teardown", approximated="blackhole route")
        else:
            self.approximations.append(f"network teardown: NOT approximated ({why}); B1's address stays reachable")
            self.event("teardown", approximated=f"not ({why})")


def _admin(node: NodeProcess, method: str, path: str, timeout: float) -> tuple[int, float]:
    """Status and seconds until the answer of an admin request (the answer comes when the event completes)."""
    request = urllib.request.Request(f"http://{node.control_ip}:15000{path}", method=method)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:
        raise LabError(f"{method} {path} on {node.name} failed: {e}") from None
    return status, time.monotonic() - started


def _reloads(node: NodeProcess) -> float:
    try:
        return total(parse_metrics(fetch(f"http://{node.control_ip}:15020/metrics").decode()), "ztwisted_config_reloads_total")
    except OSError:
        return 0.0


def _wait_ready(node: NodeProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if node.http("readiness", "/healthz/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise LabError(f"{node.name} not ready within {timeout} s (logs: {node.log_path}):\n{node.log_tail()}")


def _stop_node(node: NodeProcess) -> None:
    try:
        node.stop(timeout=15)
    except RuntimeError:
        node.kill()
