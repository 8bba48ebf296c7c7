"""Fixtures for the ztunnel interop tests: the namespaces, ztunnel, ztwisted (:mod:`tests.interop.ztunnel.support`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.interop.ztunnel.support import CLIENT_IP, ECHO_IP, NET, ZPOD_IP, ZTWISTED_NODE, Network, mesh_yaml
from ztwisted.tools.harness import NodeProcess
from ztwisted.tools.lab.netns import Namespaces, leftover_namespaces
from ztwisted.tools.lab.ztunnel_peer import ZtunnelInstall, ZtunnelMissing, ZtunnelPeer, find_ztunnel, write_plugin_ca


@pytest.fixture(scope="session")
def ztunnel_install() -> ZtunnelInstall:
    try:
        return find_ztunnel()
    except ZtunnelMissing as e:
        problem = str(e)
    pytest.fail(f"ztunnel is needed for these interop tests: {problem}", pytrace=False)


@pytest.fixture
def network():
    """The namespaces, the SYN counters, an echo app and a reply-after-EOF app beside each proxy."""
    for stale in leftover_namespaces(NET):
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    namespaces = Namespaces(NET)
    network = None
    try:
        namespaces.add_router()
        namespaces.add_pod("zt", ZPOD_IP)
        namespaces.add_pod("ztw", CLIENT_IP, ECHO_IP)
        network = Network(namespaces)
        yield network
    finally:
        if network is not None:
            network.close()
        namespaces.destroy()


@pytest.fixture
def pki(tmp_path, ztunnel_install) -> Path:
    """ztwisted's ``--ca-dir``: ztunnel's FAKE_CA root."""
    ca_dir = tmp_path / "ca"
    write_plugin_ca(ztunnel_install, ca_dir)
    return ca_dir


@pytest.fixture
def start_ztunnel(network, tmp_path, ztunnel_install, interop_processes):
    """``start_ztunnel(mesh=None, env=None, name="ztunnel")`` -> a ready ztunnel for ``zpod``."""

    def start(mesh: str | None = None, env: dict | None = None, name: str = "ztunnel") -> ZtunnelPeer:
        config = tmp_path / f"{name}-mesh.yaml"
        config.write_text(mesh or mesh_yaml())
        peer = ZtunnelPeer(
            name,
            netns=network.zt,
            config=config,
            workdir=tmp_path / name,
            workload=("default", "zpod", "zpod"),
            install=ztunnel_install,
            env=env,
        )
        interop_processes.add(peer)
        return peer.start()

    return start


@pytest.fixture
def start_ztwisted(network, tmp_path, pki, interop_processes):
    """``start_ztwisted(*args, mesh=None, name="ztwisted")`` -> a ready ``twistd ztunnel`` in the ztw namespace."""

    def start(*extra_args: str, mesh: str | None = None, name: str = "ztwisted") -> NodeProcess:
        config = tmp_path / f"{name}-mesh.yaml"
        config.write_text(mesh or mesh_yaml())
        node = NodeProcess(
            tmp_path / name,
            name=name,
            control_ip="127.0.0.1",
            config=config,
            node=ZTWISTED_NODE,
            state_dir=tmp_path / f"{name}-state",
            extra_args=("--ca-dir", str(pki), *extra_args),
            netns=network.ztw,
        )
        interop_processes.add(node)
        return node.start()

    return start
