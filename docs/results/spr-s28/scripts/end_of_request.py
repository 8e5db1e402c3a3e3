"""The host time at each request's end (Speculator._end_request: the laws' refit, the store's
save) of the default arm over issue 41's 24 short first turns, cap 64, three passes from an empty
store; `idle`: as under the server's worker (idle_saves), whose closed-loop client never leaves
it idle, so the save runs every SAVE_EVERY_S.

    .venv/bin/python docs/results/spr-s28/scripts/end_of_request.py per-request|idle
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

from adaspark import speculative as S
from adaspark.bench.conversations import load_conversations
from adaspark.engine import Engine
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.speculative import load_speculator

times = []
f = S.Speculator._end_request
def w(self, *a, **k):
    t = time.perf_counter(); f(self, *a, **k); times.append(time.perf_counter() - t)
S.Speculator._end_request = w
reqs = cc.first_turns(load_conversations(cc.CONVERSATIONS), 500)[:24]
path = resolve_model(None); gguf = read_gguf(path); target = Transformer(gguf); tok = Tokenizer.from_gguf(gguf)
e = Engine(target, tok, path, load_speculator(target, path, tok.stop_ids, ModelOptions(arm="adaspark,gate", store=Path(tempfile.mkdtemp()) / "s", fresh=True)))
if sys.argv[1] == "idle":
    e.speculator.idle_saves = True
for rep in range(3):
    for msgs, tools in reqs:
        e.generate(msgs, tools=tools, max_tokens=64)
print(sys.argv[1], f"end of request: median {1000*st.median(times):.2f} ms, mean {1000*st.mean(times):.2f} ms over {len(times)}")
