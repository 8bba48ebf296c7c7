"""The proxy's own listeners: one log line each, and one line naming the option when a port is taken."""

from __future__ import annotations

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel
from twisted.python import log as legacy_log

from tests.support import close_listener, listening_socket
from ztwisted.endpoints import ListenerService, ReusePortEndpoint
from ztwisted.sockets import CannotListen, is_port_noise
from ztwisted.tap import ProxyService


@pytest.fixture
def taken():
    """A port someone else listens on, without SO_REUSEPORT (so it cannot be shared)."""
    sock = listening_socket("127.0.0.1", 0, backlog=1)
    yield sock.getsockname()
    close_listener(sock)


def test_a_taken_port_names_the_option_and_the_address(taken):
    ip, port = taken
    service = ListenerService(
        ReusePortEndpoint(MemoryReactorClock(), port, ip), Factory(), purpose="admin", option="--admin"
    )
    with pytest.raises(CannotListen) as raised:
        service.privilegedStartService()
    assert str(raised.value) == f"--admin: cannot listen on {ip}:{port}: Address already in use"


def test_the_proxy_says_it_in_one_line_and_exits(taken, logged):
    ip, port = taken
    root = ProxyService("text", MemoryReactorClock())
    ListenerService(ReusePortEndpoint(MemoryReactorClock(), port, ip), Factory(), option="--metrics").setServiceParent(
        root
    )
    with pytest.raises(SystemExit) as raised:
        root.privilegedStartService()
    assert raised.value.code == 1
    (critical,) = [event for event in logged if event.get("log_level") == LogLevel.critical]
    assert critical["error"] == f"--metrics: cannot listen on {ip}:{port}: Address already in use"


@pytest_twisted.inlineCallbacks
def test_a_listener_logs_one_line_with_its_address(logged):
    factory = Factory()
    service = ListenerService(ReusePortEndpoint(reactor, 0, "127.0.0.1"), factory, purpose="admin", option="--admin")
    service.startService()
    try:
        port = service.listening_port.getHost().port
        lines = [event for event in logged if event.get("log_namespace") == "ztwisted.sockets"]
        assert [(event["address"], event["purpose"]) for event in lines] == [(f"127.0.0.1:{port}", "admin (--admin)")]
        assert not factory.noisy
    finally:
        yield service.stopService()
    assert not [event for event in logged if "Starting factory" in event.get("log_format", "")]


def test_twisteds_own_port_lines_are_recognised(logged):
    legacy_log.msg("Site starting on 15000")
    legacy_log.msg("_ConnectionFactory (TLS) starting on 15008")
    legacy_log.msg("(TCP Port 15000 Closed)")
    legacy_log.msg("the proxy is starting on time")
    assert [is_port_noise(event) for event in logged] == [True, True, True, False]
