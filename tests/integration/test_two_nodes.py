"""Two real twistd ztunnel processes on loopback, apps talking through SOCKS5 and HBONE."""

from __future__ import annotations

import os
import socket
import threading

from tests.integration.conftest import CLIENT_IP, SERVER_IP
from tests.support import recv_all
from ztwisted.tools.harness import socks5_connect


def test_echo_through_service_hostname_is_byte_exact(two_nodes):
    payload = os.urandom(300_000)
    sock = socks5_connect(two_nodes.a.socks5, CLIENT_IP, "echo.default.svc.cluster.local", 80)
    with sock:
        threading.Thread(target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR)), daemon=True).start()
        assert recv_all(sock) == payload
    dump = two_nodes.a.config_dump()
    assert [entry["destination"] for entry in dump["pool"]] == [f"{SERVER_IP}:15008"]
