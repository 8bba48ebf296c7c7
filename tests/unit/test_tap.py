"""twistd ztunnel's options and service tree, built on a fake reactor."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage

from ztwisted import tap
from ztwisted.config import builtin_example_path

SOURCE = Path(__file__).parents[2]
BUILT_IN = ("client-evict", "goaway-on-start", "gradual", "immediate", "last-mile")


def options(tmp_path, *args):
    parsed = tap.Options()
    parsed.parseOptions(["--state-dir", str(tmp_path / "state"), *args])
    return parsed


def node_of(service):
    return service.proxy.view


def test_random_seed_makes_the_proxys_choices_reproducible(tmp_path):
    first = node_of(tap.makeService(options(tmp_path, "--random-seed", "5"), MemoryReactorClock()))
    second = node_of(tap.makeService(options(tmp_path, "--random-seed", "5"), MemoryReactorClock()))
    expected = random.Random(5)
    draws = [first.random.random() for _ in range(3)]
    assert draws == [second.random.random() for _ in range(3)] == [expected.random() for _ in range(3)]


def test_defaults_follow_ztunnel(tmp_path, monkeypatch):
    monkeypatch.delenv("TERMINATION_GRACE_PERIOD_SECONDS", raising=False)
    monkeypatch.delenv("CONNECTION_TERMINATION_DEADLINE", raising=False)
    parsed = options(tmp_path)
    assert parsed["socks5"] == "tcp:15080:interface=127.0.0.1"
    assert parsed["admin"] == "tcp:15000:interface=127.0.0.1"
    assert (parsed["hbone-port"], parsed["inbound-plaintext-port"]) == (15008, 15006)
    assert parsed["drain-strategy"] == "immediate"
    assert parsed["drain-timeout"] == 5.0
    assert parsed["packet-mark"] is None and not parsed["inpod"]
    assert parsed.mesh.workloads, "without --config the built-in example runs"
    assert builtin_example_path().endswith("mesh.yaml")


@pytest.mark.parametrize("grace, expected", [("30", 25.0), ("10", 9.0), ("1", 1.0)])
def test_drain_timeout_from_the_termination_grace_period(tmp_path, monkeypatch, grace, expected):
    monkeypatch.delenv("CONNECTION_TERMINATION_DEADLINE", raising=False)
    monkeypatch.setenv("TERMINATION_GRACE_PERIOD_SECONDS", grace)
    assert options(tmp_path)["drain-timeout"] == expected


def test_inpod_mode_marks_packets_and_uses_the_default_socket(tmp_path):
    parsed = options(tmp_path, "--inpod")
    assert parsed["inpod-uds"] == "/var/run/ztunnel/ztunnel.sock"
    assert parsed["packet-mark"] == 1337
    assert options(tmp_path, "--inpod", "--packet-mark", "0")["packet-mark"] is None


def test_bad_values_are_usage_errors(tmp_path):
    with pytest.raises(usage.UsageError, match="--log-format must be json or text"):
        options(tmp_path, "--log-format", "xml")
    for option in ("--keepalive-interval", "--keepalive-timeout"):
        for value in ("0", "-1"):
            with pytest.raises(usage.UsageError, match="not a positive number of seconds"):
                options(tmp_path, option, value)
    assert options(tmp_path, "--keepalive-interval", "0.5")["keepalive-interval"] == 0.5


def test_an_unknown_drain_strategy_is_the_error_and_the_installed_names_alone(tmp_path, capsys):
    # Not a usage error: twistd would print its whole help on stdout before the error.
    with pytest.raises(SystemExit) as raised:
        options(tmp_path, "--drain-strategy", "last-mil")
    assert raised.value.code == (
        "ztunnel: --drain-strategy: unknown drain strategy last-mil; "
        "installed: client-evict, goaway-on-start, gradual, immediate, last-mile (--drain-strategy help describes them)"
    )
    assert capsys.readouterr().out == ""


def test_drain_strategy_help_speaks_to_operators_and_points_at_the_docs(tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        options(tmp_path, "--drain-strategy", "help")
    assert raised.value.code == 0
    out = capsys.readouterr().out
    described = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(described) >= set(BUILT_IN)
    assert "seed option" not in out  # a term of the design discussion, undefined for an operator
    assert tap.DRAINING_DOCS in out
    for name in BUILT_IN:
        assert described[name].split(None, 1)[1].startswith("when "), "each says when it acts, then what it does"
        assert (SOURCE / "docs" / "strategies" / f"{name}.rst").is_file()
    assert (SOURCE / "docs" / "draining.rst").is_file()


def test_a_bad_configuration_stops_start_up_with_its_errors(tmp_path):
    bad = tmp_path / "mesh.yaml"
    bad.write_text("workloads:\n- name: x\n  bogus: 1\n")
    with pytest.raises(SystemExit, match=r"mesh.yaml: workloads\[0\].bogus: unknown key"):
        options(tmp_path, "--config", str(bad))


def test_ztunnel_environment_variables_are_defaults(tmp_path, monkeypatch):
    config = tmp_path / "local.yaml"
    config.write_text(open(builtin_example_path()).read())
    monkeypatch.setenv("LOCAL_XDS_PATH", str(config))
    monkeypatch.setenv("INPOD_ENABLED", "true")
    monkeypatch.setenv("INPOD_UDS", str(tmp_path / "zds.sock"))
    monkeypatch.setenv("INPOD_MARK", "99")
    monkeypatch.setenv("NODE_NAME", "node-b")
    parsed = options(tmp_path)
    assert parsed["config"] == str(config)
    assert parsed["node"] == "node-b"
    assert parsed["inpod"] and parsed["inpod-uds"] == str(tmp_path / "zds.sock")
    assert parsed["packet-mark"] == 99
    # The command line wins.
    assert options(tmp_path, "--packet-mark", "7")["packet-mark"] == 7


def test_the_proxy_twistd_runs_freezes_what_start_up_made_and_one_in_a_test_does_not():
    from twisted.application import service

    frozen = []
    for parent, expected in ((None, []), (service.MultiService(), []), (service.Application("ztunnel"), ["frozen"])):
        root = tap.ProxyService("json", MemoryReactorClock(), freeze_heap=lambda: frozen.append("frozen"))
        if parent is not None:
            root.setServiceParent(parent)
        root.startService()
        root.stopService()
        assert frozen == expected


def test_the_proxy_twistd_runs_gives_freed_memory_back_every_interval():
    from twisted.application import service

    from ztwisted.sockets import GIVE_BACK_INTERVAL

    clock = MemoryReactorClock()
    given_back = []
    root = tap.ProxyService(
        "json", clock, freeze_heap=lambda: None, give_back_memory=lambda: given_back.append(clock.seconds())
    )
    root.setServiceParent(service.Application("ztunnel"))
    root.startService()
    clock.advance(GIVE_BACK_INTERVAL)
    clock.advance(GIVE_BACK_INTERVAL)
    root.stopService()
    clock.advance(GIVE_BACK_INTERVAL)
    assert given_back == [0, GIVE_BACK_INTERVAL, 2 * GIVE_BACK_INTERVAL]

    in_a_test = tap.ProxyService("json", clock, freeze_heap=lambda: None, give_back_memory=lambda: given_back.append(0))
    in_a_test.startService()
    clock.advance(GIVE_BACK_INTERVAL)
    in_a_test.stopService()
    assert len(given_back) == 3, "only the service twistd runs"
