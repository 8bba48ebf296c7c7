"""The lifecycle of one HBONE connection: its states, how it ended, and its timers.

The connection moves through these states, only forwards::

    new ──► handshaking ──► open ──► draining ──► closing ──► close_notify ──► closed
                 │            │          │            │             │
                 └────────────┴──────────┴────────────┴─────────────┴──► aborted ──► closed

- **handshaking**: TCP is up, TLS is negotiating. Streams may already be
  opened (the client side writes its preface with the handshake).
- **open**: TLS is done; the connection carries tunnels.
- **draining**: no new streams. On the server side the first GOAWAY
  (last stream 2^31-1) and a PING are out; a client that drains, or either
  side that received a GOAWAY, waits here for its streams to end.
- **closing**: the second GOAWAY, with the real last stream id, is out; the
  streams up to it finish.
- **close_notify**: TLS close_notify is sent; waiting for the peer's before
  closing TCP (bounded by ``close_notify_wait``).
- **aborted**: the transport was aborted (no close_notify); waiting for
  ``connectionLost``.
- **closed**: ``connectionLost`` ran; ``HBONEConnection.closed`` has fired.

The machine is a small explicit one rather than Automat's: the connection,
the pool and the admin dump *ask* about the state (``usable``,
``available_streams``, whether to process a frame, ``ended_by``), and
Automat's machines deliberately hide their state behind inputs and outputs,
so the same facts would have had to be kept a second time in flags -- the
tangle this module replaces. An enum and one transition table keep every
legal move in one place and every question a one-line property.

``ended_by`` is part of the state. It is set by the move that starts the end
(to close_notify or aborted), or decided just before it when resetting the
last streams would otherwise look like a drain (the drain deadline); when
the peer or the network ended the connection, it is ``peer`` or ``lost``,
decided once ``connectionLost`` has told the streams. It does not change
after, except that an abort overrides the ending of a graceful close still
waiting for the peer's close_notify (a keepalive timeout then is what really
ended it).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs
from twisted.internet.interfaces import IDelayedCall

#: How a connection ended (``HBONEConnection.ended_by``, the value ``closed`` fires with).
ENDINGS = (
    "drained",  # graceful: every stream finished, then TLS close_notify
    "drain-deadline",  # graceful drain ran out of time: streams reset, then closed
    "abrupt",  # closed at once on request, no GOAWAY, no close_notify
    "peer",  # the peer closed the connection
    "lost",  # the transport failed
    "keepalive-timeout",
    "handshake-timeout",
    "idle-timeout",
    "protocol-error",
    "flood",  # control-frame flood or rapid reset
)


class State(enum.Enum):
    NEW = "new"
    HANDSHAKING = "handshaking"
    OPEN = "open"
    DRAINING = "draining"
    CLOSING = "closing"
    CLOSE_NOTIFY = "close_notify"
    ABORTED = "aborted"
    CLOSED = "closed"


_TRANSITIONS: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.HANDSHAKING, State.ABORTED, State.CLOSED}),
    State.HANDSHAKING: frozenset({State.OPEN, State.DRAINING, State.CLOSE_NOTIFY, State.ABORTED, State.CLOSED}),
    State.OPEN: frozenset({State.DRAINING, State.CLOSE_NOTIFY, State.ABORTED, State.CLOSED}),
    State.DRAINING: frozenset({State.CLOSING, State.CLOSE_NOTIFY, State.ABORTED, State.CLOSED}),
    State.CLOSING: frozenset({State.CLOSE_NOTIFY, State.ABORTED, State.CLOSED}),
    State.CLOSE_NOTIFY: frozenset({State.ABORTED, State.CLOSED}),
    State.ABORTED: frozenset({State.CLOSED}),
    State.CLOSED: frozenset(),
}

#: states in which the connection takes new streams
_ACCEPTING = frozenset({State.HANDSHAKING, State.OPEN})
#: states in which the connection lets its streams finish and then closes
_WINDING_DOWN = frozenset({State.DRAINING, State.CLOSING})
#: states in which h2's output is written to the transport
_WRITABLE = frozenset({State.HANDSHAKING, State.OPEN, State.DRAINING, State.CLOSING})
#: states in which this side has started to close the transport (or it is gone): nothing more is processed
_ENDING = frozenset({State.CLOSE_NOTIFY, State.ABORTED, State.CLOSED})


class IllegalTransition(Exception):
    """A move the lifecycle does not allow: a bug in the connection, never the peer's doing."""


@attrs.define
class Lifecycle:
    """Where one connection is in its life, and how it ended."""

    state: State = State.NEW
    #: one of :data:`ENDINGS`; see the module's docstring for when it is set
    ended_by: str | None = None
    # What the connection asks, derived from ``state`` at each move: plain attributes,
    # as some are read for every frame (an enum's hash is a Python call).
    #: the transport is there (it may be closing)
    connected_now: bool = attrs.field(default=False, init=False)
    #: new streams are taken
    accepting: bool = attrs.field(default=False, init=False)
    #: no new streams; closes once the last stream ended
    winding_down: bool = attrs.field(default=False, init=False)
    #: this side started to close the transport, or it is gone: nothing more is processed
    ending: bool = attrs.field(default=False, init=False)
    #: h2's output may be written: connected and not closing
    writable: bool = attrs.field(default=False, init=False)

    def _move(self, to: State) -> None:
        if to not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.state.value} -> {to.value}")
        self.state = to
        self.connected_now = to not in (State.NEW, State.CLOSED)
        self.accepting = to in _ACCEPTING
        self.winding_down = to in _WINDING_DOWN
        self.ending = to in _ENDING
        self.writable = to in _WRITABLE

    # -- inputs -----------------------------------------------------------------

    def connected(self) -> None:
        if self.state is State.NEW:  # not after an abort before the transport came
            self._move(State.HANDSHAKING)

    def handshake_done(self) -> None:
        if self.state is State.HANDSHAKING:
            self._move(State.OPEN)

    def stop_taking_streams(self) -> None:
        """Drain asked for, or a GOAWAY received: no new streams."""
        if self.accepting:
            self._move(State.DRAINING)

    def last_stream_announced(self) -> None:
        """The second GOAWAY is out."""
        if self.state is State.DRAINING:
            self._move(State.CLOSING)

    def decide_ending(self, ended_by: str) -> None:
        """Fix how the connection ends before the move that ends it (unless decided already)."""
        self.ended_by = self.ended_by or ended_by

    def send_close_notify(self, ended_by: str) -> bool:
        """Start a graceful close; False if the connection is ending already."""
        if self.ending:
            return False
        self.ended_by = self.ended_by or ended_by
        self._move(State.CLOSE_NOTIFY)
        return True

    def abort(self, ended_by: str | None) -> bool:
        """Start an abort; False if one started already or the transport is gone.

        ``ended_by`` overrides a graceful ending; ``None`` keeps it."""
        if self.state in (State.ABORTED, State.CLOSED):
            return False
        if ended_by is not None:
            self.ended_by = ended_by
        self._move(State.ABORTED)
        return True

    def lost(self) -> None:
        """The transport is gone; :meth:`decide_ending` follows if nothing ended it before."""
        self._move(State.CLOSED)


class Timer:
    """Every timer of a connection, each with its one owner (who starts it and whom it calls).

    Plain strings rather than an enum: an enum member's hash is a Python call."""

    HANDSHAKE = "handshake"  # HBONEConnection: a TLS handshake that does not finish
    IDLE = "idle"  # HBONEConnection: a server connection that opens no stream
    CLOSE_NOTIFY = "close-notify"  # HBONEConnection: the peer's close_notify that does not come
    KEEPALIVE = "keepalive"  # Keepalive: quiet time before the next PING
    PING_TIMEOUT = "ping-timeout"  # Keepalive: the PING answer that does not come
    GOAWAY_PING_WAIT = "goaway-ping-wait"  # Shutdown: the PING after the first GOAWAY
    DRAIN_DEADLINE = "drain-deadline"  # Shutdown: the end of a graceful drain


@attrs.define
class Timers:
    """The connection's delayed calls, on its injected clock; all cancelled when it is lost."""

    clock: object
    _calls: dict[str, IDelayedCall] = attrs.field(factory=dict)

    def start(self, timer: str, seconds: float, call: Callable[[], None]) -> None:
        """Run ``call`` in ``seconds``, replacing what ``timer`` was set to."""
        self.cancel(timer)
        self._calls[timer] = self.clock.callLater(seconds, call)

    def active(self, timer: str) -> bool:
        delayed = self._calls.get(timer)
        return delayed is not None and delayed.active()

    def due(self, timer: str) -> float | None:
        """When an active ``timer`` fires, in clock seconds."""
        return self._calls[timer].getTime() if self.active(timer) else None

    def cancel(self, timer: str) -> None:
        delayed = self._calls.pop(timer, None)
        if delayed is not None and delayed.active():
            delayed.cancel()

    def cancel_all(self) -> None:
        for timer in list(self._calls):
            self.cancel(timer)
