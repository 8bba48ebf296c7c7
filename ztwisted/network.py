"""Where a local workload's sockets live: the proxy's own network namespace, or a pod's.

In local-config mode every workload uses :class:`HostNetwork`. In in-pod
mode each pod added by the node agent gets a :class:`PodNetwork`: its
listeners are opened inside the pod's network namespace, and the proxy's
connections on its behalf leave from there too, keeping the pod's source
address. Every socket may carry a packet mark so the pod's redirect rules
can exclude the proxy's own traffic.
"""

from __future__ import annotations

import attrs
from twisted.internet import defer

from ztwisted.endpoints import ReusePortEndpoint
from ztwisted.netns import Netns, connecting_socket_in, run_in_netns
from ztwisted.sockets import allow_accept_queue_migration, client_socket, connect_socket


@attrs.define
class HostNetwork:
    """Sockets in the proxy's own network namespace."""

    reactor: object
    #: SO_MARK on every socket, so a pod's redirect rules can let the proxy's own traffic pass
    mark: int | None = None
    name: str = "host"

    def listen(self, ip: str, port: int, factory) -> defer.Deferred:
        return ReusePortEndpoint(self.reactor, port, ip, mark=self.mark).listen(factory)

    def connect(
        self, ip: str, port: int, factory, *, source_ip: str | None = None, timeout: float = 10.0
    ) -> defer.Deferred:
        """Connect; fires with the protocol ``factory`` built."""
        try:
            sock = client_socket(ip, source_ip=source_ip, mark=self.mark)
        except OSError as e:
            return defer.fail(e)
        return connect_socket(self.reactor, sock, (ip, port), factory, timeout=timeout)


@attrs.define
class PodNetwork:
    """Sockets inside a pod's network namespace (created on a short-lived thread, adopted by the reactor)."""

    reactor: object
    netns: Netns
    mark: int | None = None

    @property
    def name(self) -> str:
        return f"netns {self.netns.name}"

    def listen(self, ip: str, port: int, factory) -> defer.Deferred:
        # Per namespace: a restarted proxy then loses none of the pod's queued connections.
        run_in_netns(self.netns, allow_accept_queue_migration, reactor=self.reactor).addErrback(lambda failure: None)
        return ReusePortEndpoint(self.reactor, port, ip, mark=self.mark, netns=self.netns).listen(factory)

    def connect(
        self, ip: str, port: int, factory, *, source_ip: str | None = None, timeout: float = 10.0
    ) -> defer.Deferred:
        created = connecting_socket_in(self.netns, ip, source_ip=source_ip, mark=self.mark, reactor=self.reactor)
        return created.addCallback(
            lambda sock: connect_socket(self.reactor, sock, (ip, port), factory, timeout=timeout)
        )

    def close(self) -> None:
        self.netns.close()
