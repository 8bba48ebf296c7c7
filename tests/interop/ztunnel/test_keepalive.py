"""HTTP/2 keepalive between ztwisted and real ztunnel: a frozen peer (SIGSTOP) is found out by PING.

A frozen process's kernel still acknowledges TCP, so only an unanswered
HTTP/2 PING shows the connection is dead. Each test keeps two HBONE
connections open between the proxies, one each way (a tunnel in flight from
each proxy's client app to the other proxy's app), freezes one proxy and
waits for the other to give up on both.

ztwisted: PING after ``--keepalive-interval`` without frames, close when it is
not answered within ``--keepalive-timeout`` (1 s and 2 s here). ztunnel:
fixed, a PING 10 s after the connection starts and 10 s after each answer,
close when one is not answered within 20 s (``src/proxy/h2.rs``), so it finds
a frozen peer within 30 s.
"""

from __future__ import annotations

import signal
import time

from tests.interop.ztunnel.support import (
    APP_PORT,
    ECHO_IP,
    ZPOD_IP,
    ZTUNNEL_TEST_MARKS,
    ended_by,
    through_ztunnel,
    through_ztwisted,
)
from tests.support import wait_until

pytestmark = ZTUNNEL_TEST_MARKS

ZTWISTED_INTERVAL, ZTWISTED_TIMEOUT = 1.0, 2.0
ZTUNNEL_INTERVAL, ZTUNNEL_TIMEOUT = 10.0, 20.0
# Detection must come within interval + timeout; the margin is for this shared machine's load.
MARGIN = 10.0
# ztunnel logs every HTTP/2 frame it receives.
H2_FRAMES_LOGGED = {"RUST_LOG": "info,h2::codec::framed_read=debug"}


def tunnels_both_ways(network):
    """A tunnel in flight each way: ztunnel's app to echo, ztwisted's app to zpod."""
    from_ztunnel = through_ztunnel(network, ECHO_IP, APP_PORT)
    from_ztwisted = through_ztwisted(network, ZPOD_IP, APP_PORT)
    echo_on(from_ztunnel, from_ztwisted)
    return from_ztunnel, from_ztwisted


def echo_on(*sockets) -> None:
    for sock in sockets:
        sock.settimeout(10)
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"


def pings_received(ztunnel, ack: bool) -> int:
    """PING frames ztunnel's h2 logged as received: PINGs (``ack=False``) or answers to its own."""
    return len(ztunnel.log_lines("received", "Ping", f"ack: {str(ack).lower()}"))


def test_ztwisted_finds_a_frozen_ztunnel(network, start_ztunnel, start_ztwisted):
    ztunnel = start_ztunnel(env=H2_FRAMES_LOGGED)
    ztwisted = start_ztwisted(
        "--keepalive-interval", str(ZTWISTED_INTERVAL), "--keepalive-timeout", str(ZTWISTED_TIMEOUT)
    )
    from_ztunnel, from_ztwisted = tunnels_both_ways(network)
    # Idle past ztwisted's interval: ztunnel answers its PINGs, and the tunnels live on.
    wait_until(lambda: pings_received(ztunnel, ack=False) >= 4, 10 * ZTWISTED_INTERVAL, "ztwisted's PINGs at ztunnel")
    echo_on(from_ztunnel, from_ztwisted)
    assert ztwisted.metric("ztwisted_hbone_connections_closed_total", ended_by="keepalive-timeout") == 0

    ztunnel.freeze()
    frozen_at = time.monotonic()
    try:

        def closed_by_keepalive(direction):
            return ztwisted.metric(
                "ztwisted_hbone_connections_closed_total", direction=direction, ended_by="keepalive-timeout"
            )

        wait_until(
            lambda: closed_by_keepalive("outbound") and closed_by_keepalive("inbound"),
            ZTWISTED_INTERVAL + ZTWISTED_TIMEOUT + MARGIN,
            "ztwisted closing both connections to the frozen ztunnel",
        )
        detected_after = time.monotonic() - frozen_at
        # ztwisted's app learns at once: its tunnel ends.
        _, how = ended_by(from_ztwisted, timeout=5)
        assert how in ("eof", "ConnectionResetError")
    finally:
        ztunnel.thaw()
    print(f"ztwisted found the frozen ztunnel after {detected_after:.1f} s (its app's tunnel ended by {how})")
    assert closed_by_keepalive("outbound") == 1 and closed_by_keepalive("inbound") == 1
    from_ztunnel.close()
    from_ztwisted.close()


def test_ztunnel_finds_a_frozen_ztwisted(network, start_ztunnel, start_ztwisted):
    ztunnel = start_ztunnel(env=H2_FRAMES_LOGGED)
    ztwisted = start_ztwisted()
    from_ztunnel, from_ztwisted = tunnels_both_ways(network)
    # Idle past ztunnel's interval: ztwisted answers its PINGs on both connections, the tunnels live on.
    wait_until(
        lambda: pings_received(ztunnel, ack=True) >= 2,
        ZTUNNEL_INTERVAL + MARGIN,
        "ztwisted's answers to ztunnel's PINGs",
    )
    echo_on(from_ztunnel, from_ztwisted)

    ztwisted.process.send_signal(signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        # ztunnel's client app: its tunnel over ztunnel's pooled connection ends.
        _, client_side = ended_by(from_ztunnel, timeout=ZTUNNEL_INTERVAL + ZTUNNEL_TIMEOUT + MARGIN)
        client_detected_after = time.monotonic() - frozen_at
        # zpod's app behind ztunnel's inbound: the tunnel from ztwisted ends too.
        wait_until(
            lambda: network.zpod_echo.outcomes,
            ZTUNNEL_INTERVAL + ZTUNNEL_TIMEOUT + MARGIN,
            "ztunnel ending the inbound tunnel from the frozen ztwisted",
        )
        server_detected_after = time.monotonic() - frozen_at
    finally:
        ztwisted.process.send_signal(signal.SIGCONT)
    print(
        f"ztunnel found the frozen ztwisted after {client_detected_after:.1f} s (client side, app saw "
        f"{client_side}) and {server_detected_after:.1f} s (server side, app saw {network.zpod_echo.outcomes})"
    )
    assert client_detected_after > ZTUNNEL_INTERVAL, "something other than ztunnel's PING ended the tunnel"
    assert client_side in ("eof", "ConnectionResetError")
    from_ztunnel.close()
    from_ztwisted.close()
