"""Helpers shared by the integration and interop tests: apps that workloads run."""

from __future__ import annotations

import socket
import threading


class EchoServer:
    """A TCP echo app: echoes as it reads, half-closes after the client's FIN."""

    def __init__(self, ip: str, port: int = 8080):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(512)
        self.address = self.sock.getsockname()
        self.connections = 0
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket):
        with conn:
            try:
                while True:
                    data = conn.recv(262144)
                    if not data:
                        conn.shutdown(socket.SHUT_WR)
                        return
                    conn.sendall(data)
            except OSError:
                return

    def close(self):
        self.sock.close()


class SinkServer:
    """An app that accepts and never reads: the slow reader."""

    def __init__(self, ip: str, port: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            self.accepted.append(conn)

    def close(self):
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def recv_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        data = sock.recv(262144)
        if not data:
            return b"".join(chunks)
        chunks.append(data)
