"""``ztunnel-lab``: ztwisted's drain strategies measured on live traffic through one pod shutdown.

Python API::

    from ztwisted.tools.lab import LabConfig, Timeline, run_lab, render_svg, format_table
    results = run_lab(LabConfig(strategies=["immediate", "last-mile"], timeline=Timeline().scaled(8)))

See docs/drain-lab.rst.
"""

from ztwisted.tools.lab.chart import render_svg
from ztwisted.tools.lab.clients import Traffic
from ztwisted.tools.lab.report import format_table, write_json
from ztwisted.tools.lab.runner import run_lab
from ztwisted.tools.lab.scenario import DEFAULT_STRATEGIES, LabConfig, LabError, Strategy, Timeline

__all__ = [
    "DEFAULT_STRATEGIES",
    "LabConfig",
    "LabError",
    "Strategy",
    "Timeline",
    "Traffic",
    "format_table",
    "render_svg",
    "run_lab",
    "write_json",
]
