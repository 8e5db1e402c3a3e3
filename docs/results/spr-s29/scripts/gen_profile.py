"""cProfile of ReplyGenerator (gen-data's loop) on datagen_rate.py's 64 first turns at concurrency K.

    .venv/bin/python docs/results/spr-s29/scripts/gen_profile.py 32
"""
import cProfile, pstats, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
import datagen_rate as dr
from adaspark.drafter.generate import GenSettings, ReplyGenerator
from adaspark.engine import Engine
from adaspark.model.sources import resolve_model
args = dr.args_of(["--prompts", "64"])
path = resolve_model(None)
engine = Engine.load(path, arm="ar", max_context=512 + 256 + 1)
args.tokenizer = engine.tokenizer
convs = dr.prompts_of(args, engine.tokenizer)
engine.generate_ids(convs[0].prompt_ids(engine.tokenizer, 0, []), max_tokens=2); engine.reset()
k = int(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    g = ReplyGenerator(engine, convs, Path(tmp), {"model_file": path.name}, GenSettings(256, 512, k, 10**6))
    pr = cProfile.Profile(); pr.enable()
    rep = g.run()
    pr.disable()
print(rep.reply_tokens, rep.seconds, rep.tok_s)
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
