"""The reuseport endpoint strings and the listener services of ``twistd ztunnel``."""

from __future__ import annotations

import errno
import os
import socket

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.endpoints import serverFromString
from twisted.internet.protocol import Factory, Protocol

from tests.support import TEST_NET
from ztwisted.endpoints import ReusePortEndpoint, listener_service, with_reuseport
from ztwisted.sockets import CannotListen

NET = TEST_NET
IP = f"127.{NET}.40.1"


def test_tcp_descriptions_are_served_with_reuseport_and_others_are_left_alone():
    assert with_reuseport("tcp:15080:interface=127.0.0.1") == "reuseport:15080:interface=127.0.0.1"
    assert with_reuseport("tcp6:15080") == "reuseport6:15080"
    assert with_reuseport("unix:/run/admin.sock") == "unix:/run/admin.sock"


def test_the_parser_plugin_makes_a_reuseport_endpoint_from_a_string():
    endpoint = serverFromString(reactor, "reuseport:15008:interface=10.0.0.5:backlog=64:mark=1337")
    assert endpoint == ReusePortEndpoint(reactor, 15008, "10.0.0.5", 64, 1337)
    assert serverFromString(reactor, "reuseport6:15008").interface == "::"
    assert serverFromString(reactor, "reuseport:15008").interface == "0.0.0.0"


def test_an_unknown_option_is_an_error():
    with pytest.raises(TypeError, match="colour"):
        serverFromString(reactor, "reuseport:15008:colour=blue")


@pytest_twisted.inlineCallbacks
def test_two_listeners_share_a_port_and_carry_the_mark():
    endpoint = ReusePortEndpoint(reactor, 0, IP, mark=1337 if os.geteuid() == 0 else None)
    first = yield endpoint.listen(Factory.forProtocol(Protocol))
    try:
        port = first.getHost().port
        sock = socket.fromfd(first.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        try:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            if os.geteuid() == 0:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == 1337
        finally:
            sock.close()
        second = yield ReusePortEndpoint(reactor, port, IP).listen(Factory.forProtocol(Protocol))
        yield second.stopListening()
    finally:
        yield first.stopListening()


def test_a_listener_service_fails_its_start_when_the_port_is_taken():
    taken = socket.socket()
    taken.bind((IP, 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        service = listener_service(f"tcp:{port}:interface={IP}", Factory.forProtocol(Protocol), reactor)
        with pytest.raises(CannotListen) as raised:
            service.privilegedStartService()
        assert str(raised.value) == f"cannot listen on {IP}:{port}: {os.strerror(errno.EADDRINUSE)}"
    finally:
        taken.close()
