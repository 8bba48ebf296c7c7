"""Starting and stopping a node from the command line: what it logs, how it refuses to start, how it exits."""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.integration.conftest import NET
from tests.support import close_listener, listening_socket, mesh_workload, mesh_workloads, wait_until
from ztwisted.tools.harness import NodeProcess, twistd_command

pytestmark = pytest.mark.integration

WORKLOAD_IP = f"127.{NET}.6.1"
CONTROL_IP = f"127.{NET}.6.254"
CONTROL_PORTS = {"--socks5": 15080, "--outbound": 15001, "--admin": 15000, "--metrics": 15020, "--readiness": 15021}


def control_listeners(ip: str = CONTROL_IP) -> list[str]:
    return [f"{option}=tcp:{port}:interface={ip}" for option, port in CONTROL_PORTS.items()]


@pytest.fixture
def mesh(tmp_path):
    config = tmp_path / "mesh.yaml"
    config.write_text(mesh_workloads(mesh_workload("solo", WORKLOAD_IP, "node-s")))
    return config


def test_start_up_logs_one_line_per_listener_with_its_address(tmp_path, mesh):
    node = NodeProcess(tmp_path / "node", name="node-s", control_ip=CONTROL_IP, config=mesh, node="node-s").start()
    try:
        events = node.log_events()
    finally:
        node.stop()
    listening = {event["address"]: event["message"] for event in events if event["message"].startswith("listening on ")}
    expected = {f"{CONTROL_IP}:{port}": option for option, port in CONTROL_PORTS.items()}
    expected |= {
        f"{WORKLOAD_IP}:15008": "HBONE inbound of default/solo",
        f"{WORKLOAD_IP}:15006": "plaintext inbound of default/solo",
    }
    assert set(listening) == set(expected)
    for address, what in expected.items():
        assert listening[address].startswith(f"listening on {address}: ") and what in listening[address]
    noise = [
        event["message"]
        for event in node.log_events()
        if "factory" in event["message"].lower() or " starting on " in event["message"] or "Port" in event["message"]
    ]
    assert noise == [], "Twisted's per-listener lines (the one line above says it all)"


def test_start_up_log_in_text_format_has_the_same_lines(tmp_path, mesh):
    text = start_and_stop(tmp_path, mesh, "--log-format", "text")
    assert f"listening on {WORKLOAD_IP}:15008: HBONE inbound of default/solo" in text
    assert f"listening on {CONTROL_IP}:15000: admin (--admin)" in text
    assert "Starting factory" not in text and " starting on " not in text and "Closed)" not in text


def ztunnel_command(tmp_path, mesh, *args: str, twistd_options: tuple[str, ...] = ()) -> list[str]:
    """``twistd -n ztunnel`` in the foreground with this test's state directory and mesh, then ``args``."""
    return twistd_command() + [
        "-n",
        "--pidfile=",
        *twistd_options,
        "ztunnel",
        "--state-dir",
        str(tmp_path / "state"),
        "--config",
        str(mesh),
        *args,
    ]


def start_and_stop(tmp_path, mesh, *args: str, twistd_options: tuple[str, ...] = ()) -> str:
    """Everything a ``twistd -n ztunnel`` prints from its start until it stopped on SIGTERM."""
    log = tmp_path / "twistd.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            ztunnel_command(
                tmp_path, mesh, "--node", "node-s", *control_listeners(), *args, twistd_options=twistd_options
            ),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: "node proxy ready" in log.read_text() or process.poll() is not None,
            timeout=20,
            what="the node to start",
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(20)
    return log.read_text()


def test_twistd_ztunnel_runs_on_ztwisted_epoll_unless_another_reactor_is_named(tmp_path, mesh):
    assert "reactor class: ztwisted.reactor.LeanEPollReactor." in start_and_stop(tmp_path, mesh)
    named = start_and_stop(tmp_path, mesh, twistd_options=("--reactor=poll",))
    assert "reactor class: twisted.internet.pollreactor.PollReactor." in named
    assert "node proxy ready" in named


@pytest.mark.parametrize("option", ["--admin", "--readiness"])
def test_a_port_in_use_at_start_up_is_one_line_naming_the_option_and_the_address(tmp_path, mesh, option):
    # A port of its own (the default 15021 may be held on the wildcard address by a demo proxy left running).
    taken = listening_socket(CONTROL_IP, 0, backlog=1)  # no SO_REUSEPORT: the node cannot share it
    port = taken.getsockname()[1]
    listeners = [
        f"{option}=tcp:{port}:interface={CONTROL_IP}" if arg.startswith(f"{option}=") else arg
        for arg in control_listeners()
    ]
    try:
        done = subprocess.run(
            ztunnel_command(tmp_path, mesh, *listeners),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        close_listener(taken)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output
    mentions = [line for line in output.splitlines() if str(port) in line]
    assert len(mentions) == 1, output
    assert f"{option}: cannot listen on {CONTROL_IP}:{port}: Address already in use" in mentions[0]


def test_after_quitquitquit_the_process_exits_without_interpreter_teardown(tmp_path, mesh):
    # Python's verbose mode writes "# cleanup[...]" lines while it tears the interpreter
    # down: the slow part of an exit without a signal (twistd re-raises SIGTERM/SIGINT).
    node = NodeProcess(
        tmp_path / "node", name="node-s", control_ip=CONTROL_IP, config=mesh, node="node-s", env={"PYTHONVERBOSE": "1"}
    ).start()
    try:
        assert node.http("admin", "/quitquitquit", method="POST")[0] == 200
        assert node.process.wait(20) == 0
    finally:
        node.kill()
    output = node.log_path.read_text(errors="replace")
    assert any(event["message"] == "Server Shut Down." for event in node.log_events())
    assert "# cleanup[" not in output
