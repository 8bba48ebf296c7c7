"""Accounting of one proxied connection: istio_tcp_* metrics and the access log."""

from __future__ import annotations

import attrs
from twisted.internet import defer
from twisted.logger import Logger

from ztwisted.logs import access_log
from ztwisted.metrics import ConnectionLabels

log = Logger(namespace="access")


class ConnectionRecord:
    """Counts a connection opened now and, when it ends, closed with its bytes and outcome."""

    def __init__(self, metrics, clock, labels: ConnectionLabels, **fields):
        self.metrics = metrics
        self.clock = clock
        self.labels = labels
        self.fields = fields
        self.started = clock.seconds()
        self.series = metrics.traffic(labels)
        self.series.opened()

    def refused(self, flags: str, error: str) -> None:
        """The connection never opened: count and log it with ``flags`` (DENY, CONNECT, ...)."""
        labels = self.labels.with_flags(flags)
        self.metrics.closed(labels)
        self._log(bytes_sent=0, bytes_recv=0, error=error)

    def finish_when_done(self, spliced, app_end, upstream_end) -> None:
        """``app_end`` faces the side this record counts from, ``upstream_end`` the other."""

        def done(outcomes):
            self.series.closed()
            # Istio's convention: "received" is what the client sent, "sent" what it got back.
            self.series.bytes(sent=upstream_end.bytes_received, received=upstream_end.bytes_sent)
            app_outcome, upstream_outcome = outcomes
            clean = (app_outcome, upstream_outcome) == ("closed", "closed")
            self._log(
                bytes_sent=upstream_end.bytes_sent,
                bytes_recv=upstream_end.bytes_received,
                error=None if clean else f"{app_outcome}/{upstream_outcome}",
                outcome="closed" if clean else _ending(app_outcome, upstream_outcome),
            )

        spliced.addCallback(done)
        spliced.addErrback(lambda failure: log.failure("accounting failed", failure))

    def _log(self, bytes_sent: int, bytes_recv: int, error: str | None, outcome: str = "refused") -> None:
        access_log(
            log,
            **self.fields,
            outcome=outcome,
            bytes_sent=bytes_sent,
            bytes_recv=bytes_recv,
            duration=self.clock.seconds() - self.started,
            error=error or None,
        )


def track_hbone_connection(metrics, connection, direction: str) -> None:
    """Count an HBONE connection while it is open, how it ended, and the limits its peer hit."""
    open_connections = metrics.hbone_connections.labels(direction=direction)
    open_connections.inc()
    ended = metrics.counter(
        "ztwisted_hbone_connections_closed_total",
        "HBONE connections closed, by how they ended (drained, drain-deadline, abrupt, peer, ...)",
        ("direction", "ended_by"),
    )
    limits = metrics.counter(
        "ztwisted_hbone_limit_hits_total",
        "Peers that tripped a protection limit (flood, rapid reset, stream or header limits, timeouts)",
        ("direction", "kind"),
    )

    def closed(ended_by):
        open_connections.dec()
        ended.labels(direction=direction, ended_by=ended_by or "lost").inc()
        return ended_by

    connection.closed.addCallback(closed)
    connection.on_limit = lambda kind, detail: limits.labels(direction=direction, kind=kind).inc()


def _ending(app_outcome: str, upstream_outcome: str) -> str:
    """The more telling of the two ends' outcomes: the one that was not merely closed or reset in turn."""
    for outcome in (upstream_outcome, app_outcome):
        if outcome not in ("closed", "reset", "closed early"):
            return outcome
    return app_outcome if app_outcome != "closed" else upstream_outcome


@attrs.define(eq=False)
class LiveConnections:
    """The app-side connections a listener accepted, so that a drain can wait for them to end."""

    #: protocol -> the Deferred that fires when it ends, made only once a drain waits for it
    #: (most connections end without anyone waiting)
    _ended: dict = attrs.field(init=False, factory=dict)

    def add(self, protocol) -> None:
        self._ended[protocol] = None

    def remove(self, protocol) -> None:
        ended = self._ended.pop(protocol, None)
        if ended is not None:
            ended.callback(None)

    def __len__(self) -> int:
        return len(self._ended)

    def __iter__(self):
        return iter(list(self._ended))

    def ended(self) -> list:
        """One new Deferred per live connection, firing when it ends."""
        waits = []
        for protocol, ended in list(self._ended.items()):
            if ended is None:
                ended = self._ended[protocol] = defer.Deferred()
            follower = defer.Deferred()
            ended.addBoth(lambda result, follower=follower: (follower.callback(None), result)[1])
            waits.append(follower)
        return waits

    def abort_all(self) -> None:
        for protocol in self:
            if protocol.transport is not None:
                protocol.transport.abortConnection()
