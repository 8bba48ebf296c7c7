"""Where a local workload's sockets live: the proxy's own network namespace, or a pod's.

In local-config mode every workload uses :class:`HostNetwork`. In in-pod
mode each pod added by the node agent gets a :class:`PodNetwork`: its
listeners are opened inside the pod's network namespace, and the proxy's
connections on its behalf leave from there too, keeping the pod's source
address. Every socket may carry a packet mark so the pod's redirect rules
can exclude the proxy's own traffic.
"""

from __future__ import annotations

from twisted.internet import defer

from ztwisted.sockets import (
    adopt_listening_socket,
    allow_accept_queue_migration,
    client_socket,
    connect_socket,
    listen_tcp,
)


class HostNetwork:
    """Sockets in the proxy's own network namespace."""

    name = "host"

    def __init__(self, reactor, mark: int | None = None):
        self.reactor = reactor
        self.mark = mark

    def listen(self, ip: str, port: int, factory) -> defer.Deferred:
        return defer.maybeDeferred(listen_tcp, self.reactor, ip, port, factory, mark=self.mark)

    def connect(self, ip: str, port: int, factory, *, source_ip: str | None = None, timeout: float = 10.0) -> defer.Deferred:
        """Connect; fires with the protocol ``factory`` built."""
        try:
            sock = client_socket(ip, source_ip=source_ip, mark=self.mark)
        except OSError as e:
            return defer.fail(e)
        return connect_socket(self.reactor, sock, (ip, port), factory, timeout=timeout)


class PodNetwork:
    """Sockets inside a pod's network namespace (created on a short-lived thread, adopted by the reactor)."""

    def __init__(self, reactor, netns, mark: int | None = None):
        self.reactor = reactor
        self.netns = netns
        self.mark = mark

    @property
    def name(self) -> str:
        return f"netns {self.netns.name}"

    def listen(self, ip: str, port: int, factory) -> defer.Deferred:
        from ztwisted.inpod.netns import listening_socket_in, run_in_netns

        # Per namespace: a restarted proxy then loses none of the pod's queued connections.
        run_in_netns(self.netns, allow_accept_queue_migration, reactor=self.reactor).addErrback(lambda failure: None)

        listening = listening_socket_in(self.netns, ip, port, mark=self.mark, reactor=self.reactor)
        return listening.addCallback(lambda sock: adopt_listening_socket(self.reactor, sock, factory))

    def connect(self, ip: str, port: int, factory, *, source_ip: str | None = None, timeout: float = 10.0) -> defer.Deferred:
        from ztwisted.inpod.netns import connecting_socket_in

        created = connecting_socket_in(self.netns, ip, source_ip=source_ip, mark=self.mark, reactor=self.reactor)
        return created.addCallback(lambda sock: connect_socket(self.reactor, sock, (ip, port), factory, timeout=timeout))

    def close(self) -> None:
        self.netns.close()
