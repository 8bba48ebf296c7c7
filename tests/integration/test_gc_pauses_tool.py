"""``benchmarks/gc_pauses.py`` runs, and the nodes it starts are real ``twistd ztunnel`` processes
that froze their start-up objects (``gc.freeze`` in ``ProxyService.startService``).

A smoke test of the benchmark tool and the only check of the freeze in a real process; no
pause length is asserted (speed is the benchmarks' business).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import NET

pytestmark = pytest.mark.integration

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_gc_pauses_reports_both_nodes_and_their_frozen_start_up_objects():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gc_pauses.py"), "--net", str(NET), "--seconds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^\d+ short connections in 1 s \(\d+/s\), 0 errors$", run.stdout, re.MULTILINE), run.stdout
    rows = re.findall(r"^\| (node-[ab]) \| ([\d,]+) \| ([012]) \| (\d+) \|", run.stdout, re.MULTILINE)
    assert {(node, generation) for node, _, generation, _ in rows} == {
        (node, generation) for node in ("node-a", "node-b") for generation in "012"
    }
    assert all(int(frozen.replace(",", "")) > 10_000 for _, frozen, _, _ in rows), run.stdout
