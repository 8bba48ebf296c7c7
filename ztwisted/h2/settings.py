"""HTTP/2 settings and timers of an HBONE connection, and how a tunnel can fail to open."""

from __future__ import annotations

import attr
from h2.settings import SettingCodes

MiB = 1024 * 1024
KiB = 1024


@attr.s(frozen=True)
class H2Settings:
    """HTTP/2 settings and timers; the defaults are ztunnel's."""

    stream_window: int = attr.ib(default=4 * MiB)
    connection_window: int = attr.ib(default=16 * MiB)
    max_frame_size: int = attr.ib(default=1 * MiB)
    max_concurrent_streams: int = attr.ib(default=200)
    max_header_list_size: int = attr.ib(default=64 * KiB)
    # A received frame over max_frame_size, or a header block over
    # goaway.header_block_cap(max_header_list_size), ends the connection as it arrives.
    # Positive: the KEEPALIVE timer re-arms for the rest of the interval each time it fires.
    keepalive_interval: float = attr.ib(default=10.0, validator=attr.validators.gt(0))
    keepalive_timeout: float = attr.ib(default=20.0, validator=attr.validators.gt(0))
    #: how long a graceful close waits for the PING that follows the first GOAWAY
    goaway_ping_wait: float = attr.ib(default=1.0)
    #: after sending close_notify, how long to wait for the peer's before closing TCP anyway
    #: (also the bound on delivering the GOAWAY that ends a connection after an error)
    close_notify_wait: float = attr.ib(default=1.0)
    #: a TLS handshake that has not completed by then is aborted
    handshake_timeout: float = attr.ib(default=10.0)
    #: a server connection that opens no stream for this long is closed
    idle_timeout: float = attr.ib(default=60.0)
    #: control frames (PING/SETTINGS ACKs, resets, ...) written while the peer does
    #: not read, before the connection counts as a flood
    max_unread_control_bytes: int = attr.ib(default=1 * MiB)
    #: streams the peer may reset per second before it counts as a rapid-reset flood
    max_peer_resets_per_second: int = attr.ib(default=200)
    #: PING and SETTINGS frames (each makes us write an ACK) the peer may send per second,
    #: read or not, before it counts as a control-frame flood
    max_peer_control_frames_per_second: int = attr.ib(default=1000)

    def announced(self) -> dict[int, int]:
        """The SETTINGS frame we send."""
        return {
            SettingCodes.INITIAL_WINDOW_SIZE: self.stream_window,
            SettingCodes.MAX_FRAME_SIZE: self.max_frame_size,
            SettingCodes.MAX_CONCURRENT_STREAMS: self.max_concurrent_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: self.max_header_list_size,
            SettingCodes.ENABLE_PUSH: 0,
        }

    @classmethod
    def server(cls, **overrides) -> H2Settings:
        return cls(**overrides)

    @classmethod
    def client(cls, **overrides) -> H2Settings:
        overrides.setdefault("max_header_list_size", 16 * KiB)
        overrides.setdefault("max_concurrent_streams", 100)
        return cls(**overrides)


class TunnelError(Exception):
    """A CONNECT stream did not open."""


class TunnelRefused(TunnelError):
    """The server answered the CONNECT with a status other than 200."""

    def __init__(self, status: int):
        super().__init__(f"CONNECT answered with HTTP status {status}")
        self.status = status


class StreamRefused(TunnelError):
    """The server did not process the stream (GOAWAY or REFUSED_STREAM): safe to retry."""


class ConnectionGone(TunnelError):
    """The HTTP/2 connection ended before the tunnel opened."""
