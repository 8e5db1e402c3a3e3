"""Session 22, ad hoc: a verify of 1 / 2 / 4 / 8 tree rows at contexts 16 and 512 (widths
interleaved), median ms and x one row: the rows' cost before and with attention.

    .venv/bin/python docs/results/zen3-s22/rows.py 16,512 1,2,4,8 40

With a fourth argument, an environment variable that a patched native build reads at each
call (kv-side-prefetch.patch: ADASPARK_SIDEFETCH), each verify runs with it 0 and 1,
alternated, and the medians of both are printed:

    .venv/bin/python docs/results/zen3-s22/rows.py 16,512,2000 1,2,4,8 40 ADASPARK_SIDEFETCH
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
toggle = sys.argv[4] if len(sys.argv) > 4 else None
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
            for arm in (("0", "1") if rep % 2 else ("1", "0")) if toggle else ("",):
                if toggle:
                    os.environ[toggle] = arm
                start = time.perf_counter()
                model.verify(tokens, depths, mask)
                times.setdefault((ctx, n, arm), []).append(time.perf_counter() - start)
for ctx in sorted(contexts):
    if toggle:
        for n in widths:
            off, on = (statistics.median(times[(ctx, n, a)]) for a in "01")
            print(f"ctx {ctx:5d} rows {n:2d}: off {off * 1e3:7.2f} ms  on {on * 1e3:7.2f} ms  "
                  f"on/off {on / off:.3f}")
        continue
    one = statistics.median(times[(ctx, 1, "")])
    print(ctx, " ".join(f"{n}:{statistics.median(times[(ctx, n, '')]) * 1e3:.2f}ms"
                        f"({statistics.median(times[(ctx, n, '')]) / one:.2f}x)" for n in widths))
