"""The per-token host path A/B behind host_ab-*.txt, in one process: Transformer's _head,
_tokens, _rows and verify_many as in another tree (BASE: a worktree of a04d851) against this
tree's, alternated request by request (old, new, then new, old), on three chat prompts of 200
tokens; prints the per-token wall time (median), the pairs the new code won and whether the
texts are equal.

    .venv/bin/python docs/results/zen3-s21/host_ab.py BASE ARM REPS
"""

import importlib.util
import statistics
import sys
import time

import torch

from adaspark.engine import Engine
from adaspark.model import transformer as new_mod

base, arm, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
spec = importlib.util.spec_from_file_location("old_transformer",
                                              f"{base}/adaspark/model/transformer.py")
old_mod = importlib.util.module_from_spec(spec)
sys.modules["old_transformer"] = old_mod
spec.loader.exec_module(old_mod)
names = ("_head", "_tokens", "_rows", "verify_many")
impl = {"new": {n: new_mod.Transformer.__dict__[n] for n in names},
        "old": {n: old_mod.Transformer.__dict__[n] for n in names}}


def use(which):
    for n, f in impl[which].items():
        setattr(new_mod.Transformer, n, f)


eng = Engine.load(arm=arm)
msgs = [[{"role": "user", "content": q}] for q in
        ["Write a short story about a robot learning to paint.",
         "Explain how a hash map works, with an example in Python.",
         "What are the main causes of the French revolution?"]]
eng.generate(msgs[0], max_tokens=16)
res, texts = {"old": [], "new": []}, {"old": [], "new": []}
for rep in range(reps):
    for m in msgs:
        for which in (("old", "new") if rep % 2 == 0 else ("new", "old")):
            use(which)
            t = time.perf_counter()
            g = eng.generate(m, max_tokens=200)
            res[which].append((time.perf_counter() - t) / len(g.token_ids) * 1e3)
            texts[which].append(g.text)
o, n = statistics.median(res["old"]), statistics.median(res["new"])
won = sum(a < b for a, b in zip(res["new"], res["old"], strict=True))
print(f"{arm}: per token ms, median of {len(res['old'])}: old {o:.3f}, new {n:.3f}, "
      f"new/old {n / o:.3f}; pairs new<old {won}/{len(res['old'])}; "
      f"same texts {texts['old'] == texts['new']}")
