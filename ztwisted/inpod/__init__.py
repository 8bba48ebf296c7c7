"""In-pod mode: the ZDS protocol between the node agent and the proxy.

- :mod:`.wire`: encode/decode of the ZDS messages (``zds.proto``).
- :mod:`.seqpacket`: SOCK_SEQPACKET Unix sockets on the reactor (with SCM_RIGHTS).
- :mod:`.client`: the proxy side (:class:`~.client.ZdsClient`).
- :mod:`.proxies`: what the node agent's messages do to the node.

Network-namespace fds and sockets created inside them are :mod:`ztwisted.netns`;
the node-agent side (``ztunnel-agent``) is :mod:`ztwisted.tools.agent`.
"""

#: where the node agent listens for the proxy (ztunnel's and istio-cni's default)
DEFAULT_SOCKET_PATH = "/var/run/ztunnel/ztunnel.sock"
