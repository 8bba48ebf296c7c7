"""Benchmark clients: bulk transfer, short connections, ping-pong and connection setup.

A *target* is a JSON-able dict saying how an app reaches the echo or sink:
``{"connect": [host, port], "source_ip": ip}`` for plain TCP, plus
``"socks5": [ip, port]`` when the app goes through a SOCKS5 proxy (then
``connect`` is the destination asked of the proxy).

The short-connection test runs in worker processes
(``python benchmarks/load.py conns ...``) so that the client's Python is not
limited to one core by the GIL.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ztwisted.tools.harness import recv_exact, socks5_handshake

HEADER_SIZE = 8
MESSAGE = bytes(range(64))
CHUNK = 256 * 1024
TIMEOUT = 10.0
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux 4.2+


def open_connection(target: dict) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(TIMEOUT)
        # Leave from the workload's address, but let connect() pick the port by the whole
        # 4-tuple: a plain bind(ip, 0) must skip every port held by a TIME_WAIT socket on
        # that address, which costs ~70 µs with a few hundred of them and milliseconds
        # with the tens of thousands a short-connection run leaves behind.
        sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((target["source_ip"], 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if target.get("socks5"):
            sock.connect(tuple(target["socks5"]))
            socks5_handshake(sock, *target["connect"])
        else:
            sock.connect(tuple(target["connect"]))
    except BaseException:
        sock.close()
        raise
    return sock


def echo_once(sock: socket.socket) -> None:
    sock.sendall(MESSAGE)
    if recv_exact(sock, len(MESSAGE)) != MESSAGE:
        raise ConnectionError("echo returned different bytes")


def bulk(sink_target: dict, total_bytes: int) -> float:
    """Send ``total_bytes`` to the sink on one connection; MB/s (10^6 bytes) until it acknowledges all."""
    buffer = memoryview(bytes(CHUNK))
    with open_connection(sink_target) as sock:
        sock.settimeout(60)
        start = time.perf_counter()
        sock.sendall(total_bytes.to_bytes(HEADER_SIZE, "big"))
        remaining = total_bytes
        while remaining:
            n = min(remaining, CHUNK)
            sock.sendall(buffer[:n])
            remaining -= n
        acknowledged = int.from_bytes(recv_exact(sock, HEADER_SIZE), "big")
        elapsed = time.perf_counter() - start
    if acknowledged != total_bytes:
        raise ConnectionError(f"sink acknowledged {acknowledged} bytes, sent {total_bytes}")
    return total_bytes / elapsed / 1e6


def pingpong(echo_target: dict, count: int, warmup: int = 200) -> list[int]:
    """Round-trip times (ns) of ``count`` 64-byte echoes on one connection."""
    times = []
    with open_connection(echo_target) as sock:
        for _ in range(warmup):
            echo_once(sock)
        clock = time.perf_counter_ns
        for _ in range(count):
            start = clock()
            echo_once(sock)
            times.append(clock() - start)
    return times


def setup(echo_target: dict, count: int) -> tuple[list[int], list[int]]:
    """For ``count`` new connections, one after another: (ns until connected, ns until the first echo)."""
    connected, first_echo = [], []
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        sock = open_connection(echo_target)
        with sock:
            ready = clock()
            echo_once(sock)
            done = clock()
        connected.append(ready - start)
        first_echo.append(done - start)
    return connected, first_echo


# -- short connections -----------------------------------------------------------


def _short_connections_thread(target: dict, start_at: float, stop_at: float, result: dict) -> None:
    ok = errors = 0
    latencies = []
    first_error = None
    while time.time() < start_at:
        time.sleep(0.001)
    clock = time.perf_counter_ns
    while time.time() < stop_at:
        begin = clock()
        try:
            with open_connection(target) as sock:
                echo_once(sock)
        except OSError as e:
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            continue
        if time.time() <= stop_at:
            ok += 1
            latencies.append(clock() - begin)
    result.update(ok=ok, errors=errors, latencies=latencies, first_error=first_error)


def short_connections_worker(target: dict, start_at: float, duration: float, threads: int) -> dict:
    while time.time() < start_at:
        time.sleep(0.001)
    cpu_before = time.process_time()
    results = [{} for _ in range(threads)]
    workers = [
        threading.Thread(target=_short_connections_thread, args=(target, start_at, start_at + duration, r))
        for r in results
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {
        "ok": sum(r["ok"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "latencies": [x for r in results for x in r["latencies"]],
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "cpu_seconds": time.process_time() - cpu_before,
    }


def short_connections(echo_target: dict, duration: float, processes: int, threads: int, on_start=None) -> dict:
    """``processes`` x ``threads`` clients each open, echo 64 bytes, close, for ``duration`` s.

    All workers start at one wall-clock instant, set once every worker has
    started its interpreter and said so (on a busy machine that can take
    seconds), so the rate is the total count over ``duration``; ``on_start``
    is called at that instant.
    """
    command = [sys.executable, str(Path(__file__)), "conns", json.dumps(echo_target), repr(duration), str(threads)]
    children = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(processes)]
    for child in children:
        if child.stdout.readline().strip() != b"ready":
            raise RuntimeError("short-connection worker failed to start")
    start_at = time.time() + 0.1
    for child in children:
        child.stdin.write(f"{start_at!r}\n".encode())
        child.stdin.close()
    while time.time() < start_at:
        time.sleep(0.001)
    if on_start is not None:
        on_start()
    outputs = []
    for child in children:
        out = child.stdout.read()
        child.wait(timeout=duration + 60)
        if child.returncode != 0:
            raise RuntimeError(f"short-connection worker failed with exit code {child.returncode}")
        outputs.append(json.loads(out))
    ok = sum(o["ok"] for o in outputs)
    latencies = sorted(x for o in outputs for x in o["latencies"])
    return {
        "per_second": ok / duration,
        "ok": ok,
        "errors": sum(o["errors"] for o in outputs),
        "first_error": next((o["first_error"] for o in outputs if o["first_error"]), None),
        "latency_p50_us": percentile(latencies, 50) / 1e3 if latencies else None,
        "client_cpu_seconds": sum(o["cpu_seconds"] for o in outputs),
    }


def percentile(sorted_values: list, p: float):
    if not sorted_values:
        raise ValueError("no samples")
    # Nearest rank: the smallest sample with at least p % of samples at or below it.
    index = max(0, math.ceil(p / 100 * len(sorted_values)) - 1)
    return sorted_values[index]


if __name__ == "__main__":
    if sys.argv[1:2] != ["conns"] or len(sys.argv) != 5:
        sys.exit("usage: load.py conns TARGET_JSON DURATION THREADS  (then the start time on stdin)")
    print("ready", flush=True)
    start = float(sys.stdin.readline())
    result = short_connections_worker(json.loads(sys.argv[2]), start, float(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(result))
