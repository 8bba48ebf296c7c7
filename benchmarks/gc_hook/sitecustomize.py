"""Imported at start-up by the ``twistd`` processes ``gc_pauses.py`` starts (PYTHONPATH): times
every collection of Python's cyclic garbage collector, by generation.

SIGUSR1 forgets what was timed so far (after the warm-up); SIGUSR2 writes what was timed
since to ``$ZTWISTED_GC_TRACE_DIR/gc-<pid>.json``. Other processes are left alone. Being
first on the PYTHONPATH, it hides any other ``sitecustomize`` (a distribution's) from the nodes.
"""

import gc
import json
import os
import signal
import sys
import time

if os.environ.get("ZTWISTED_GC_TRACE_DIR") and "twistd" in " ".join(sys.argv):
    _started = []
    _pauses = {0: [], 1: [], 2: []}

    def _time_collection(phase, info):
        if phase == "start":
            _started.append(time.perf_counter_ns())
        elif _started:
            _pauses[info["generation"]].append(time.perf_counter_ns() - _started.pop())

    def _forget(*_):
        for pauses in _pauses.values():
            pauses.clear()

    def _write(*_):
        path = os.path.join(os.environ["ZTWISTED_GC_TRACE_DIR"], f"gc-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pauses_ns": _pauses, "frozen": gc.get_freeze_count()}, f)
        os.replace(path + ".tmp", path)  # whole, or not there yet, for the reader

    gc.callbacks.append(_time_collection)
    signal.signal(signal.SIGUSR1, _forget)
    signal.signal(signal.SIGUSR2, _write)
