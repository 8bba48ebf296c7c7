"""Outbound flow control of an HBONE connection: HTTP/2 windows and the TLS transport's buffer.

Stream data goes out only while both allow: a stream's :meth:`~ztwisted.h2.stream.Stream.flush`
sends what the HTTP/2 windows take, and nothing is flushed while the TLS transport
has paused us (its write buffer is full). Each wait pauses the stream's partner,
so backpressure reaches the other socket. Inbound, the windows are reopened
(``acknowledge``) only as the partner takes the data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs
import h2.connection
import h2.exceptions

from ztwisted.h2 import lean_data
from ztwisted.h2.lifecycle import Lifecycle

if TYPE_CHECKING:
    from ztwisted.h2.stream import Stream


@attrs.define
class FlowControl:
    h2: h2.connection.H2Connection
    lifecycle: Lifecycle
    #: writes what h2 queued
    send_pending: Callable[[], None]
    #: the TLS transport asked us to stop writing
    transport_paused: bool = False

    def send(self, stream: Stream) -> None:
        """Send what ``stream`` buffered, as far as the windows and the transport allow."""
        if self.transport_paused:
            stream.apply_backpressure()
            return
        stream.flush(self.h2)
        self.send_pending()

    def windows_opened(self, streams: Iterable[Stream]) -> None:
        """A WINDOW_UPDATE or a larger INITIAL_WINDOW_SIZE: buffered data may go out."""
        if not self.transport_paused:
            for stream in list(streams):
                stream.flush(self.h2)

    def transport_resumed(self, streams: Iterable[Stream]) -> None:
        self.transport_paused = False
        for stream in list(streams):
            stream.flush(self.h2)
        self.send_pending()

    def acknowledge(self, stream: Stream, size: int) -> None:
        """Reopen the windows by ``size`` bytes ``stream``'s partner took."""
        if not self.lifecycle.connected_now or stream.done:
            return
        if lean_data.acknowledge_received_data(self.h2, size, stream.stream_id):
            return  # no WINDOW_UPDATE due: nothing to send
        try:
            self.h2.acknowledge_received_data(size, stream.stream_id)
        except h2.exceptions.StreamClosedError:
            return
        self.send_pending()

    def release(self, stream: Stream, size: int) -> None:
        """Give the connection's window back the ``size`` bytes ``stream`` received that nobody will
        take now that it ended (its partner was paused, or there was none yet).

        Left out, they would shrink the peer's connection window for good, until a few such
        streams starved every stream of the connection. h2 credits only the connection's window
        for a closed stream.
        """
        if size and self.lifecycle.connected_now:
            self.h2.acknowledge_received_data(size, stream.stream_id)
            self.send_pending()
