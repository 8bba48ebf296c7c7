"""Coupling two pipe ends (app TCP sockets, HBONE streams) with backpressure and half-close."""

from __future__ import annotations

import socket
import struct

from twisted.internet import defer, error
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from zope.interface import implementer

from ztwisted.interfaces import IPipeEnd
from ztwisted.sockets import write_through


@implementer(IPipeEnd, IHalfCloseableProtocol)
class TCPEnd(Protocol):
    """A TCP connection as a pipe end.

    Also usable without being the transport's protocol: ``attach(transport)``
    plus forwarding ``dataReceived``/``readConnectionLost``/``connectionLost``
    (the SOCKS5 protocol does that after its handshake).
    """

    attach = Protocol.makeConnection

    def __init__(self) -> None:
        self.partner = None
        self.finished: defer.Deferred = defer.Deferred()
        self.bytes_received = 0
        self.bytes_sent = 0
        self._pending: list[bytes] = []
        self._pending_eof = False
        self._read_closed = False
        self._write_closed = False
        self._aborted = False
        self._done = False

    # -- Protocol -------------------------------------------------------------

    def connectionMade(self) -> None:
        write_through(self.transport)
        if self.partner is not None:
            self.transport.registerProducer(self.partner, True)
        pending, self._pending = self._pending, []
        for data in pending:
            self.write(data)
        if self._pending_eof:
            self.write_eof()

    def dataReceived(self, data: bytes) -> None:
        self.bytes_received += len(data)
        self.partner.write(data)

    def readConnectionLost(self) -> None:
        self._read_closed = True
        self.partner.write_eof()
        self._close_if_both_done()

    def writeConnectionLost(self) -> None:
        self._write_closed = True
        self._close_if_both_done()

    def connectionLost(self, reason=None) -> None:
        clean = self._read_closed and self._write_closed and not self._aborted
        if not clean and self.partner is not None:
            self.partner.abort()
        if self._done:
            return
        self._done = True
        if clean:
            outcome = "closed"
        elif self._aborted:
            outcome = "reset"
        elif reason is not None and reason.check(error.ConnectionDone):
            outcome = "closed early"
        else:
            outcome = "reset by peer"
        self.finished.callback(outcome)

    # -- IPipeEnd ---------------------------------------------------------------

    def set_partner(self, partner) -> None:
        self.partner = partner
        if self.transport is not None:
            self.transport.registerProducer(partner, True)

    def write(self, data: bytes) -> None:
        if self.transport is None:
            self._pending.append(data)
            return
        if self._write_closed or self._done:
            return
        self.bytes_sent += len(data)
        self.transport.write(data)

    def write_eof(self) -> None:
        if self.transport is None:
            self._pending_eof = True
            return
        if self._write_closed or self._done:
            return
        self._write_closed = True
        # Twisted defers a half-close until the producer is unregistered, and
        # no more data will come from the partner anyway.
        self.transport.unregisterProducer()
        self.transport.loseWriteConnection()
        self._close_if_both_done()

    def abort(self) -> None:
        if self._done or self._aborted:
            return
        self._aborted = True
        if self.transport is None:
            return
        # SO_LINGER 0 makes the close send RST: the app sees a reset, as it would without the proxy.
        try:
            self.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (AttributeError, OSError):
            pass
        self.transport.abortConnection()

    def pauseProducing(self) -> None:
        if self.transport is not None and not self._done:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        if self.transport is not None and not self._done:
            self.transport.resumeProducing()

    def stopProducing(self) -> None:
        # Twisted calls this when the partner's transport goes away, clean or
        # not; the partner's connectionLost says which and aborts us if needed.
        pass

    def _close_if_both_done(self) -> None:
        if self._read_closed and self._write_closed and not self._done:
            self.transport.loseConnection()


def splice(a, b) -> defer.Deferred:
    """Couple two pipe ends; fires with ``(outcome_a, outcome_b)`` when both are finished."""
    a.set_partner(b)
    b.set_partner(a)
    for end, other in ((a, b), (b, a)):
        if end.finished.called:
            # Finished before it was coupled (the client reset its stream while the app
            # connection was being made, say): the other end has no one to talk to.
            other.abort()
    # Chained, not gatherResults(): DeferredList's machinery was a visible part of a short
    # connection's cost on both nodes. ``finished`` only ever fires with an outcome.
    both = defer.Deferred()

    def a_finished(outcome_a):
        def b_finished(outcome_b):
            # Both ends are done, so neither calls the other any more. Linked, the two would
            # be a reference cycle, freed (with the socket transport they hold) only when the
            # cyclic garbage collector next runs, instead of now.
            a.partner = b.partner = None
            both.callback((outcome_a, outcome_b))
            return outcome_b

        b.finished.addCallback(b_finished)
        return outcome_a

    a.finished.addCallback(a_finished)
    return both
