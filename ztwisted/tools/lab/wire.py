"""Node A's HBONE connections as the kernel sees them, from inside the client pods' network namespaces.

In netns mode an in-pod proxy (ztwisted or ztunnel) opens its outbound
HBONE connections from the client pod's namespace, so that namespace's TCP
table (``/proc/thread-self/net/tcp`` read by a thread that entered it) lists
them: this works for a proxy the lab cannot ask, such as ztunnel, whose
``/metrics`` and ``/config_dump`` have no pool. One thread per namespace
reads the table every ``interval`` seconds and keeps, per destination pod:

- the connections open now (``ESTABLISHED``, or ``CLOSE_WAIT``: the peer
  closed, the proxy has not yet), which is what the pool holds;
- every connection seen so far, by its 4-tuple, with when it was first and
  last seen and whether it was ever established (a connect to a vanished
  pod stays in ``SYN_SENT``): a connection that opened and closed between
  two reads is missed, so counts of openings are a lower bound.
"""

from __future__ import annotations

import socket
import struct
import threading

from ztwisted.netns import enter_netns
from ztwisted.tools.workers import Workers

ESTABLISHED, SYN_SENT, CLOSE_WAIT = 0x01, 0x02, 0x08
HELD = (ESTABLISHED, CLOSE_WAIT)
WATCHED = (*HELD, SYN_SENT)


def _ipv4(hex_address: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(hex_address, 16)))


def tcp_table(text: str) -> list[tuple[str, int, str, int, int]]:
    """``/proc/net/tcp`` -> ``[(local ip, local port, remote ip, remote port, state)]``."""
    rows = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4:
            continue
        local, remote, state = fields[1], fields[2], int(fields[3], 16)
        local_ip, local_port = local.split(":")
        remote_ip, remote_port = remote.split(":")
        rows.append((_ipv4(local_ip), int(local_port, 16), _ipv4(remote_ip), int(remote_port, 16), state))
    return rows


class WireWatch:
    """Watches TCP connections from the given namespaces to ``destinations`` (``{ip: name}``) on ``port``."""

    def __init__(
        self, clock, namespaces: list[str], destinations: dict[str, str], *, port: int = 15008, interval: float = 0.1
    ):
        self.clock = clock
        self.namespaces = namespaces
        self.destinations = destinations
        self.port = port
        self.interval = interval
        self._now: dict[str, dict[str, int]] = {path: {} for path in namespaces}
        self._read_at: dict[str, float] = {}
        #: 4-tuple -> {"destination", "first_seen", "last_seen"}
        self.connections: dict[tuple, dict] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._workers = Workers()

    def start(self) -> WireWatch:
        for i, path in enumerate(self.namespaces):
            self._workers.spawn(self._watch, path, name=f"lab-wire-{i}")
        return self

    def stop(self) -> None:
        self._workers.stop(5)

    def open_now(self) -> tuple[float | None, dict[str, int]]:
        """(when the oldest of the latest reads was made, connections held then per destination name).

        The time is that of the reads, not of this call: a sample must not
        claim to be newer than what it saw.
        """
        counts = dict.fromkeys(self.destinations.values(), 0)
        with self._lock:
            for per_namespace in self._now.values():
                for name, count in per_namespace.items():
                    counts[name] += count
            read_at = min(self._read_at.values()) if len(self._read_at) == len(self.namespaces) else None
        return read_at, counts

    def opened_since(self, t: float, *, attempts: bool = False) -> dict[str, int]:
        """Connections first seen at or after ``t`` that were established (or, with ``attempts``, all)."""
        counts = dict.fromkeys(self.destinations.values(), 0)
        with self._lock:
            for seen in self.connections.values():
                if seen["first_seen"] >= t and (attempts or seen["established"]):
                    counts[seen["destination"]] += 1
        return counts

    def _watch(self, path: str) -> None:
        try:
            enter_netns(path)
        except OSError as e:
            self.errors.append(f"cannot enter {path}: {e}")
            return
        while not self._workers.stopping.is_set():
            t = round(self.clock(), 4)
            try:
                with open("/proc/thread-self/net/tcp") as f:
                    rows = tcp_table(f.read())
            except OSError as e:
                if len(self.errors) < 20:
                    self.errors.append(f"{path}: {e}")
                rows = []
            held: dict[str, int] = {}
            with self._lock:
                for local_ip, local_port, remote_ip, remote_port, state in rows:
                    name = self.destinations.get(remote_ip)
                    if name is None or remote_port != self.port or state not in WATCHED:
                        continue
                    key = (path, local_ip, local_port, remote_ip, remote_port)
                    seen = self.connections.setdefault(
                        key, {"destination": name, "first_seen": t, "established": False}
                    )
                    seen["last_seen"] = t
                    if state in HELD:
                        held[name] = held.get(name, 0) + 1
                        seen["established"] = True
                self._now[path] = held
                self._read_at[path] = t
            self._workers.stopping.wait(self.interval)
