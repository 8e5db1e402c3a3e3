"""The simulation loop: the Scheduler decodes simulated requests on a cost curve, no model.

One arm runs every request in order from an empty store, as the engine would serve them; every
arm sees the same requests, drafter blocks and machine noise (common random numbers), so the
arms' rates differ only by the scheduler's decisions.
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from adaspark.scheduler.round import Arm, Scheduler
from adaspark.sim.curves import CostCurve
from adaspark.sim.process import EOS, World, WorldParams, target_argmax

# Pinned widths swept against AdaSpark: the ladder and a few widths in between.
PINNED_WIDTHS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass
class ArmResult:
    arm: str
    tokens: int = 0
    time_s: float = 0.0
    rounds: int = 0
    widths: Counter = field(default_factory=Counter)  # rows verified, chooser rounds only
    cost_errors: list[float] = field(default_factory=list)  # |pred - measured| / measured
    logloss_fitted: float = 0.0
    logloss_head: float = 0.0
    labels: int = 0
    records: list[dict] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Decoded tokens per second of simulated time."""
        return self.tokens / self.time_s if self.time_s > 0 else 0.0


def run_arm(curve: CostCurve, world: World, arm: Arm, requests: int,
            keep_records: bool = False) -> ArmResult:
    """Decode `requests` requests with one Scheduler that starts from an empty store."""
    sched = Scheduler(arm=arm)
    result = ArmResult(arm=arm.name)
    for index in range(requests):
        req = world.request(index)
        context = req.prompt_length
        end = req.prompt_length + req.reply_length  # stream index one past the EOS
        verify_noise, fixed_noise = world.noise(req, req.reply_length + 1)
        sched.begin_request(req.stream[:context])
        k = 0
        while context < end:
            anchor = context - 1
            drafting = sched.should_draft(context)
            if drafting:
                block = world.block(req, anchor)
                plan = sched.plan(block, context, stop_ids=(EOS,))
                fixed_s = curve.fixed_s * fixed_noise[k]
            else:
                plan = sched.plain(context)
                fixed_s = 0.0
            argmax = target_argmax(req, anchor, plan.tokens, plan.depths, plan.mask)
            verify_s = curve.verify_s(plan.rows, context) * verify_noise[k]
            outcome = sched.accept(plan, argmax)
            committed = outcome.committed
            stop = np.flatnonzero(committed == EOS)
            if len(stop):
                committed = committed[: stop[0] + 1]
            last = context + len(committed) >= end
            commit_s = curve.commit_s
            record = sched.learn(outcome, verify_s, fixed_s, commit_s, last_round=last)
            result.tokens += len(committed)
            result.time_s += fixed_s + verify_s + commit_s
            result.rounds += 1
            _score(result, record, verify_s)
            if keep_records:
                result.records.append(record)
            context += len(committed)
            k += 1
        sched.end_request()
    return result


def _score(result: ArmResult, record: dict, verify_s: float) -> None:
    if record.get("chosen_by") == "chooser":
        result.widths[record["rows"]] += 1
        predicted = record.get("predicted_T_s")
        if predicted:
            result.cost_errors.append(abs(predicted - verify_s) / verify_s)
    if record.get("labels"):
        result.labels += record["labels"]
        result.logloss_fitted += record["logloss_fitted"]
        result.logloss_head += record["logloss_head"]


def _run_one(curve: CostCurve, seed: int, params: WorldParams | None, arm: str,
             requests: int) -> ArmResult:
    return run_arm(curve, World(seed, params), Arm.parse(arm), requests)


def sweep(curve: CostCurve, requests: int = 24, seed: int = 0,
          widths: tuple[int, ...] = PINNED_WIDTHS, arm: str = "adaspark",
          params: WorldParams | None = None, workers: int | None = None) -> dict:
    """AdaSpark against every pinned width on the same requests; the `adaspark sim --json` dict.

    The arms are independent runs over the same seeded world, so they run in `workers`
    processes (default: one per CPU); the results do not depend on how many."""
    arms = [arm] + [f"{arm}:{n}" for n in widths]
    workers = min(len(arms), workers or os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_run_one, *zip(*[(curve, seed, params, a, requests)
                                                      for a in arms], strict=True)))
    else:
        world = World(seed, params)
        results = [run_arm(curve, world, Arm.parse(a), requests) for a in arms]
    ada = results[0]
    pinned = {n: r.rate for n, r in zip(widths, results[1:], strict=True)}
    best = max(pinned, key=pinned.get)
    errors = ada.cost_errors[len(ada.cost_errors) // 2 :]
    return {
        "curve": curve.name,
        "requests": requests,
        "seed": seed,
        "adaspark": ada.rate,
        "pinned": {str(n): rate for n, rate in pinned.items()},
        "best_pinned": best,
        "ratio_to_best": ada.rate / pinned[best],
        "widths_chosen": {str(n): c for n, c in sorted(ada.widths.items())},
        "cost_error_median": float(np.median(errors)) if errors else None,
        "logloss_fitted": ada.logloss_fitted / ada.labels if ada.labels else None,
        "logloss_head": ada.logloss_head / ada.labels if ada.labels else None,
        "rounds": ada.rounds,
    }
