"""Why the default's rounds draft on issue 41's work (24 short first turns, cap 64, 2 passes,
one engine from an empty store): each gated round's decision by the gate's state at choose()
(warming: a mode still below its warm rounds; verdict: the faster mode; exploring: the other
mode once every EXPLORE rounds), the gate's restarts (a wider width measured), and the first
rounds (always drafted).

    ADASPARK_NATIVE=avx2 .venv/bin/python docs/results/zen5-s36/scripts/gate_reasons.py
"""
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from short_turns import setup

from adaspark.scheduler.gate import EXPLORE, DraftGate

reqs, target, engs = setup(["adaspark,gate"])
engine = engs["adaspark,gate"]
gate = engine.speculator.scheduler.gate
reasons = Counter()
choose, restart = DraftGate.choose, DraftGate.restart


def spy_choose(self, bucket):
    best = self.faster(bucket)
    exploring = best is not None and self.streak.get(bucket, 0) >= EXPLORE
    drafted = choose(self, bucket)
    why = "warming" if best is None else ("exploring" if exploring else "verdict")
    reasons[(bucket, why, "draft" if drafted else "skip")] += 1
    return drafted


def spy_restart(self):
    reasons[("restart",)] += 1
    return restart(self)


DraftGate.choose, DraftGate.restart = spy_choose, spy_restart
rounds = Counter()
for _ in range(2):
    for msgs, tools in reqs:
        out = engine.generate(msgs, tools=tools, max_tokens=64)
        t = out.timings
        rounds["draft"] += t.draft_rounds
        rounds["plain"] += t.plain_rounds
        rounds["ngram"] += t.ngram_rounds
print("rounds by kind:", dict(rounds), "(48 first rounds drafted, outside the gate)")
print("gate restarts:", reasons.pop(("restart",), 0))
for key, n in sorted(reasons.items(), key=str):
    print(key, n)
