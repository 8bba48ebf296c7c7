"""Delivers drain events to the selected strategies, measures them, and composes their results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet import defer
from twisted.logger import Logger

log = Logger()

EVENTS = ("pod_terminating", "pod_removed", "destination_removed", "proxy_stopping")


@attrs.define(eq=False)
class DrainCoordinator:
    """Each event goes to each strategy in order; it completes when all of theirs have."""

    strategies: list = attrs.field(converter=list)
    facade: Any
    #: where the coordinator's own series are made (a :class:`ztwisted.metrics.Metrics`)
    metrics: Any
    clock: Any
    _events: Any = attrs.field(init=False)
    _failures: Any = attrs.field(init=False)
    _durations: Any = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._events = self.metrics.counter(
            "ztwisted_drain_events_total", "Drain events delivered, per strategy", ("strategy", "event")
        )
        self._failures = self.metrics.counter(
            "ztwisted_drain_event_failures_total", "Drain event handlers that failed", ("strategy", "event")
        )
        self._durations = self.metrics.histogram(
            "ztwisted_drain_duration_seconds",
            "How long drain events took to complete",
            ("event",),
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60),
        )

    @property
    def names(self) -> str:
        return ",".join(s.name for s in self.strategies)

    def attach(self) -> None:
        for strategy in self.strategies:
            strategy.attach(self.facade)

    def pod_terminating(self, workload) -> defer.Deferred:
        return self._deliver(
            "pod_terminating", workload.name, lambda strategy: strategy.pod_terminating(self.facade, workload)
        )

    def pod_removed(self, workload) -> defer.Deferred:
        return self._deliver("pod_removed", workload.name, lambda strategy: strategy.pod_removed(self.facade, workload))

    def destination_removed(self, workload) -> defer.Deferred:
        return self._deliver(
            "destination_removed", workload.name, lambda strategy: strategy.destination_removed(self.facade, workload)
        )

    def proxy_stopping(self) -> defer.Deferred:
        return self._deliver("proxy_stopping", "proxy", lambda strategy: strategy.proxy_stopping(self.facade))

    def _deliver(self, event: str, subject: str, handle: Callable[[object], object]) -> defer.Deferred:
        """``handle(strategy)`` for each strategy in order; fires when every one's part is done."""
        started = self.clock.seconds()
        log.info(
            "drain event {event} for {subject}: strategies {strategies}",
            event=event,
            subject=subject,
            strategies=self.names,
        )
        results = []
        for strategy in self.strategies:
            self._events.labels(strategy=strategy.name, event=event).inc()
            handled = defer.maybeDeferred(handle, strategy)
            handled.addErrback(self._failed, strategy, event, subject)
            results.append(handled)

        def done(_):
            elapsed = self.clock.seconds() - started
            self._durations.labels(event=event).observe(elapsed)
            log.info(
                "drain event {event} for {subject} complete after {elapsed:.3f} s",
                event=event,
                subject=subject,
                elapsed=elapsed,
            )

        return defer.gatherResults(results).addCallback(done)

    def _failed(self, failure, strategy, event, subject) -> None:
        self._failures.labels(strategy=strategy.name, event=event).inc()
        log.failure(
            "drain strategy {strategy} failed on {event} for {subject}",
            failure,
            strategy=strategy.name,
            event=event,
            subject=subject,
        )
