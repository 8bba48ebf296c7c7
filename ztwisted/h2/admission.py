"""Which requested streams a server-side HBONE connection takes, and how it refuses the others."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import h2.connection
import h2.errors
import h2.events
import h2.settings
from twisted.logger import Logger

from ztwisted.h2.lifecycle import Timer
from ztwisted.h2.stream import Stream

if TYPE_CHECKING:
    from ztwisted.h2.connection import HBONEConnection


def let_h2_accept_any_number_of_streams(h2conn: h2.connection.H2Connection) -> None:
    """h2 treats a stream beyond MAX_CONCURRENT_STREAMS as a connection error, raised
    before the header block is decoded; RFC 9113 section 5.1.2 wants a stream error,
    which :meth:`StreamAdmission.requested` applies. So h2's own copy of the setting
    stays at the maximum; what we announce to the peer is unchanged. Only call this
    with no other local setting waiting for the peer's ACK."""
    local = h2conn.local_settings
    local[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = 2**31 - 1
    local.acknowledge()


@attrs.define
class StreamAdmission:
    """A CONNECT is handed to ``on_tunnel_request`` unless a limit or a GOAWAY refuses it first."""

    connection: HBONEConnection

    log = Logger()

    def requested(self, event: h2.events.RequestReceived) -> None:
        connection = self.connection
        connection.timers.cancel(Timer.IDLE)
        headers = dict(event.headers)
        over_limit = len(connection.streams) >= connection.settings.max_concurrent_streams
        stream = Stream(connection, event.stream_id, headers)
        connection.streams[event.stream_id] = stream
        if over_limit:
            self.log.info(
                "refusing stream {id} from {peer}: {limit} streams are open already",
                id=event.stream_id,
                peer=connection.peer_text(),
                limit=connection.settings.max_concurrent_streams,
            )
            connection.limit_hit("max-concurrent-streams", f"stream {event.stream_id}")
            stream.reset(h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        last_stream_id = connection.shutdown.sent_last_stream_id
        if last_stream_id is not None and event.stream_id > last_stream_id:
            stream.reset(h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if headers.get(":method") != "CONNECT":
            self.log.info(
                "refusing {method} from {peer}: only CONNECT is served",
                method=headers.get(":method"),
                peer=connection.peer_text(),
            )
            stream.refuse(400)
            return
        self._hand_over(stream)

    def _hand_over(self, stream: Stream) -> None:
        connection = self.connection
        if connection.on_tunnel_request is None:
            stream.refuse(400)
            return
        try:
            connection.on_tunnel_request(connection, stream)
        except Exception:
            self.log.failure("tunnel request handler failed")
            if not stream.response.called:
                stream.refuse(503)
