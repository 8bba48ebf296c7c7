"""The reactor ``twistd ztunnel`` runs on: Twisted's epoll reactor without a log context per event.

Twisted's epoll reactor wraps every ready file descriptor's ``doRead`` or
``doWrite`` in ``log.callWithLogger``, which copies the legacy logging
context (a dict) to put the protocol's ``logPrefix()`` in it, so that a
``twisted.python.log.msg`` call made inside shows that prefix as its
``system``. A proxy forwarding small messages handles one or two such events
per message and node, and this wrapping was ~14 % of each node's Python time
in a ping-pong (``benchmarks/README.md``, where its removal is measured). ztwisted logs through
``twisted.logger``, whose events carry their own namespace and never read
that context, so the wrapping buys ztwisted nothing.

What changes for anyone else's code: a legacy ``log.msg``/``log.err`` made
while a descriptor is handled (including Twisted's own report of an
exception raised by ``doRead``) has ``system`` ``"-"`` instead of the
protocol's prefix. An exception that escapes Twisted's handling of a
descriptor (from a protocol's ``connectionLost``, say) is logged with the
descriptor's repr and the poll's other descriptors are still handled, as
``callWithLogger`` did. Everything else is Twisted's ``EPollReactor``.

A descriptor that is only readable (``EPOLLIN`` alone, the usual event of a
proxy) is handled in the loop itself, as Twisted's ``_doReadOrWrite`` would
(its ``fileno() == -1`` check, ``doRead``, an exception logged with
``log.err``, the reason given to ``_disconnectSelectable`` as a read): one
Python call less per event. Every other event (hangups, errors, writable)
goes to ``_doReadOrWrite`` itself.

It also runs calls *after the events* of a poll (:meth:`LeanEPollReactor.callAfterEvents`):
Twisted's TLS transport sends the writes of a reactor turn together, in a
``callLater(0)`` per connection and turn, which costs a timed call (an
object, a heap insertion, the timed-call queue's upkeep) for every burst of
writes. :class:`AfterEventsClock` turns that ``callLater(0)`` into an
after-events call: the same moment (once every ready socket of the poll
was handled, before the reactor waits again) without the timed call
(ztwisted's own TLS transport, ``tls._WritesOfATurn``, asks the clock's
reactor for the after-events call itself).

And its loop (:meth:`LeanEPollReactor.mainLoop`) does the upkeep of the timed
calls only in the turns that have some: Twisted's runs the due timed calls
and computes the poll's timeout in every turn, ~8 Python calls (twice the
insertion of new timed calls, a failure handler's ``__enter__``/``__exit__``)
although most turns of a busy proxy have no timed call due and none new.

It is installed by ``twistd ztunnel`` when no reactor was chosen (see
:func:`install_unless_chosen`); ``twistd --reactor=NAME ztunnel`` still
picks any other, and ``twistd --reactor=ztwisted-epoll`` names this one.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from select import EPOLLIN
from typing import Any

import attrs
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.interfaces import IReactorTime
from twisted.internet.posixbase import _NO_FILEDESC
from twisted.logger import Logger
from twisted.python import log as legacy_log
from zope.interface import implementer

log = Logger()

#: the longest poll timeout (s): what epoll_wait takes in milliseconds in a C int (Twisted's bound)
_LONGEST_WAIT = 2147483


class AfterEventsCall:
    """A call :meth:`LeanEPollReactor.callAfterEvents` will make, unless cancelled first."""

    __slots__ = ("function", "cancelled")

    def __init__(self, function: Callable[[], Any]) -> None:
        self.function = function
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class LeanEPollReactor(EPollReactor):
    """``EPollReactor`` that dispatches ready descriptors without ``log.callWithLogger``.

    The reactor's loop calls ``doIteration`` (``EPollReactor.doPoll`` under another name).
    """

    def __init__(self) -> None:
        self._after_events: list[AfterEventsCall] = []
        super().__init__()

    def callAfterEvents(self, function: Callable[[], Any]) -> AfterEventsCall:
        """Call ``function`` once the ready sockets of the current poll were handled (or, asked
        outside the handling of a poll, as by a timed call, before the reactor next waits).

        From the reactor's thread only (other threads: ``callFromThread``)."""
        call = AfterEventsCall(function)
        self._after_events.append(call)
        return call

    def mainLoop(self) -> None:
        """Twisted's ``mainLoop``, calling ``runUntilCurrent`` and ``timeout`` only in the turns
        that have work for them (see the module's docstring).

        ``runUntilCurrent`` runs when a timed call is due (the earliest on Twisted's heap; one
        pushed back by ``reset`` is moved there), when timed calls were added since the last
        turn (it puts them on the heap), when another thread handed over calls, and when the
        reactor was just stopped (it fires the shutdown). Otherwise the timeout is the time
        until the earliest timed call, as ``timeout`` computes it.
        """
        while self._started:
            try:
                while self._started:
                    now = self.seconds()
                    pending = self._pendingTimedCalls
                    if (
                        self._newTimedCalls
                        or self.threadCallQueue
                        or self._justStopped
                        or (pending and pending[0].time <= now)
                    ):
                        self.runUntilCurrent()
                        timeout = self.timeout()
                    elif pending:
                        timeout = min(_LONGEST_WAIT, pending[0].time - now)
                    else:
                        timeout = None
                    self.doIteration(timeout if self.running else 0)
            except BaseException:
                # As Twisted's loop: logged, and the loop goes on (while the reactor runs).
                log.failure("Unexpected error in main loop")
        log.info("Main loop terminated.")

    def doIteration(self, timeout: float | None) -> None:
        if self._after_events:  # asked for by timed calls: not after a wait of up to `timeout`
            self._run_after_events()
            # What they did may have scheduled a timed call or another after-events call,
            # which the caller's timeout does not know of: look at the sockets without waiting.
            timeout = 0
        try:
            ready = self._poller.poll(-1 if timeout is None else timeout, len(self._selectables))
        except InterruptedError:
            return
        selectables = self._selectables
        handle = self._doReadOrWrite
        for fd, event in ready:
            selectable = selectables.get(fd)
            # Gone already: an earlier descriptor's handler in this batch removed it.
            if selectable is not None:
                try:
                    if event != EPOLLIN:
                        handle(selectable, fd, event)  # Twisted's: hangups, errors, writable
                        continue
                    # Only readable: what Twisted's _doReadOrWrite does then, without the call.
                    why = None
                    in_read = False
                    try:
                        if selectable.fileno() == -1:  # closed but not removed (Twisted's check)
                            why = _NO_FILEDESC
                        else:
                            why = selectable.doRead()
                            in_read = True
                    except BaseException:
                        why = sys.exc_info()[1]
                        legacy_log.err()  # as Twisted: to the legacy log, with the traceback
                    if why:
                        self._disconnectSelectable(selectable, why, in_read)
                except KeyboardInterrupt:
                    raise
                except BaseException:
                    # What Twisted's own handling lets through (connectionLost raising):
                    # logged, and the other ready descriptors are still handled.
                    log.failure("while handling {selectable!r}", selectable=selectable)
        if self._after_events:
            self._run_after_events()

    def _run_after_events(self) -> None:
        calls, self._after_events = self._after_events, []
        for call in calls:
            if not call.cancelled:
                # As Twisted's timed calls: any exception is logged, and the other calls are still made.
                try:
                    call.function()
                except BaseException:
                    log.failure("while making an after-events call")


@implementer(IReactorTime)
@attrs.frozen
class AfterEventsClock:
    """``reactor`` as a clock whose ``callLater(0, ...)`` is an after-events call.

    For Twisted's TLS write aggregation (``TLSMemoryBIOFactory(clock=...)``),
    whose only use of its clock is ``callLater(0, flush)``, the result's truth
    and ``cancel()``: an after-events call has no ``active()`` or ``getTime()``
    and is not among ``getDelayedCalls()``.
    """

    reactor: LeanEPollReactor

    def callLater(self, delay: float, callable: Callable[..., Any], *args: Any, **kw: Any):
        if delay == 0:
            return call_after_events(self.reactor, callable, *args, **kw)
        return self.reactor.callLater(delay, callable, *args, **kw)

    def seconds(self) -> float:
        return self.reactor.seconds()

    def getDelayedCalls(self):
        return self.reactor.getDelayedCalls()


def call_after_events(reactor: IReactorTime, function: Callable[..., Any], *args: Any, **kw: Any):
    """``function(*args, **kw)`` at the end of the current reactor turn; returns what ``cancel()`` stops.

    On ztwisted's reactor an after-events call (:meth:`LeanEPollReactor.callAfterEvents`),
    on any other a ``callLater(0)``: the same moment (after the ready sockets of the poll,
    before the reactor waits again), without a timed call on Twisted's heap and the upkeep
    of the timed-call queue in the next turn.
    """
    if isinstance(reactor, LeanEPollReactor):
        return reactor.callAfterEvents(functools.partial(function, *args, **kw) if args or kw else function)
    return reactor.callLater(0, function, *args, **kw)


def write_aggregation_clock(reactor: IReactorTime) -> IReactorTime:
    """The clock for Twisted's TLS write aggregation: :class:`AfterEventsClock` on ztwisted's
    reactor, ``reactor`` itself on any other (there ``callLater(0)`` does the same, slower)."""
    return AfterEventsClock(reactor) if isinstance(reactor, LeanEPollReactor) else reactor


def install() -> None:
    """Install :class:`LeanEPollReactor` as the global reactor (the ``ztwisted-epoll`` plugin)."""
    from twisted.internet.main import installReactor

    installReactor(LeanEPollReactor())


def install_unless_chosen() -> None:
    """Install :class:`LeanEPollReactor` if no reactor is installed yet, on Linux.

    ``twistd`` installs a reactor named with ``--reactor`` while it parses its
    own options, before it loads the ``ztunnel`` subcommand; only when none
    was named is the reactor still free to choose here.
    """
    if "twisted.internet.reactor" not in sys.modules and sys.platform.startswith("linux"):
        install()
