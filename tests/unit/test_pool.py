"""ConnectionPool with real client and server HBONEConnections joined in memory (twisted.test.iosim)."""

from __future__ import annotations

import h2.errors
import h2.exceptions
from twisted.internet import defer, error, task
from twisted.test import iosim

from ztwisted.h2.connection import H2Settings, HBONEConnection, StreamRefused
from ztwisted.h2.goaway import encode_goaway
from ztwisted.hbone.pool import ConnectionPool, PoolKey

from .h2_support import accept_and_record, couple

REFUSED_STREAM = h2.errors.ErrorCodes.REFUSED_STREAM
AUTHORITY = "10.0.3.1:8080"


def key_to(ip: str = "10.0.3.1", source_ip: str = "10.0.2.1") -> PoolKey:
    return PoolKey(
        source_identity="spiffe://cluster.local/ns/default/sa/client",
        destination_identities={"spiffe://cluster.local/ns/default/sa/echo"},
        destination=(ip, 15008),
        source_ip=source_ip,
    )


class TrackingTransport(iosim.FakeTransport):
    """iosim's transport, remembering whether the protocol closed it cleanly or aborted it."""

    def __init__(self, protocol, isServer):
        super().__init__(protocol, isServer)
        self.calls: list[str] = []

    def loseConnection(self):
        self.calls.append("loseConnection")
        super().loseConnection()

    def abortConnection(self):
        self.calls.append("abortConnection")
        super().abortConnection()


def refuse(stream):
    stream.reset(REFUSED_STREAM)


class Network:
    """Stands in for TCP + TLS: ``connect(key)`` makes a client/server HBONEConnection pair.

    With ``manual`` the attempt stays pending until :meth:`complete` or :meth:`fail`.
    """

    def __init__(self, clock, *, server_settings=None, handler=accept_and_record, manual=False):
        self.clock = clock
        self.server_settings = server_settings
        self.handlers = [handler]
        self.manual = manual
        self.attempts: list[tuple[PoolKey, defer.Deferred]] = []
        self.cancelled: list[PoolKey] = []
        self.pumps: list[iosim.IOPump] = []
        self.clients: list[HBONEConnection] = []
        self.servers: list[HBONEConnection] = []
        self.transports: list[TrackingTransport] = []
        self.requests: list = []  # server-side streams, in arrival order

    def connect(self, key: PoolKey) -> defer.Deferred:
        attempt = defer.Deferred(lambda d: self.cancelled.append(key))
        self.attempts.append((key, attempt))
        if not self.manual:
            self.complete(len(self.attempts) - 1)
        return attempt

    def _on_request(self, connection, stream):
        self.requests.append(stream)
        handler = self.handlers[0] if len(self.handlers) == 1 else self.handlers.pop(0)
        handler(stream)

    def complete(self, index: int = -1) -> HBONEConnection:
        _, attempt = self.attempts[index]
        client = HBONEConnection(client=True, clock=self.clock)
        server = HBONEConnection(
            client=False, clock=self.clock, settings=self.server_settings, on_tunnel_request=self._on_request
        )
        client_transport = TrackingTransport(client, isServer=False)
        pump = iosim.connect(server, iosim.makeFakeServer(server), client, client_transport, greet=False)
        self.pumps.append(pump)
        self.clients.append(client)
        self.servers.append(server)
        self.transports.append(client_transport)
        pump.flush()  # the server's SETTINGS are known before the pool uses the connection
        server.handshakeCompleted()
        client.ready.addCallback(attempt.callback)
        client.handshakeCompleted()
        return client

    def fail(self, reason: Exception, index: int = -1) -> None:
        self.attempts[index][1].errback(reason)

    def flush(self) -> None:
        for pump in self.pumps:
            pump.flush()


class Setup:
    def __init__(self, **network_options):
        self.clock = task.Clock()
        self.net = Network(self.clock, **network_options)
        self.opened: list = []
        self.pool = ConnectionPool(
            self.clock, self.net.connect, on_connection_opened=lambda key, connection: self.opened.append(connection)
        )

    def open(self, key: PoolKey | None = None) -> defer.Deferred:
        return self.pool.open_tunnel(key or key_to(), AUTHORITY)

    def advance(self, seconds: float, step: float = 1.0) -> None:
        """Time passes; the in-memory network delivers meanwhile (keepalive PINGs get answered)."""
        while seconds > 1e-9:
            delta = min(step, seconds)
            self.clock.advance(delta)
            seconds -= delta
            self.net.flush()


def result_of(d: defer.Deferred):
    assert d.called, "the Deferred has not fired"
    results = []
    d.addBoth(results.append)
    return results[0]


def finish(client_stream, server_stream) -> None:
    """Both sides end the tunnel cleanly."""
    if client_stream.partner is None:
        couple(client_stream)
    client_stream.write_eof()
    server_stream.write_eof()


# -- sharing connections ---------------------------------------------------------------


def test_concurrent_requests_for_one_key_share_one_connect():
    s = Setup(manual=True)
    tunnels = [s.open() for _ in range(5)]
    assert len(s.net.attempts) == 1
    assert not any(t.called for t in tunnels)
    s.net.complete()
    s.net.flush()
    streams = [result_of(t) for t in tunnels]
    assert {stream.connection for stream in streams} == {s.net.clients[0]}
    assert [stream.stream_id for stream in streams] == [1, 3, 5, 7, 9]
    assert len(s.net.attempts) == 1 and s.opened == [s.net.clients[0]]


def test_different_keys_do_not_share():
    s = Setup()
    s.open(key_to("10.0.3.1"))
    s.open(key_to("10.0.3.2"))
    s.open(key_to("10.0.3.1", source_ip="10.0.2.9"))
    s.net.flush()
    assert len(s.net.attempts) == 3


def test_hundred_streams_per_connection_then_a_second_connection():
    s = Setup()
    tunnels = [s.open() for _ in range(101)]
    s.net.flush()
    streams = [result_of(t) for t in tunnels]
    assert len(s.net.attempts) == 2
    first, second = s.net.clients
    assert sum(stream.connection is first for stream in streams) == 100
    assert [stream.connection for stream in streams[100:]] == [second]
    assert first.available_streams == 0 and second.available_streams == 99


def test_the_servers_smaller_stream_limit_applies():
    s = Setup(server_settings=H2Settings.server(max_concurrent_streams=3))
    tunnels = [s.open() for _ in range(7)]
    s.net.flush()
    streams = [result_of(t) for t in tunnels]
    assert all(not isinstance(stream, Exception) and stream.response.called for stream in streams)
    assert len(s.net.attempts) == 3
    assert [len(client.streams) for client in s.net.clients] == [3, 3, 1]
    # A stream ends: its connection has room again, no new connection is made.
    finish(streams[0], s.net.requests[0])
    s.net.flush()
    assert result_of(_opened(s)).connection is s.net.clients[0]
    assert len(s.net.attempts) == 3


# -- GOAWAY and refused streams -------------------------------------------------------


def test_goaway_connection_is_never_handed_out_again_while_its_streams_finish():
    s = Setup()
    old = result_of(_opened(s))
    old_server_stream = s.net.requests[0]
    drained = s.net.servers[0].drain()
    s.net.flush()
    assert s.net.clients[0].goaway_received is not None
    new = result_of(_opened(s))
    assert len(s.net.attempts) == 2 and new.connection is s.net.clients[1]
    assert old.connection is s.net.clients[0]
    # The old tunnel still works both ways.
    app = couple(old)
    old.write(b"still here")
    old_server_stream.write(b"me too")
    s.net.flush()
    assert old_server_stream.far.data == b"still here" and app.data == b"me too"
    assert {c for c in s.pool.connections()} == {s.net.clients[0], s.net.clients[1]}
    for _ in range(3):
        assert result_of(_opened(s)).connection is s.net.clients[1]
    old.write_eof()
    old_server_stream.write_eof()
    s.net.flush()
    assert result_of(drained) == "drained"
    assert s.pool.connections() == [s.net.clients[1]]
    assert s.net.transports[0].calls == ["loseConnection"]


def _opened(s: Setup, key: PoolKey | None = None) -> defer.Deferred:
    tunnel = s.open(key)
    s.net.flush()
    return tunnel


def test_stream_refused_by_goaway_is_retried_on_a_new_connection():
    s = Setup()
    tunnel = s.open()
    first = s.net.clients[0]
    # The server decided to process nothing more before our HEADERS reached it.
    first.dataReceived(encode_goaway(0))
    assert len(s.net.attempts) == 2
    s.net.flush()
    stream = result_of(tunnel)
    assert stream.connection is s.net.clients[1]
    assert first not in s.pool.connections()


def test_refused_stream_is_retried_once_invisibly():
    s = Setup()
    s.net.handlers = [refuse, accept_and_record]
    tunnel = _opened(s)
    stream = result_of(tunnel)
    assert hasattr(stream, "stream_id"), stream
    assert len(s.net.requests) == 2 and s.net.requests[1].response.called


def test_refused_stream_is_retried_on_another_connection():
    s = Setup()
    s.net.handlers = [refuse, accept_and_record]
    stream = result_of(_opened(s))
    assert len(s.net.attempts) == 2
    assert stream.connection is s.net.clients[1]


def test_second_refusal_fails_the_tunnel():
    s = Setup(handler=refuse)
    tunnel = _opened(s)
    failure = result_of(tunnel)
    assert failure.check(StreamRefused)
    assert len(s.net.requests) == 2  # one retry, no more


def test_a_tunnel_no_longer_wanted_while_it_opens_is_reset_and_not_retried():
    s = Setup(handler=lambda stream: None)  # the server never answers
    tunnel = _opened(s)
    outcome: list = []
    tunnel.addBoth(outcome.append)
    assert outcome == []
    (client,) = s.net.clients
    (stream,) = client.streams.values()
    tunnel.cancel()
    s.net.flush()
    (failure,) = outcome
    assert failure.check(defer.CancelledError)
    assert stream.done and not client.streams
    assert len(s.net.requests) == 1 and s.net.requests[0].done, "the server saw the reset; no second CONNECT"


# -- idle release ---------------------------------------------------------------------


def test_idle_connection_is_released_after_five_minutes_without_streams():
    s = Setup()
    stream = result_of(_opened(s))
    client = s.net.clients[0]
    s.advance(400)  # a stream open: never idle
    assert s.pool.connections() == [client]
    finish(stream, s.net.requests[0])
    s.net.flush()
    assert client.streams == {}
    s.advance(299)
    assert s.pool.connections() == [client] and s.net.transports[0].calls == []
    s.advance(2)
    assert s.pool.connections() == []
    assert s.net.transports[0].calls == ["loseConnection"]
    assert client.ended_by == "drained"
    # The next tunnel needs a new connection.
    result_of(_opened(s))
    assert len(s.net.attempts) == 2


def test_new_stream_cancels_the_idle_release():
    s = Setup()
    stream = result_of(_opened(s))
    finish(stream, s.net.requests[0])
    s.net.flush()
    s.advance(200)
    result_of(_opened(s))
    s.advance(200)
    assert s.pool.connections() == [s.net.clients[0]] and s.net.transports[0].calls == []


def test_closed_result_survives_the_pool():
    s = Setup()
    result_of(_opened(s))
    client = s.net.clients[0]
    seen = []
    client.closed.addCallback(lambda ended_by: (seen.append(ended_by), ended_by)[1])
    retired = s.pool.retire(client)
    for stream in list(client.streams.values()):
        finish(stream, s.net.requests[0])
    s.net.flush()
    assert seen == ["drained"]
    assert result_of(retired) == "drained"


# -- connect failures ---------------------------------------------------------------


def test_connect_failure_fails_every_waiter_and_the_next_request_tries_again():
    s = Setup(manual=True)
    tunnels = [s.open() for _ in range(3)]
    s.net.fail(error.ConnectionRefusedError("no route"))
    failures = [result_of(t) for t in tunnels]
    assert all(f.check(error.ConnectionRefusedError) for f in failures)
    assert s.pool.connections() == []
    retry = s.open()
    assert len(s.net.attempts) == 2
    s.net.complete()
    s.net.flush()
    assert result_of(retry).connection is s.net.clients[0]


def test_a_connect_that_raises_fails_every_waiter():
    clock = task.Clock()

    def no_certificate(key):
        raise LookupError("no certificate for the source yet")

    pool = ConnectionPool(clock, no_certificate)
    tunnels = [pool.open_tunnel(key_to(), AUTHORITY) for _ in range(2)]
    assert all(result_of(t).check(LookupError) for t in tunnels)
    assert result_of(pool.open_tunnel(key_to(), AUTHORITY)).check(LookupError)


def test_connect_timeout_is_ten_seconds():
    s = Setup(manual=True)
    tunnels = [s.open() for _ in range(2)]
    s.clock.advance(9.9)
    assert not any(t.called for t in tunnels)
    s.clock.advance(0.2)
    failures = [result_of(t) for t in tunnels]
    assert all(f.check(defer.TimeoutError) for f in failures)
    assert s.net.cancelled == [key_to()]
    retry = s.open()
    assert len(s.net.attempts) == 2
    s.net.complete()
    s.net.flush()
    assert hasattr(result_of(retry), "stream_id")


# -- introspection -----------------------------------------------------------------------


def test_connections_by_destination_and_snapshot():
    s = Setup()
    result_of(_opened(s, key_to("10.0.3.1")))
    result_of(_opened(s, key_to("10.0.3.1")))
    result_of(_opened(s, key_to("10.0.3.2")))
    first, second = s.net.clients
    assert s.pool.connections("10.0.3.1") == [first]
    assert s.pool.connections("10.0.3.2") == [second]
    assert s.pool.connections("10.0.3.3") == []
    assert set(s.pool.connections()) == {first, second}
    s.net.servers[1].drain()
    s.net.flush()
    snapshot = sorted(s.pool.snapshot(), key=lambda entry: entry["destination"])
    assert snapshot == [
        {
            "source": "spiffe://cluster.local/ns/default/sa/client",
            "destination": "10.0.3.1:15008",
            "destination_identities": ["spiffe://cluster.local/ns/default/sa/echo"],
            "source_ip": "10.0.2.1",
            "streams": 2,
            "usable": True,
            "goaway_received": False,
        },
        {
            "source": "spiffe://cluster.local/ns/default/sa/client",
            "destination": "10.0.3.2:15008",
            "destination_identities": ["spiffe://cluster.local/ns/default/sa/echo"],
            "source_ip": "10.0.2.1",
            "streams": 1,
            "usable": False,
            "goaway_received": True,
        },
    ]


def test_an_idle_connection_is_released_five_minutes_after_its_last_stream_not_its_first_idle_moment():
    s = Setup()
    finish(result_of(_opened(s)), s.net.requests[0])
    s.net.flush()
    s.advance(200)
    second = result_of(_opened(s))
    s.advance(50)
    finish(second, s.net.requests[1])  # idle again at 250
    s.net.flush()
    s.advance(200)  # 450: past five minutes from the first idle moment, not from the last
    assert s.pool.connections() == [s.net.clients[0]]
    s.advance(99)
    assert s.pool.connections() == [s.net.clients[0]]
    s.advance(2)
    assert s.pool.connections() == []


def test_a_connection_busy_when_its_idle_timer_fires_is_released_five_minutes_after_its_streams_end():
    s = Setup()
    finish(result_of(_opened(s)), s.net.requests[0])
    s.net.flush()
    s.advance(100)
    busy = result_of(_opened(s))
    s.advance(300)  # the idle timer fired while a stream was open
    assert s.pool.connections() == [s.net.clients[0]]
    finish(busy, s.net.requests[1])
    s.net.flush()
    s.advance(299)
    assert s.pool.connections() == [s.net.clients[0]]
    s.advance(2)
    assert s.pool.connections() == []


def test_short_tunnels_one_after_another_keep_one_idle_timer():
    # The timer is not cancelled and made anew for every tunnel: it looks when it fires.
    s = Setup()
    finish(result_of(_opened(s)), s.net.requests[0])
    s.net.flush()
    (client,) = s.net.clients
    timer = s.pool._idle_timers[client]
    for index in range(1, 4):
        s.advance(10)
        finish(result_of(_opened(s)), s.net.requests[index])
        s.net.flush()
        assert s.pool._idle_timers[client] is timer and timer.active()


def test_a_tunnel_that_cannot_be_opened_on_a_free_connection_fails_its_deferred(monkeypatch):
    s = Setup()
    finish(result_of(_opened(s)), s.net.requests[0])
    s.net.flush()
    (client,) = s.net.clients

    def exhausted():
        raise h2.exceptions.NoAvailableStreamIDError("no stream IDs left")

    monkeypatch.setattr(client.h2, "get_next_available_stream_id", exhausted)
    failure = result_of(s.open())
    assert failure.check(h2.exceptions.NoAvailableStreamIDError)
