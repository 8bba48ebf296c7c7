"""In-pod mode: the ZDS protocol between the node agent and the proxy.

- :mod:`.wire`: encode/decode of the ZDS messages (``zds.proto``).
- :mod:`.seqpacket`: SOCK_SEQPACKET Unix sockets on the reactor (with SCM_RIGHTS).
- :mod:`.netns`: network-namespace fds and sockets created inside them.
- :mod:`.client`: the proxy side (:class:`~.client.ZdsClient`).
- :mod:`.agent`: the node-agent side (``ztunnel-agent``), for tests, demos and labs.
"""
