"""ztunnel's local-config files, read by both proxies: what ztunnel accepts, ztwisted accepts, and means the same.

Each file is given to real ztunnel (``LOCAL_XDS_PATH``, in its own network
namespace) and to ztwisted (``--config``, in another); both must start, and
their ``/config_dump`` must show the same workloads, services (with their
endpoints, ``canonical`` and ``visibility``) and policies. The files are
ztunnel's own example and ``configs/every-field.yaml``, which sets every
field ztunnel's LocalConfig has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.ztunnel.support import Network
from tests.support import EchoServer, recv_all
from ztwisted.tools.harness import NodeProcess, socks5_connect
from ztwisted.tools.lab.ztunnel_peer import ZtunnelInstall, ZtunnelPeer

pytestmark = [pytest.mark.interop, pytest.mark.root]

CONFIGS = Path(__file__).parent / "configs"


def ztunnel_example(install: ZtunnelInstall, name: str) -> Path:
    return install.tls.parent / "examples" / name


def comparable(dump: dict) -> dict:
    """What both dumps say about the local config, in one shape (ztunnel's field names)."""

    def ports(mapping: dict) -> dict:
        return {str(k): v for k, v in mapping.items()}

    return {
        "workloads": {
            w["uid"]: {
                "name": w["name"],
                "namespace": w["namespace"],
                "serviceAccount": w["serviceAccount"],
                "workloadIps": sorted(w["workloadIps"]),
                "protocol": w["protocol"],
                "node": w["node"],
                "status": w["status"],
                "networkMode": w["networkMode"],
                "capacity": w["capacity"],
            }
            for w in dump["workloads"]
        },
        "services": {
            f"{s['namespace']}/{s['hostname']}": {
                "name": s["name"],
                "vips": sorted(s["vips"]),
                "ports": ports(s["ports"]),
                "canonical": s["canonical"],
                "visibility": s["visibility"],
                "endpoints": {uid: (ports(e["port"]), e["status"]) for uid, e in s["endpoints"].items()},
            }
            for s in dump["services"]
        },
        "policies": sorted((p["namespace"], p["name"], p["scope"], p["action"]) for p in dump["policies"]),
    }


@pytest.fixture
def both(network: Network, tmp_path, ztunnel_install, pki, interop_processes):
    """``both(config, workload_info)``: ztunnel and ztwisted started on the same file; (ztunnel, ztwisted)."""

    def start(config: Path, workload_info: str) -> tuple[ZtunnelPeer, NodeProcess]:
        config = config.resolve()
        ztunnel = ZtunnelPeer(
            "ztunnel",
            netns=network.zt,
            config=config,
            workdir=tmp_path / "ztunnel",
            workload=workload_info,
            install=ztunnel_install,
        )
        interop_processes.add(ztunnel)
        ztwisted = NodeProcess(
            tmp_path / "ztwisted",
            name="ztwisted",
            control_ip="127.0.0.1",
            config=config,
            node="local",
            state_dir=tmp_path / "ztwisted-state",
            extra_args=("--ca-dir", str(pki)),
            netns=network.ztw,
        )
        interop_processes.add(ztwisted)
        return ztunnel.start(), ztwisted.start()

    return start


def test_ztunnels_example_localhost_yaml_means_the_same_to_both_and_ztwisted_serves_it(both, network, ztunnel_install):
    ztunnel, ztwisted = both(ztunnel_example(ztunnel_install, "localhost.yaml"), "default/local/default")
    theirs, ours = comparable(ztunnel.config_dump()), comparable(ztwisted.config_dump())
    assert ours == theirs
    assert {s["canonical"] for s in theirs["services"].values()} == {True}

    # ztwisted serves it: the workload "local" (127.0.0.1) reaches example.com through its VIP's endpoints.
    apps = [network.in_ztw(lambda ip=ip: EchoServer(ip, 8080)) for ip in ("127.0.0.1", "127.0.0.2")]
    try:

        def exchange():
            sock = socks5_connect(("127.0.0.1", 15080), "127.0.0.1", "example.com", 80)
            with sock:
                sock.sendall(b"through the example mesh")
                sock.shutdown(1)
                return recv_all(sock)

        assert network.in_ztw(exchange) == b"through the example mesh"
        assert sum(app.connections for app in apps) == 1
    finally:
        for app in apps:
            app.close()


def test_what_ztunnel_accepts_with_a_warning_from_ztwisted_is_read_the_same(both):
    ztunnel, ztwisted = both(CONFIGS / "accepted-with-warnings.yaml", "default/local/local")
    theirs, ours = comparable(ztunnel.config_dump()), comparable(ztwisted.config_dump())
    # The one deliberate difference here (docs/configuration.rst): ztunnel hands the workloads'
    # endpoints of a service given twice to the first entry, which the second then replaces, so
    # the service ends up with none; ztwisted keeps them.
    assert theirs["services"]["default/example.com"].pop("endpoints") == {}
    assert ours["services"]["default/example.com"].pop("endpoints") == {
        "cluster1//v1/Pod/default/local": ({"80": 8080}, "Healthy")
    }
    assert ours == theirs
    assert theirs["workloads"]["cluster1//v1/Pod/default/local"]["name"] == "local"
    assert [s["name"] for s in theirs["services"].values()] == ["example", "other"]
    assert theirs["policies"] == [("default", "p", "Namespace", "Allow")]
    warnings = [e for e in ztwisted.log_events() if e.get("log_namespace", e.get("scope")) == "ztwisted.config"]
    assert len(warnings) == 8, warnings


def test_every_field_ztunnel_accepts_is_accepted_and_read_the_same(both):
    ztunnel, ztwisted = both(CONFIGS / "every-field.yaml", "default/local/local")
    theirs, ours = comparable(ztunnel.config_dump()), comparable(ztwisted.config_dump())
    assert ours == theirs
    # What the file exercises, so the comparison above cannot pass on an empty reading.
    assert theirs["services"]["default/listed.example.com"]["endpoints"] == {
        "cluster1//v1/Pod/default/waypointed": ({"80": 9090}, "Healthy")
    }
    assert theirs["services"]["shop/example.com"]["visibility"] == "Namespace"
    # healthPolicy AllowAll: the unhealthy workload is an endpoint of it
    assert theirs["services"]["shop/example.com"]["endpoints"]["cluster1//v1/Pod/default/waypointed"] == (
        {"80": 8081},
        "Unhealthy",
    )
    assert theirs["workloads"]["cluster1//v1/Pod/kube-system/host"]["networkMode"] == "HostNetwork"
    assert len(theirs["policies"]) == 2
