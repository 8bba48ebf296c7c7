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
from ztwisted.sockets import CannotListen, adopt_listening_socket, listening_socket, log_listening

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


class ListenerService(StreamServerEndpointService):
    """One of the proxy's node-wide listeners (``--socks5``, ``--admin``, ...), served through an endpoint.

    It listens when the service starts, before twistd drops privileges. A port
    that cannot be opened fails the start with :class:`~ztwisted.sockets.CannotListen`
    naming the option and the address (Twisted's own service would log a
    traceback and carry on); an open one is logged in one line with its
    address and purpose.
    """

    def __init__(
        self, endpoint: IStreamServerEndpoint, factory, *, purpose: str = "listener", option: str | None = None
    ):
        super().__init__(endpoint, factory)
        self.purpose = purpose
        self.option = option
        self.listening_port = None
        self._raiseSynchronously = True

    def privilegedStartService(self) -> None:
        try:
            super().privilegedStartService()
        except OSError as e:
            raise CannotListen(f"{self.option}: {e.strerror}" if self.option else str(e.strerror)) from None
        self._waitingForPort.addCallback(self._listening)

    def _listening(self, port):
        if port is not None:
            self.listening_port = port
            log_listening(port, f"{self.purpose} ({self.option})" if self.option else self.purpose)
        return port


def listener_service(
    description: str, factory, reactor, *, purpose: str = "listener", option: str | None = None
) -> ListenerService:
    """A service listening on an endpoint description; ``tcp:`` and ``tcp6:`` ones get SO_REUSEPORT."""
    endpoint = serverFromString(reactor, with_reuseport(description))
    return ListenerService(endpoint, factory, purpose=purpose, option=option)
