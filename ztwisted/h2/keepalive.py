"""PINGs of an HBONE connection: matching answers to the PINGs sent, and the keepalive."""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs
import h2.connection

from ztwisted.h2.lifecycle import Timer, Timers


@attrs.define
class Pings:
    """Sends PINGs and calls back whoever sent one when its ACK arrives."""

    h2: h2.connection.H2Connection
    _pending: dict[bytes, Callable[[], None]] = attrs.field(factory=dict)

    def send(self, on_answer: Callable[[], None]) -> None:
        """Queue a PING in h2; the caller writes it out."""
        opaque = os.urandom(8)
        self._pending[opaque] = on_answer
        self.h2.ping(opaque)

    def answered(self, opaque: bytes) -> None:
        on_answer = self._pending.pop(opaque, None)
        if on_answer is not None:
            on_answer()


@attrs.define
class Keepalive:
    """A PING after ``interval`` seconds without a received byte; no answer in ``timeout`` fails.

    Owns the KEEPALIVE and PING_TIMEOUT timers (cancelled with all others when the
    connection is lost, so a PING is only ever sent on a live connection).

    A read only notes the time (:meth:`heard_from_peer`); the KEEPALIVE timer, when
    it fires, looks at how long the peer has been quiet and either sends the PING or
    waits for the rest of the interval. Pushing the timer back on every read, as it
    was, cost a ``DelayedCall.reset`` and three more calls per received message.
    """

    timers: Timers
    pings: Pings
    interval: float
    timeout: float
    #: writes what h2 queued
    send_pending: Callable[[], None]
    #: called when a PING went unanswered
    on_timeout: Callable[[], None]
    #: the clock's time of the last read
    last_heard: float = attrs.field(init=False, default=0.0)

    def start(self) -> None:
        """The connection is up: the peer counts as heard from now."""
        self.heard_from_peer()
        self.timers.start(Timer.KEEPALIVE, self.interval, self._quiet_for_a_while)

    def heard_from_peer(self) -> None:
        self.last_heard = self.timers.clock.seconds()

    def _quiet_for_a_while(self) -> None:
        quiet = self.timers.clock.seconds() - self.last_heard
        if quiet >= self.interval:
            self._ping()
            quiet = 0.0  # the next PING is due a whole interval from now, if nothing comes
        self.timers.start(Timer.KEEPALIVE, self.interval - quiet, self._quiet_for_a_while)

    def _ping(self) -> None:
        if self.timers.active(Timer.PING_TIMEOUT):
            return
        self.pings.send(self._answered)
        self.timers.start(Timer.PING_TIMEOUT, self.timeout, self.on_timeout)
        self.send_pending()

    def _answered(self) -> None:
        self.timers.cancel(Timer.PING_TIMEOUT)
