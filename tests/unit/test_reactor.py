"""ztwisted's reactor: Twisted's epoll reactor minus the per-event log context, found as a twistd plugin."""

from __future__ import annotations

import socket
import threading

import pytest
from twisted.application.reactors import getReactorTypes
from twisted.internet import task
from twisted.internet.abstract import FileDescriptor
from twisted.internet.error import ConnectionDone, ConnectionFdescWentAway, ConnectionLost
from twisted.internet.interfaces import IHalfCloseableDescriptor
from twisted.internet.main import CONNECTION_DONE
from twisted.python import log as legacy_log
from zope.interface import implementer

from ztwisted.reactor import (
    AfterEventsClock,
    LeanEPollReactor,
    call_after_events,
    install_unless_chosen,
    write_aggregation_clock,
)


class Readable(FileDescriptor):
    """One end of a socket pair; ``handle`` runs on each ``doRead``."""

    def __init__(self, reactor, sock: socket.socket, handle):
        super().__init__(reactor)
        self.sock = sock
        self.handle = handle
        self.reads = 0
        self.lost = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def doRead(self):
        self.reads += 1
        return self.handle(self)

    def connectionLost(self, reason) -> None:
        self.lost.append(reason)
        super().connectionLost(reason)


def read_all(readable: Readable):
    readable.sock.recv(1024)


@pytest.fixture
def pairs():
    made = []

    def make():
        pair = socket.socketpair()
        made.append(pair)
        return pair

    yield make
    for pair in made:
        for sock in pair:
            sock.close()


def test_a_ready_descriptor_is_read(lean_reactor, pairs):
    ours, theirs = pairs()
    readable = Readable(lean_reactor, ours, read_all)
    lean_reactor.addReader(readable)
    lean_reactor.doIteration(0)
    assert readable.reads == 0
    theirs.send(b"x")
    lean_reactor.doIteration(1)
    assert readable.reads == 1


def test_a_reason_returned_by_do_read_disconnects_the_descriptor(lean_reactor, pairs):
    ours, theirs = pairs()
    readable = Readable(lean_reactor, ours, lambda _: CONNECTION_DONE)
    lean_reactor.addReader(readable)
    theirs.send(b"x")
    lean_reactor.doIteration(1)
    assert len(readable.lost) == 1 and readable.lost[0].check(ConnectionDone)
    assert readable not in lean_reactor.getReaders()


def poll_a_failing_and_a_fine_descriptor(lean_reactor, pairs, failing: Readable) -> tuple[Readable, Readable]:
    """One poll in which ``failing`` (given its socket here) and a plain reader are both ready."""
    failing.sock, failing_peer = pairs()
    fine_end, fine_peer = pairs()
    fine = Readable(lean_reactor, fine_end, read_all)
    lean_reactor.addReader(failing)
    lean_reactor.addReader(fine)
    failing_peer.send(b"x")
    fine_peer.send(b"x")
    lean_reactor.doIteration(1)
    return failing, fine


def test_an_exception_in_do_read_is_logged_and_disconnects_only_that_descriptor(lean_reactor, pairs, logged):
    def fail(_):
        raise ZeroDivisionError("handler bug")

    failing, fine = poll_a_failing_and_a_fine_descriptor(lean_reactor, pairs, Readable(lean_reactor, None, fail))
    assert [reason.type for reason in failing.lost] == [ZeroDivisionError]
    assert fine.reads == 1 and fine.lost == []
    # Twisted's own report, as a legacy log.err event (its "failure" key).
    assert any(event.get("isError") and event["failure"].check(ZeroDivisionError) for event in logged)


def test_an_exception_from_connection_lost_is_logged_and_the_rest_of_the_poll_is_handled(lean_reactor, pairs, logged):
    # Twisted's _doReadOrWrite does not catch what connectionLost raises; callWithLogger did.
    class LostRaises(Readable):
        def connectionLost(self, reason) -> None:
            super().connectionLost(reason)
            raise ZeroDivisionError("bug in connectionLost")

    failing = LostRaises(lean_reactor, None, lambda r: (read_all(r), CONNECTION_DONE)[1])
    failing, fine = poll_a_failing_and_a_fine_descriptor(lean_reactor, pairs, failing)
    assert fine.reads == 1
    assert any(
        event.get("log_failure") and event["log_failure"].check(ZeroDivisionError) and "LostRaises" in repr(event)
        for event in logged
    )


def test_a_half_closeable_descriptor_whose_read_ends_is_half_closed_not_lost(lean_reactor, pairs):
    # A readable-only event is handled in the reactor's loop itself: it keeps Twisted's
    # distinction between the end of reading (half-close) and a lost connection.
    @implementer(IHalfCloseableDescriptor)
    class HalfCloseable(Readable):
        def readConnectionLost(self, reason) -> None:
            self.read_lost = reason

    ours, theirs = pairs()
    readable = HalfCloseable(lean_reactor, ours, lambda r: (read_all(r), CONNECTION_DONE)[1])
    lean_reactor.addReader(readable)
    theirs.send(b"x")
    lean_reactor.doIteration(1)
    assert readable.read_lost.check(ConnectionDone) and readable.lost == []


def test_a_ready_descriptor_whose_fileno_is_minus_one_is_lost_without_a_read(lean_reactor, pairs):
    ours, theirs = pairs()
    readable = Readable(lean_reactor, ours, read_all)
    lean_reactor.addReader(readable)
    theirs.send(b"x")
    readable.fileno = lambda: -1  # as Twisted's FileDescriptor once it closed its file
    lean_reactor.doIteration(1)
    assert readable.reads == 0
    assert [reason.type for reason in readable.lost] == [ConnectionFdescWentAway]


def test_a_descriptor_both_readable_and_writable_is_read_then_written(lean_reactor, pairs):
    written = []

    class ReadsAndWrites(Readable):
        def doWrite(self):
            written.append(self.reads)
            lean_reactor.removeWriter(self)

    ours, theirs = pairs()
    readable = ReadsAndWrites(lean_reactor, ours, read_all)
    lean_reactor.addReader(readable)
    lean_reactor.addWriter(readable)
    theirs.send(b"x")
    lean_reactor.doIteration(1)
    assert readable.reads == 1 and written == [1]


def test_a_hung_up_descriptor_with_nothing_left_to_read_is_lost_as_twisted_decides(lean_reactor, pairs):
    ours, theirs = pairs()
    readable = Readable(lean_reactor, ours, read_all)
    lean_reactor.addWriter(readable)  # writing only: a hangup is then a lost connection
    theirs.close()
    readable.doWrite = lambda: None
    for _ in range(3):
        if readable.lost:
            break
        lean_reactor.doIteration(1)
    assert readable.reads == 0
    assert [reason.type for reason in readable.lost] == [ConnectionLost]


def test_a_descriptor_removed_by_an_earlier_handler_of_the_same_poll_is_not_called(lean_reactor, pairs):
    first_end, first_peer = pairs()
    second_end, second_peer = pairs()
    readables = []

    def remove_the_other(readable):
        read_all(readable)
        other = readables[1] if readable is readables[0] else readables[0]
        lean_reactor.removeReader(other)

    readables += [
        Readable(lean_reactor, first_end, remove_the_other),
        Readable(lean_reactor, second_end, remove_the_other),
    ]
    for readable in readables:
        lean_reactor.addReader(readable)
    first_peer.send(b"x")
    second_peer.send(b"x")
    lean_reactor.doIteration(1)
    assert sorted(readable.reads for readable in readables) == [0, 1]


def test_the_handler_runs_without_twisteds_legacy_log_context(lean_reactor, pairs):
    # What the reactor leaves out: Twisted's epoll reactor would show the descriptor's logPrefix here.
    ours, theirs = pairs()
    seen = []
    readable = Readable(lean_reactor, ours, lambda r: seen.append(legacy_log.context.get(legacy_log.ILogContext)))
    readable.logPrefix = lambda: "our-prefix"
    lean_reactor.addReader(readable)
    theirs.send(b"x")
    lean_reactor.doIteration(1)
    assert len(seen) == 1 and seen[0].get("system") != "our-prefix"


def test_after_events_calls_run_once_every_ready_descriptor_of_the_poll_was_handled(lean_reactor, pairs):
    order = []
    readables = []
    for _ in range(2):
        ours, theirs = pairs()
        readable = Readable(lean_reactor, ours, lambda r: (read_all(r), order.append("read")))
        readables.append(readable)
        lean_reactor.addReader(readable)
        theirs.send(b"x")
    readables[0].handle = lambda r: (
        read_all(r),
        order.append("read"),
        lean_reactor.callAfterEvents(lambda: order.append("after")),
    )
    lean_reactor.doIteration(1)
    assert order == ["read", "read", "after"]
    order.clear()
    lean_reactor.doIteration(0)
    assert order == [], "made once"


def test_an_after_events_call_asked_for_outside_a_poll_runs_before_the_reactor_waits(lean_reactor, pairs):
    # As a timed call's write must not wait for the next event: the call makes a socket readable,
    # and the poll right after it already sees that.
    ours, theirs = pairs()
    seen = []
    readable = Readable(lean_reactor, ours, lambda r: (read_all(r), seen.append("read")))
    lean_reactor.addReader(readable)
    lean_reactor.callAfterEvents(lambda: (seen.append("after"), theirs.send(b"x")))
    lean_reactor.doIteration(5)
    assert seen == ["after", "read"]


def run_until_stopped(reactor, bound: float = 10.0) -> bool:
    """Run ``reactor`` until it stops itself; True if a guard thread had to stop it after ``bound`` s."""
    done = threading.Event()
    guard_needed = []

    def stop_if_hung():
        if not done.wait(bound):
            guard_needed.append(True)
            reactor.callFromThread(reactor.stop)

    threading.Thread(target=stop_if_hung, daemon=True).start()
    reactor.run(installSignalHandlers=False)
    done.set()
    return bool(guard_needed)


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(lambda r: r.callLater(0, r.stop), id="a timed call"),
        pytest.param(lambda r: r.callAfterEvents(r.stop), id="another after-events call"),
    ],
)
def test_what_an_after_events_call_made_before_the_poll_schedules_does_not_wait_for_an_event(lean_reactor, schedule):
    # Nothing else happens: were the poll to wait with the timeout computed before the call,
    # with no timed call left it would wait for ever (here: for the guard).
    lean_reactor.callLater(0, lambda: lean_reactor.callAfterEvents(lambda: schedule(lean_reactor)))
    assert not run_until_stopped(lean_reactor)


def test_an_after_events_call_raising_even_a_base_exception_does_not_lose_the_others(lean_reactor, logged):
    made = []

    def interrupted():
        raise KeyboardInterrupt

    lean_reactor.callAfterEvents(interrupted)
    lean_reactor.callAfterEvents(lambda: made.append("next"))
    lean_reactor.doIteration(0)
    assert made == ["next"]
    assert any(event.get("log_failure") and event["log_failure"].check(KeyboardInterrupt) for event in logged)


def test_a_cancelled_after_events_call_is_not_made_and_one_that_raises_is_logged(lean_reactor, logged):
    made = []
    lean_reactor.callAfterEvents(lambda: made.append("cancelled")).cancel()
    lean_reactor.callAfterEvents(lambda: 1 / 0)
    lean_reactor.callAfterEvents(lambda: made.append("next"))
    lean_reactor.doIteration(0)
    assert made == ["next"]
    assert any(event.get("log_failure") and event["log_failure"].check(ZeroDivisionError) for event in logged)


def test_the_write_aggregation_clock_turns_call_later_0_into_an_after_events_call(lean_reactor):
    clock = write_aggregation_clock(lean_reactor)
    assert isinstance(clock, AfterEventsClock)
    made = []
    clock.callLater(0, made.append, "now")
    later = clock.callLater(30, made.append, "later")
    assert later in lean_reactor.getDelayedCalls() and later in clock.getDelayedCalls()
    lean_reactor.doIteration(0)
    assert made == ["now"]
    later.cancel()
    lean_reactor.seconds = lambda: 42.0
    assert clock.seconds() == 42.0


def test_on_another_reactor_the_write_aggregation_clock_is_that_reactor():
    from twisted.internet import reactor

    assert write_aggregation_clock(reactor) is reactor


def test_call_after_events_is_an_after_events_call_on_this_reactor(lean_reactor):
    made = []
    call_after_events(lean_reactor, made.append, "now")
    call_after_events(lean_reactor, made.append, "never").cancel()
    assert lean_reactor.getDelayedCalls() == [], "no timed call"
    lean_reactor.doIteration(0)
    assert made == ["now"]


def test_call_after_events_is_a_call_later_0_on_another_reactor():
    clock = task.Clock()
    made = []
    call_after_events(clock, made.append, "now")
    call_after_events(clock, made.append, "never").cancel()
    assert made == []
    clock.advance(0)
    assert made == ["now"]


def test_twistd_finds_it_as_the_ztwisted_epoll_reactor_plugin():
    found = {installer.shortName: installer for installer in getReactorTypes()}
    assert found["ztwisted-epoll"].moduleName == "ztwisted.reactor"


def test_install_unless_chosen_leaves_an_installed_reactor_alone():
    from twisted.internet import reactor

    install_unless_chosen()
    from twisted.internet import reactor as after

    assert after is reactor and not isinstance(reactor, LeanEPollReactor)


def run_turns(reactor, now: list[float], turns: int, fail_on_turn: int | None = None):
    """Run ``reactor``'s own loop for ``turns`` turns on a fake clock; each poll "waits" its whole
    timeout. Returns the timeouts the polls got and the turns in which ``runUntilCurrent`` ran."""
    timeouts: list[float | None] = []
    upkeep: list[int] = []
    run_until_current = reactor.runUntilCurrent

    def counted() -> None:
        upkeep.append(len(timeouts) + 1)
        run_until_current()

    def poll(timeout) -> None:
        timeouts.append(timeout)
        now[0] += timeout or 0
        if len(timeouts) == turns:
            reactor._started = False
        if len(timeouts) == fail_on_turn:
            raise ZeroDivisionError("bug in a poll")

    reactor.seconds = lambda: now[0]
    reactor.runUntilCurrent = counted
    reactor.doIteration = poll
    reactor._started = reactor.running = True
    reactor.mainLoop()
    return timeouts, upkeep


def test_the_loop_runs_timed_calls_when_due_and_polls_until_the_next_one(lean_reactor):
    now = [100.0]
    lean_reactor.seconds = lambda: now[0]
    made = []
    pushed_back = lean_reactor.callLater(3, lambda: made.append(("pushed back to 105", now[0])))
    lean_reactor.callLater(1, lambda: pushed_back.reset(4))  # at 101: Twisted moves it when 103 comes
    lean_reactor.callLater(6, lambda: made.append(("106", now[0])))
    timeouts, upkeep = run_turns(lean_reactor, now, turns=6)
    assert made == [("pushed back to 105", 105.0), ("106", 106.0)]
    # at 100 the new calls go onto the heap; 101: the reset; 103: the call moved; 105, 106: due.
    assert timeouts == [1, 2, 2, 1, None, None]
    assert upkeep == [1, 2, 3, 4, 5], "a turn with no timed call due and none new does no upkeep"


def test_the_loop_polls_without_upkeep_until_a_timed_call_is_due(lean_reactor):
    now = [100.0]
    lean_reactor.seconds = lambda: now[0]
    made = []
    lean_reactor.callLater(10, lambda: made.append(now[0]))
    polls = []

    def short_poll(timeout) -> None:  # events come every 2 s
        polls.append(timeout)
        now[0] += 2
        if len(polls) == 6:
            lean_reactor._started = False

    lean_reactor.doIteration = short_poll
    upkeep = []
    run_until_current = lean_reactor.runUntilCurrent
    lean_reactor.runUntilCurrent = lambda: (upkeep.append(len(polls) + 1), run_until_current())
    lean_reactor._started = lean_reactor.running = True
    lean_reactor.mainLoop()
    assert polls == [10, 8, 6, 4, 2, None]
    assert made == [110.0]
    assert upkeep == [1, 6]


def test_calls_from_other_threads_and_the_stop_are_handled_in_the_next_turn(lean_reactor):
    now = [100.0]
    made = []
    lean_reactor.threadCallQueue.append((made.append, ("from a thread",), {}))
    timeouts, upkeep = run_turns(lean_reactor, now, turns=2)
    assert made == ["from a thread"] and upkeep == [1]


def test_an_exception_in_the_loop_is_logged_and_the_loop_goes_on(lean_reactor, logged):
    now = [100.0]
    timeouts, _ = run_turns(lean_reactor, now, turns=3, fail_on_turn=1)
    assert len(timeouts) == 3
    assert any(event.get("log_failure") and event["log_failure"].check(ZeroDivisionError) for event in logged)


def test_the_reactor_stops_through_its_own_loop(lean_reactor):
    made = []
    lean_reactor.callLater(0, lambda: (made.append("ran"), lean_reactor.stop()))
    lean_reactor.addSystemEventTrigger("after", "shutdown", lambda: made.append("shut down"))
    assert not run_until_stopped(lean_reactor)
    assert made == ["ran", "shut down"]
