"""The h2 events of an HBONE connection, one named handler each (in the spirit of
``twisted.web._http2``): each hands its event to the piece of the connection it concerns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import h2.events

from ztwisted.h2.admission import let_h2_accept_any_number_of_streams

if TYPE_CHECKING:
    from ztwisted.h2.connection import HBONEConnection


@attrs.define
class EventHandlers:
    """The handler of each h2 event type; an event without one (trailers) is ignored."""

    connection: HBONEConnection
    #: event type -> handler; the connection looks its events up here (one call less per DATA frame)
    by_type: dict = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.by_type = {
            h2.events.DataReceived: self._on_data,
            h2.events.RequestReceived: self._on_request,
            h2.events.ResponseReceived: self._on_response,
            h2.events.StreamEnded: self._on_stream_ended,
            h2.events.StreamReset: self._on_stream_reset,
            h2.events.WindowUpdated: self._on_window_updated,
            h2.events.RemoteSettingsChanged: self._on_remote_settings_changed,
            h2.events.PingReceived: self._on_ping,
            h2.events.PingAckReceived: self._on_ping_ack,
            h2.events.ConnectionTerminated: self._on_connection_terminated,
            h2.events.SettingsAcknowledged: self._on_settings_acknowledged,
        }

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream = self.connection.streams.get(event.stream_id)
        if stream is None:
            self.connection.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        stream.on_data(event.data, event.flow_controlled_length)
        if event.stream_ended is not None:
            stream.on_remote_end()

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        self.connection.admission.requested(event)
        if event.stream_ended is not None:
            stream = self.connection.streams.get(event.stream_id)
            if stream is not None:
                stream.on_remote_end()

    def _on_response(self, event: h2.events.ResponseReceived) -> None:
        stream = self.connection.streams.get(event.stream_id)
        if stream is not None:
            stream.on_response(dict(event.headers))

    def _on_stream_ended(self, event: h2.events.StreamEnded) -> None:
        stream = self.connection.streams.get(event.stream_id)
        if stream is not None and not stream.remote_closed:
            stream.on_remote_end()

    def _on_stream_reset(self, event: h2.events.StreamReset) -> None:
        if event.remote_reset:
            self.connection.floods.peer_reset()
            if self.connection.lifecycle.ending:
                return
        stream = self.connection.streams.get(event.stream_id)
        if stream is not None:
            stream.on_remote_reset(event.error_code)

    def _on_window_updated(self, event: h2.events.WindowUpdated) -> None:
        if event.stream_id == 0:
            self.connection.flow.windows_opened(self.connection.streams.values())
        else:
            stream = self.connection.streams.get(event.stream_id)
            if stream is not None:
                self.connection.flow.windows_opened((stream,))

    def _on_remote_settings_changed(self, event: h2.events.RemoteSettingsChanged) -> None:
        self.connection.floods.peer_control_frame("SETTINGS")
        if self.connection.lifecycle.ending:
            return
        # A larger INITIAL_WINDOW_SIZE opens every stream's window without
        # any WINDOW_UPDATE frame: buffered data must go out now.
        self.connection.flow.windows_opened(self.connection.streams.values())

    def _on_ping(self, event: h2.events.PingReceived) -> None:
        self.connection.floods.peer_control_frame("PING")

    def _on_ping_ack(self, event: h2.events.PingAckReceived) -> None:
        self.connection.pings.answered(event.ping_data)

    def _on_connection_terminated(self, event: h2.events.ConnectionTerminated) -> None:
        # Only reached if h2 itself ends the connection; GOAWAY frames are filtered.
        self.connection.abort_connection("protocol-error")

    def _on_settings_acknowledged(self, event: h2.events.SettingsAcknowledged) -> None:
        if not self.connection.client:
            let_h2_accept_any_number_of_streams(self.connection.h2)
