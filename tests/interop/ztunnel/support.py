"""Real ztunnel and a ztwisted node, each in a network namespace of its own, for the interop tests.

Topology (all inside namespaces the test creates; ``N`` is ``ZTWISTED_TEST_NET``)::

    ztw<N>-<pid>-zt    ztunnel, dedicated to workload zpod (10.N.50.1); zpod's apps
    ztw<N>-<pid>-ztw   ztwisted (twistd, --node ztw-node): workloads client (10.N.51.1)
                       and echo (10.N.51.2); echo's apps
    ztw<N>-<pid>-router  joins them (veth pairs), stands in for the nodes' network

Both proxies read the same local-config YAML (:func:`mesh_yaml`; a test may
hand one of them a diverging copy) and trust one root: ztwisted's plug-in CA
is ztunnel's FAKE_CA test root. Apps reach their proxy through SOCKS5 on
``127.0.0.1:15080`` inside their namespace. An iptables rule in each
namespace counts the TCP connections (SYNs) arriving on 15008: the HBONE
connections each proxy's pool opened to the other, counted by the kernel.
"""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import threading

import pytest

from tests.support import EchoServer, ReplyAfterEofServer
from ztwisted.netns import call_in_netns
from ztwisted.tools.harness import socks5_connect
from ztwisted.tools.lab.netns import Namespaces

NET = int(os.environ.get("ZTWISTED_TEST_NET", "0"))
#: every ztunnel test module's ``pytestmark``
ZTUNNEL_TEST_MARKS = [
    pytest.mark.interop,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces, veth pairs and iptables"),
]
ZPOD_IP = f"10.{NET}.50.1"
CLIENT_IP = f"10.{NET}.51.1"
ECHO_IP = f"10.{NET}.51.2"
ECHO_VIP = f"10.{NET}.52.2"
ZPOD_VIP = f"10.{NET}.52.1"
APP_PORT = 8080
REPLY_AFTER_EOF_PORT = 8081
DENIED_PORT = 9999
HBONE_PORT = 15008
SOCKS5 = ("127.0.0.1", 15080)
ZTWISTED_NODE = "ztw-node"
ZTUNNEL_NODE = "zt-node"
TRUST_DOMAIN = "cluster.local"


def spiffe(service_account: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/ns/default/sa/{service_account}"


def mesh_yaml(*, echo_account: str = "echo", zpod_account: str = "zpod") -> str:
    """The mesh both proxies read. ``echo`` denies its port 9999 (policy ``deny-9999``).

    ``trustDomain`` is explicit: ztunnel's local config leaves it empty when
    omitted (identities ``spiffe:///ns/...``), ztwisted assumes
    ``cluster.local`` as ztunnel does for xDS (docs/interop.rst).
    ``services`` and ``dryRun`` are there because ztunnel requires them.
    """
    return textwrap.dedent(
        f"""
        workloads:
        - uid: cluster1//v1/Pod/default/zpod
          name: zpod
          workloadName: zpod-deploy
          namespace: default
          trustDomain: cluster.local
          serviceAccount: {zpod_account}
          workloadIps: ["{ZPOD_IP}"]
          protocol: HBONE
          node: {ZTUNNEL_NODE}
          services: {{"default/zpod.default.svc.cluster.local": {{80: {APP_PORT}}}}}
        - uid: cluster1//v1/Pod/default/client
          name: client
          workloadName: client-deploy
          namespace: default
          trustDomain: cluster.local
          serviceAccount: client
          workloadIps: ["{CLIENT_IP}"]
          protocol: HBONE
          node: {ZTWISTED_NODE}
          services: {{}}
        - uid: cluster1//v1/Pod/default/echo
          name: echo
          workloadName: echo-deploy
          namespace: default
          trustDomain: cluster.local
          serviceAccount: {echo_account}
          workloadIps: ["{ECHO_IP}"]
          protocol: HBONE
          node: {ZTWISTED_NODE}
          services: {{"default/echo.default.svc.cluster.local": {{80: {APP_PORT}}}}}
          authorizationPolicies: ["default/deny-9999"]
        services:
        - name: zpod
          namespace: default
          hostname: zpod.default.svc.cluster.local
          vips: ["/{ZPOD_VIP}"]
          ports: {{80: {APP_PORT}}}
        - name: echo
          namespace: default
          hostname: echo.default.svc.cluster.local
          vips: ["/{ECHO_VIP}"]
          ports: {{80: {APP_PORT}}}
        policies:
        - name: deny-9999
          namespace: default
          scope: WorkloadSelector
          action: Deny
          dryRun: false
          rules:
          - - - destinationPorts: [{DENIED_PORT}]
        """
    )


# -- namespaces and apps ---------------------------------------------------------------------


class HboneSynCounter:
    """Counts TCP SYNs arriving on port 15008 in one namespace (an iptables rule, read from its counters)."""

    COMMENT = "ztwisted-interop-hbone-syns"

    def __init__(self, netns: str):
        self.netns = netns
        self._iptables(
            "-I", "INPUT", "-p", "tcp", "--dport", str(HBONE_PORT), "--syn", "-m", "comment", "--comment", self.COMMENT
        )

    def _iptables(self, *args: str) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, "iptables", "-w", *args], check=True, capture_output=True, text=True
        ).stdout

    def count(self) -> int:
        for line in self._iptables("-L", "INPUT", "-n", "-v", "-x").splitlines():
            if self.COMMENT in line:
                return int(line.split()[0])
        raise AssertionError(f"the SYN counting rule is gone from {self.netns}")


class Network:
    """The namespaces (``zt``, ``ztw``: their names), their SYN counters and the apps in them."""

    def __init__(self, namespaces: Namespaces):
        self.namespaces = namespaces
        self.zt = namespaces.name("zt")
        self.ztw = namespaces.name("ztw")
        self.zt_syns = HboneSynCounter(self.zt)
        self.ztw_syns = HboneSynCounter(self.ztw)
        self.apps: list = []
        #: zpod's apps, served by ztunnel
        self.zpod_echo = self._app(self.zt, lambda: EchoServer(ZPOD_IP, APP_PORT))
        self.zpod_reply_after_eof = self._app(self.zt, lambda: ReplyAfterEofServer(ZPOD_IP, REPLY_AFTER_EOF_PORT))
        #: echo's apps, served by ztwisted
        self.echo_echo = self._app(self.ztw, lambda: EchoServer(ECHO_IP, APP_PORT))
        self.echo_reply_after_eof = self._app(self.ztw, lambda: ReplyAfterEofServer(ECHO_IP, REPLY_AFTER_EOF_PORT))

    def _app(self, netns: str, make):
        app = _in_named_netns(netns, make)
        self.apps.append(app)
        return app

    def in_zt(self, function):
        return _in_named_netns(self.zt, function)

    def in_ztw(self, function):
        return _in_named_netns(self.ztw, function)

    def close(self) -> None:
        for app in self.apps:
            app.close()


def _in_named_netns(name: str, function):
    return call_in_netns(f"/var/run/netns/{name}", function)


# -- apps' connections -----------------------------------------------------------------------


def through_ztunnel(network: Network, host: str, port: int, timeout: float = 30.0) -> socket.socket:
    """An app connection from zpod through ztunnel's SOCKS5 (ztunnel answers success before it connects)."""
    return network.in_zt(lambda: socks5_connect(SOCKS5, "127.0.0.1", host, port, timeout=timeout))


def through_ztwisted(network: Network, host: str, port: int, timeout: float = 30.0) -> socket.socket:
    """An app connection from workload ``client`` through ztwisted's SOCKS5."""
    return network.in_ztw(lambda: socks5_connect(SOCKS5, CLIENT_IP, host, port, timeout=timeout))


def in_parallel(function, count: int, timeout: float = 60.0) -> list:
    """``function(index)`` for each index at once, a thread each: its results (or exceptions), in order."""
    results: list = [None] * count

    def run(index: int) -> None:
        try:
            results[index] = function(index)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            results[index] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return results


def many(connect, count: int) -> list[socket.socket]:
    """``count`` connections opened at once, in order; AssertionError (and none open) if any failed."""
    results = in_parallel(lambda index: connect(), count)
    failed = [(i, r) for i, r in enumerate(results) if not isinstance(r, socket.socket)]
    if failed:
        for r in results:
            if isinstance(r, socket.socket):
                r.close()
        raise AssertionError(
            f"{len(failed)} of {count} connections failed, the first: #{failed[0][0]}: {failed[0][1]!r}"
        )
    return results


def ended_by(sock: socket.socket, timeout: float = 30.0) -> tuple[bytes, str]:
    """Read until the connection ends: (what was read, "eof" or the OSError's class name)."""
    sock.settimeout(timeout)
    chunks = []
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return b"".join(chunks), "eof"
            chunks.append(data)
    except OSError as e:
        return b"".join(chunks), type(e).__name__
