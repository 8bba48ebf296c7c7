"""The HBONE connection's lifecycle: its states in order, and how ``ended_by`` follows from them."""

from __future__ import annotations

import pytest
from twisted.internet import task

from ztwisted.h2.connection import State
from ztwisted.h2.lifecycle import IllegalTransition, Lifecycle, Timer, Timers

from .h2_support import RecordingEnd, accept_and_record
from .test_h2_connection import Pair


def _pair_with_a_tunnel():
    """A client and a server over iosim, and one open tunnel (client end, server end)."""
    pair = Pair(handler=accept_and_record)
    # iosim reports no TLS handshake: a connection that ends errbacks ``ready``.
    for connection in (pair.client, pair.server):
        connection.ready.addErrback(lambda failure: None)
    opened = pair.client.open_tunnel("127.0.0.1:8080")
    pair.flush()
    stream = opened.result
    stream.set_partner(RecordingEnd())
    return pair, stream, pair.requests[0]


def _end_the_tunnel(pair, stream, server_stream):
    stream.write_eof()
    server_stream.write_eof()
    pair.flush()


def test_graceful_server_drain_goes_through_every_state_in_order():
    pair, stream, server_stream = _pair_with_a_tunnel()
    assert pair.server.state is State.HANDSHAKING
    pair.server.handshakeCompleted()  # iosim has no TLS to report it
    assert pair.server.state is State.OPEN
    pair.server.drain(graceful=True)
    assert pair.server.state is State.DRAINING
    pair.flush()  # the PING is answered: the second GOAWAY goes out
    assert pair.server.state is State.CLOSING
    assert pair.server.ended_by is None
    _end_the_tunnel(pair, stream, server_stream)
    assert pair.server.state in (State.CLOSE_NOTIFY, State.CLOSED)
    assert pair.server.ended_by == "drained"


def test_client_stops_taking_streams_when_a_goaway_arrives_and_closes_after_the_last():
    pair, stream, server_stream = _pair_with_a_tunnel()
    pair.server.drain(graceful=True)
    pair.flush()
    assert pair.client.state is State.DRAINING
    assert not pair.client.usable and pair.client.available_streams == 0
    _end_the_tunnel(pair, stream, server_stream)
    assert pair.client.state in (State.CLOSE_NOTIFY, State.CLOSED)
    assert pair.client.ended_by == "drained"


def test_abort_overrides_a_graceful_ending_but_not_another_abort():
    lifecycle = Lifecycle()
    lifecycle.connected()
    assert lifecycle.send_close_notify("drained")
    assert not lifecycle.send_close_notify("idle-timeout")
    assert lifecycle.ended_by == "drained"
    assert lifecycle.abort("keepalive-timeout")
    assert lifecycle.ended_by == "keepalive-timeout"
    assert not lifecycle.abort("abrupt")
    lifecycle.lost()
    lifecycle.decide_ending("peer")
    assert (lifecycle.state, lifecycle.ended_by) == (State.CLOSED, "keepalive-timeout")


def test_an_ending_decided_before_the_close_stays():
    lifecycle = Lifecycle()
    lifecycle.connected()
    lifecycle.stop_taking_streams()
    lifecycle.decide_ending("drain-deadline")
    lifecycle.send_close_notify("drained")
    assert lifecycle.ended_by == "drain-deadline"


def test_a_closed_connection_goes_nowhere():
    lifecycle = Lifecycle()
    lifecycle.connected()
    lifecycle.lost()
    with pytest.raises(IllegalTransition):
        lifecycle.lost()
    lifecycle.stop_taking_streams()
    lifecycle.last_stream_announced()
    assert lifecycle.state is State.CLOSED and not lifecycle.writable


def test_timers_keep_one_call_per_name_and_cancel_all():
    clock = task.Clock()
    timers = Timers(clock)
    fired = []
    timers.start(Timer.IDLE, 5, lambda: fired.append("first"))
    timers.start(Timer.IDLE, 10, lambda: fired.append("second"))
    timers.start(Timer.KEEPALIVE, 3, lambda: fired.append("keepalive"))
    clock.advance(2)
    timers.start(Timer.KEEPALIVE, 3, lambda: fired.append("keepalive"))
    clock.advance(2)
    assert fired == [] and timers.due(Timer.IDLE) == 10
    timers.cancel_all()
    clock.advance(20)
    assert fired == [] and clock.getDelayedCalls() == []
