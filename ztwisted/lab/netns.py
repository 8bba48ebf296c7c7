"""``--mode netns``: what it needs, and a clear refusal when something is missing.

In netns mode each pod would live in its own network namespace joined to the
host by a veth pair, node A and node B would run in in-pod mode
(``twistd ztunnel --inpod``) driven by a ``ztunnel-agent`` each, and the
teardown would delete B1's veth so its address really vanishes. The client
pods' traffic reaches their proxy only through a redirect rule in the pod's
namespace (iptables or nftables, as istio-cni installs), so that is needed
too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

from ztwisted.lab.scenario import LabError


def missing_for_netns() -> list[str]:
    """What this machine or this ztwisted lacks for netns mode (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and veth pairs)")
    if shutil.which("ip") is None:
        missing.append("the `ip` command (iproute2)")
    if shutil.which("iptables") is None and shutil.which("nft") is None:
        missing.append("iptables or nft, for the client pods' redirect to their proxy (SO_ORIGINAL_DST needs a NAT rule)")
    if importlib.util.find_spec("ztwisted.inpod.agent") is None:
        missing.append("ztwisted.inpod.agent (the ZDS node agent)")
    missing.append(
        "the lab's netns scenario itself (pods in namespaces, agents, veth teardown): not built yet, "
        "waiting for in-pod mode to be complete and tested end to end"
    )
    return missing


def check_netns_mode() -> None:
    missing = missing_for_netns()
    if missing:
        raise LabError(
            "--mode netns is not available here; missing:\n  - " + "\n  - ".join(missing)
            + "\nUse --mode loopback (the default)."
        )
