"""Every decision and learned number of seeded simulator runs, one JSON line each: the check that
a change meant to be exact (a faster scheduler) changes nothing the scheduler decides or learns.

Per round: the plan (tokens, depths, parents, mask, width, who chose it, offers, predicted S and
T, ...), the accepted rows and the round record; every 7th round and at each request's end the
cost model's levels and clocks, the gate's drafted curves, the acceptance model's weights and
calibration, the chooser's incumbent and gains; at each end the state_dict. Floats as repr, so
two traces are equal only bit for bit. Arms: the default, its modifiers, ngram, the paper's
baselines, pinned widths; two more curves (one at temperature 0.7); multi-stream policies.

    .venv/bin/python benchmarks/scheduler_decisions.py OUT.jsonl     # before the change
    .venv/bin/python benchmarks/scheduler_decisions.py AFTER.jsonl   # after it
    cmp OUT.jsonl AFTER.jsonl
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from adaspark.scheduler.arm import Arm
from adaspark.scheduler.driver import run_round
from adaspark.scheduler.round import Scheduler
from adaspark.sim.curves import load_curve
from adaspark.sim.multi import multi_sweep
from adaspark.sim.process import EOS, World, WorldParams
from adaspark.sim.run import SimTarget

ARMS = ("adaspark", "adaspark,gate", "adaspark,ladder", "adaspark,plain", "adaspark,classes",
        "adaspark,head", "adaspark,no-ngram", "adaspark,ratio", "adaspark,no-hysteresis",
        "adaspark,gate,ladder", "ngram", "ngram,classes", "cost", "chain3", "chain", "tree:16",
        "adaspark:16", "adaspark:64", "ar")


def _plan(p) -> list:
    return [p.tokens.tolist(), p.depths.tolist(), p.parents.tolist(),
            np.packbits(p.mask).tolist(), p.width_chosen, str(p.chosen_by),
            list(p.width_offered), repr(p.predicted_S), repr(p.predicted_T_s), p.explored,
            p.fitted_prices, p.drafted, p.gate_bucket, p.ngram_widened]


def _internals(sched: Scheduler) -> str:
    cost, ch = sched.cost, sched.chooser
    levels = [[k.top, list(k.level.window), k.level.value, k.clock, k.clock_context,
               k.clock_law, k.law._w] for k in cost.classes]
    curves = {repr(b): [w, t.tolist()] for b, (w, t) in sched.gate.curves.items()}
    return repr([levels, list(cost.fixed_level.window), cost.fixed_level.value, cost.fixed._w,
                 curves, sched.acceptance.calibration.tolist(),
                 sched.acceptance.ftrl.weights.tolist(), ch.incumbent, ch.held_rounds,
                 ch.best_width, sorted(sched.width_rounds.items()), sched.gate.fixed_ms,
                 sched.plain_law._w, [(g.a, g.b) for g in ch.above + ch.below]])


def trace_arm(out, arm: str, curve_name: str, seed: int, requests: int,
              temperature: float = 0.0) -> None:
    curve = load_curve(curve_name)
    world = World(seed, WorldParams(reply=(200, 500)))
    sched = Scheduler(Arm.parse(arm))
    for index in range(requests):
        sim = SimTarget(curve, world, world.request(index))
        sched.begin_request(sim.req.stream[: sim.context], temperature=temperature)
        while sim.context < sim.end:
            r = run_round(sched, sim, sim.context, (EOS,))
            record = r.record.to_json()
            record.pop("commit")  # the accept walk's measured wall time: not a decision
            out.write(json.dumps([arm, curve_name, seed, _plan(r.plan), list(r.outcome.rows),
                                  r.outcome.bonus, {k: repr(v) for k, v in record.items()}])
                      + "\n")
            sim.context += len(r.committed.emitted)
            sim.k += 1
            if sim.k % 7 == 0:
                out.write(json.dumps([arm, "inner", _internals(sched)]) + "\n")
        adopted = sched.end_request()
        out.write(json.dumps([arm, "end", adopted, json.dumps(sched.state_dict()),
                              _internals(sched)]) + "\n")
    out.write(json.dumps([arm, "snapshot", json.dumps(sched.snapshot(), default=repr)]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSONL trace to write")
    args = parser.parse_args()
    with open(args.out, "w") as out:
        for arm in ARMS:
            trace_arm(out, arm, "int8-dense", 0, 5)
        for arm in ("adaspark", "adaspark,gate", "ngram"):
            trace_arm(out, arm, "cpu-avx2", 3, 5)
            trace_arm(out, arm, "moe", 5, 4, temperature=0.7)
        rows = multi_sweep(load_curve("cpu-avx2"), streams=(1, 3), seconds=2.0)
        out.write(json.dumps(rows, default=repr) + "\n")


if __name__ == "__main__":
    main()
