"""Bounds on a long-running process's native heap (`adaspark serve`), set before torch loads.

Two things grew the server's RSS without bound in the soak (docs/results/soak/):

- Torch's bf16 matmuls (prefill chunks, bf16 verify widths) go through oneDNN, and every
  distinct row count (a prompt's last prefill chunk) builds new JIT primitives kept in two
  caches of 1024 entries each, ideep's (LRU_CACHE_CAPACITY) and oneDNN's own
  (ONEDNN_PRIMITIVE_CACHE_CAPACITY), ~280 KiB an entry per cache: 4 new entries per cache per
  new prompt length, so about 2 MiB per request, up to ~560 MiB. A forward reuses one shape
  per projection across all layers, so a few dozen entries hold every hot shape.
- glibc's sliding mmap threshold: large temporaries freed during the model load raise it to
  32 MiB, so per-request buffers below that come from the heap and fragment it. A fixed
  threshold sends them back to mmap.

A user's own setting of any of these (environment, GLIBC_TUNABLES) is left as it is.

And one on the Python heap: once the model has loaded, its ~180k Python objects (the
tokenizer's vocabulary, the weights' wrappers, the modules) go out of the cyclic collector's
reach (`freeze_loaded_heap`). A full collection walked them all: 161-232 ms, every stream of the
server stalled, once a minute in a 3-client soak (docs/results/zen3-s21/).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform

PRIMITIVE_CACHE_ENTRIES = 64
CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
# 1 MiB keeps a few rows of fp32 logits (192 KiB a row at 49k vocab) off mmap's syscall and
# page-fault path while bigger per-request buffers (prefill activations, wide logits) use it:
# 128 KiB cost ~2M page faults and ~3 s of system time per 4 soak requests (~25% of the CPU
# time), 1 MiB no more than the sliding threshold (7k faults, <0.1 s), interleaved in one run.
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# parameter -> (its environment variable, its GLIBC_TUNABLES name)
_MALLOPT = {M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
            M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold")}


def bound_primitive_caches(environ=os.environ) -> list[str]:
    """Cap the oneDNN/ideep primitive caches unless the user set them; the names it set.
    Effective only before torch's first oneDNN primitive, which reads them once."""
    unset = [name for name in CACHE_VARS if name not in environ]
    for name in unset:
        environ[name] = str(PRIMITIVE_CACHE_ENTRIES)
    return unset


def _user_set(parameter: int, environ) -> bool:
    var, tunable = _MALLOPT[parameter]
    return var in environ or f"{tunable}=" in environ.get("GLIBC_TUNABLES", "")


def fix_malloc_thresholds(environ=os.environ) -> list[int]:
    """Fixed glibc mmap/trim thresholds (no sliding) unless the user set them; the mallopt
    parameters it set. Nothing on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return []
    libc = ctypes.CDLL("libc.so.6")
    done = []
    for parameter, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                             (M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if not _user_set(parameter, environ) and libc.mallopt(parameter, value) == 1:
            done.append(parameter)
    return done


def bound_native_heap(environ=os.environ) -> None:
    """Both of the above: call first thing in a long-running command."""
    bound_primitive_caches(environ)
    fix_malloc_thresholds(environ)


def freeze_loaded_heap() -> int:
    """Collect the load's garbage, then move every object still alive into the collector's
    permanent generation (gc.freeze), where no collection walks it again; returns how many
    objects are frozen. Call once, when a long-running process has loaded what it keeps:
    objects made later are collected as before, and a frozen one is still freed when its last
    reference goes (only a cycle among frozen objects is never collected)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def resident_bytes() -> dict[str, int]:
    """This process's resident memory now (VmRSS) and at its peak (VmHWM), in bytes, from
    /proc/self/status (Linux; an empty dict elsewhere): what the load test and
    benchmarks/load_cost.py compare."""
    fields = {}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    fields[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return fields
