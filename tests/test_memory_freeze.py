"""memory.freeze_loaded_heap: what is alive when it runs leaves the collector's reach (no
collection walks it again), what comes later is collected as before."""

from __future__ import annotations

import gc
import weakref

from adaspark.memory import freeze_loaded_heap


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_objects_alive_at_the_freeze_are_never_walked_and_later_ones_still_are():
    kept = Node()
    held = weakref.ref(kept)
    try:
        frozen = freeze_loaded_heap()
        assert frozen == gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert held() is not None  # a cycle alive at the freeze: no collection reaches it
        later = Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # made after the freeze: collected as before
    finally:
        gc.unfreeze()
    gc.collect()
    assert held() is None  # back within reach: the cycle is freed
