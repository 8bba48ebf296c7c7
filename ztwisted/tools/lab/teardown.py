"""The "network teardown" of a pod in loopback mode: make its address unreachable.

In a cluster, the CNI deletes the pod's veth and its address vanishes: packets
to and from it go nowhere, so a peer learns of it only by timeouts (or
keepalives). On loopback nothing can be deleted; as root, a ``blackhole``
route for the pod's /32 in the ``local`` routing table comes close: it wins
over ``127.0.0.0/8`` by prefix length, packets *to* the address are dropped,
and packets *from* it fail source validation and are dropped too, for
established connections as well. The differences: a new ``connect()`` to
the address fails at once with EINVAL instead of timing out, and the
address stays assigned (the proxy's listeners on it stay open until the
pod is removed). Without root it is not approximated at all.
"""

from __future__ import annotations

import ipaddress
import subprocess

from ztwisted.tools.system import cannot_set_up_network


class TeardownUnavailable(Exception):
    pass


def blackhole_available() -> str | None:
    """None if blackhole routes can be used here, else why not."""
    return cannot_set_up_network("ip")


class Blackhole:
    """A blackhole route for one address in the local table; :meth:`remove` is safe to repeat."""

    def __init__(self, ip: str):
        self.ip = str(ipaddress.ip_address(ip))
        self.active = False

    def add(self) -> None:
        why = blackhole_available()
        if why is not None:
            raise TeardownUnavailable(why)
        _ip("route", "add", "blackhole", f"{self.ip}/32", "table", "local")
        self.active = True

    def remove(self) -> None:
        if self.active:
            _ip("route", "del", "blackhole", f"{self.ip}/32", "table", "local", check=False)
            self.active = False


def leftover_blackholes(network: str) -> list[str]:
    """Blackhole routes in the local table inside ``network`` (e.g. from a killed lab run)."""
    if blackhole_available() is not None:
        return []
    net = ipaddress.ip_network(network)
    output = _ip("route", "show", "table", "local", "type", "blackhole").stdout
    found = []
    for line in output.splitlines():
        words = line.split()
        target = words[1] if words and words[0] == "blackhole" and len(words) > 1 else (words[0] if words else "")
        try:
            address = ipaddress.ip_network(target, strict=False)
        except ValueError:
            continue
        if address.subnet_of(net):
            found.append(str(address.network_address))
    return found


def remove_leftovers(network: str) -> list[str]:
    removed = leftover_blackholes(network)
    for ip in removed:
        _ip("route", "del", "blackhole", f"{ip}/32", "table", "local", check=False)
    return removed


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise TeardownUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip() or result.returncode}")
    return result
