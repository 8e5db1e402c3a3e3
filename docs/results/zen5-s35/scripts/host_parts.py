"""Median per-call time of the host parts of a round, default arm, issue 41's 24 short first
turns (cap 64), empty store, two passes."""
import statistics as st, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
torch.set_num_threads(2)
import concurrency as cc
from adaspark import batch as B, speculative as S
from adaspark.scheduler import round as R
from adaspark.bench.conversations import load_conversations
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator
import adaspark.sequence as SQ
arm = sys.argv[1]
reqs = cc.first_turns(load_conversations(cc.CONVERSATIONS), 500)[:24]
path = resolve_model(None); gguf = read_gguf(path); target = Transformer(gguf); tok = Tokenizer.from_gguf(gguf)
e = Engine(target, tok, path, load_speculator(target, path, tok.stop_ids, ModelOptions(arm=arm, store=Path(tempfile.mkdtemp()) / "s", fresh=True)))
T = defaultdict(list)
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        s = time.perf_counter(); r = f(*a, **k); T[label].append(time.perf_counter() - s); return r
    setattr(owner, name, w)
targets = [(B.Batch, "step", "step"), (type(target), "verify_many", "verify_many"),
           (B.Batch, "_verify", "_verify"),
           (SQ.Decode, "advance", "advance"), (SQ.Decode, "row", "row"), (SQ.Decode, "take", "take")]
if arm != "ar":
    targets += [(S.RoundDecode, "row", "row"), (S.RoundDecode, "take", "take"), (S.RoundDecode, "advance", "advance"),
           (R.Scheduler, "plan_round", "plan_round"), (R.Scheduler, "accept", "accept"),
           (R.Scheduler, "learn", "learn"), (S.Speculator, "report", "report"), (S, "take_path", "take_path")]
for t in targets:
    wrap(*t)
for msgs, tools in reqs * 2:
    e.generate(msgs, tools=tools, max_tokens=64)
for k, v in T.items():
    print(f"{arm:14s} {k:12s} n={len(v):5d} median {1000*st.median(v):.3f} ms  mean {1000*st.mean(v):.3f}")
