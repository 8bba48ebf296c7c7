"""``--client-proxy ztunnel``: node A, the client pods' node, is Istio's real ztunnel (netns mode only).

ztunnel runs in in-pod mode (``PROXY_MODE=shared``) in a network namespace
of its own (``ztw<net>-<pid>-ztunnel-a``), started by
:class:`ztwisted.tools.lab.ztunnel_peer.ZtunnelPeer` and driven over ZDS by the
same ``ztunnel-agent`` that drives ztwisted in the other mode: the agent's
Add hands it the client pods' namespaces, where ztunnel binds its 15001 and
opens its HBONE connections. Its discovery and its certificates come from
the lab's ``ztunnel-control-plane``, as node B's do (``XDS_ADDRESS`` and
``CA_ADDRESS`` at it, no ``FAKE_CA``, no local config file): the lab's
"unready" and "removed" are calls to the control plane's API, and ztunnel
learns them over xDS. The control plane listens on the host; a relay
(:class:`ztwisted.tools.lab.relay.Relay`) carries ztunnel's connections to it
from ztunnel's namespace, at the same address.

What the lab cannot read from ztunnel, and where it looks instead:

- ztunnel has no pool in ``/config_dump`` and no pool metrics: node A's HBONE
  connections per destination come from the client pods' TCP tables
  (:mod:`ztwisted.tools.lab.wire`), and the count of new ones from node B's
  inbound metrics;
- ztunnel's HTTP/2 PING keepalive is fixed (10 s interval, 20 s timeout, in
  ``src/proxy/h2.rs``): the lab's keepalive options apply to node B only.
"""

from __future__ import annotations

from pathlib import Path

from ztwisted.tools.lab.platform import LabError

#: what the results say about a ztunnel node A (see the module's docstring)
ZTUNNEL_NOTES = (
    "node A is ztunnel: discovery and certificates from the lab control plane over xDS and the CA service, "
    "as node B's; its HBONE connections are read from the client pods' TCP tables and counted by node B; "
    "its PING keepalive is its fixed 10 s + 20 s",
)

_PORTS = {"admin": 15000, "metrics": 15020, "readiness": 15021}


class ZtunnelNodeA:
    """ztunnel in in-pod mode as node A, with the interface the lab's sampler uses (``http``, ``process``)."""

    name = "node-a"
    #: ztunnel's /config_dump has no pool section
    has_pool_dump = False

    def __init__(self, namespaces, workdir: Path, control_plane, agent_socket: Path):
        from ztwisted.tools.lab.relay import Relay
        from ztwisted.tools.lab.ztunnel_peer import ZtunnelMissing, ZtunnelPeer, find_ztunnel

        try:
            install = find_ztunnel()
        except ZtunnelMissing as e:
            raise LabError(f"--client-proxy ztunnel: {e}") from None
        namespaces.add_pod("ztunnel-a")
        host, _, port = control_plane.listen.rpartition(":")
        # ztunnel dials the control plane's own address; in its namespace, the relay answers there.
        self.relay = Relay(namespaces.path("ztunnel-a"), (host, int(port)))
        root = str(control_plane.root_cert)
        self.peer = ZtunnelPeer(
            "node-a",
            netns=namespaces.name("ztunnel-a"),
            config=control_plane.mesh,
            workdir=workdir,
            workload=None,
            install=install,
            env={
                "PROXY_MODE": "shared",
                "INPOD_UDS": str(agent_socket),
                "NODE_NAME": "node-a",
                "UNSTABLE_ENABLE_SOCKS5": "false",
                "FAKE_CA": None,
                "LOCAL_XDS_PATH": None,
                "XDS_ADDRESS": control_plane.address,
                "CA_ADDRESS": control_plane.address,
                "XDS_ROOT_CA": root,
                "CA_ROOT_CA": root,
                "POD_NAME": "ztunnel-a",
                "POD_NAMESPACE": "istio-system",
            },
        )
        self.log_path = self.peer.log_path

    @property
    def process(self):
        return self.peer.process

    def start(self) -> None:
        from ztwisted.tools.lab.ztunnel_peer import ZtunnelFailed

        self.relay.start()
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
        self.relay.stop()
