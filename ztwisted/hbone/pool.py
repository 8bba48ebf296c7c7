"""The outbound HBONE connection pool: one HTTP/2 connection carries many tunnels.

Behaviour as ztunnel's (see docs/pool.rst): connections are keyed by source
identity, destination identities, destination address and source IP;
creation is single-flight per key; a connection at its stream limit or that
received GOAWAY is not handed out; idle connections are released after five
minutes; a stream the server refused before it opened is retried once on
another connection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs
from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger

from ztwisted.h2.connection import HBONEConnection, StreamRefused


@attrs.frozen(order=True)
class PoolKey:
    source_identity: str
    destination_identities: frozenset = attrs.field(converter=frozenset)
    destination: tuple  # (ip, port) of the peer's HBONE listener
    source_ip: str

    def __str__(self) -> str:
        ip, port = self.destination
        return f"{self.source_identity} -> {ip}:{port}"


@attrs.define(eq=False)
class ConnectionPool:
    """Outbound HBONE connections by :class:`PoolKey`; ``connect(key)`` opens a new one."""

    log = Logger()

    clock: Any
    _connect: Callable[[PoolKey], defer.Deferred]
    idle_timeout: float = attrs.field(default=300.0, kw_only=True)
    connect_timeout: float = attrs.field(default=10.0, kw_only=True)
    _on_connection_opened: Callable[[PoolKey, HBONEConnection], None] | None = attrs.field(default=None, kw_only=True)
    _connections: dict[PoolKey, list[HBONEConnection]] = attrs.field(init=False, factory=dict)
    #: waiters of the single connect in flight per key
    _connecting: dict[PoolKey, list[defer.Deferred]] = attrs.field(init=False, factory=dict)
    #: at most one timer per connection, armed when it became idle and looking again when it fires
    _idle_timers: dict[HBONEConnection, object] = attrs.field(init=False, factory=dict)
    #: when each connection last had its last stream finish
    _idle_since: dict[HBONEConnection, float] = attrs.field(init=False, factory=dict)
    _keys: dict[HBONEConnection, PoolKey] = attrs.field(init=False, factory=dict)
    #: consecutive failed connects per key (for ``connect_backoff``)
    _failures: dict[PoolKey, int] = attrs.field(init=False, factory=dict)
    #: ``delay(consecutive_failures) -> seconds`` before a new connect attempt, or None
    connect_backoff: Callable[[int], float] | None = attrs.field(init=False, default=None)

    def open_tunnel(self, key: PoolKey, authority: str, headers: Iterable[tuple[str, str]] = ()) -> defer.Deferred:
        """Fires with an open :class:`~ztwisted.h2.connection.Stream` to ``authority``."""
        # Callbacks, not a coroutine: with a connection free (nearly always) every step runs at
        # once, and a coroutine's resumption through Deferreds cost more than the steps themselves.
        headers = list(headers)

        def open_on(connection: HBONEConnection) -> defer.Deferred:
            # No timer to cancel: the idle timer looks at the connection when it fires.
            return connection.open_tunnel(authority, headers)

        def retry_if_refused(failure, refused_on: HBONEConnection) -> defer.Deferred:
            failure.trap(StreamRefused)
            self.log.info(
                "tunnel to {authority} refused before it opened ({why}); retrying on another connection",
                authority=authority,
                why=failure.value,
            )
            return self._acquire(key, exclude=refused_on).addCallback(open_on)

        def open_with_retry(connection: HBONEConnection) -> defer.Deferred:
            return open_on(connection).addErrback(retry_if_refused, connection)

        connection = self._free_connection(key, None)
        if connection is None:
            return self._acquire(key).addCallback(open_with_retry)
        # Nearly always: the tunnel's Deferred is the stream's, not one chained behind an
        # already fired one (a Deferred, a callback run and a chaining fewer per tunnel).
        try:
            return open_with_retry(connection)
        except Exception:  # as a callback's exception would: the tunnel fails, the caller is not raised at
            return defer.fail()

    def _acquire(self, key: PoolKey, exclude: HBONEConnection | None = None) -> defer.Deferred:
        """Fires with a connection for ``key`` (not ``exclude``) that takes another stream, once there is one."""
        connection = self._free_connection(key, exclude)
        if connection is not None:
            return defer.succeed(connection)
        return defer.Deferred.fromCoroutine(self._wait_for_connection(key, exclude))

    def _free_connection(self, key: PoolKey, exclude: HBONEConnection | None) -> HBONEConnection | None:
        for connection in self._connections.get(key, ()):
            if connection is not exclude and connection.available_streams > 0:
                return connection
        return None

    async def _wait_for_connection(self, key: PoolKey, exclude: HBONEConnection | None) -> HBONEConnection:
        while True:
            waiter = defer.Deferred()
            waiters = self._connecting.get(key)
            if waiters is None:
                self._connecting[key] = [waiter]
                self._start_connect(key)
            else:
                waiters.append(waiter)
            await waiter
            connection = self._free_connection(key, exclude)
            if connection is not None:
                return connection

    def _start_connect(self, key: PoolKey) -> None:
        failures = self._failures.get(key, 0)
        delay = self.connect_backoff.delay(failures) if self.connect_backoff is not None and failures else 0
        if delay > 0:
            attempt = deferLater(self.clock, delay, self._connect, key)
        else:
            # A connect that raises (no certificate for the source yet, say) must fail the waiters, not strand them.
            attempt = defer.maybeDeferred(self._connect, key)
        attempt.addTimeout(self.connect_timeout + delay, self.clock)

        def connected(connection: HBONEConnection):
            self._failures.pop(key, None)
            self._add(key, connection)
            return None

        def failed(failure):
            self._failures[key] = self._failures.get(key, 0) + 1
            return failure

        def done(result):
            waiters = self._connecting.pop(key, [])
            for waiter in waiters:
                waiter.callback(None) if result is None else waiter.errback(result)

        attempt.addCallbacks(connected, failed)
        attempt.addBoth(done)

    def _add(self, key: PoolKey, connection: HBONEConnection) -> None:
        self._connections.setdefault(key, []).append(connection)
        self._keys[connection] = key
        connection.stream_finished_hook = self._stream_finished
        connection.closed.addBoth(lambda ended_by: (self._remove(connection), ended_by)[1])
        if self._on_connection_opened is not None:
            self._on_connection_opened(key, connection)

    def _remove(self, connection: HBONEConnection) -> None:
        self._cancel_idle(connection)
        key = self._keys.pop(connection, None)
        if key is None:
            return
        connections = self._connections.get(key, [])
        if connection in connections:
            connections.remove(connection)
        if not connections:
            self._connections.pop(key, None)

    def _stream_finished(self, connection: HBONEConnection) -> None:
        # Idle from now on. A connection that carries one short tunnel after another goes idle
        # and busy again with every tunnel: the timer is not cancelled and armed anew each
        # time (a timed call and its upkeep per tunnel) but, armed once, looks when it fires.
        if not connection.streams and connection.usable:
            self._idle_since[connection] = self.clock.seconds()
            if connection not in self._idle_timers:
                self._arm_idle_timer(connection, self.idle_timeout)

    def _arm_idle_timer(self, connection: HBONEConnection, delay: float) -> None:
        self._idle_timers[connection] = self.clock.callLater(delay, self._idle_timer_fired, connection)

    def _idle_timer_fired(self, connection: HBONEConnection) -> None:
        del self._idle_timers[connection]
        if connection.streams or not connection.usable:
            return  # busy (its last stream's end arms the timer again), or on its way out
        idle_for = self.clock.seconds() - self._idle_since[connection]
        if idle_for < self.idle_timeout:
            self._arm_idle_timer(connection, self.idle_timeout - idle_for)
            return
        self.log.info("releasing idle connection {key}", key=str(self._keys.get(connection)))
        self.retire(connection)

    def _cancel_idle(self, connection: HBONEConnection) -> None:
        self._idle_since.pop(connection, None)
        timer = self._idle_timers.pop(connection, None)
        if timer is not None and timer.active():
            timer.cancel()

    # -- for the drain layer and the admin interface ---------------------------

    def retire(self, connection: HBONEConnection, deadline: float | None = None) -> defer.Deferred:
        """No new streams on ``connection``; close it cleanly after its last stream."""
        return connection.drain(graceful=True, deadline=deadline)

    def connections(self, destination_ip: str | None = None, source_ip: str | None = None) -> list[HBONEConnection]:
        """Pooled connections: all, or those to one destination IP and/or from one source IP."""
        return [
            connection
            for key, connections in self._connections.items()
            if (destination_ip is None or key.destination[0] == destination_ip)
            and (source_ip is None or key.source_ip == source_ip)
            for connection in connections
        ]

    def snapshot(self) -> list[dict]:
        return [
            {
                "source": key.source_identity,
                "destination": "{}:{}".format(*key.destination),
                "destination_identities": sorted(key.destination_identities),
                "source_ip": key.source_ip,
                "streams": len(connection.streams),
                "usable": connection.usable,
                "goaway_received": connection.goaway_received is not None,
            }
            for key, connections in self._connections.items()
            for connection in connections
        ]
