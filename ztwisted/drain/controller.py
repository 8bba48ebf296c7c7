"""The drain layer above the node: raises drain events, bounds them, and cleans up after them.

Every drain event enters here (from the node agent, configuration reloads,
the admin API and signals). The coordinator hands it to the strategies;
then the controller ends what they left, through the node's view
(:class:`ztwisted.interfaces.IDrainView`) and nothing else.
"""

from __future__ import annotations

import os

from twisted.application import service
from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger
from zope.interface import implementer

from ztwisted.drain.coordinator import DrainCoordinator
from ztwisted.drain.facade import DrainDeadline, DrainFacade, drain_all
from ztwisted.interfaces import IDrainEvents, IDrainView
from ztwisted.readiness import Readiness

log = Logger()

DEFAULT_DRAIN_TIMEOUT = 5.0
#: under a real node agent's 5 s Ack timeout
DEFAULT_POD_DRAIN_TIMEOUT = 3.0
#: after pod_drain_timeout, how long the controller waits for a strategy before closing the pod itself
POD_DRAIN_GRACE = 0.25


def drain_timeout_from_environment(environ=os.environ) -> float:
    """ztunnel's rule for the process drain deadline (see docs/draining.rst)."""
    explicit = environ.get("CONNECTION_TERMINATION_DEADLINE")
    if explicit:
        return float(explicit.rstrip("s"))
    grace = environ.get("TERMINATION_GRACE_PERIOD_SECONDS")
    if grace:
        seconds = int(grace)
        return float(max(1, seconds - 5 if seconds > 10 else seconds - 1))
    return DEFAULT_DRAIN_TIMEOUT


@implementer(IDrainEvents)
class DrainController(service.Service):
    """Runs the drain events of one node; as a service, stopping it is the *proxy stopping* event."""

    name = "drain"

    def __init__(self, view: IDrainView, strategies, metrics, deadline: DrainDeadline, readiness: Readiness):
        self.view = view
        self.deadline = deadline
        self.readiness = readiness
        self.coordinator = DrainCoordinator(strategies, DrainFacade(view, deadline), metrics, view.clock)
        self._stopping: defer.Deferred | None = None
        self._strategies_stopping: defer.Deferred | None = None

    @property
    def clock(self):
        return self.view.clock

    @property
    def stopping(self) -> bool:
        return self._stopping is not None

    def startService(self) -> None:
        self.coordinator.attach()
        super().startService()

    def stopService(self) -> defer.Deferred:
        super().stopService()
        return self.begin_proxy_drain()

    # -- pod and destination events ---------------------------------------------------

    def pod_terminating(self, workload) -> defer.Deferred:
        return self.coordinator.pod_terminating(workload)

    def destination_removed(self, workload) -> defer.Deferred:
        return self.coordinator.destination_removed(workload)

    def pod_removed(self, workload, forget: bool = True) -> defer.Deferred:
        """*pod removed*: the strategies act, then what is left of the pod is ended and closed.

        ``forget=False`` keeps it local (a changed workload that is restarted).
        """
        if forget:
            self.view.withdraw(workload)
        removing = self.coordinator.pod_removed(workload)
        # The node agent waits for this; a strategy gets pod_drain_timeout (its own deadline acts first).
        removing.addTimeout(self.deadline.pod_drain_timeout + POD_DRAIN_GRACE, self.clock)
        removing.addErrback(lambda failure: None)
        removing.addCallback(lambda _: self._end_pod(workload, forget))
        return removing

    def _end_pod(self, workload, forget: bool) -> defer.Deferred:
        """What a strategy left of a removed pod ends at once, as in ztunnel; then its listeners close."""
        leftovers = self.view.inbound_connections(workload)
        if forget:
            # The pod's own pooled connections have no users left.
            leftovers += self.view.pool_connections_from(workload)
        for live in self.view.app_connections(workload):
            live.abort_all()
        ended = drain_all(leftovers, graceful=False, deadline=None)
        closed = self.view.close_workload(workload, forget)
        return defer.DeferredList([ended, closed])

    # -- proxy stopping ------------------------------------------------------------

    def begin_proxy_drain(self) -> defer.Deferred:
        """The *proxy stopping* event (SIGTERM, ``POST /quitquitquit``, ``POST /drain``); runs once."""
        if self._stopping is not None:
            return _follow(self._stopping)
        log.info("proxy stopping: draining connections (deadline {deadline} s)", deadline=self.deadline.drain_timeout)
        self.readiness.pending.add("draining")
        self.deadline.start()
        stopped = self.view.stop_listening()
        strategies_done = self.coordinator.proxy_stopping()
        # A strategy cannot hold the process past the deadline; stop_now cancels it sooner.
        strategies_done.addTimeout(self.deadline.drain_timeout, self.clock)
        self._strategies_stopping = strategies_done
        strategies_done.addErrback(lambda failure: None)
        strategies_done.addCallback(lambda _: defer.Deferred.fromCoroutine(self._drain_until_idle()))
        self._stopping = defer.DeferredList([stopped, strategies_done], consumeErrors=True)
        self._stopping.addCallback(lambda _: log.info("proxy drain complete"))
        return _follow(self._stopping)

    async def _drain_until_idle(self) -> None:
        """Drain until no connection is left, new ones included (the pool may open some for
        app connections accepted before the stop); at the deadline, end the rest at once."""
        while True:
            connections = self.view.inbound_connections() + self.view.pool_connections()
            apps = self.view.app_connections()
            if not connections and not any(apps):
                return
            left = self.deadline.time_left()
            if left <= 0:
                drain_all(connections, graceful=False, deadline=None)
                for live in apps:
                    live.abort_all()
                return
            waits = [c.drain(graceful=True, deadline=left) for c in connections]
            waits += [ended for live in apps for ended in live.ended()]
            waited = defer.DeferredList(waits)
            if waited.called:
                # Everything listed says it is done but has not left the lists yet: look again shortly.
                await deferLater(self.clock, min(left, 0.05), lambda: None)
                continue
            try:
                await waited.addTimeout(left, self.clock)
            except defer.TimeoutError:
                pass

    def stop_now(self) -> None:
        """A second SIGTERM/SIGINT: end every connection at once."""
        log.info("stopping at once: aborting every connection")
        self.deadline.reached_now()
        if self._strategies_stopping is not None and not self._strategies_stopping.called:
            self._strategies_stopping.cancel()
        drain_all(self.view.inbound_connections() + self.view.pool_connections(), graceful=False, deadline=None)


def _follow(deferred: defer.Deferred) -> defer.Deferred:
    """A new Deferred that fires with ``deferred``'s result, leaving ``deferred`` untouched."""
    follower = defer.Deferred()
    deferred.addBoth(lambda result: (follower.callback(None), result)[1])
    return follower
