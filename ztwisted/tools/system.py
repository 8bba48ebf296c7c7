"""Whether this process may change the machine's network: root, and the commands it runs."""

from __future__ import annotations

import os
import shutil

#: the Debian package of each command the tools and tests run
PACKAGES = {"ip": "iproute2", "ss": "iproute2", "iptables": "iptables"}


def missing_for_network_setup(*commands: str) -> list[str]:
    """What this process lacks to create namespaces, veth pairs, routes and rules: root, and
    each of ``commands`` (default: ``ip``). Empty when nothing is missing."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces, links, routes and rules need CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    for command in commands or ("ip",):
        if shutil.which(command) is None:
            missing.append(f"the `{command}` command (apt-get install {PACKAGES.get(command, command)})")
    return missing


def cannot_set_up_network(*commands: str) -> str | None:
    """None when :func:`missing_for_network_setup` finds nothing, else why not (a skip reason)."""
    missing = missing_for_network_setup(*commands)
    return "needs " + " and ".join(missing) if missing else None
