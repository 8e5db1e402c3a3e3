"""Where the default arm's decode time goes against `ar`'s on issue 41's 24 short first turns
(cap 64), each arm from an empty store, the arms interleaved per request, in one process: each
step timed (Batch.step), labelled by its round's kind (plain, ngram, drafted; `ar`: plain).
Prints per arm and kind: rounds, tokens, ms per round, ms per token, and the share of the time.

    ADASPARK_NATIVE=avx2 .venv/bin/python docs/results/zen5-s36/scripts/round_mix.py [passes]
"""
import statistics as st
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from short_turns import setup

from adaspark import batch as B
from adaspark import speculative as S

passes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
arms = sys.argv[2].split(";") if len(sys.argv) > 2 else ["ar", "adaspark,gate"]
reqs, target, engs = setup(arms)
kind = [None]
detail = [None]
drafted = defaultdict(list)  # (arm, chosen_by, bucket, first) -> [(seconds, tokens, rows)]
tokens = [0]
report = S.Speculator.report


def spy_report(self, record, *rest):
    kind[0] = record.kind
    detail[0] = (record.kind, record.chosen_by.name, record.gate_bucket, record.rows,
                 self.scheduler.request.rounds == 1)
    # (trace, timing, id) before session 36, (plan, emitted, timing, id, trace) after
    tokens[0] += len(rest[0].emitted) if hasattr(rest[0], "emitted") else rest[1]
    return report(self, record, *rest)


S.Speculator.report = spy_report
step = B.Batch.step
rec = defaultdict(list)  # (arm, kind) -> [(seconds, tokens)]
cur = [None]


def timed_step(self, *a, **k):
    kind[0], tokens[0] = "plain", 0
    t = time.perf_counter()
    r = step(self, *a, **k)
    dt = time.perf_counter() - t
    rec[(cur[0], kind[0])].append((dt, tokens[0] or 1))
    if detail[0] is not None and detail[0][0] == "drafted":
        k, by, bucket, rows, first = detail[0]
        drafted[(cur[0], by, bucket, first)].append((dt, tokens[0], rows))
    detail[0] = None
    return r


B.Batch.step = timed_step
decode = defaultdict(float)
made = defaultdict(int)
for _ in range(passes):
    for msgs, tools in reqs:
        for a, e in engs.items():
            cur[0] = a
            out = e.generate(msgs, tools=tools, max_tokens=64)
            decode[a] += out.timings.decode_s
            made[a] += out.timings.decode_tokens
for a in arms:
    total = sum(dt for (arm, _), xs in rec.items() if arm == a for dt, _ in xs)
    print(f"{a}: decode {made[a]} tokens in {decode[a]:.3f} s = {made[a] / decode[a]:.1f} tok/s"
          f" (steps {total:.3f} s)")
    for (arm, k), xs in sorted(rec.items()):
        if arm != a:
            continue
        s = sum(dt for dt, _ in xs)
        n = sum(t for _, t in xs)
        print(f"  {k:8s} rounds {len(xs):5d} tokens {n:5d} ms/round med {1000 * st.median(dt for dt, _ in xs):.3f}"
              f" mean {1000 * s / len(xs):.3f}  ms/token {1000 * s / n:.3f}  share {s / total:.2f}")
print("drafted rounds by (arm, chosen_by, bucket, first round):")
for key, xs in sorted(drafted.items(), key=str):
    s = sum(dt for dt, _, _ in xs)
    n = sum(t for _, t, _ in xs)
    print(f"  {key}: rounds {len(xs)} tokens/round {n / len(xs):.2f} rows {st.mean(r for _, _, r in xs):.1f}"
          f" ms/round {1000 * s / len(xs):.2f} ms/token {1000 * s / n:.3f}")
print("default over ar (decode tok/s):", (made[arms[1]] / decode[arms[1]]) / (made[arms[0]] / decode[arms[0]]))
