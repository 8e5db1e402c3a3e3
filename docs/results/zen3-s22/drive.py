"""Session 22, ad hoc: 4 concurrent streaming clients against a running `adaspark serve` (the
first 24 short first turns, as benchmarks/concurrency.py sends them, cap 64), a 4-request
warm-up at cap 16, then PASSES passes; prints each pass's aggregate tok/s.

    .venv/bin/python docs/results/zen3-s22/drive.py http://127.0.0.1:8765 PASSES
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
from concurrency import first_turns, run_clients  # noqa: E402

from adaspark.bench.conversations import load_conversations  # noqa: E402

url, passes = sys.argv[1], int(sys.argv[2])
requests = first_turns(load_conversations(REPO.parent / "shared/data/eval/conversations.jsonl"),
                       500)[:24]
run_clients(url, requests[:4], 4, 16)
for _ in range(passes):
    replies, wall = run_clients(url, requests, 4, 64)
    print(sum(r.completion_tokens for r in replies if r) / wall, "tok/s", flush=True)
