"""Each built-in drain strategy on real twistd processes, seen from the peer's side of the wire.

An :class:`~tests.integration.drain_support.HbonePeer` (TLS 1.3 with a
client certificate of the nodes' dev CA, HTTP/2) opens CONNECT tunnels to
node-b's workloads and records every GOAWAY, PING, RST_STREAM and END_STREAM
it receives and how the TLS connection ended (close_notify or not). node-a
plays the pooling client where the pool matters. Timings are checked as
orderings and generous bounds only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.integration.conftest import CLIENT_IP, SERVER_IP, SINK_IP, TWO_NODE_MESH
from tests.integration.drain_support import (
    CANCEL,
    ECHO_HOST,
    MAX_STREAM_ID,
    LongTunnel,
    Nodes,
    Peers,
    TimedRequest,
    config_without_workload,
    finish_tunnel,
    send_signal,
    tunnel_in_flight,
    wait_exit,
)
from tests.support import can_connect, echo_through, wait_until
from ztwisted.tools.harness import socks5_connect, twistd_command

pytestmark = pytest.mark.integration

ECHO = f"{SERVER_IP}:8080"
SINK = f"{SINK_IP}:8080"
BUILT_IN = ("client-evict", "goaway-on-start", "gradual", "immediate", "last-mile")


@pytest.fixture
def nodes(tmp_path, echo_app, sink_app):
    """Starts node-b (and node-a) with the given drain options; stops them after the test."""
    started: list[Nodes] = []

    def start(*, a_args=(), b_args=(), with_a: bool = True) -> Nodes:
        pair = Nodes(tmp_path, a_args=tuple(a_args), b_args=tuple(b_args))
        started.append(pair)
        return pair.start(a=with_a)

    yield start
    for pair in started:
        pair.stop()


@pytest.fixture
def peers(tmp_path):
    made = Peers(tmp_path / "peers")
    yield made
    made.close()


def through_node_a(nodes: Nodes, size: int = 32 * 1024) -> None:
    payload = os.urandom(size)
    with socks5_connect(nodes.a.socks5, CLIENT_IP, ECHO_HOST, 80) as sock:
        assert echo_through(sock, payload, timeout=10) == payload


def kinds(peer) -> list[str]:
    return [
        event.kind
        for event in peer.events
        if event.kind in ("goaway", "rst_stream", "end_stream", "close_notify", "tls_eof", "tcp_reset")
    ]


# -- immediate -------------------------------------------------------------------------


def test_immediate_cuts_the_pod_off_without_goaway(nodes, peers):
    pair = nodes(b_args=("--drain-strategy", "immediate"), with_a=False)
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)

    delete = TimedRequest(pair.b, "/workloads/echo", "DELETE")
    status, body = delete.wait()

    assert status == 200, body
    assert delete.elapsed < 2.0, "the immediate strategy answers without waiting for streams"
    ending = peer.wait_closed(5)
    assert ending in ("tcp_reset", "tls_eof"), f"abrupt close expected, the peer saw {ending}"
    assert kinds(peer) == [ending], "no GOAWAY, no END_STREAM, no close_notify: only the abrupt end"
    assert tunnel.wait_finished(1).ended_cleanly is False
    tunnel.send(b"too late")
    assert not tunnel.byte_exact
    assert not can_connect(SERVER_IP), "the pod's HBONE listener is closed"
    assert pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by="abrupt") == 1


# -- goaway-on-start ---------------------------------------------------------------------


def test_goaway_on_start_lets_the_terminating_pod_serve(nodes, peers):
    pair = nodes(b_args=("--drain-strategy", "goaway-on-start"))
    through_node_a(pair)  # node-a now has a pooled connection to the pod
    opened_before = pair.a.metric("ztwisted_pool_connections_opened_total")
    assert opened_before == 1
    long_tunnel = LongTunnel(pair.a.socks5, CLIENT_IP).start()
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)

    terminating = TimedRequest(pair.b, "/workloads/echo/terminating", "POST")
    assert terminating.wait()[0] == 200

    first, second = peer.wait_for("goaway", 2)[:2]
    assert (first.last_stream_id, first.error_code) == (MAX_STREAM_ID, 0)
    assert (second.last_stream_id, second.error_code) == (tunnel.stream_id, 0)
    assert first.at <= second.at
    assert peer.of_kind("ping"), "the first GOAWAY is followed by a PING"
    assert finish_tunnel(tunnel).byte_exact, "the tunnel in flight finishes byte-exact"
    assert peer.wait_closed() == "close_notify"
    assert kinds(peer) == ["goaway", "goaway", "end_stream", "close_notify"]

    # The pod keeps serving: a new connection is accepted and carries a tunnel.
    newcomer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    assert finish_tunnel(tunnel_in_flight(newcomer, ECHO)).byte_exact
    assert newcomer.goaways() == []

    # node-a keeps sending while the pod terminates: the pool opens one new connection, not one per request.
    for _ in range(20):
        through_node_a(pair, size=4096)
    opened = pair.a.metric("ztwisted_pool_connections_opened_total") - opened_before
    assert 1 <= opened <= 2, f"node-a opened {opened} new connections for 20 requests"
    assert long_tunnel.finish(), "node-a's tunnel in flight on the old connection finishes byte-exact"
    wait_until(
        lambda: pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by="drained") >= 2,
        what="the peer's and node-a's old connections to end as drained",
    )
    assert pair.b.metric("ztwisted_drain_events_total", strategy="goaway-on-start", event="pod_terminating") == 1


# -- last-mile ------------------------------------------------------------------------------


def test_last_mile_acks_after_the_tunnel_in_flight_finished(nodes, peers):
    pair = nodes(b_args=("--drain-strategy", "last-mile", "--pod-drain-timeout", "5"), with_a=False)
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)

    delete = TimedRequest(pair.b, "/workloads/echo", "DELETE")
    peer.wait_for("goaway", 2, timeout=3)
    wait_until(lambda: not can_connect(SERVER_IP), 2, "the pod's listener to stop accepting")
    assert delete.answered_at is None, "the Ack waits for the tunnel in flight"
    time.sleep(max(0.0, delete.sent_at + 1.0 - time.monotonic()))
    assert delete.answered_at is None
    finish_tunnel(tunnel)
    status, body = delete.wait()

    assert status == 200, body
    assert tunnel.byte_exact
    assert [g.last_stream_id for g in peer.goaways()] == [MAX_STREAM_ID, tunnel.stream_id]
    assert peer.wait_closed() == "close_notify"
    (close_notify,) = peer.of_kind("close_notify")
    assert tunnel.ended_at <= close_notify.at < delete.answered_at
    assert delete.elapsed >= 0.9
    assert pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by="drained") == 1


def test_last_mile_resets_what_is_left_at_the_pod_drain_timeout(nodes, peers):
    pair = nodes(b_args=("--drain-strategy", "last-mile", "--pod-drain-timeout", "1.5"), with_a=False)
    peer = peers.connect(pair.b, SINK_IP, CLIENT_IP)
    tunnel = peer.open_tunnel(SINK)  # the sink never reads nor answers: this tunnel does not end
    assert tunnel.status == 200
    tunnel.send(b"x" * 1000)

    delete = TimedRequest(pair.b, "/workloads/sink", "DELETE")
    status, body = delete.wait()

    assert status == 200, body
    assert 1.2 <= delete.elapsed < 5.0, f"the Ack came after {delete.elapsed:.2f} s, not after about 1.5 s"
    tunnel.wait_finished(1)
    assert tunnel.reset_code == CANCEL
    (reset,) = peer.of_kind("rst_stream")
    assert reset.stream_id == tunnel.stream_id
    assert peer.wait_closed() == "close_notify"
    assert kinds(peer) == ["goaway", "goaway", "rst_stream", "close_notify"]
    assert reset.at - peer.goaways()[0].at >= 1.2
    assert pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by="drain-deadline") == 1


# -- client-evict --------------------------------------------------------------------------


def test_client_evict_retires_the_pooled_connection_to_a_removed_destination(nodes):
    pair = nodes(a_args=("--drain-strategy", "client-evict"))
    long_tunnel = LongTunnel(pair.a.socks5, CLIENT_IP).start()
    wait_until(lambda: long_tunnel.received > 0, what="the long tunnel to carry data")
    (entry,) = pair.a.config_dump()["pool"]
    assert (entry["destination"], entry["usable"], entry["streams"]) == (f"{SERVER_IP}:15008", True, 1)

    pair.a_config.write_text(config_without_workload(TWO_NODE_MESH, "echo"))
    wait_until(lambda: pair.a.metric("ztwisted_config_reloads_total") >= 1, what="node-a to reload")

    (entry,) = pair.a.config_dump()["pool"]
    assert (entry["usable"], entry["streams"]) == (False, 1), "retired: no new streams, the one in flight goes on"
    assert pair.a.metric("ztwisted_drain_events_total", strategy="client-evict", event="destination_removed") == 1
    time.sleep(0.5)
    assert pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound") == 0
    assert long_tunnel.finish(), "the tunnel in flight finishes byte-exact"

    wait_until(lambda: pair.a.config_dump()["pool"] == [], what="the retired connection to leave the pool")
    wait_until(
        lambda: pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound") == 1,
        what="node-b to see the connection end",
    )
    # "peer" on node-b: node-a closed with close_notify (a close without it counts as "lost").
    assert pair.b.metric("ztwisted_hbone_connections_closed_total", direction="inbound", ended_by="peer") == 1
    assert pair.a.metric("ztwisted_hbone_connections_closed_total", direction="outbound", ended_by="drained") == 1


# -- gradual ----------------------------------------------------------------------------------


def test_gradual_spreads_goaways_over_the_drain_window(nodes, peers):
    pair = nodes(b_args=("--drain-strategy", "gradual", "--drain-timeout", "4"), with_a=False)
    connections = [peers.connect(pair.b, SERVER_IP, CLIENT_IP) for _ in range(6)]
    tunnels = [tunnel_in_flight(peer, ECHO) for peer in connections]

    stopped_at = send_signal(pair.b, signal.SIGTERM)
    finished = []
    for peer, tunnel in zip(connections, tunnels, strict=True):
        peer.wait_for("goaway", timeout=5)  # then the tunnel in flight carries more and ends
        finished.append(finish_tunnel(tunnel))
    status = wait_exit(pair.b, 10)

    arrivals = sorted(peer.goaways()[0].at - stopped_at for peer in connections)
    assert arrivals[-1] - arrivals[0] >= 1.0, (
        f"GOAWAYs all arrived within {arrivals[-1] - arrivals[0]:.3f} s: {arrivals}"
    )
    assert arrivals[-1] < 4.0, "every GOAWAY goes out within the drain window"
    assert all(tunnel.byte_exact for tunnel in finished)
    assert all(peer.wait_closed() == "close_notify" for peer in connections)
    assert status == -signal.SIGTERM


# -- proxy stopping (the default strategy) ---------------------------------------------------------


def test_sigterm_drains_the_tunnel_in_flight_then_exits(nodes, peers):
    pair = nodes(b_args=("--drain-timeout", "10"), with_a=False)
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)

    stopped_at = send_signal(pair.b, signal.SIGTERM)
    peer.wait_for("goaway", 2, timeout=3)
    assert pair.b.process.poll() is None, "the process waits for the tunnel in flight"
    assert finish_tunnel(tunnel).byte_exact
    assert peer.wait_closed() == "close_notify"
    status = wait_exit(pair.b, 5)

    assert time.monotonic() - stopped_at < 8, "it exits once drained, not at the deadline"
    # twistd re-raises the signal that stopped the reactor (app._exitWithSignal): "killed by SIGTERM".
    assert status == -signal.SIGTERM


def test_a_second_sigterm_during_the_drain_stops_at_once(nodes, peers):
    pair = nodes(b_args=("--drain-timeout", "30"), with_a=False)
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)  # never ends on its own

    send_signal(pair.b, signal.SIGTERM)
    peer.wait_for("goaway", timeout=3)
    time.sleep(0.3)
    assert pair.b.process.poll() is None
    second = send_signal(pair.b, signal.SIGTERM)
    wait_exit(pair.b, 5)

    assert time.monotonic() - second < 5, "well before the 30 s drain deadline"
    assert peer.wait_closed(3) in ("tcp_reset", "tls_eof"), "aborted, no close_notify"
    assert not tunnel.ended_cleanly


def test_quitquitquit_drains_like_sigterm(nodes, peers):
    pair = nodes(b_args=("--drain-timeout", "10"), with_a=False)
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)

    assert pair.b.http("admin", "/quitquitquit", "POST")[0] == 200
    peer.wait_for("goaway", 2, timeout=3)
    assert pair.b.process.poll() is None, "the process waits for the tunnel in flight"
    assert finish_tunnel(tunnel).byte_exact
    assert peer.wait_closed() == "close_notify"
    # No signal stopped it: twistd exits normally.
    assert wait_exit(pair.b, 5) == 0


# -- composition and the command line ------------------------------------------------------------


def test_composed_strategies_each_receive_the_event(nodes, peers):
    pair = nodes(b_args=("--drain-strategy", "client-evict,last-mile", "--pod-drain-timeout", "5"), with_a=False)
    peer = peers.connect(pair.b, SERVER_IP, CLIENT_IP)
    tunnel = tunnel_in_flight(peer, ECHO)

    delete = TimedRequest(pair.b, "/workloads/echo", "DELETE")
    peer.wait_for("goaway", 2, timeout=3)
    finish_tunnel(tunnel)
    assert delete.wait()[0] == 200

    assert tunnel.byte_exact and peer.wait_closed() == "close_notify", "last-mile acted"
    for strategy in ("client-evict", "last-mile"):
        assert pair.b.metric("ztwisted_drain_events_total", strategy=strategy, event="pod_removed") == 1
    assert pair.b.metric("ztwisted_drain_events_total", strategy="immediate") == 0


def run_twistd(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        twistd_command() + ["ztunnel", "--state-dir", str(tmp_path / "state"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_drain_strategy_help_lists_the_built_ins(tmp_path):
    done = run_twistd(tmp_path, "--drain-strategy", "help")
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert set(BUILT_IN) <= set(listed)


def test_unknown_drain_strategy_fails_with_the_list(tmp_path):
    done = run_twistd(tmp_path, "--drain-strategy", "last-mile,no-such-thing")
    assert done.returncode != 0
    assert "unknown drain strategy no-such-thing" in done.stderr
    assert "installed: " + ", ".join(BUILT_IN) in done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert done.stdout == "", "the error alone, without twistd's usage text"
