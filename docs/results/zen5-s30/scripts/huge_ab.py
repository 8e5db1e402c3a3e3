"""A step of N one-row sequences over caches on 4 KiB pages against caches madvised for
transparent huge pages (MADV_HUGEPAGE before their first write), steps alternated in one
process. With `--weights`, afterwards the same with the packed weights collapsed into huge pages
(MADV_COLLAPSE) for both sets: before / after.

    .venv/bin/python docs/results/zen5-s30/scripts/huge_ab.py N CONTEXT STEPS
"""
import ctypes, statistics, sys, time
import numpy as np, torch
from adaspark.engine import Engine
from adaspark.model.sources import resolve_model
torch.set_num_threads(2)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20

def advise(t, how):
    a = t.data_ptr(); b = a + t.numel() * t.element_size()
    lo, hi = (a + HUGE - 1) // HUGE * HUGE, b // HUGE * HUGE
    if hi > lo:
        r = libc.madvise(lo, hi - lo, how)
        return r == 0 or ctypes.get_errno()
    return "small"

n, ctx, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
e = Engine.load(resolve_model(None), arm="ar", max_context=2 * ctx + 64)
t = e.target
rng = np.random.default_rng(0)
sets = {"4k": [], "huge": []}
for name, caches in sets.items():
    for s in range(n):
        c = t.new_cache()
        if name == "huge":
            advise(c.k, 14); advise(c.v, 14)
        with t.using(c):
            t.prefill(rng.integers(100, 40000, int(ctx * (0.5 + s / max(1, n - 1)))).tolist())
        caches.append(c)
print(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split("\n")[0].strip(), "anon huge")
one = (np.array([5]), np.array([0]), np.array([[True]]))
ts = {k: [] for k in sets}
outs = {}
for i in range(steps):
    for name in (("4k", "huge") if i % 2 == 0 else ("huge", "4k")):
        a = time.perf_counter(); o = t.verify_many(sets[name], [one] * n); ts[name].append(time.perf_counter() - a)
        outs.setdefault(name, o.argmax.tolist())
for k, v in ts.items():
    print(f"{k}: median {statistics.median(v) * 1e3:.2f} ms over {len(v)}")
print("same argmax:", outs["4k"] == outs["huge"])
