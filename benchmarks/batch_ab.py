"""In-process A/B of arms under continuous batching, with a per-step time breakdown.

No HTTP: each arm is an Engine (the embedded model, a fresh learned store in a temporary
directory) whose Batch runs the evaluation's first turns as the server's engine thread would
(requests join between steps while fewer than --parallel run; greedy; capped at --cap). Per
arm, as benchmarks/concurrency.py orders it: a warm-up of --parallel requests at cap 16, then
the requests one at a time (N = 1), then over --parallel slots (N = P); then --reps more rounds
of N = P, the arms interleaved, so that the arms meet the same machine load. Per run: aggregate
tok/s (reply tokens over the wall time), and where a step's time went: advance, plan (row():
the scheduler's plan, its draft calls counted apart), the budget (before_plan + share_rows),
verify_many (and its rows per call), take (accept, commit, learn) and the rest (Python around
them, prefill chunks). Replies at N = P are compared with the N = 1 ones token for token.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/batch_ab.py --arms ar,adaspark+gate \\
        --requests 8 --cap 64 --parallel 4 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from adaspark.batch import Batch
from adaspark.bench.conversations import load_conversations
from adaspark.engine import Engine
from adaspark.speculative import RoundDecode, Speculator

CONVERSATIONS = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"


class Clock:
    """Seconds and calls per part, summed while `on`."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, owner, name: str, part: str):
        """Time owner.name (a method on a class or an instance) under `part`."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.on:
                    self.s[part] += time.perf_counter() - start
                    self.n[part] += 1

        setattr(owner, name, timed)
        return inner

    @contextmanager
    def measuring(self):
        self.s.clear()
        self.n.clear()
        self.on = True
        try:
            yield
        finally:
            self.on = False


CLOCK = Clock()
ROWS: list[int] = []  # rows per verify_many call while measuring
PLANS: dict[str, int] = defaultdict(int)  # rounds by kind while measuring


def count_plans() -> None:
    """Each round's kind: priced beside others or not, drafted or not, how it was chosen."""
    row = RoundDecode.row

    def counted(self):
        out = row(self)
        if CLOCK.on:
            plan = self._plan
            priced = "priced" if self.step is not None else (
                "unrated" if self.spec.step_rate.rate is None else "unpriced")
            kind = "drafted" if plan.drafted else ("plain" if plan.rows == 1 else "undrafted")
            PLANS[f"{priced}/{kind}/{plan.chosen_by.name.lower()}"] += 1
        return out

    RoundDecode.row = counted


def instrument() -> None:
    """Time the parts of a step on the classes every engine uses."""
    CLOCK.wrap(Batch, "step", "step")
    CLOCK.wrap(Batch, "_verify", "verify+take")
    CLOCK.wrap(RoundDecode, "advance", "advance")
    CLOCK.wrap(RoundDecode, "row", "plan (row)")
    CLOCK.wrap(RoundDecode, "_draft", "draft call")
    CLOCK.wrap(RoundDecode, "take", "take")
    CLOCK.wrap(Speculator, "price_step", "budget: price_step")
    CLOCK.wrap(Speculator, "share_rows", "budget: share_rows")
    CLOCK.wrap(Speculator, "learn_shared_verify", "learn_shared_verify")
    from adaspark.sequence import Decode

    CLOCK.wrap(Decode, "take", "take (plain)")
    CLOCK.wrap(Batch, "_prefill", "prefill chunks")
    count_plans()


def spy_verify(engine: Engine) -> None:
    inner = engine.target.verify_many

    def verify_many(caches, rows, **kw):
        start = time.perf_counter()
        try:
            return inner(caches, rows, **kw)
        finally:
            if CLOCK.on:
                CLOCK.s["verify_many"] += time.perf_counter() - start
                CLOCK.n["verify_many"] += 1
                ROWS.append(sum(len(r[0]) for r in rows))

    engine.target.verify_many = verify_many


def first_turns(path: Path, n: int) -> list[tuple[list[dict], list | None]]:
    out = []
    for conv in load_conversations(path):
        messages = [{"role": "system", "content": conv.system}] if conv.system else []
        out.append(([*messages, {"role": "user", "content": conv.turns[0]}],
                     conv.openai_tools()))
    return (out * (n // len(out) + 1))[:n]


def run(engine: Engine, prompts: list[list[int]], slots: int, cap: int) -> tuple[list, float]:
    """The prompts over `slots` running at once (joining between steps); replies, wall s."""
    batch = engine.batch
    batch.max_slots = max(batch.max_slots, slots)
    todo = list(enumerate(prompts))
    replies: list = [None] * len(prompts)
    seqs: dict[int, int] = {}
    start = time.perf_counter()
    while todo or batch.running:
        while todo and len(batch.running) < slots:
            i, ids = todo.pop(0)
            seq = engine.new_decode(ids, max_tokens=cap)
            seqs[id(seq)] = i
            if not batch.join(seq):  # prefilled in the next step's prefill forward
                raise RuntimeError(f"request {i} failed: {seq.error}")
        for seq in batch.step():
            if seq.error is not None:
                raise RuntimeError(f"request {seqs[id(seq)]} failed: {seq.error}")
            replies[seqs[id(seq)]] = engine.result(seq).token_ids
    return replies, time.perf_counter() - start


def measure(engine: Engine, prompts, slots: int, cap: int) -> dict:
    ROWS.clear()
    PLANS.clear()
    cpu = time.process_time()
    with CLOCK.measuring():
        replies, wall = run(engine, prompts, slots, cap)
    cpu = time.process_time() - cpu
    tokens = sum(len(r) for r in replies)
    steps = max(CLOCK.n.get("step", 1), 1)
    parts = {k: 1000.0 * v / steps for k, v in sorted(CLOCK.s.items())}
    return {"slots": slots, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "tok_per_cpu_s": tokens / cpu,
            "steps": steps, "ms_per_step": parts,
            "calls_per_step": {k: v / steps for k, v in sorted(CLOCK.n.items())},
            "rows_per_call": statistics.mean(ROWS) if ROWS else 0.0,
            "plans": dict(sorted(PLANS.items())), "replies": replies}


def show(arm: str, r: dict) -> None:
    parts = "  ".join(f"{k} {v:.2f}" for k, v in r["ms_per_step"].items() if k != "step")
    calls = r["calls_per_step"]
    print(f"{arm:<14} N={r['slots']} {r['tok_s']:7.1f} tok/s  ({r['tok_per_cpu_s']:.1f} a CPU s)  "
          f"{r['tokens']} tok  "
          f"{r['steps']} steps  {r['ms_per_step'].get('step', 0):.2f} ms/step  "
          f"rows/call {r['rows_per_call']:.2f}  drafts/step "
          f"{calls.get('draft call', 0):.2f}", flush=True)
    print(f"{'':<14} ms/step: {parts}", flush=True)
    if r["plans"]:
        print(f"{'':<14} rounds: {r['plans']}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="ar,adaspark+gate")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--cap", type=int, default=64)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--reps", type=int, default=3, help="more N = P runs, arms interleaved")
    p.add_argument("--data", type=Path, default=CONVERSATIONS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    instrument()
    arms = [a.replace("+", ",") for a in args.arms.split(",") if a]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="adaspark-batch-ab-") as tmp:
        engines = {}
        for arm in arms:
            engine = Engine.load(arm=arm, store=Path(tmp) / arm, fresh=True)
            spy_verify(engine)
            print(f"{arm}: forward {engine.forward}", flush=True)
            engines[arm] = engine
            turns = first_turns(args.data, args.requests)
            prompts = [engine.tokenizer.encode_chat(m, tools=t) for m, t in turns]
            engine.prompts = prompts
            run(engine, prompts[:args.parallel], args.parallel, 16)  # warm every slot
            for slots in (1, args.parallel):
                r = measure(engine, prompts, slots, args.cap)
                show(arm, r)
                results[arm].append(r)
            solo = results[arm][0]["replies"]
            same = sum(a == b for a, b in zip(results[arm][1]["replies"], solo, strict=True))
            print(f"{arm}: N={args.parallel} replies equal to N=1: {same}/{len(solo)}")
        for _ in range(args.reps):
            for arm in arms:
                r = measure(engines[arm], engines[arm].prompts, args.parallel, args.cap)
                show(arm, r)
                results[arm].append(r)
    print("summary (tok/s at N=P: first run, then the interleaved reps; median of all)")
    for key in ("tok_s", "tok_per_cpu_s"):
        print(f"by {key}:")
        for arm in arms:
            one = results[arm][0][key]
            many = [r[key] for r in results[arm][1:]]
            print(f"{arm:<14} N=1 {one:.1f}  N={args.parallel} "
                  f"{' '.join(f'{x:.1f}' for x in many)}  median {statistics.median(many):.1f} "
                  f"({statistics.median(many) / one:.2f}x N=1)")
        if len(arms) == 2:
            a, b = (statistics.median([r[key] for r in results[arm][1:]]) for arm in arms)
            print(f"{arms[1]} over {arms[0]} at N={args.parallel}: {b / a:.2f}x")
    if args.json is not None:
        for rs in results.values():
            for r in rs:
                r.pop("replies")
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
