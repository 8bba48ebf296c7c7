"""What every lab mode provides to the scenario, and helpers they share."""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from pathlib import Path

from ztwisted.tools.harness import NodeProcess
from ztwisted.tools.lab.mesh import Addresses
from ztwisted.tools.lab.server import ServerApp


class LabError(Exception):
    """The lab cannot run as asked; the message says why and what to do."""


class Platform:
    """What a mode provides to the scenario: proxies, pods, apps' connections and the lifecycle events."""

    addresses: Addresses
    node_a: NodeProcess
    node_b: NodeProcess
    b1_app: ServerApp
    #: how discovery changes reach the nodes, for the results (the events "unready" and "removed")
    discovery_via: str

    def __init__(self, config, workdir: Path, state_dir: Path):
        self.config = config
        self.workdir = workdir
        self.state_dir = state_dir
        self.cleanup = contextlib.ExitStack()

    def change_discovery(self, b1: str) -> None:
        """Tell discovery that B1 is ``unready`` (an endpoint no more) or ``gone``."""
        raise NotImplementedError

    def close(self) -> None:
        self.cleanup.close()

    def watch_wire(self, clock):
        """A started :class:`ztwisted.tools.lab.wire.WireWatch` of node A's HBONE connections, or None (loopback)."""
        return None

    def node(self, name: str, control_ip: str, config: Path, extra_args: tuple[str, ...]) -> NodeProcess:
        return NodeProcess(
            self.workdir / name,
            name=name,
            control_ip=control_ip,
            config=config,
            node=name,
            state_dir=self.state_dir,
            extra_args=extra_args,
        )

    def start_node(self, node: NodeProcess) -> None:
        try:
            node.start()
        except RuntimeError as e:
            raise LabError(f"cannot start {node.name} (logs: {node.log_path}): {e}") from None
        self.cleanup.callback(_stop_node, node)
        wait_ready(node)


def admin_call(node: NodeProcess, method: str, path: str, timeout: float) -> tuple[int, float]:
    """Status and seconds until the answer of a node's admin API (it answers when the event completes)."""
    request = urllib.request.Request(f"http://{node.control_ip}:15000{path}", method=method)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            status = response.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError as e:
        raise LabError(f"{method} {path} on {node.name} failed: {e}") from None
    return status, time.monotonic() - started


def wait_ready(node: NodeProcess, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if node.http("readiness", "/healthz/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise LabError(f"{node.name} not ready within {timeout} s (logs: {node.log_path}):\n{node.log_tail()}")


def _stop_node(node: NodeProcess) -> None:
    try:
        node.stop(timeout=15)
    except RuntimeError:
        node.kill()
