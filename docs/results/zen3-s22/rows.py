"""Session 22, ad hoc: a verify of 1 / 2 / 4 / 8 tree rows at contexts 16 and 512 (widths
interleaved), median ms and x one row: the rows' cost before and with attention.

    .venv/bin/python docs/results/zen3-s22/rows.py 16,512 1,2,4,8 40
"""

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
    for _ in range(reps):
        for n in widths:
            depths, mask = binary_tree(n)
            tokens = [(17 * i) % 1000 + 100 for i in range(n)]
            start = time.perf_counter()
            model.verify(tokens, depths, mask)
            times.setdefault((ctx, n), []).append(time.perf_counter() - start)
for ctx in sorted(contexts):
    one = statistics.median(times[(ctx, 1)])
    print(ctx, " ".join(f"{n}:{statistics.median(times[(ctx, n)]) * 1e3:.2f}ms"
                        f"({statistics.median(times[(ctx, n)]) / one:.2f}x)" for n in widths))
