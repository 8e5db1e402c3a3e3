"""Host time the server's watching adds: per round, per request and per scrape.

Drives the Scheduler (adaspark,gate) with the simulator's drafter blocks, as
scheduler_overhead.py does, and times on the thread's CPU clock:
  round     ServerMetrics.observe_round (what the speculator's observer runs every round)
  calib     the acceptance model's calibration bins (inside learn(), every tree round)
  snapshot  Scheduler.snapshot() (after every request, and at most once a second in one)
  scrape    generate_latest() of the registry (each GET /metrics; not on the engine thread)

    .venv/bin/python benchmarks/metrics_overhead.py [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
from time import thread_time

import numpy as np
from prometheus_client import generate_latest

from adaspark.scheduler.arm import Arm
from adaspark.scheduler.driver import run_round
from adaspark.scheduler.round import Scheduler
from adaspark.server.metrics import ServerMetrics
from adaspark.sim.curves import load_curve
from adaspark.sim.process import EOS, World, WorldParams
from adaspark.sim.run import SimTarget


def measure(requests: int, seed: int = 0) -> dict:
    curve = load_curve("int8-dense")
    world = World(seed, WorldParams(block=7, topk=8, reply=(300, 600)))
    sched, metrics = Scheduler(Arm.parse("adaspark,gate")), ServerMetrics()
    calibrate = sched.acceptance._calibrate
    calib_s: list[float] = []

    def timed_calibrate(q, y):
        start = thread_time()
        calibrate(q, y)
        calib_s.append(thread_time() - start)

    sched.acceptance._calibrate = timed_calibrate
    round_s, snapshot_s, scrape_s = [], [], []
    for index in range(requests):
        sim = SimTarget(curve, world, world.request(index))
        sim.verify_noise[:] = sim.fixed_noise[:] = 1.0  # the curve's times
        sched.begin_request(sim.req.stream[: sim.context])
        while sim.context < sim.end:
            r = run_round(sched, sim, sim.context, (EOS,))
            r.record.arm, r.record.request = "adaspark,gate", f"r{index}"
            row = r.record.to_json()
            start = thread_time()
            metrics.observe_round(row, r.plan.depths)
            round_s.append(thread_time() - start)
            sim.context += len(r.committed.emitted)
            sim.k += 1
        sched.end_request()
        start = thread_time()
        sched.snapshot()
        snapshot_s.append(thread_time() - start)
        start = thread_time()
        generate_latest(metrics.registry)
        scrape_s.append(thread_time() - start)

    def stats(seconds: list[float]) -> dict:
        us = 1e6 * np.array(seconds)
        return {"n": int(us.size), "median_us": float(np.median(us)),
                "p90_us": float(np.percentile(us, 90)), "mean_us": float(us.mean())}

    return {"round": stats(round_s), "calib": stats(calib_s), "snapshot": stats(snapshot_s),
            "scrape": stats(scrape_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.requests)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, s in result.items():
        print(f"{name:9s} n={s['n']:5d}  median {s['median_us']:8.1f} us  "
              f"p90 {s['p90_us']:8.1f} us  mean {s['mean_us']:8.1f} us")


if __name__ == "__main__":
    main()
