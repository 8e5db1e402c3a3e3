"""Whether this machine's `ar` gives the replies another machine wrote into a reply shard: the
first N records of SHARD (prompt ids as stored), each decoded greedily here with the same cap
(256) through gen-data's engine, compared token for token.

    .venv/bin/python docs/results/zen5-s30/scripts/same_replies.py data/drafter/replies/replies_00000.npz 12
"""
import sys
from pathlib import Path
import torch
from adaspark.drafter.replies import read_shard
from adaspark.engine import Engine
from adaspark.model.sources import resolve_model
torch.set_num_threads(2)
shard, n = Path(sys.argv[1]), int(sys.argv[2])
records = read_shard(shard)[:n]
engine = Engine.load(resolve_model(None), arm="ar", max_context=4096 + 257)
same = 0
for r in records:
    prompt = [int(t) for t in r.tokens[:r.prompt_len]]
    got = engine.generate_ids(prompt, max_tokens=256).token_ids
    engine.reset()
    want = [int(t) for t in r.reply]
    if r.finish == "stop" and got == want[:-1]:  # the shard keeps the stop token
        got = want
    same += got == want
    print(r.key, r.turn, len(want), "same" if got == want else f"differ at {next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}")
print(f"{same}/{len(records)} replies equal")
