"""Daemon threads that run until told to stop, stopped as one: the lab's watchers and apps, and test load.

Each thread's loop checks :attr:`Workers.stopping`, or waits on it to sleep
until its next step unless the stop comes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Workers:
    """The threads one object runs, and the event that tells them all to stop."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def spawn(self, target: Callable[..., None], *args, name: str | None = None) -> None:
        """Run ``target(*args)`` on a new daemon thread (a stuck one must not keep the process alive)."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self, timeout: float) -> None:
        """Tell every thread to stop, and wait up to ``timeout`` seconds for each to end."""
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout)
