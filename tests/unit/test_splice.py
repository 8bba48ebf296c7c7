"""ztwisted.splice.splice: what a spliced pair reports when both ends are finished."""

from __future__ import annotations

from twisted.internet import error
from twisted.python.failure import Failure

from ztwisted.splice import splice

from .h2_support import connected_end


def test_outcomes_come_in_argument_order_whichever_end_finishes_first():
    a, b = connected_end(), connected_end()
    outcomes = []
    splice(a, b).addCallback(outcomes.append)
    b.connectionLost(Failure(error.ConnectionDone()))  # b's peer left mid-stream: a is aborted
    assert outcomes == []
    a.connectionLost(Failure(error.ConnectionLost()))
    assert outcomes == [("reset", "closed early")]


def test_outcomes_of_a_clean_close_from_both_sides():
    a, b = connected_end(), connected_end()
    outcomes = []
    splice(a, b).addCallback(outcomes.append)
    a.readConnectionLost()  # a's peer is done sending: b's write side is closed in turn
    assert b.transport.write_closed
    b.readConnectionLost()
    a.writeConnectionLost()
    a.connectionLost(Failure(error.ConnectionDone()))
    assert outcomes == []
    b.writeConnectionLost()
    b.connectionLost(Failure(error.ConnectionDone()))
    assert outcomes == [("closed", "closed")]


def test_each_ends_own_finished_keeps_its_outcome():
    a, b = connected_end(), connected_end()
    splice(a, b)
    seen = []
    a.finished.addCallback(seen.append)
    b.finished.addCallback(seen.append)
    a.connectionLost(Failure(error.ConnectionLost()))
    b.connectionLost(Failure(error.ConnectionDone()))
    assert seen == ["reset by peer", "reset"]


def test_an_end_finished_before_it_was_coupled_gets_its_partner_aborted():
    # The inbound side's stream reset while the app connection was being made, say.
    a, b = connected_end(), connected_end()
    a.connectionLost(Failure(error.ConnectionLost()))
    outcomes = []
    splice(a, b).addCallback(outcomes.append)
    assert b.transport.disconnecting, "aborted"
    b.connectionLost(Failure(error.ConnectionAborted()))
    assert outcomes == [("reset by peer", "reset")]
