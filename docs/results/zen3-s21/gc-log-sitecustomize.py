"""The garbage-collection logger behind gc-*.txt: put this folder on PYTHONPATH (as
`sitecustomize.py`) and every `serve` process writes one line per collection to $GC_LOG: wall
time, generation, the collection's duration and what it collected."""

import gc
import os
import sys
import time

if "serve" in sys.argv:
    _start = {}
    _log = open(os.environ.get("GC_LOG", f"/tmp/gclog-{os.getpid()}.txt"), "w", buffering=1)

    def _note(phase, info):
        if phase == "start":
            _start["t"] = time.perf_counter()
        else:
            ms = (time.perf_counter() - _start["t"]) * 1e3
            _log.write(f"{time.time():.3f} gen{info['generation']} {ms:.2f} ms "
                       f"collected {info['collected']}\n")

    gc.callbacks.append(_note)
