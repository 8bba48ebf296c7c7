"""Sockets created inside real network namespaces (``ip netns add ztw51-...``), adopted by the reactor."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import pytest_twisted
from twisted.internet import defer, protocol, reactor

from tests.integration.conftest import NET
from ztwisted.netns import Netns, connect_socket, connecting_socket_in, listening_socket_in, run_in_netns
from ztwisted.tools.zds_testing import NamedNetns, can_manage_netns

pytestmark = [pytest.mark.integration, pytest.mark.root]

POD_IP = f"127.{NET}.40.1"  # added to the pod namespace's loopback


@pytest.fixture
def pod_ns():
    reason = can_manage_netns()
    if reason:
        pytest.skip(f"network namespace tests skipped: {reason}")
    try:
        named = NamedNetns()
    except Exception as exc:  # e.g. no CAP_SYS_ADMIN inside a container
        pytest.skip(f"network namespace tests skipped: `ip netns add` failed: {exc}")
    try:
        named.exec("ip", "addr", "add", f"{POD_IP}/32", "dev", "lo")
        netns = named.open()
        yield named, netns
        netns.close()
    finally:
        named.delete()


def _thread_netns_inode():
    return os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net").st_ino


@pytest_twisted.inlineCallbacks
def test_run_in_netns_runs_inside_and_leaves_the_reactor_thread_alone(pod_ns):
    named, netns = pod_ns
    own = _thread_netns_inode()
    inside = yield run_in_netns(netns, _thread_netns_inode)
    assert inside == netns.inode != own
    assert _thread_netns_inode() == own


@pytest_twisted.inlineCallbacks
def test_run_in_netns_reports_the_functions_error(pod_ns):
    _, netns = pod_ns

    def boom():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        yield run_in_netns(netns, boom)


@pytest_twisted.inlineCallbacks
def test_entering_a_namespace_that_is_not_a_network_one_fails_clearly():
    if os.geteuid() != 0:
        pytest.skip("needs root for setns")
    mount_ns = Netns(os.open("/proc/self/ns/mnt", os.O_RDONLY), name="the mount namespace")
    try:
        with pytest.raises(OSError, match="cannot enter network namespace the mount namespace"):
            yield run_in_netns(mount_ns, lambda: None)
    finally:
        mount_ns.close()


class Echo(protocol.Protocol):
    def dataReceived(self, data):
        self.transport.write(data)


class Collect(protocol.Protocol):
    def __init__(self):
        self.data = b""
        self.done = defer.Deferred()

    def dataReceived(self, data):
        self.data += data
        if self.data.endswith(b"\n"):
            self.done.callback(self.data)


@pytest_twisted.inlineCallbacks
def test_listener_inside_a_pod_namespace_serves_a_connection_made_inside_it(pod_ns):
    named, netns = pod_ns
    sock = yield listening_socket_in(netns, POD_IP, 0, mark=1337)
    try:
        port_number = sock.getsockname()[1]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == 1337
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        port = reactor.adoptStreamPort(sock.fileno(), sock.family, protocol.Factory.forProtocol(Echo))
    finally:
        sock.close()
    try:
        # Not reachable from the host namespace: the address lives in the pod's.
        listeners = named.exec("ss", "-Hltn", check=False).stdout
        assert f"{POD_IP}:{port_number}" in listeners
        client_sock = yield connecting_socket_in(netns, POD_IP, mark=1337)
        assert client_sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == 1337
        client = yield connect_socket(
            reactor, client_sock, (POD_IP, port_number), protocol.Factory.forProtocol(Collect), timeout=5
        )
        client.transport.write(b"ping through the pod namespace\n")
        assert (yield client.done.addTimeout(5, reactor)) == b"ping through the pod namespace\n"
        client.transport.loseConnection()
    finally:
        yield port.stopListening()


@pytest_twisted.inlineCallbacks
def test_two_listeners_share_a_port_with_reuse_port(pod_ns):
    # What an upgrade needs: the new proxy binds beside the old one.
    _, netns = pod_ns
    first = yield listening_socket_in(netns, POD_IP, 0)
    try:
        second = yield listening_socket_in(netns, POD_IP, first.getsockname()[1])
        second.close()
        with pytest.raises(OSError):
            yield listening_socket_in(netns, POD_IP, first.getsockname()[1], reuse_port=False)
    finally:
        first.close()


@pytest_twisted.inlineCallbacks
def test_connect_socket_reports_a_refused_connection(pod_ns):
    _, netns = pod_ns
    probe = yield listening_socket_in(netns, POD_IP, 0)
    free_port = probe.getsockname()[1]
    probe.close()
    client_sock = yield connecting_socket_in(netns, POD_IP, source_ip=POD_IP)
    assert client_sock.getsockname()[0] == POD_IP
    with pytest.raises(OSError, match="refused"):
        yield connect_socket(reactor, client_sock, (POD_IP, free_port), protocol.Factory.forProtocol(Collect))
