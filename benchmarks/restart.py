"""Restart without loss, under load, many times: node-b (the server side), then node-a (SOCKS5).

    python benchmarks/restart.py [--rounds 20] [--net 72] [--json FILE]

Two real ``twistd ztunnel`` nodes on loopback (127.<net>.0.0/16). Three
clients keep opening short SOCKS5 connections through node-a to the echo
workload behind node-b, each a byte-exact echo of 1-64 KB, and in each round
one long tunnel streams data continuously. A round starts a second process
of the node under test (same config, state dir and ports: SO_REUSEPORT),
waits until it is ready, sends SIGTERM to the first, keeps the load going for
1.5 s, ends the long tunnel (its echo is checked by hash) and waits for the
old process to exit. The report counts the connections made and failed and
the bytes verified. Any failure makes the exit status 1.

Run it as root if you can: the proxy then sets ``net.ipv4.tcp_migrate_req=1``
so connections waiting in the old listener's accept queue move to the new one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="restarts of each node (default 20)")
    parser.add_argument(
        "--net",
        type=int,
        default=int(os.environ.get("ZTWISTED_TEST_NET", "72")),
        help="use addresses in 127.NET.0.0/16 (default: $ZTWISTED_TEST_NET or 72)",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()

    # The test support reads the address block when it is imported.
    os.environ["ZTWISTED_TEST_NET"] = str(args.net)
    sys.path.insert(0, str(REPO))
    from tests.integration.conftest import SERVER_IP
    from tests.integration.drain_support import Nodes
    from tests.support import EchoServer

    results = {}
    echo = EchoServer(SERVER_IP, 8080)
    try:
        for side in ("node-b", "node-a"):
            with tempfile.TemporaryDirectory(prefix="ztwisted-restart-") as workdir:
                nodes = Nodes(Path(workdir)).start()
                try:
                    started = time.monotonic()
                    result = _restart(nodes, side, args.rounds)
                    results[side] = _summary(result, args.rounds, time.monotonic() - started)
                finally:
                    nodes.stop()
            _print(side, results[side])
    finally:
        echo.close()

    migrate = Path("/proc/sys/net/ipv4/tcp_migrate_req")
    report = {
        "rounds": args.rounds,
        "tcp_migrate_req": migrate.read_text().strip() if migrate.exists() else "absent",
        "results": results,
    }
    print(f"net.ipv4.tcp_migrate_req = {report['tcp_migrate_req']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    lost = sum(r["connections_failed"] + r["long_tunnels"] - r["long_tunnels_exact"] for r in results.values())
    return 1 if lost else 0


def _restart(nodes, side: str, rounds: int):
    from tests.integration.conftest import CLIENT_IP
    from tests.integration.drain_support import restart_under_load

    def successor(round_number: int):
        make = nodes.node_b if side == "node-b" else nodes.node_a
        process = make(workdir=f"{side}-{round_number + 1}")
        nodes.extra.append(process)
        return process

    current = nodes.b if side == "node-b" else nodes.a
    current, result = restart_under_load(current, successor, lambda: nodes.a.socks5, CLIENT_IP, rounds=rounds)
    if side == "node-b":
        nodes.b = current
    else:
        nodes.a = current
    return result


def _summary(result, rounds: int, seconds: float) -> dict:
    return {
        "restarts": len(result.old_exit_statuses),
        "connections_made": result.connections_made,
        "connections_failed": result.connections_failed,
        "bytes_verified": result.bytes_verified,
        "long_tunnels": result.long_tunnels,
        "long_tunnels_exact": result.long_tunnels_exact,
        "long_tunnel_bytes_verified": result.long_tunnel_bytes,
        "old_exit_statuses": sorted(set(result.old_exit_statuses)),
        "seconds": round(seconds, 1),
        "failures": result.failures[:10],
    }


def _print(side: str, summary: dict) -> None:
    print(f"restarting {side}: {summary['restarts']} restarts in {summary['seconds']} s")
    print(
        f"  short connections: {summary['connections_made']} made, {summary['connections_failed']} failed, "
        f"{summary['bytes_verified'] / 1e6:.1f} MB verified"
    )
    print(
        f"  long tunnels: {summary['long_tunnels_exact']}/{summary['long_tunnels']} byte-exact, "
        f"{summary['long_tunnel_bytes_verified'] / 1e6:.1f} MB verified"
    )
    print(f"  old processes' exit statuses: {summary['old_exit_statuses']}")
    for failure in summary["failures"]:
        print(f"  failure: {failure}")


if __name__ == "__main__":
    sys.exit(main())
