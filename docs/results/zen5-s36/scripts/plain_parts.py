"""Median per-call time (us) of each part of a one-row step, `ar` against the default arm (and
of the default's drafted 2-row steps), on
issue 41's 24 short first turns (cap 64), each from an empty store, interleaved per request.
The parts are wrapped with perf_counter (about 0.1 us each); a step's parts are kept only when
its verify had one row.

    ADASPARK_NATIVE=avx2 .venv/bin/python docs/results/zen5-s36/scripts/plain_parts.py
"""
import statistics as st
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from short_turns import setup

import torch

from adaspark import batch as B
from adaspark import cached as C
from adaspark import sequence as SQ
from adaspark import speculative as S
from adaspark import threads as TH
from adaspark.drafter import runtime as DR
from adaspark.model import cache as KC
from adaspark.scheduler import round as R

arms = ["ar", "adaspark,gate"]
reqs, target, engs = setup(arms)
step_parts = defaultdict(float)
T = defaultdict(list)  # (arm, part) -> [us per step]
cur = [None]


def wrap(owner, name, label):
    f = getattr(owner, name)

    def w(*a, **k):
        s = time.perf_counter()
        r = f(*a, **k)
        step_parts[label] += time.perf_counter() - s
        return r
    setattr(owner, name, w)


parts = [(TH, "adapt", "adapt"), (SQ.Decode, "advance", "advance"),
         (S.RoundDecode, "advance", "advance"), (SQ.Decode, "row", "row"),
         (S.RoundDecode, "row", "row"), (S.Speculator, "price_step", "price_step"),
         (S.Speculator, "share_rows", "share_rows"),
         (SQ.Decode, "take", "take"), (S.RoundDecode, "take", "take"),
         (S.Speculator, "learn_shared_verify", "after_verify"),
         (R.Scheduler, "accept", "take:accept"), (R.Scheduler, "learn", "take:learn"),
         (S, "take_path", "take:take_path"), (S.Speculator, "report", "take:report"),
         (KC.KVCache, "commit", "take:kv.commit"), (C.CachedTokens, "commit", "take:slot.commit"),
         (DR.Drafter, "observe_taps", "take:observe_taps"), (R.Scheduler, "plan_round", "row:plan_round"),
         (torch, "stack", "stack"), (R.Scheduler, "_drafted", "row:_drafted (tree plan)"),
         (S.RoundDecode, "_draft", "row:draft (drafter)"), (DR.Drafter, "catch_up", "row:draft:catch_up"),
         (R.Scheduler, "_learn_tree_round", "take:learn:tree"), (R.Scheduler, "_ngram_tree", "row:ngram_tree")]
for p in parts:
    wrap(*p)
B.threads = TH
rows = [0]
vm = type(target).verify_many


def count_rows(self, caches, r, **k):
    rows[0] = sum(len(x[0]) for x in r)
    return vm(self, caches, r, **k)


type(target).verify_many = count_rows
wrap(type(target), "verify_many", "forward")
step = B.Batch.step


def timed_step(self, *a, **k):
    step_parts.clear()
    rows[0] = 0
    t = time.perf_counter()
    r = step(self, *a, **k)
    dt = time.perf_counter() - t
    arm = cur[0] if rows[0] == 1 else (f"{cur[0]} {rows[0]} rows drafted" if "row:draft (drafter)" in step_parts else None)
    if arm is not None:
        for k2, v in step_parts.items():
            T[(arm, k2)].append(1e6 * v)
        T[(arm, "step")].append(1e6 * dt)
        T[(arm, "step - forward")].append(1e6 * (dt - step_parts["forward"]))
    return r


B.Batch.step = timed_step
for _ in range(2):
    for msgs, tools in reqs:
        for a, e in engs.items():
            cur[0] = a
            e.generate(msgs, tools=tools, max_tokens=64)
arms = arms + ["adaspark,gate 2 rows drafted"]
names = sorted({k for _, k in T}, key=lambda k: (k != "step", k != "step - forward", k))
print(f"{'part':22s} " + " ".join(f"{a:>16s}" for a in arms) + "   (median us per one-row step)")
for k in names:
    print(f"{k:22s} " + " ".join(f"{st.median(T[(a, k)]) if T[(a, k)] else float('nan'):16.1f}"
                                 for a in arms))
