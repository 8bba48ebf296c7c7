"""Loopback mode: every pod is an address on ``lo``; both proxies serve them from the host.

The client apps reach node A through its SOCKS5 port, leaving from their
pod's address; lifecycle events go through node B's admin API
(``POST /workloads/b1/terminating``, ``DELETE /workloads/b1``); the network
teardown is a blackhole route (see :mod:`ztwisted.tools.lab.teardown`).

Discovery is file-based here: each node reads its own local config file
(which it reloads on change), so "unready" is news for node A alone and
"removed" reaches both. Netns mode uses the lab control plane over xDS.
"""

from __future__ import annotations

from pathlib import Path

from ztwisted.tools.lab.clients import socks5_connector
from ztwisted.tools.lab.mesh import APP_PORT, SERVICE_PORT, Addresses, write_mesh
from ztwisted.tools.lab.platform import Platform, admin_call
from ztwisted.tools.lab.server import ServerApp
from ztwisted.tools.lab.teardown import Blackhole, TeardownUnavailable, blackhole_available


class LoopbackPlatform(Platform):
    mode = "loopback"

    discovery_via = "local config files (node A's for unready, both for removed)"

    def __init__(self, config, workdir: Path, state_dir: Path):
        super().__init__(config, workdir, state_dir)
        self.addresses = Addresses(config.net)
        self.blackhole = Blackhole(self.addresses.b1)
        self.a_mesh = workdir / "node-a-discovery" / "mesh.yaml"
        self.b_mesh = workdir / "node-b-discovery" / "mesh.yaml"

    def start(self, node_args: tuple[str, ...]) -> None:
        addresses = self.addresses
        write_mesh(self.a_mesh, addresses)
        write_mesh(self.b_mesh, addresses)
        self.b1_app = ServerApp("b1", addresses.b1, APP_PORT).start()
        self.cleanup.callback(self.b1_app.close)
        b2 = ServerApp("b2", addresses.b2, APP_PORT).start()
        self.cleanup.callback(b2.close)
        self.cleanup.callback(self.blackhole.remove)
        self.node_b = self.node("node-b", addresses.node_b, self.b_mesh, node_args)
        self.node_a = self.node("node-a", addresses.node_a, self.a_mesh, node_args)
        self.start_node(self.node_b)
        self.start_node(self.node_a)

    def change_discovery(self, b1: str) -> None:
        # Node B keeps B1 until it is gone: being unready is news for the clients' node only.
        for path in (self.a_mesh,) if b1 == "unready" else (self.a_mesh, self.b_mesh):
            write_mesh(path, self.addresses, b1=b1)

    def client(self, pod: str) -> dict:
        """Keyword arguments for a client app of ``pod`` (``client-pool`` or ``client-req``)."""
        source = self.addresses.pool_client if pod == "client-pool" else self.addresses.request_client
        return {"connect": socks5_connector(self.node_a.socks5, source, self.addresses.vip, SERVICE_PORT)}

    def pod_terminating(self) -> dict:
        status, took = admin_call(self.node_b, "POST", "/workloads/b1/terminating", timeout=30)
        return {"status": status, "answered_in_s": round(took, 4)}

    def delete_pod(self) -> dict:
        status, took = admin_call(self.node_b, "DELETE", "/workloads/b1", timeout=self.config.pod_drain_timeout + 30)
        return {"status": status, "delete_to_ack_s": round(took, 4)}

    def teardown(self) -> tuple[str, str]:
        """Tear B1's network down as far as loopback allows; (what was done, the approximation said)."""
        if not self.config.teardown:
            return "skipped", "network teardown: skipped (--no-teardown); B1's address stays reachable"
        why = blackhole_available()
        if why is None:
            try:
                self.blackhole.add()
            except TeardownUnavailable as e:
                why = str(e)
        if why is not None:
            return f"not ({why})", f"network teardown: NOT approximated ({why}); B1's address stays reachable"
        return "blackhole route", (
            f"network teardown: blackhole route for {self.blackhole.ip}/32 in the local table (packets to and from "
            "B1 dropped, established connections included; a new connect() fails at once with EINVAL instead of "
            "timing out; node B's listeners on B1's address stay open until the pod is deleted)"
        )
