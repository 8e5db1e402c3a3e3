"""The server's native-heap bounds (adaspark/memory.py): `adaspark serve` caps the oneDNN/ideep
primitive caches and fixes glibc's mmap threshold before torch loads, a user's own settings
win, and with the caps a stream of new matmul shapes (new prompt lengths) or of mixed requests
stops growing the heap once the caches are full. Each check runs in a fresh interpreter: the
caches read their capacity once, at the first oneDNN primitive."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from adaspark import memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
USER_VARS = (*memory.CACHE_VARS, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
             "GLIBC_TUNABLES")

HEAP = """
import ctypes, json, os, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def live():  # bytes handed out by malloc: in the arenas plus mmapped chunks
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
"""


def run_python(code: str, env_changes: dict[str, str] | None = None, timeout: float = 120):
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    env.update({"OMP_NUM_THREADS": "1", **(env_changes or {})})
    out = subprocess.run([sys.executable, "-c", HEAP + textwrap.dedent(code)], env=env,
                         capture_output=True, text=True, timeout=timeout, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_caps_are_set_only_where_the_user_left_them_unset():
    environ = {"LRU_CACHE_CAPACITY": "7"}
    assert memory.bound_primitive_caches(environ) == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert environ == {"LRU_CACHE_CAPACITY": "7",
                       "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(memory.PRIMITIVE_CACHE_ENTRIES)}


@glibc
def test_a_users_malloc_thresholds_are_left_alone():
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536:"
                                  "glibc.malloc.trim_threshold=65536"}
    assert memory.fix_malloc_thresholds(tunables) == []
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    assert memory.fix_malloc_thresholds(env) == []


@glibc
def test_serve_fixes_the_mmap_threshold_and_caps_the_caches_before_anything_else():
    # `serve --parallel 0` fails its option check, after the settings and before any load.
    got = run_python("""
        from adaspark.cli import main
        from adaspark.memory import CACHE_VARS
        rc = main(["serve", "--parallel", "0", "--port", "1"])
        big = libc.malloc(8 << 20)
        libc.free(big)  # a sliding threshold would now be 8 MiB, taking 4 MiB from the heap
        before = libc.mallinfo2().hblks
        p = libc.malloc(4 << 20)
        mmapped = libc.mallinfo2().hblks - before
        libc.free(p)
        print(json.dumps({"rc": rc, "mmapped": mmapped,
                          "caps": [os.environ.get(v) for v in CACHE_VARS]}))
    """)
    assert got == {"rc": 2, "mmapped": 1, "caps": [str(memory.PRIMITIVE_CACHE_ENTRIES)] * 2}


SHAPES = """
import torch
import torch.nn.functional as F
from adaspark.memory import PRIMITIVE_CACHE_ENTRIES, bound_native_heap
bound_native_heap()
w = torch.randn(960, 576).to(torch.bfloat16)
rows = iter(range(1, 10_000))  # every call a new row count: a new prompt length's last chunk
def calls(n):
    for _ in range(n):
        F.linear(torch.randn(next(rows), 576).to(torch.bfloat16), w)
with torch.inference_mode():
    calls(2 * PRIMITIVE_CACHE_ENTRIES)  # the caps' worth, twice over
    start = live()
    calls(160)
print(json.dumps((live() - start) / 160 / 1024))
"""


def test_new_matmul_shapes_stop_growing_the_heap_once_the_capped_caches_are_full():
    # Measured: ~560 KiB per new shape uncapped (two caches of 1024), ~0 once capped and full.
    uncapped = run_python(SHAPES, {v: "1024" for v in memory.CACHE_VARS})
    if uncapped < 100:
        pytest.skip(f"bf16 matmul keeps no primitive cache here ({uncapped:.0f} KiB a shape)")
    capped = run_python(SHAPES)
    assert capped < 50, f"{capped:.0f} KiB per new shape (uncapped: {uncapped:.0f})"


ENGINE = """
import sys, time
from adaspark.memory import bound_native_heap
bound_native_heap()  # what `adaspark serve` does first
from adaspark.engine import Engine
from adaspark.sampling import SamplingParams
from adaspark.server.worker import EngineWorker, Job
worker = EngineWorker(lambda: Engine.load(store=sys.argv[1]))
while not worker.ready:
    time.sleep(0.2)
def request(k):  # every request a new prompt length, a third of them sampled
    ids = [(37 * i + k) % 9000 + 100 for i in range(40 + 17 * k)]
    sampling = SamplingParams(temperature=0.7, seed=k) if k % 3 == 0 else None
    worker.submit(Job(ids, 8, [], sampling=sampling)).result()
for k in range(24):  # fills the capped caches (4 entries a new length)
    request(k)
start = live()
for k in range(24, 40):
    request(k)
print(json.dumps((live() - start) / 16 / 2**20), flush=True)
worker.close()
os._exit(0)  # the interpreter's exit after an engine thread aborts (a joinable std::thread)
"""


@pytest.mark.slow
@glibc
def test_the_engine_worker_stops_growing_the_heap_once_warm(tmp_path):
    # Measured on the soak's mix: ~2 MiB per request uncapped, flat once the caches are full.
    grown = run_python(ENGINE.replace("sys.argv[1]", repr(str(tmp_path / "store"))),
                       timeout=600)
    assert grown < 0.5, f"{grown:.2f} MiB of live native heap per request after warm-up"
