"""Per-run ratios of one arm over another from arms.py --json files (the same run: the arms
interleaved), and their geometric mean over every run of the files given.

    .venv/bin/python paired.py ARM_A ARM_B FILE.json [FILE.json ...]
ARM_A / ARM_B are matched by prefix up to '@' (e.g. 'adaspark,gate@s34' matches
'adaspark,gate@s34-stage4' or '...@checkpoint' when given exactly)."""
import json
import math
import sys

sys.path.insert(0, "benchmarks")
from arms import summary  # noqa: E402


def find(results, name):
    if name in results:
        return name
    hits = [a for a in results if a.startswith(name)]
    return hits[0] if len(hits) == 1 else None


a_name, b_name, files = sys.argv[1], sys.argv[2], sys.argv[3:]
logs = []
for f in files:
    res = json.load(open(f))["results"]
    a, b = find(res, a_name), find(res, b_name)
    if a is None or b is None:
        print(f"{f}: no {a_name} or {b_name}")
        continue
    ratios = [summary(ra)["tok_s"] / summary(rb)["tok_s"] for ra, rb in zip(res[a], res[b])]
    logs += [math.log(r) for r in ratios]
    print(f"{f}: {a} / {b}: " + " ".join(f"{r:.3f}" for r in ratios))
if logs:
    print(f"geometric mean over {len(logs)} runs: {math.exp(sum(logs) / len(logs)):.3f}; "
          f"{sum(x > 0 for x in logs)} of {len(logs)} above 1")
