"""verify_many (N sequences, one row each, context C) against one sequence's chain of N rows at the same
context: what a continuous-batching step of N plain decodes costs (issue 44's data rate, issue 41's
4-client step). Medians of 15 calls, the embedded model, 2 threads.

    .venv/bin/python docs/results/spr-s29/scripts/verify_many_ctx.py CONTEXT
"""
import statistics, sys, time
import numpy as np, torch
from adaspark.engine import Engine
from adaspark.model.sources import resolve_model
torch.set_num_threads(2)
e = Engine.load(resolve_model(None), arm="ar", max_context=769)
t = e.target
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 200
rng = np.random.default_rng(0)
caches = []
for s in range(32):
    c = t.new_cache()
    with t.using(c):
        t.prefill(rng.integers(100, 40000, ctx).tolist())
    caches.append(c)
def timeit(f, reps=15):
    f(); ts = []
    for _ in range(reps):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e3
one = (np.array([5]), np.array([0]), np.array([[True]]))
for n in (1, 2, 4, 8, 16, 24, 32):
    many = timeit(lambda: t.verify_many(caches[:n], [one] * n))
    chain = (np.arange(n) + 5, np.arange(n), np.tril(np.ones((n, n), bool)))
    with t.using(caches[0]):
        single = timeit(lambda: t.verify(*chain))
    print(f"ctx {ctx} n {n:2d}: many {many:6.2f} ms  one-seq chain {single:6.2f} ms", flush=True)
