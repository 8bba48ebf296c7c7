"""Tools around the proxy, not part of it: the node agent (``ztunnel-agent``), the drain lab
(``ztunnel-lab``), the lab control plane (``ztunnel-control-plane``), the harness that runs
real node processes, and ZDS test helpers.

The proxy's runtime (everything else in :mod:`ztwisted`) never imports from here.
"""
