"""ztwisted draining as the server while real ztunnel's pool has tunnels in flight, and the reverse.

For every built-in strategy and each drain event ztwisted can raise in
local-config mode (pod terminating, pod removed, proxy stopping with a
successor sharing its ports), ztunnel's client app has tunnels in flight
when the event starts. The tests check what must hold (in-flight tunnels
finish byte-exact where the strategy drains gracefully; ztunnel opens no new
tunnel on a connection after its GOAWAY) and pin what ztunnel's pool does
next: when it opens a new HBONE connection and whether later app connections
share it. The kernel counts the HBONE connections (SYNs on 15008 in
ztwisted's namespace); ztunnel's own log shows the HTTP/2 frames it received
(``RUST_LOG=h2::codec::framed_read=debug``). docs/interop.rst has the
findings.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading

import pytest

from tests.interop.conftest import describe_mismatch, recv_exact
from tests.interop.ztunnel.support import (
    APP_PORT,
    ECHO_IP,
    ZPOD_IP,
    ZTUNNEL_TEST_MARKS,
    ended_by,
    in_parallel,
    many,
    through_ztunnel,
    through_ztwisted,
)
from tests.support import echo_through, wait_until

pytestmark = ZTUNNEL_TEST_MARKS

STRATEGIES = ["immediate", "goaway-on-start", "last-mile", "client-evict", "gradual"]
IN_FLIGHT = 3
LATER_SEQUENTIAL = 4
LATER_CONCURRENT = 5
BURST = 5  # app connections at once, the first after a GOAWAY
PAYLOAD = 256 * 1024
HEAD = PAYLOAD // 4
# ztunnel logs every HTTP/2 frame it receives: the GOAWAYs (and PINGs) it got, in its own words.
H2_FRAMES_LOGGED = {"RUST_LOG": "info,h2::codec::framed_read=debug"}
ECHO_UID = "default/echo"
TIMEOUT = 30.0


class InFlight:
    """App connections through ztunnel with the first quarter of their payload echoed: tunnels in flight."""

    def __init__(self, connect, count: int = IN_FLIGHT):
        self.payloads = [os.urandom(PAYLOAD) for _ in range(count)]
        self.sockets = [connect() for _ in range(count)]
        self.heads = []
        for sock, payload in zip(self.sockets, self.payloads, strict=True):
            sock.settimeout(TIMEOUT)
            sock.sendall(payload[:HEAD])
            self.heads.append(recv_exact(sock, HEAD))

    def finish(self) -> list[str]:
        """Send the rest and half-close on each; "exact" where everything came back, else what happened."""
        results = []
        for sock, payload, head in zip(self.sockets, self.payloads, self.heads, strict=True):
            try:
                received = head + echo_through(sock, payload[HEAD:])
            except OSError as e:
                results.append(type(e).__name__)
                continue
            finally:
                sock.close()
            results.append("exact" if received == payload else describe_mismatch(received, payload))
        return results

    def how_they_ended(self) -> list[str]:
        """For tunnels that were cut: read until the end; "eof" or the error's name (data must be a prefix)."""
        endings = []
        for sock, payload in zip(self.sockets, self.payloads, strict=True):
            with sock:
                data, how = ended_by(sock, timeout=TIMEOUT)
            assert data == payload[HEAD : HEAD + len(data)], "bytes that were never sent"
            endings.append(how)
        return endings


def goaways(ztunnel) -> list[str]:
    """The GOAWAY frames ztunnel's h2 logged as received."""
    return ztunnel.log_lines("received", "GoAway")


def small_echo(sock: socket.socket) -> None:
    payload = os.urandom(16 * 1024)
    with sock:
        received = echo_through(sock, payload)
    assert received == payload, describe_mismatch(received, payload)


def later_connections(network, syns) -> dict:
    """Later app connections: one at a time, then several at once; the new HBONE connections each made."""
    before = syns.count()
    for _ in range(LATER_SEQUENTIAL):
        small_echo(through_ztunnel(network, ECHO_IP, APP_PORT))
    sequential = syns.count() - before
    before = syns.count()
    echo_at_once(network, LATER_CONCURRENT)
    return {"sequential": sequential, "concurrent": syns.count() - before}


def echo_at_once(network, count: int) -> None:
    """``count`` app connections through ztunnel opened at once, each echoing a little."""
    sockets = many(lambda: through_ztunnel(network, ECHO_IP, APP_PORT), count)
    failed = [r for r in in_parallel(lambda index: small_echo(sockets[index]), count) if r is not None]
    assert not failed, failed


def ztwisted_args(strategy: str) -> tuple[str, ...]:
    return ("--drain-strategy", strategy, "--drain-timeout", "10", "--pod-drain-timeout", "10")


def in_background(function) -> threading.Thread:
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = function()
        except BaseException as e:  # noqa: BLE001 - the caller checks
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.outcome = outcome
    thread.start()
    return thread


# -- pod terminating (POST /workloads/<uid>/terminating) ---------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pod_terminating_with_ztunnel_pool_in_flight(network, start_ztunnel, start_ztwisted, strategy):
    ztunnel = start_ztunnel(env=H2_FRAMES_LOGGED)
    ztwisted = start_ztwisted(*ztwisted_args(strategy))
    syns = network.ztw_syns
    in_flight = InFlight(lambda: through_ztunnel(network, ECHO_IP, APP_PORT))
    assert syns.count() == 1, "ztunnel's pool put the tunnels in flight on one connection"

    status, body = ztwisted.http("admin", f"/workloads/{ECHO_UID}/terminating", "POST")
    assert status == 200, body
    if strategy == "goaway-on-start":
        # Graceful: GOAWAY 2^31-1 and PING, then GOAWAY with the last stream id.
        wait_until(lambda: len(goaways(ztunnel)) >= 2, 10, "ztunnel receiving both GOAWAYs")
        assert syns.count() == 1, "ztunnel opened a connection on GOAWAY, before any app asked"
        # Honoured: app connections while the old tunnels are still open go on a new connection; a
        # burst of them opens just one (ztunnel's pool lets one connect per key, the others wait).
        echo_at_once(network, BURST)
        assert syns.count() == 2
    else:
        small_echo(through_ztunnel(network, ECHO_IP, APP_PORT))
        assert goaways(ztunnel) == [] and syns.count() == 1, "a strategy that ignores the event changed the pool"
    assert in_flight.finish() == ["exact"] * IN_FLIGHT
    # The terminating pod keeps serving; whatever its pool has now, later app connections share it.
    assert later_connections(network, syns) == {"sequential": 0, "concurrent": 0}


# -- pod removed (DELETE /workloads/<uid>) ------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pod_removed_with_ztunnel_pool_in_flight(network, start_ztunnel, start_ztwisted, strategy):
    ztunnel = start_ztunnel(env=H2_FRAMES_LOGGED)
    ztwisted = start_ztwisted(*ztwisted_args(strategy))
    in_flight = InFlight(lambda: through_ztunnel(network, ECHO_IP, APP_PORT))

    removal = in_background(lambda: ztwisted.http("admin", f"/workloads/{ECHO_UID}", "DELETE"))
    if strategy == "last-mile":
        # GOAWAY first, the removal waits for the tunnels in flight (up to --pod-drain-timeout).
        wait_until(lambda: len(goaways(ztunnel)) >= 1, 10, "ztunnel receiving the GOAWAY")
        assert in_flight.finish() == ["exact"] * IN_FLIGHT
    else:
        # The node aborts the pod's connections: no GOAWAY, the tunnels end where they were.
        removal.join(TIMEOUT)
        assert in_flight.how_they_ended() == ["eof"] * IN_FLIGHT
        assert goaways(ztunnel) == []
    removal.join(TIMEOUT)
    assert removal.outcome.get("result", (None,))[0] == 200, removal.outcome

    # The pod is gone: ztwisted no longer listens on its address. ztunnel's app still gets SOCKS5
    # success (ztunnel answers before connecting), then its connection is closed; ztunnel logs the
    # refused connect. (Bytes the app sent meanwhile turn the close into a reset.)
    failures = len(ztunnel.log_lines("connection complete", "error="))
    with through_ztunnel(network, ECHO_IP, APP_PORT) as sock:
        data, how = ended_by(sock)
    assert (data, how) == (b"", "eof")
    wait_until(
        lambda: len(ztunnel.log_lines("connection complete", "error=")) > failures,
        10,
        "ztunnel's access log of the failed connection",
    )


# -- proxy stopping: a successor shares the ports, the old node gets SIGTERM -------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_proxy_restart_with_ztunnel_pool_in_flight(network, start_ztunnel, start_ztwisted, strategy):
    ztunnel = start_ztunnel(env=H2_FRAMES_LOGGED)
    old = start_ztwisted(*ztwisted_args(strategy))
    syns = network.ztw_syns
    in_flight = InFlight(lambda: through_ztunnel(network, ECHO_IP, APP_PORT))
    successor = start_ztwisted(*ztwisted_args(strategy), name="ztwisted-successor")

    old.process.send_signal(signal.SIGTERM)
    wait_until(lambda: len(goaways(ztunnel)) >= 2, 10, "ztunnel receiving both GOAWAYs")
    assert syns.count() == 1, "ztunnel opened a connection on GOAWAY, before any app asked"
    # Honoured: app connections while the old tunnels are open go on one new connection (a burst
    # opens just one), which only the successor can have accepted (the old node stopped listening).
    echo_at_once(network, BURST)
    assert syns.count() == 2
    assert in_flight.finish() == ["exact"] * IN_FLIGHT
    try:
        status = old.process.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail("the old ztwisted did not exit after its last tunnel ended")
    assert status in (0, -signal.SIGTERM)
    assert later_connections(network, syns) == {"sequential": 0, "concurrent": 0}
    assert (
        successor.metric("istio_tcp_connections_opened_total", reporter="destination")
        == BURST + LATER_SEQUENTIAL + LATER_CONCURRENT
    )


# -- ztunnel draining as the server (SIGTERM) with ztwisted's pool in flight -----------------------------


def test_ztunnel_drain_with_ztwisted_pool_in_flight(network, start_ztunnel, start_ztwisted):
    ztunnel = start_ztunnel(env={"CONNECTION_TERMINATION_DEADLINE": "10s"})
    ztwisted = start_ztwisted()
    in_flight = InFlight(lambda: through_ztwisted(network, ZPOD_IP, APP_PORT))
    assert network.zt_syns.count() == 1

    stopping = in_background(lambda: ztunnel.stop(timeout=TIMEOUT))

    def goaways_at_ztwisted():
        return [e for e in ztwisted.log_events() if e.get("message", "").startswith("GOAWAY from ")]

    # RFC 9113's graceful sequence: GOAWAY 2^31-1, then GOAWAY with the last stream ztunnel took.
    received = wait_until(
        lambda: len(goaways_at_ztwisted()) >= 2 and goaways_at_ztwisted(),
        10,
        "ztwisted receiving ztunnel's two GOAWAYs",
    )
    assert [(e["last"], e["code"]) for e in received] == [(2**31 - 1, 0), (2 * IN_FLIGHT - 1, 0)]
    assert in_flight.finish() == ["exact"] * IN_FLIGHT
    stopping.join(TIMEOUT)
    assert stopping.outcome.get("result") == 0, stopping.outcome

    # ztwisted's pool never hands out the drained connection again: the next tunnel, to ztunnel's
    # successor, opens a new one.
    start_ztunnel(name="ztunnel-successor")
    small_echo(through_ztwisted(network, ZPOD_IP, APP_PORT))
    assert network.zt_syns.count() == 2
