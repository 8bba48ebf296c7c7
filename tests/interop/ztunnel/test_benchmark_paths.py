"""``benchmarks/run.py``'s namespaced paths start and carry bytes: ``ztunnel`` and ``ztwisted-netns``.

A smoke test of the benchmark's own machinery (``paths.NamespacedPair``, as
``run.py`` builds it), with the benchmark's own clients (``load.py``): if the
ztunnel path cannot start, or its SOCKS5 entry or HBONE hop does not carry
an echo and a bulk transfer, this fails before a benchmark run would. No
timing is asserted.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.interop.ztunnel.support import NET
from ztwisted.ca import CertificateAuthority
from ztwisted.tools.lab.netns import Namespaces

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _benchmark_module(name: str):
    """``benchmarks/<name>.py`` (a directory of scripts, not a package) under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


paths = _benchmark_module("paths")
load = _benchmark_module("load")


@pytest.mark.parametrize(
    ("name", "kind", "workers", "roles"),
    [
        ("ztunnel", "ztunnel", 1, {"node-a-ztunnel", "node-b-ztunnel"}),
        ("ztwisted-netns", "ztwisted", None, {"node-a-ztwisted", "node-b-ztwisted"}),
    ],
)
def test_namespaced_path_carries_echo_and_bulk(tmp_path, ztunnel_install, name, kind, workers, roles):
    state_dir = tmp_path / "state"
    CertificateAuthority.load_or_create_dev(state_dir)  # as run.py does for its ztwisted paths
    namespaces = Namespaces(NET)
    path = paths.NamespacedPair(
        1,
        kind,
        kind,
        workers,
        name=name,
        net=NET,
        namespaces=namespaces,
        workdir=tmp_path,
        state_dir=state_dir,
        install=ztunnel_install,
    )

    def echo_and_bulk() -> float:
        with load.open_connection(path.echo) as sock:
            load.echo_once(sock)
        return load.bulk(path.sink, 1_000_000)  # raises unless the sink acknowledged every byte

    try:
        path.start()
        assert path.call(echo_and_bulk) > 0
        assert set(path.pids()) == roles
        assert path.apps is not None and path.apps.process.poll() is None
    finally:
        path.stop()
        namespaces.destroy()
    if kind == "ztunnel":
        # run.py's ztunnel runs one worker thread, as Envoy's --concurrency 1.
        assert "numWorkerThreads: 1" in (tmp_path / name / "node-a.log").read_text()
