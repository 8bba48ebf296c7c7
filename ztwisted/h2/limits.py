"""The limits an HBONE connection holds its (untrusted, even if authenticated) peer to."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import h2.exceptions

from ztwisted.h2.goaway import FrameLimitExceeded
from ztwisted.h2.settings import H2Settings


@attrs.define
class PerSecond:
    """Counts events in one-second windows against a limit."""

    limit: int
    _window_start: float = 0.0
    _count: int = 0

    def exceeded(self, now: float) -> bool:
        """Count one event at ``now``; whether its window now holds more than ``limit``."""
        if now - self._window_start >= 1.0:
            self._window_start = now
            self._count = 0
        self._count += 1
        return self._count > self.limit


@attrs.define
class FloodGuard:
    """Detects a peer that makes us write without reading, or resets streams too fast.

    ``on_flood(kind, detail)`` is called for each limit broken; the connection closes.
    """

    settings: H2Settings
    clock: object
    on_flood: Callable[[str, str], None]
    _resets: PerSecond = attrs.field(init=False)
    _control_frames: PerSecond = attrs.field(init=False)
    _unread_control_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        self._resets = PerSecond(self.settings.max_peer_resets_per_second)
        self._control_frames = PerSecond(self.settings.max_peer_control_frames_per_second)

    def peer_reset(self) -> None:
        if self._resets.exceeded(self.clock.seconds()):
            self.on_flood(
                "rapid-reset", f"more than {self.settings.max_peer_resets_per_second} stream resets in a second"
            )

    def peer_control_frame(self, what: str) -> None:
        # The unread-bytes bound only works once the transport pauses, which a peer
        # with large socket buffers delays for seconds of full CPU; a rate does not wait.
        if self._control_frames.exceeded(self.clock.seconds()):
            limit = self.settings.max_peer_control_frames_per_second
            self.on_flood("control-frame", f"more than {limit} PING and SETTINGS frames in a second (last: {what})")

    def unread_control_bytes(self, size: int) -> bool:
        """Count control bytes written while the peer does not read; whether that is a flood."""
        # Stream data is never written while paused: this is control traffic
        # the peer provokes but does not read.
        self._unread_control_bytes += size
        if self._unread_control_bytes > self.settings.max_unread_control_bytes:
            self.on_flood("control-frame", f"{self._unread_control_bytes} bytes of control frames unread")
            return True
        return False

    def peer_reads_again(self) -> None:
        self._unread_control_bytes = 0


def limit_kind(exc: Exception) -> str:
    """The ``ztwisted_hbone_limit_hits_total`` kind of a connection error."""
    if isinstance(exc, FrameLimitExceeded):
        return exc.kind
    if isinstance(exc, h2.exceptions.TooManyStreamsError):
        return "max-concurrent-streams"
    if (
        isinstance(exc, h2.exceptions.DenialOfServiceError)
        or "header" in str(exc).lower()
        and "size" in str(exc).lower()
    ):
        return "header-list-size"
    return "protocol-error"
