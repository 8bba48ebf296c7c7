"""One strategy through one pod shutdown, on live traffic, with real ``twistd ztunnel`` processes.

Node A serves the client pods ``client-pool`` and ``client-req``; node B
serves ``b1`` (the pod that terminates) and ``b2`` (its replacement), both
endpoints of ``echo.default.svc.cluster.local``. The timeline, in seconds
from the start of traffic (see :class:`Timeline`)::

    warm-up -> terminating (B1 keeps serving; node B gets "pod terminating")
            -> unready     (discovery: B1 is no longer an endpoint)
            -> app exit    (B1's app stops accepting, finishes, closes)
            -> delete + teardown  (last-mile: Del, Ack, then the network goes;
                                   the others: the network goes, then Del)
            -> removed     (discovery: B1 is gone; node A: destination removed)
            -> observe     (traffic goes on; leftovers are watched) -> stop
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import attr
import attrs

from ztwisted.tools.lab.clients import Clock, PerRequestApp, PoolingApp, Recorder, Traffic
from ztwisted.tools.lab.loopback import LoopbackPlatform
from ztwisted.tools.lab.platform import LabError
from ztwisted.tools.lab.probes import Sampler, b1_in_config_dump

__all__ = ["DEFAULT_STRATEGIES", "LabConfig", "LabError", "Strategy", "StrategyRun", "Timeline"]

DEFAULT_STRATEGIES = ("immediate", "goaway-on-start", "last-mile", "client-evict", "client-evict+last-mile")


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
    #: node A's proxy: ``ztwisted`` or ``ztunnel`` (the real one, netns mode only); node B is always ztwisted
    client_proxy: str = attr.ib(default="ztwisted")
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
            "--drain-strategy",
            ",".join(strategy.components),
            "--keepalive-interval",
            str(self.keepalive_interval),
            "--keepalive-timeout",
            str(self.keepalive_timeout),
            "--pod-drain-timeout",
            str(self.pod_drain_timeout),
            "--drain-timeout",
            str(self.drain_timeout),
            "--random-seed",
            str(self.seed),
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


def platform_for(config: LabConfig, workdir: Path, state_dir: Path):
    if config.mode == "netns":
        from ztwisted.tools.lab.netns import NetnsPlatform

        return NetnsPlatform(config, workdir, state_dir)
    return LoopbackPlatform(config, workdir, state_dir)


@attrs.frozen
class _Shutdown:
    """What B1's shutdown left to report: the scrape as it began, how B1's app exited, and the Del's Ack."""

    before: dict
    b1_exit: dict
    ack: dict


def _wire_connections(wire) -> list[dict]:
    """Node A's HBONE connections as the client pods' TCP tables showed them (netns mode)."""
    return [{**seen, "namespace": Path(key[0]).name, "local_port": key[2]} for key, seen in wire.connections.items()]


class StrategyRun:
    """Runs one strategy's scenario and returns its raw observations (see :func:`measures.measure`)."""

    def __init__(
        self, config: LabConfig, strategy: Strategy, workdir: Path, state_dir: Path, progress: Progress | None = None
    ):
        self.config = config
        self.strategy = strategy
        self.workdir = workdir
        self.state_dir = state_dir
        self.progress = progress or (lambda *args: None)
        self.events: list[dict] = []
        self.approximations: list[str] = []
        self.clock: Clock | None = None
        self.recorder: Recorder | None = None

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

    def run(self) -> dict:
        platform = platform_for(self.config, self.workdir, self.state_dir)
        try:
            return self._run(platform)
        finally:
            platform.close()

    def _run(self, platform) -> dict:
        self.progress("starting proxies and pods", 0.0, 0, 0)
        platform.start(self.config.node_args(self.strategy))
        self.clock = Clock()
        self.recorder = Recorder(self.clock)
        wire = platform.watch_wire(self.clock)
        addresses = platform.addresses
        sampler = Sampler(
            self.clock, platform.node_a, platform.node_b, b1_ip=addresses.b1, b2_ip=addresses.b2, wire=wire
        ).start()
        platform.cleanup.callback(sampler.stop)
        start_scrape = sampler.scrape()
        apps = self._start_apps(platform)
        self.event("traffic-start")
        shutdown = self._shut_down_b1(platform, sampler, apps)
        self.event("traffic-stop")
        self.progress("stopping apps", self.clock(), self.recorder.ok, self.recorder.failed)
        for app in apps:
            app.stop()
        after = sampler.scrape()
        sampler.stop()
        self.event("done")
        scrapes = {"start": start_scrape, "before": shutdown.before, "after": after}
        return self._observations(platform, apps, sampler, wire, scrapes, shutdown)

    def _start_apps(self, platform) -> list:
        """The client pods' apps, sending: one keeps a pool of connections, one opens one per request."""
        config, recorder = self.config, self.recorder
        apps = [
            PoolingApp(
                "client-pool",
                traffic=config.traffic,
                recorder=recorder,
                seed=config.seed,
                **platform.client("client-pool"),
            ),
            PerRequestApp(
                "client-req",
                traffic=config.traffic,
                recorder=recorder,
                seed=config.seed,
                **platform.client("client-req"),
            ),
        ]
        for app in apps:
            app.start(self.clock)
            platform.cleanup.callback(app.stop)
        return apps

    def _shut_down_b1(self, platform, sampler: Sampler, apps: list) -> _Shutdown:
        """B1's shutdown, from the warm-up to the end of observing, as the timeline says."""
        timeline = self.config.timeline
        # Events happen at planned times (from the start of traffic), so every strategy sends the same
        # schedule for the same time; a step that overruns (a slow Ack) pushes the rest back.
        planned = timeline.warmup
        self.wait_until(planned, "warm-up")
        before = sampler.scrape()
        self.event("terminating", **platform.pod_terminating())
        if timeline.unready_after is not None:
            self.wait_until(planned + timeline.unready_after, "terminating (B1 still an endpoint)")
            self._discovery(platform, "unready", "unready")
        planned += timeline.grace
        self.wait_until(planned, "terminating (grace period)")
        self.event("app-exit")
        exit_report = platform.b1_app.exit()
        self.event("app-exited", **exit_report)
        planned += timeline.teardown_after_exit
        self.wait_until(planned, "app exited")
        if self.strategy.delete_before_teardown:
            ack = self._delete(platform)
            self._teardown(platform)
        else:
            self._teardown(platform)
            ack = self._delete(platform)
        planned = max(planned + timeline.removal_after, self.clock())
        self.wait_until(planned, "pod deleted")
        self._discovery(platform, "gone", "removed")
        planned += timeline.observe
        for app in apps:
            app.deadline = planned  # the same schedule, whenever this thread gets to stop them
        self.wait_until(planned, "observing")
        return _Shutdown(before=before, b1_exit=exit_report, ack=ack)

    def _observations(self, platform, apps: list, sampler: Sampler, wire, scrapes: dict, shutdown: _Shutdown) -> dict:
        """The run's raw observations, as :func:`measures.measure` reads them."""
        return {
            "strategy": self.strategy.name,
            "components": list(self.strategy.components),
            "delete_before_teardown": self.strategy.delete_before_teardown,
            "mode": platform.mode,
            "events": self.events,
            "records": self.recorder.records,
            "pool": sampler.pool,
            "pool_source": "wire" if wire is not None else "config_dump",
            "wire_connections": [] if wire is None else _wire_connections(wire),
            "client_proxy": getattr(self.config, "client_proxy", "ztwisted"),
            "metrics": sampler.metrics,
            "scrapes": scrapes,
            "ack": shutdown.ack,
            "b1_exit": shutdown.b1_exit,
            "apps": {
                app.name: {"connections_opened": app.connections_opened, "idle_closes": app.idle_closes} for app in apps
            },
            "approximations": self.approximations,
            "sampler_errors": sampler.errors + ([] if wire is None else wire.errors),
            "logs": {"node-a": str(platform.node_a.log_path), "node-b": str(platform.node_b.log_path)},
        }

    def _discovery(self, platform, b1: str, name: str) -> None:
        """Change discovery; the event's time is the change, ``applied_in_s`` when node A's /config_dump shows it."""
        platform.change_discovery(b1)
        t = self.event(name, via=platform.discovery_via)
        deadline = time.monotonic() + 5.0
        seen = None
        while time.monotonic() < deadline:
            seen = b1_in_config_dump(platform.node_a, platform.addresses.b1)
            if seen == b1:
                self.events[-1]["applied_in_s"] = round(self.clock() - t, 4)
                break
            time.sleep(0.02)
        else:
            self.events[-1]["applied_in_s"] = None
        # what node A's /config_dump said of B1 last: ready, unready, gone (None: unreadable)
        self.events[-1]["node_a_config_dump_b1"] = seen

    def _delete(self, platform) -> dict:
        self.event("delete")
        ack = platform.delete_pod()
        self.event("ack", **ack)
        return ack

    def _teardown(self, platform) -> None:
        done, approximation = platform.teardown()
        if approximation:
            self.approximations.append(approximation)
        self.event("teardown", done=done)
