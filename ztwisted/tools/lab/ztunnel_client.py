"""``--client-proxy ztunnel``: node A, the client pods' node, is Istio's real ztunnel (netns mode only).

ztunnel runs in in-pod mode (``PROXY_MODE=shared``) in a network namespace
of its own (``ztw<net>-<pid>-ztunnel-a``), started by
:class:`ztwisted.tools.lab.ztunnel_peer.ZtunnelPeer` and driven over ZDS by the
same ``ztunnel-agent`` that drives ztwisted in the other mode: the agent's
Add hands it the client pods' namespaces, where ztunnel binds its 15001 and
opens its HBONE connections. Node B stays ztwisted, with a plug-in CA that
signs with the root ztunnel's ``FAKE_CA`` uses, so the two trust each other.

What the lab cannot read from ztunnel, and where it looks instead:

- ztunnel has no pool in ``/config_dump`` and no pool metrics: node A's HBONE
  connections per destination come from the client pods' TCP tables
  (:mod:`ztwisted.tools.lab.wire`), and the count of new ones from node B's
  inbound metrics;
- ztunnel reads ``LOCAL_XDS_PATH`` once, at start, and the lab serves no
  XDS: the discovery changes ("unready", "removed") never reach node A;
- ztunnel's HTTP/2 PING keepalive is fixed (10 s interval, 20 s timeout, in
  ``src/proxy/h2.rs``): the lab's keepalive options apply to node B only.
"""

from __future__ import annotations

from pathlib import Path

from ztwisted.tools.lab.platform import LabError

#: what the results say about a ztunnel node A (see the module's docstring)
ZTUNNEL_NOTES = (
    "node A is ztunnel: it reads its local config file once, so 'unready' and 'removed' never reach it "
    "(no XDS server in the lab); its HBONE connections are read from the client pods' TCP tables and "
    "counted by node B; its PING keepalive is its fixed 10 s + 20 s",
)

_PORTS = {"admin": 15000, "metrics": 15020, "readiness": 15021}


class ZtunnelNodeA:
    """ztunnel in in-pod mode as node A, with the interface the lab's sampler uses (``http``, ``process``)."""

    name = "node-a"
    #: ztunnel's /config_dump has no pool section
    has_pool_dump = False

    def __init__(self, namespaces, workdir: Path, state_dir: Path, config: Path, agent_socket: Path):
        from ztwisted.tools.lab.ztunnel_peer import ZtunnelMissing, ZtunnelPeer, find_ztunnel, write_plugin_ca

        try:
            install = find_ztunnel()
        except ZtunnelMissing as e:
            raise LabError(f"--client-proxy ztunnel: {e}") from None
        # Node B (ztwisted, started after this) loads its CA from here: the root ztunnel's FAKE_CA signs with.
        write_plugin_ca(install, Path(state_dir) / "ca")
        namespaces.add_pod("ztunnel-a")
        self.peer = ZtunnelPeer(
            "node-a", netns=namespaces.name("ztunnel-a"), config=config, workdir=workdir, workload=None,
            install=install,
            env={"PROXY_MODE": "shared", "INPOD_UDS": str(agent_socket), "NODE_NAME": "node-a",
                 "UNSTABLE_ENABLE_SOCKS5": "false"},
        )
        self.log_path = self.peer.log_path

    @property
    def process(self):
        return self.peer.process

    def start(self) -> None:
        from ztwisted.tools.lab.ztunnel_peer import ZtunnelFailed

        try:
            self.peer.start()
        except ZtunnelFailed as e:
            raise LabError(f"cannot start ztunnel as node A (log: {self.log_path}): {e}") from None

    def http(self, listener: str, path: str, method: str = "GET") -> tuple[int, bytes]:
        return self.peer.http(_PORTS[listener], path, method)

    def stop(self) -> None:
        from ztwisted.tools.lab.ztunnel_peer import ZtunnelFailed

        try:
            self.peer.stop(timeout=15)
        except ZtunnelFailed:
            pass  # killed after the timeout; the log has why
