"""Per 1-row round: the step's time, the target's forward (verify_many) within it, and the host
time around it, for each arm on issue 41's 24 short first turns (cap 64), the arms interleaved
per request, each from an empty store. Rounds with more than one row are counted apart.

    .venv/bin/python docs/results/spr-s28/scripts/round_overhead.py "ar;ngram;adaspark,gate"
"""
import statistics as st
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import torch

torch.set_num_threads(2)
import concurrency as cc

from adaspark import batch as B
from adaspark.bench.conversations import load_conversations
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator

reqs = cc.first_turns(load_conversations(cc.CONVERSATIONS), 500)[:24]
path = resolve_model(None); gguf = read_gguf(path); target = Transformer(gguf); tok = Tokenizer.from_gguf(gguf)
st_ = Path(tempfile.mkdtemp())
arms = sys.argv[1].split(";")
engs = {a: Engine(target, tok, path, load_speculator(target, path, tok.stop_ids, ModelOptions(arm=a, store=st_ / a.replace(",", "+"), fresh=True))) for a in arms}
rec = []
vm = type(target).verify_many
fw = [0.0]
nrows = [0]
def verify_many(self, caches, rows, **k):
    nrows[0] = sum(len(r[0]) for r in rows)
    t = time.perf_counter(); r = vm(self, caches, rows, **k); fw[0] += time.perf_counter() - t; return r
type(target).verify_many = verify_many
step = B.Batch.step
def timed_step(self, *a, **k):
    fw[0] = 0.0
    t = time.perf_counter(); r = step(self, *a, **k); dt = time.perf_counter() - t
    rec.append((cur[0], dt, fw[0]) if nrows[0] == 1 else (cur[0] + '-wide', dt, fw[0]))
    return r
B.Batch.step = timed_step
cur = [None]
for i, (msgs, tools) in enumerate(reqs):
    for a, e in engs.items():
        cur[0] = a
        e.generate(msgs, tools=tools, max_tokens=64)
for a in arms:
    xs = [(dt, f) for (arm, dt, f) in rec if arm == a and f > 0]
    print(a, len(xs), "step median %.3f ms, forward median %.3f, host (step - forward) median %.3f ms, mean %.3f" % (
        1000 * st.median(d for d, f in xs), 1000 * st.median(f for d, f in xs), 1000 * st.median(d - f for d, f in xs), 1000 * st.mean(d - f for d, f in xs)))
