"""The server app of pods B1 and B2: answers lab requests with its name and the payload echoed.

Its exit is a well-behaved app's graceful shutdown (what an HTTP server does
on SIGTERM): stop accepting and close the listening socket, finish the
requests in flight, close idle keep-alive connections, and after
``finish_timeout`` reset whatever is still open.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

from ztwisted.tools.lab.protocol import FrameReader, ProtocolError, Response, encode_response, read_request

POLL = 0.02


class ServerApp:
    def __init__(self, name: str, ip: str, port: int, *, finish_timeout: float = 2.0):
        self.name = name
        self.address = (ip, port)
        self.finish_timeout = finish_timeout
        self.served = 0
        self.connections = 0
        self._exiting = threading.Event()
        self._lock = threading.Lock()
        self._open: dict[socket.socket, bool] = {}  # connection -> a request is in flight
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None

    def start(self) -> ServerApp:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(self.address)
        except OSError as e:
            listener.close()
            raise OSError(
                e.errno, f"server app {self.name} cannot listen on {self.address[0]}:{self.address[1]}: {e.strerror}"
            ) from None
        listener.listen(512)
        self._listener = listener
        self._accepting = threading.Thread(target=self._accept, name=f"{self.name}-accept", daemon=True)
        self._accepting.start()
        return self

    def exit(self) -> dict:
        """Graceful exit; returns what happened to the connections."""
        started = time.monotonic()
        self._exiting.set()
        if self._accepting is not None:
            self._accepting.join(1.0)
        with self._lock:
            in_flight = sum(1 for busy in self._open.values() if busy)
            idle = len(self._open) - in_flight
        deadline = started + self.finish_timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = list(self._open)
        for conn in left:
            _reset(conn)
        for thread in list(self._threads):
            thread.join(1.0)
        return {
            "in_flight_at_exit": in_flight,
            "idle_at_exit": idle,
            "reset_at_deadline": len(left),
            "took_s": round(time.monotonic() - started, 4),
        }

    def close(self) -> None:
        """End of the run: exit without waiting for anything."""
        self.finish_timeout = 0.0
        self.exit()

    # -- threads ----------------------------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        try:
            while not self._exiting.is_set():
                readable, _, _ = select.select([listener], [], [], POLL)
                if not readable:
                    continue
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._lock:
                    self._open[conn] = False
                    self.connections += 1
                thread = threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-conn", daemon=True)
                self._threads.append(thread)
                thread.start()
        finally:
            # Stop accepting: new connections to the address are refused from now on.
            listener.close()

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader(conn)
        conn.settimeout(10.0)
        try:
            while True:
                readable, _, _ = select.select([conn], [], [], POLL)
                if not readable:
                    if self._exiting.is_set():
                        return  # idle keep-alive connection: close it
                    continue
                with self._lock:
                    self._open[conn] = True
                request = read_request(reader)
                if request is None:
                    return
                time.sleep(request.think_ms / 1000)
                conn.sendall(encode_response(Response(request.request_id, self.name, request.payload)))
                with self._lock:
                    self.served += 1
                    self._open[conn] = False
                if self._exiting.is_set():
                    return  # like "Connection: close" on the last response
        except (OSError, ProtocolError):
            return
        finally:
            with self._lock:
                self._open.pop(conn, None)
            try:
                conn.close()
            except OSError:
                pass


def _reset(conn: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as the kernel does for a killed process's sockets."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    except OSError:
        pass
