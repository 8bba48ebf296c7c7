"""A TCP relay from inside a network namespace to the host, for the drain lab."""

from __future__ import annotations

import socket
import threading

from ztwisted.netns import call_in_netns


class Relay:
    """Carries TCP connections made to ``address`` inside a namespace to the same address in the lab's own.

    ztunnel as node A runs in a namespace of its own, the lab control plane on
    the host's loopback: the relay listens at the control plane's address in
    ztunnel's namespace (its loopback has all of 127/8) and connects from the
    host. TLS passes through untouched, end to end.
    """

    def __init__(self, netns_path: str, address: tuple[str, int]):
        self.netns_path = netns_path
        self.address = address
        self.listener: socket.socket | None = None
        self.sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> Relay:
        # A socket stays in the namespace it was made in; the accepting thread (made here) is in the host's.
        self.listener = call_in_netns(self.netns_path, lambda: socket.create_server(self.address))
        threading.Thread(target=self._accept, name="lab-relay", daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:
                return  # stopped
            try:
                outside = socket.create_connection(self.address, timeout=5)
            except OSError:
                inside.close()
                continue
            outside.settimeout(None)
            with self._lock:
                self.sockets += [inside, outside]
            for source, target in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(source, target), name="lab-relay-pump", daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        try:
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()
        with self._lock:
            for sock in self.sockets:
                sock.close()
            self.sockets.clear()
