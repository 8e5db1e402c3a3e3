"""Host time of one round's scheduling and learning (plan + accept + learn), K = 8, B = 7.

Drives the Scheduler through the engine's round driver (scheduler/driver.py) on the simulator's
target (sim/run.py's SimTarget) at pinned widths up to 64 rows and with the chooser, and times
every round: the median and p90 per round of the
thread's CPU time (on a shared machine, wall time's tail is other processes' preemption; the wall
median is printed too), and the median split by part (the Scheduler's own wall-clock part
timers). The simulator's own work (drawing blocks, the target's argmax) is measured where it
runs and taken out of the round's span. The end-of-request refit is the thread's CPU time too.

    .venv/bin/python benchmarks/scheduler_overhead.py [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
from time import perf_counter, thread_time

import numpy as np

from adaspark.scheduler.arm import Arm
from adaspark.scheduler.driver import run_round
from adaspark.scheduler.round import Scheduler
from adaspark.sim.curves import load_curve
from adaspark.sim.process import EOS, World, WorldParams
from adaspark.sim.run import SimTarget


class _Untimed(SimTarget):
    """The simulator's target, with the CPU and wall time of its own work summed."""

    outside_cpu = outside_wall = 0.0

    def _timed(self, work, *args):
        wall, cpu = perf_counter(), thread_time()
        out = work(*args)
        self.outside_cpu += thread_time() - cpu
        self.outside_wall += perf_counter() - wall
        return out

    def draft(self):
        return self._timed(super().draft)

    def verify(self, plan):
        return self._timed(super().verify, plan)

ARMS = ("adaspark", "adaspark:8", "adaspark:16", "adaspark:32", "adaspark:64")


def measure(arm: str, requests: int, seed: int = 0) -> dict:
    curve = load_curve("int8-dense")
    world = World(seed, WorldParams(block=7, topk=8, reply=(300, 600)))
    sched = Scheduler(Arm.parse(arm), time_parts=True)
    totals, walls, parts, rows, refits = [], [], [], [], []
    for index in range(requests):
        sim = _Untimed(curve, world, world.request(index))
        sim.verify_noise[:] = sim.fixed_noise[:] = 1.0  # the curve's times, as before
        sched.begin_request(sim.req.stream[: sim.context])
        while sim.context < sim.end:
            sched.part_times.clear()
            sim.outside_cpu = sim.outside_wall = 0.0
            start, cpu_start = perf_counter(), thread_time()
            r = run_round(sched, sim, sim.context, (EOS,))
            totals.append(thread_time() - cpu_start - sim.outside_cpu)
            walls.append(perf_counter() - start - sim.outside_wall)
            parts.append(dict(sched.part_times))
            rows.append(r.plan.rows)
            sim.context += len(r.committed.emitted)
            sim.k += 1
        start = thread_time()  # CPU time, as the rounds (the machine is shared)
        sched.end_request()
        refits.append(thread_time() - start)
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
