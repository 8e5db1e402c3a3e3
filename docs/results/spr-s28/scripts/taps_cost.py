"""A one-row verify at context 300 with and without the drafter's three tap layers, interleaved, 2000 each
(medians): what the taps cost the target's forward.

    .venv/bin/python docs/results/spr-s28/scripts/taps_cost.py
"""
import statistics as st
import time

import numpy as np
import torch

torch.set_num_threads(2)
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer

path = resolve_model(None); target = Transformer(read_gguf(path))
target.prefill(list(range(100, 400)))
mask = np.ones((1, 1), dtype=bool)
res = {}
for rep in range(2000):
    for taps in ((), (1, 14, 27)):
        t = time.perf_counter()
        target.verify([500 + rep % 50], [0], mask, taps)
        res.setdefault(taps, []).append(time.perf_counter() - t)
for k, v in res.items():
    print(k, "%.3f ms" % (1000 * st.median(v)))
