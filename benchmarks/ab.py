"""Before/after: interleaved `run.py --quick` runs of two ztwisted installs, medians per metric.

    python benchmarks/ab.py BEFORE_PYTHON AFTER_PYTHON [--repetitions 3] [--paths envoy,ztwisted] [--net 41]

Each Python must have its own ztwisted *installed* (e.g. two venvs, one per
commit): the nodes run as that Python's twistd. The runs alternate (before,
after, before, after, ...) so that a shared machine's drift hits both alike;
the table shows, per path and metric, the median over the repetitions of
each run's own median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from run import METRICS, _fmt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the Python of the 'before' install")
    parser.add_argument("after", help="the Python of the 'after' install")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument(
        "--paths",
        default="envoy,ztwisted",
        help="passed to run.py; other paths are a reference for the machine's state",
    )
    parser.add_argument("--net", type=int, default=41)
    args = parser.parse_args()
    run_py = Path(__file__).with_name("run.py")
    pythons = {"before": args.before, "after": args.after}
    medians: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="ztwisted-ab-") as scratch:
        for repetition in range(args.repetitions):
            for label, python in pythons.items():
                out = Path(scratch) / f"{label}-{repetition}.json"
                subprocess.run(
                    [python, str(run_py), "--quick", "--net", str(args.net), "--paths", args.paths, "--json", str(out)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                medians[label].append(json.loads(out.read_text())["medians"])
                print(f"repetition {repetition + 1}: {label} done", file=sys.stderr)
    paths = list(medians["before"][0])
    print("| path | metric | before | after |")
    print("|---|---|---|---|")
    for path in paths:
        for key, label, unit, _higher in METRICS:
            row = []
            for side in ("before", "after"):
                values = [m[path].get(key) for m in medians[side] if m[path].get(key) is not None]
                row.append(_fmt(statistics.median(values)) if values else "-")
            print(f"| {path} | {label.strip()} ({unit}) | {row[0]} | {row[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
