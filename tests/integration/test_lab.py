"""ztunnel-lab: a short loopback run whose results must be complete and add up (no timing asserted).

The lab uses its own address range, not ZTWISTED_TEST_NET's, so it never
collides with the other integration tests: 127.<NET+100>.0.0/16 when
ZTWISTED_TEST_NET is set (so that parallel runs on one machine do not collide
either), 127.91.0.0/16 otherwise.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from ztwisted.drain.registry import installed_strategies
from ztwisted.tools.lab.clients import FAILURE_KINDS, RequestMaker, Traffic
from ztwisted.tools.lab.measures import percentile, pool_leftovers
from ztwisted.tools.lab.netns import missing_for_netns
from ztwisted.tools.lab.scenario import LabError, Strategy, Timeline

pytestmark = pytest.mark.integration

STRATEGIES = ("immediate", "last-mile")
_TEST_NET = os.environ.get("ZTWISTED_TEST_NET")
NET = str(int(_TEST_NET) + 100) if _TEST_NET and int(_TEST_NET) + 100 <= 254 else "91"
LIFECYCLE = ("traffic-start", "terminating", "unready", "app-exit", "app-exited", "removed", "traffic-stop", "done")


def lab(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ztwisted.tools.lab", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab")
    done = lab(
        "run",
        "--strategies",
        ",".join(STRATEGIES),
        "--duration",
        "6",
        "--seed",
        "7",
        "--net",
        NET,
        "--out",
        str(out),
        "--quiet",
    )
    assert done.returncode == 0, f"lab failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return out, json.loads((out / "results.json").read_text()), done.stdout


def test_every_strategy_has_its_measures(lab_run):
    _, results, _ = lab_run
    assert [s["name"] for s in results["strategies"]] == list(STRATEGIES)
    for strategy in results["strategies"]:
        m = strategy["measures"]
        for key in (
            "requests",
            "bytes",
            "hbone",
            "tunnel_open",
            "first_response_byte",
            "pool_to_b1",
            "delete_to_ack_s",
            "cpu_s",
            "answered_by",
        ):
            assert key in m, f"{strategy['name']}: no {key}"
        assert m["delete_status"] == 200
        assert m["delete_to_ack_s"] >= 0
        assert m["hbone"]["tls_handshakes_by_a_in_window"] >= m["hbone"]["opened_by_a_in_window"] >= 0
        assert set(m["pool_to_b1"]) >= {"open_at_gone", "last_closed_after_s", "still_open_at_end"}
        for node in ("a", "b"):
            assert m["cpu_s"][node]["run"] >= m["cpu_s"][node]["window"] >= 0
            assert m["cpu_s"][node]["run"] > 0, "a proxy that carried traffic used no CPU?"
        assert m["tunnel_open"]["count"] > 0, "the per-request app opens tunnels during the window"


def test_requests_add_up(lab_run):
    _, results, _ = lab_run
    for strategy in results["strategies"]:
        requests = strategy["measures"]["requests"]
        assert requests["sent"] > 0
        assert requests["succeeded"] + requests["failed"] == requests["sent"]
        assert sum(requests["failed_by"].values()) == requests["failed"]
        assert set(requests["failed_by"]) == set(FAILURE_KINDS)
        per_app = requests["per_app"]
        assert set(per_app) == {"client-pool", "client-req"}
        for field in ("sent", "succeeded", "failed"):
            assert sum(app[field] for app in per_app.values()) == requests[field]
        assert requests["in_window"]["sent"] <= requests["sent"]
        assert sum(strategy["measures"]["answered_by"].values()) == requests["succeeded"]
        assert len(strategy["failures"]) == min(100, requests["failed"])


def test_bytes_are_accounted(lab_run):
    _, results, _ = lab_run
    for strategy in results["strategies"]:
        b = strategy["measures"]["bytes"]
        assert b["payload"] == b["sent"] + b["unsent"]
        assert b["sent"] == b["echoed"] + b["lost"]
        assert 0 <= b["echoed"] <= b["sent"]


def test_events_happen_in_the_scenario_order(lab_run):
    _, results, _ = lab_run
    for strategy in results["strategies"]:
        events = strategy["events"]
        times = [e["t"] for e in events]
        assert times == sorted(times), f"{strategy['name']}: events out of order: {events}"
        names = [e["name"] for e in events]
        assert [n for n in names if n in LIFECYCLE] == list(LIFECYCLE)
        delete, ack, teardown = names.index("delete"), names.index("ack"), names.index("teardown")
        assert delete < ack
        if strategy["delete_before_teardown"]:
            assert ack < teardown, "last-mile: the Ack comes while the network still exists"
        else:
            assert teardown < delete, "the others: Del after the network is gone"
        assert names.index("app-exited") < min(delete, teardown) and max(ack, teardown) < names.index("removed")
    assert [s["delete_before_teardown"] for s in results["strategies"]] == [False, True]


def test_series_cover_the_run(lab_run):
    _, results, _ = lab_run
    for strategy in results["strategies"]:
        series = strategy["series"]
        assert len(series["succeeded_per_s"]) == len(series["failed_per_s"]) > 0
        counted = sum(series["succeeded_per_s"]) * series["bin_s"] + sum(series["failed_per_s"]) * series["bin_s"]
        assert round(counted) == strategy["measures"]["requests"]["sent"]
        assert series["hbone_a_to_b1"] and series["hbone_a_to_b2"]


def test_chart_table_and_metadata(lab_run):
    out, results, stdout = lab_run
    root = ET.parse(out / "drain-lab.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for name in STRATEGIES:
        assert name in texts
    for label in ("terminating", "app-exit", "removed"):
        assert label in texts
    table = (out / "table.txt").read_text()
    assert table in stdout
    assert [line.split()[0] for line in table.splitlines()[2:4]] == list(STRATEGIES)
    lab_info = results["lab"]
    assert lab_info["seed"] == 7 and lab_info["mode"] == "loopback"
    assert lab_info["machine"]["cpus"] >= 1
    assert lab_info["approximations"], "loopback mode always says what it approximated"
    assert lab_info["not_deterministic"]


# -- quick checks without proxies ----------------------------------------------------------


def test_seeded_requests_are_reproducible():
    def first(seed):
        maker = RequestMaker(random.Random(f"{seed}/client-pool/0"), Traffic(), 1 << 32)
        return [maker.make() for _ in range(5)]

    assert first(3) == first(3)
    assert first(3) != first(4)


def test_timeline_scales_and_checks():
    scaled = Timeline().scaled(10)
    assert abs(scaled.nominal - 10) < 0.01
    with pytest.raises(LabError, match="unready-after"):
        Timeline(unready_after=6, grace=5).check()


def test_strategy_names():
    installed = installed_strategies()
    combined = Strategy.parse("client-evict+last-mile", installed)
    assert combined.components == ("client-evict", "last-mile") and combined.delete_before_teardown
    assert not Strategy.parse("immediate", installed).delete_before_teardown
    with pytest.raises(LabError, match="unknown drain strategy nope"):
        Strategy.parse("immediate+nope", installed)


def test_measure_helpers():
    assert percentile([], 99) is None
    assert percentile([3, 1, 2], 50) == 2
    polls = [{"t": 0.0, "b1": 2}, {"t": 1.0, "b1": 2}, {"t": 1.2, "b1": 1}, {"t": 1.4, "b1": 0}, {"t": 1.6, "b1": 0}]
    assert pool_leftovers(polls, 1.0) == {
        "open_at_gone": 2,
        "max_after_gone": 2,
        "last_closed_after_s": 0.4,
        "still_open_at_end": 0,
    }
    assert pool_leftovers(polls[:3], 1.0)["last_closed_after_s"] is None


@pytest.mark.root
def test_netns_mode_immediate_leaves_a_pooled_connection_to_keepalive_and_last_mile_none(tmp_path):
    """Pods in namespaces, veth deleted at teardown: with immediate node B cannot tell node A, so A's pooled
    connection to B1 stays until keepalive gives up; last-mile closes it before the Ack."""
    _netns_or_fail()
    # keepalive 1 s + 1.5 s, so that 6 s of observation are plenty for it to give up
    done = lab(
        "run",
        "--mode",
        "netns",
        "--strategies",
        "immediate,last-mile",
        "--duration",
        "4",
        "--observe",
        "6",
        "--keepalive-interval",
        "1",
        "--keepalive-timeout",
        "1.5",
        "--net",
        NET,
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert done.returncode == 0, f"lab failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    results = json.loads((tmp_path / "results.json").read_text())
    immediate, last_mile = results["strategies"]
    for strategy in (immediate, last_mile):
        requests = strategy["measures"]["requests"]
        assert requests["succeeded"] + requests["failed"] == requests["sent"] > 0
        assert strategy["measures"]["delete_status"] == 200
        assert strategy["measures"]["answered_by"].get("b2"), "traffic crossed the namespaces over HBONE"
    assert immediate["measures"]["pool_to_b1"]["open_at_gone"] >= 1
    assert immediate["measures"]["hbone"]["closed_in_window"]["a"].get("keepalive-timeout", 0) >= 1
    assert last_mile["measures"]["pool_to_b1"]["open_at_gone"] == 0
    assert set(last_mile["measures"]["hbone"]["closed_in_window"]["b"]) == {"drained"}


def _ztunnel_or_fail():
    """The cached ztunnel build; missing: a failure under CI (which builds it), else a skip."""
    from ztwisted.tools.lab.ztunnel_peer import ZtunnelMissing, find_ztunnel

    try:
        return find_ztunnel()
    except ZtunnelMissing as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"ztunnel is missing: {e}", pytrace=False)
        pytest.skip(f"ztunnel is missing: {e}")


def _netns_or_fail():
    missing = missing_for_netns()
    if missing:
        if os.geteuid() == 0 and os.environ.get("CI") == "true":
            pytest.fail("netns mode unavailable: " + "; ".join(missing), pytrace=False)
        pytest.skip("netns mode unavailable: " + "; ".join(missing))


@pytest.mark.root
def test_netns_mode_client_evict_retires_the_pooled_connection_on_the_xds_removal(tmp_path):
    """Node A (ztwisted) learns B1's removal over xDS from the lab control plane, and client-evict retires its
    pooled connection to B1: the client pods' TCP tables show it closing after the removal. Keepalive is too
    long (30 s + 30 s) to be what closed it."""
    _netns_or_fail()
    done = lab(
        "run",
        "--mode",
        "netns",
        "--strategies",
        "client-evict",
        "--duration",
        "4",
        "--observe",
        "4",
        "--keepalive-interval",
        "30",
        "--keepalive-timeout",
        "30",
        "--net",
        NET,
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert done.returncode == 0, f"lab failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    (strategy,) = json.loads((tmp_path / "results.json").read_text())["strategies"]
    events = {e["name"]: e for e in strategy["events"]}
    for name, b1 in (("unready", "unready"), ("removed", "gone")):
        assert "control plane" in events[name]["via"]
        assert events[name]["node_a_config_dump_b1"] == b1 and events[name]["applied_in_s"] is not None, events[name]
    m = strategy["measures"]
    assert m["drain_events"]["a"].get("client-evict:destination_removed", 0) >= 1
    assert strategy["pool_source"] == "wire"
    pool = m["pool_to_b1"]
    assert pool["open_at_gone"] >= 1, "node A had a pooled connection to B1 when its network went"
    assert pool["still_open_at_end"] == 0 and pool["last_closed_after_s"] is not None, pool
    # it closed after the removal reached node A (wire times and event times share the lab's clock)
    assert events["teardown"]["t"] + pool["last_closed_after_s"] >= events["removed"]["t"]
    assert "keepalive-timeout" not in m["hbone"]["closed_in_window"]["a"]


@pytest.mark.root
def test_netns_mode_with_ztunnel_as_node_a(tmp_path):
    """Node A is the real ztunnel (in-pod mode, driven by ztunnel-agent), node B ztwisted, both fed by the lab
    control plane: traffic crosses, ztunnel's connections are seen on the wire and counted by node B, B1's
    removal reaches ztunnel over xDS (its /config_dump drops B1), and ztunnel honours goaway-on-start's GOAWAY
    by opening a new connection."""
    _netns_or_fail()
    _ztunnel_or_fail()
    # B1 stays an endpoint until it is removed, so that ztunnel still sends to it after the GOAWAY
    done = lab(
        "run",
        "--mode",
        "netns",
        "--client-proxy",
        "ztunnel",
        "--strategies",
        "immediate,goaway-on-start",
        "--duration",
        "4",
        "--unready-after",
        "never",
        "--net",
        NET,
        "--out",
        str(tmp_path),
        "--quiet",
        timeout=180,
    )
    assert done.returncode == 0, f"lab failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["lab"]["client_proxy"] == "ztunnel"
    assert any("node A is ztunnel" in a for a in results["lab"]["approximations"])
    immediate, goaway = results["strategies"]
    for strategy in (immediate, goaway):
        m = strategy["measures"]
        assert m["requests"]["succeeded"] + m["requests"]["failed"] == m["requests"]["sent"] > 0
        assert m["answered_by"].get("b1") and m["answered_by"].get("b2"), "ztunnel balanced over both pods"
        assert m["hbone"]["counted_at"].startswith("node B's metrics")
        assert strategy["pool_source"] == "wire"
        assert max(n for _, n in strategy["series"]["hbone_a_to_b2"]) >= 1, "the wire shows ztunnel's connections"
        removed = {e["name"]: e for e in strategy["events"]}["removed"]
        assert "control plane" in removed["via"]
        assert removed["node_a_config_dump_b1"] == "gone", f"ztunnel's /config_dump still lists B1: {removed}"
        assert removed["applied_in_s"] is not None
    # Nothing told ztunnel about B1 before its network went: its pooled connection was still there.
    assert immediate["measures"]["pool_to_b1"]["open_at_gone"] >= 1
    # After the GOAWAY, ztunnel kept sending to B1 on a new HBONE connection, which node B accepted.
    assert goaway["measures"]["drain_events"]["b"].get("goaway-on-start:pod_terminating", 0) >= 1
    assert goaway["measures"]["hbone"]["accepted_by_b_in_window"] >= 1


def test_cli_errors_are_clear():
    unknown = lab("run", "--strategies", "immediate,bogus", "--quiet", timeout=30)
    assert unknown.returncode == 2
    assert "unknown drain strategy bogus" in unknown.stderr and "installed:" in unknown.stderr
    ztunnel_loopback = lab("run", "--client-proxy", "ztunnel", "--quiet", timeout=30)
    assert ztunnel_loopback.returncode == 2
    assert "--client-proxy ztunnel needs --mode netns" in ztunnel_loopback.stderr
    if missing_for_netns():
        netns = lab("run", "--mode", "netns", "--quiet", timeout=30)
        assert netns.returncode == 2
        assert "--mode netns is not available here; missing:" in netns.stderr
