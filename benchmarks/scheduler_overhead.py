"""Host time of one round's scheduling and learning (plan + accept + learn), K = 8, B = 7.

Drives the Scheduler with the simulator's drafter blocks (adaspark.sim.process) at pinned widths
up to 64 rows and with the chooser, and times every round: the median and p90 per round of the
thread's CPU time (on a shared machine, wall time's tail is other processes' preemption; the wall
median is printed too), and the median split by part (the Scheduler's own wall-clock part
timers). The simulator's own work (drawing blocks, the target's argmax) is outside the timed
span.

    .venv/bin/python benchmarks/scheduler_overhead.py [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
from time import perf_counter, thread_time

import numpy as np

from adaspark.scheduler.round import Arm, Scheduler
from adaspark.sim.curves import load_curve
from adaspark.sim.process import EOS, World, WorldParams, target_argmax

ARMS = ("adaspark", "adaspark:8", "adaspark:16", "adaspark:32", "adaspark:64")


def measure(arm: str, requests: int, seed: int = 0) -> dict:
    curve = load_curve("int8-dense")
    world = World(seed, WorldParams(block=7, topk=8, reply=(300, 600)))
    sched = Scheduler(Arm.parse(arm), time_parts=True)
    totals, walls, parts, rows, refits = [], [], [], [], []
    for index in range(requests):
        req = world.request(index)
        context, end = req.prompt_length, req.prompt_length + req.reply_length
        sched.begin_request(req.stream[:context])
        while context < end:
            block = world.block(req, context - 1)
            sched.part_times.clear()
            start, cpu_start = perf_counter(), thread_time()
            plan = sched.plan(block, context, (EOS,))
            planned, cpu_planned = perf_counter(), thread_time()
            argmax = target_argmax(req, context - 1, plan.tokens, plan.depths, plan.mask)
            resumed, cpu_resumed = perf_counter(), thread_time()
            outcome = sched.accept(plan, argmax)
            committed = outcome.committed
            last = context + len(committed) >= end
            sched.learn(outcome, curve.verify_s(plan.rows, context), curve.fixed_s,
                        curve.commit_s, last)
            totals.append((cpu_planned - cpu_start) + (thread_time() - cpu_resumed))
            walls.append((planned - start) + (perf_counter() - resumed))
            parts.append(dict(sched.part_times))
            rows.append(plan.rows)
            context += len(committed)
        start = perf_counter()
        sched.end_request()
        refits.append(perf_counter() - start)
    totals_ms = 1000.0 * np.array(totals)
    names = sorted({name for p in parts for name in p})
    return {
        "arm": arm,
        "rounds": len(totals),
        "rows_median": float(np.median(rows)),
        "rows_max": int(np.max(rows)),
        "median_ms": float(np.median(totals_ms)),
        "p90_ms": float(np.percentile(totals_ms, 90)),
        "wall_median_ms": float(1000.0 * np.median(walls)),
        "parts_median_ms": {n: float(1000.0 * np.median([p.get(n, 0.0) for p in parts]))
                            for n in names},
        "refit_per_request_ms": float(1000.0 * np.median(refits)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [measure(arm, args.requests) for arm in ARMS]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"{r['arm']:12s} rounds {r['rounds']:4d}  rows median {r['rows_median']:4.0f} "
              f"max {r['rows_max']:2d}  per round CPU: median {r['median_ms']:.3f} ms, "
              f"p90 {r['p90_ms']:.3f} ms (wall median {r['wall_median_ms']:.3f});  "
              f"end-of-request refit {r['refit_per_request_ms']:.1f} ms")
        print("    " + ", ".join(f"{n} {v:.3f}" for n, v in r["parts_median_ms"].items()))


if __name__ == "__main__":
    main()
