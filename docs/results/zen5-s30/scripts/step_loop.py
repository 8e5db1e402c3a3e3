"""A continuous-batching step of N plain decodes, repeated for a while (for `perf record`):
N sequences one row each at contexts spread over [C/2, 3C/2], the embedded model, 2 threads.
Prints the median step time.

    perf record -o /tmp/p.data .venv/bin/python docs/results/zen5-s30/scripts/step_loop.py N C SECONDS
"""
import statistics, sys, time
import numpy as np, torch
from adaspark.engine import Engine
from adaspark.model.sources import resolve_model
torch.set_num_threads(2)
n, ctx, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
e = Engine.load(resolve_model(None), arm="ar", max_context=2 * ctx + 64)
t = e.target
rng = np.random.default_rng(0)
caches = []
for s in range(n):
    c = t.new_cache()
    with t.using(c):
        t.prefill(rng.integers(100, 40000, int(ctx * (0.5 + s / max(1, n - 1)))).tolist())
    caches.append(c)
one = (np.array([5]), np.array([0]), np.array([[True]]))
ts = []
stop = time.perf_counter() + seconds
while time.perf_counter() < stop:
    a = time.perf_counter(); t.verify_many(caches, [one] * n); ts.append(time.perf_counter() - a)
print(f"n {n} ctx {ctx}: median step {statistics.median(ts) * 1e3:.2f} ms over {len(ts)}", flush=True)
