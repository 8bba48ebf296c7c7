"""What a client with a valid mesh certificate cannot make node-b do: reach the proxy's own
ports through a tunnel, or write the source address of its access log."""

from __future__ import annotations

import pytest
from hyperframe.frame import HeadersFrame

from tests.integration.conftest import CLIENT_IP, SERVER_IP
from tests.integration.raw_h2 import RawClient, client_context
from tests.support import wait_until

pytestmark = pytest.mark.integration


def connect_status(client: RawClient, authority: str, *extra: tuple[str, str]) -> str:
    """Send a CONNECT to ``authority``; the :status of the answer."""
    stream_id, headers = client.headers_frames([(":method", "CONNECT"), (":authority", authority), *extra])
    client.sock.sendall(headers)
    while True:
        frame = client.read_frame()
        if isinstance(frame, HeadersFrame):
            answer = dict(client.decoder.decode(frame.data))
            if frame.stream_id == stream_id:
                return answer[":status"]


def inbound_access_events(node) -> list[dict]:
    return [e for e in node.log_events() if e.get("scope") == "access" and e.get("direction") == "inbound"]


def test_connect_to_the_proxys_own_ports_is_refused_like_ztunnel(two_nodes, tmp_path):
    """A nested tunnel through node-b's own 15008 would reach the app from node-b's address."""
    client = RawClient(client_context(two_nodes, tmp_path))
    try:
        assert connect_status(client, f"{SERVER_IP}:15008") == "503"
        assert connect_status(client, f"{SERVER_IP}:15006") == "503"
        assert connect_status(client, f"{SERVER_IP}:8080") == "200"  # the control
        events = wait_until(
            lambda: [e for e in inbound_access_events(two_nodes.b) if "error" in e] or None,
            what="node-b's access log of the refused calls",
        )
    finally:
        # Only now: closing ends the control tunnel too, "connection lost/reset" in the log,
        # which a slow first look at the log would otherwise find as well.
        client.close()
    assert [(e["dst.addr"], e["error"]) for e in events] == [
        (f"{SERVER_IP}:15008", "self-call: port 15008 is the proxy's own"),
        (f"{SERVER_IP}:15006", "self-call: port 15006 is the proxy's own"),
    ]


def test_access_log_source_is_the_connections_peer_not_the_forwarded_header(two_nodes, tmp_path):
    client = RawClient(client_context(two_nodes, tmp_path))
    try:
        real = "{}:{}".format(*client.sock.getsockname())
        assert real.startswith(f"{CLIENT_IP}:")
        assert connect_status(client, f"{SERVER_IP}:8080", ("forwarded", 'for="203.0.113.7:4444"')) == "200"
    finally:
        client.close()
    (event,) = wait_until(lambda: inbound_access_events(two_nodes.b), what="node-b's access log of the tunnel")
    assert event["src.addr"] == real
    assert event["src.forwarded"] == "203.0.113.7:4444"
