"""Listening endpoints with what a node proxy needs: SO_REUSEPORT, SO_MARK, a network namespace.

:class:`ReusePortEndpoint` is the one factory for the proxy's listeners
(node-wide ones and each workload's). The ``reuseport:`` and ``reuseport6:``
endpoint strings (parsers installed as Twisted plugins,
``plugins/ztwisted_endpoints.py``) make one from a description::

    reuseport:15008:interface=10.0.0.5:backlog=1024:mark=1337:netns=/var/run/netns/pod

``twistd ztunnel`` serves its ``tcp:`` and ``tcp6:`` listener options through
them, so a restarted proxy can share its ports (see docs/draining.rst).
"""

from __future__ import annotations

import attrs
from twisted.application.internet import StreamServerEndpointService
from twisted.internet import defer
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IStreamServerEndpoint, IStreamServerEndpointStringParser
from twisted.plugin import IPlugin
from zope.interface import implementer

from ztwisted.netns import Netns, listening_socket_in
from ztwisted.sockets import adopt_listening_socket, listening_socket

DEFAULT_BACKLOG = 1024


@implementer(IStreamServerEndpoint)
@attrs.frozen
class ReusePortEndpoint:
    """A TCP listener with SO_REUSEPORT, an optional SO_MARK, opened in ``netns`` if one is given."""

    reactor: object
    port: int
    interface: str = "0.0.0.0"
    backlog: int = DEFAULT_BACKLOG
    mark: int | None = None
    #: the network namespace to listen in (the socket is made there on a short-lived thread); None: ours
    netns: Netns | None = None

    def listen(self, factory) -> defer.Deferred:
        """Fires with the IListeningPort."""
        if self.netns is None:
            made = defer.maybeDeferred(
                listening_socket, self.interface, self.port, backlog=self.backlog, mark=self.mark
            )
        else:
            made = listening_socket_in(
                self.netns, self.interface, self.port, backlog=self.backlog, mark=self.mark, reactor=self.reactor
            )
        return made.addCallback(lambda sock: adopt_listening_socket(self.reactor, sock, factory))


@implementer(IPlugin, IStreamServerEndpointStringParser)
@attrs.frozen
class ReusePortParser:
    """``reuseport:PORT[:interface=IP][:backlog=N][:mark=N][:netns=PATH]`` (``reuseport6``: on ``::``)."""

    prefix: str
    default_interface: str = "0.0.0.0"

    def parseStreamServer(self, reactor, port, interface=None, backlog=DEFAULT_BACKLOG, mark=None, netns=None):
        return ReusePortEndpoint(
            reactor,
            int(port),
            interface or self.default_interface,
            int(backlog),
            int(mark) if mark not in (None, "") else None,
            Netns.open(netns) if netns else None,
        )


#: what ``tcp:`` and ``tcp6:`` listener descriptions become in ``twistd ztunnel``
REUSEPORT_PREFIXES = {"tcp": "reuseport", "tcp6": "reuseport6"}


def with_reuseport(description: str) -> str:
    """``tcp:...`` and ``tcp6:...`` as their ``reuseport`` equivalents; any other description unchanged."""
    kind, colon, rest = description.partition(":")
    return REUSEPORT_PREFIXES[kind] + colon + rest if kind in REUSEPORT_PREFIXES else description


def listener_service(description: str, factory, reactor) -> StreamServerEndpointService:
    """A service listening on an endpoint description; ``tcp:`` and ``tcp6:`` ones get SO_REUSEPORT."""
    service = StreamServerEndpointService(serverFromString(reactor, with_reuseport(description)), factory)
    # Listen when the service starts, before twistd drops privileges, and fail the start if the
    # port is taken instead of logging it (what the strports module does for its own services).
    service._raiseSynchronously = True
    return service
