"""Session 22, ad hoc: the arms' batches in one process, no HTTP and no timing wrappers: the
first 24 short first turns (as benchmarks/concurrency.py picks them) over 4 slots, cap 64,
after a 4-request warm-up at cap 16, each arm from an empty store; PASSES passes, the arms
alternated (A B, B A, ...); aggregate tok/s per pass.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/zen3-s22/inproc.py ar,adaspark+gate 6
"""

import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
from batch_ab import CONVERSATIONS, run  # noqa: E402
from concurrency import first_turns  # noqa: E402

from adaspark.bench.conversations import load_conversations  # noqa: E402
from adaspark.engine import Engine  # noqa: E402

torch.set_num_threads(2)
arms, passes = sys.argv[1].split(","), int(sys.argv[2])
requests = first_turns(load_conversations(CONVERSATIONS), 500)[:24]
engines = {arm: Engine.load(arm=arm, store=tempfile.mkdtemp(), fresh=True) for arm in arms}
prompts = {arm: [e.tokenizer.encode_chat(m, tools=t) for m, t in requests]
           for arm, e in engines.items()}
for arm, engine in engines.items():
    run(engine, prompts[arm][:4], 4, 16)
tok_s: dict = {arm: [] for arm in arms}
for p in range(passes):
    for arm in arms if p % 2 == 0 else arms[::-1]:
        replies, wall = run(engines[arm], prompts[arm], 4, 64)
        tok_s[arm].append(sum(len(r) for r in replies) / wall)
for arm in arms:
    print(arm, "N=4 tok/s", [round(x) for x in tok_s[arm]], "median",
          round(statistics.median(tok_s[arm]), 1))
