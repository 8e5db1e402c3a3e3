"""Session 22, ad hoc, with kv-side-prefetch.patch applied and built: the next layer's cached
K/V prefetched by the FFN matmuls' tasks (ADASPARK_SIDEFETCH=1) or not (0), alternated call by
call in one process; median ms of a tree verify per context and width.

    .venv/bin/python docs/results/zen3-s22/kv_side_prefetch.py 16,512,2000 1,2,4,8 40
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from verify_cost import binary_tree  # noqa: E402

from adaspark.model.sources import resolve_model  # noqa: E402
from adaspark.model.transformer import Transformer  # noqa: E402

torch.set_num_threads(2)
contexts = [int(x) for x in sys.argv[1].split(",")]
widths = [int(x) for x in sys.argv[2].split(",")]
reps = int(sys.argv[3])
model = Transformer.from_gguf(resolve_model(None), precision="fast",
                              max_context=max(contexts) + 64)
model.prefill([(11 * i) % 1000 + 100 for i in range(max(contexts))])
times: dict = {}
for ctx in sorted(contexts, reverse=True):
    model.truncate(ctx)
    for rep in range(reps):
        for n in widths:
            depths, mask = binary_tree(n)
            tokens = [(17 * i) % 1000 + 100 for i in range(n)]
            for arm in ("0", "1") if rep % 2 else ("1", "0"):
                os.environ["ADASPARK_SIDEFETCH"] = arm
                start = time.perf_counter()
                model.verify(tokens, depths, mask)
                times.setdefault((ctx, n, arm), []).append(time.perf_counter() - start)
for ctx in sorted(contexts):
    for n in widths:
        off, on = (statistics.median(times[(ctx, n, a)]) for a in "01")
        print(f"ctx {ctx:5d} rows {n:2d}: off {off * 1e3:7.2f} ms  on {on * 1e3:7.2f} ms  "
              f"on/off {on / off:.3f}")
