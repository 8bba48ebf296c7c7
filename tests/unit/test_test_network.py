"""The suite's own loopback range: apart from the README's demo, and checked before a run."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

from tests.support import DEFAULT_TEST_NET, close_listener, listeners_in, listening_socket
from ztwisted.config import builtin_example_path, load_config
from ztwisted.tap import Options


def test_the_default_range_is_apart_from_the_demo():
    # What `twistd -n ztunnel` (no --config) and `python3 -m http.server --bind 127.0.3.1` hold.
    suite = ipaddress.ip_network(f"127.{DEFAULT_TEST_NET}.0.0/16")
    mesh = load_config(builtin_example_path())
    demo = [ip for w in mesh.workloads for ip in w.workload_ips] + [ip for s in mesh.services for _, ip in s.vips]
    defaults = Options()
    for option in ("socks5", "admin", "outbound", "metrics", "readiness"):
        interface = dict(part.split("=", 1) for part in defaults[option].split(":")[2:]).get("interface", "0.0.0.0")
        demo.append(ipaddress.ip_address(interface))
    assert demo and not [ip for ip in demo if ip in suite]


def test_a_listener_in_the_range_is_named_with_its_process():
    net = 254
    sock = listening_socket(f"127.{net}.77.1", 0, backlog=1)
    try:
        port = sock.getsockname()[1]
        (taken,) = [entry for entry in listeners_in(net) if entry.startswith(f"127.{net}.77.1:{port} ")]
        assert f"pid {os.getpid()}: " in taken
    finally:
        close_listener(sock)
    assert not [entry for entry in listeners_in(net) if entry.startswith(f"127.{net}.77.1:{port} ")]


def test_a_run_stops_at_once_naming_what_holds_its_range():
    net = 254
    sock = listening_socket(f"127.{net}.2.1", 8080, backlog=1)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_identity.py"],
            cwd=Path(__file__).parents[2],
            env={**os.environ, "ZTWISTED_TEST_NET": str(net)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        close_listener(sock)
    assert run.returncode == 3
    assert f"127.{net}.2.1:8080 (pid {os.getpid()}: " in run.stdout + run.stderr
    assert "ZTWISTED_TEST_NET=N" in run.stdout + run.stderr
