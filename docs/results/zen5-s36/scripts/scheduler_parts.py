import sys, tempfile
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
torch.set_num_threads(2)
import concurrency as cc
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
spec = load_speculator(target, path, tok.stop_ids, ModelOptions(arm="adaspark,gate", store=Path(tempfile.mkdtemp()) / "s", fresh=True))
e = Engine(target, tok, path, spec)
sched = spec.scheduler
sched.part_times = {}
n = [0]
orig = sched._drafted
def d(*a, **k):
    n[0] += 1; return orig(*a, **k)
sched._drafted = d
for _ in range(2):
    for msgs, tools in reqs:
        e.generate(msgs, tools=tools, max_tokens=64)
print("drafted rounds", n[0])
for k, v in sorted(sched.part_times.items(), key=lambda kv: -kv[1]):
    print(f"{k:20s} {1e6 * v / n[0]:8.1f} us per drafted round")
