"""Which CPython build a Python is: the same ztwisted code costs a third less CPU per message on one than another.

Under Debian's ``/usr/bin/python3.11`` (a fixed-address executable with the interpreter linked in)
ztwisted's nodes spent 34 % less CPU per pinned round trip, 15 % per connection and 7 % per MB than
under pyenv's build (``--enable-shared``: the interpreter in a position-independent ``libpython``);
see ``benchmarks/README.md``, "The interpreter build". So the reports name the build.
"""

from __future__ import annotations

import subprocess

# Run by the Python described, so that a venv's interpreter answers for itself. sysconfig
# cannot tell: Debian's static executable reports the settings of its shared-library build.
_PROBE = """
import os, platform
executable = os.path.realpath("/proc/self/exe")
with open(executable, "rb") as f:
    elf_type = f.read(18)[16]  # e_type, low byte (little-endian ELF): 2 fixed-address, 3 position-independent
with open("/proc/self/maps") as f:
    library = next((line.split()[-1] for line in f if "/libpython" in line), None)
where = f"in {os.path.basename(library)}" if library else "linked into the executable"
layout = "position-independent" if elf_type == 3 else "fixed-address"
print(f"{platform.python_implementation()} {platform.python_version()}, {executable} ({layout}, interpreter {where})")
"""


def describe(python: str) -> str:
    """One line: version, executable and how the interpreter is linked, e.g. for ``sys.executable``."""
    try:
        result = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:  # (a report must not be lost to its first line)
        return f"{python} (not described: {e})"
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return f"{python} (not described: {last_line})"
    return result.stdout.strip()


if __name__ == "__main__":
    import sys

    # python benchmarks/interpreter.py [PYTHON ...]: describe these Pythons (default: this one)
    for python in sys.argv[1:] or [sys.executable]:
        print(describe(python))
