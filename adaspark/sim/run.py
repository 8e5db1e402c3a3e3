"""The simulation loop: the Scheduler decodes simulated requests on a cost curve, no model.

One arm runs every request in order from an empty store, as the engine would serve them; every
arm sees the same requests, drafter blocks and machine noise (common random numbers), so the
arms' rates differ only by the scheduler's decisions. Rounds run through the engine's own driver
(scheduler/driver.py): the simulated target only draws blocks, answers verifies and prices the
round on the curve, so every arm (the draft gate's n-gram rounds included) decides exactly as
the engine would.
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from adaspark.scheduler.arm import Arm
from adaspark.scheduler.driver import Committed, Target, run_round
from adaspark.scheduler.plan import Outcome, Plan
from adaspark.scheduler.record import ROUND_KINDS, ChosenBy, RoundRecord, RoundTimes
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.tree import Block
from adaspark.sim.curves import CostCurve
from adaspark.sim.process import EOS, Request, World, WorldParams, target_argmax

# Pinned widths swept against AdaSpark: the ladder and a few widths in between.
PINNED_WIDTHS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)


@dataclass
class RequestTally:
    """One request's decode: tokens and simulated seconds, and those of its probe rounds."""

    tokens: int = 0
    time_s: float = 0.0
    probe_tokens: int = 0
    probe_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0


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
    records: list[RoundRecord] = field(default_factory=list)
    rounds_by_kind: Counter = field(default_factory=Counter)  # drafted, ngram, plain
    per_request: list[RequestTally] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Decoded tokens per second of simulated time."""
        return self.tokens / self.time_s if self.time_s > 0 else 0.0


class SimTarget(Target):
    """One simulated request: the world's drafter and target, priced on the curve. The round's
    D is the curve's fixed cost when the drafter ran, else 0 (an n-gram tree or one row costs
    the host next to nothing here)."""

    def __init__(self, curve: CostCurve, world: World, req: Request) -> None:
        self.curve, self.world, self.req = curve, world, req
        self.context = req.prompt_length
        self.end = req.prompt_length + req.reply_length  # stream index one past the EOS
        self.verify_noise, self.fixed_noise = world.noise(req, req.reply_length + 1)
        self.k = 0  # rounds so far: the noise index

    def draft(self) -> Block:
        return self.world.block(self.req, self.context - 1)

    def verify(self, plan: Plan) -> np.ndarray:
        return target_argmax(self.req, self.context - 1, plan.tokens, plan.depths, plan.mask)

    def commit(self, outcome: Outcome) -> Committed:
        committed = outcome.committed
        stop = np.flatnonzero(committed == EOS)
        if len(stop):
            committed = committed[: stop[0] + 1]
        done = self.context + len(committed) >= self.end
        return Committed(outcome.rows[: len(committed)], committed.tolist(), done)

    def times(self, plan: Plan, measured: RoundTimes) -> RoundTimes:
        curve, k = self.curve, self.k
        fixed_s = curve.fixed_s * self.fixed_noise[k] if plan.drafted else 0.0
        return RoundTimes(fixed_s, curve.verify_s(plan.rows, self.context) * self.verify_noise[k],
                          curve.commit_s)


def run_arm(curve: CostCurve, world: World, arm: Arm, requests: int,
            keep_records: bool = False) -> ArmResult:
    """Decode `requests` requests with one Scheduler that starts from an empty store."""
    sched = Scheduler(arm=arm)
    result = ArmResult(arm=arm.name)
    for index in range(requests):
        sim = SimTarget(curve, world, world.request(index))
        sched.begin_request(sim.req.stream[: sim.context])
        tally = RequestTally()
        while sim.context < sim.end:
            r = run_round(sched, sim, sim.context, stop_ids=(EOS,))
            emitted = len(r.committed.emitted)
            round_s = r.times.fixed_s + r.times.verify_s + r.times.commit_s
            tally.tokens += emitted
            tally.time_s += round_s
            if r.record.chosen_by is ChosenBy.PROBE:
                tally.probe_tokens += emitted
                tally.probe_s += round_s
            result.rounds += 1
            result.rounds_by_kind[r.record.kind] += 1
            _score(result, r.record)
            if keep_records:
                result.records.append(r.record)
            sim.context += emitted
            sim.k += 1
        sched.end_request()
        result.tokens += tally.tokens
        result.time_s += tally.time_s
        result.per_request.append(tally)
    return result


def _score(result: ArmResult, record: RoundRecord) -> None:
    if record.chosen_by is ChosenBy.CHOOSER:
        result.widths[record.rows] += 1
        if record.pred_T:
            result.cost_errors.append(abs(record.pred_T - record.verify) / record.verify)
    if record.labels:
        result.labels += record.labels
        result.logloss_fitted += record.logloss_fitted
        result.logloss_head += record.logloss_head


def _run_one(curve: CostCurve, seed: int, params: WorldParams | None, arm: Arm,
             requests: int) -> ArmResult:
    return run_arm(curve, World(seed, params), arm, requests)


def sweep(curve: CostCurve, requests: int = 24, seed: int = 0,
          widths: tuple[int, ...] = PINNED_WIDTHS, arm: Arm | str = "adaspark",
          params: WorldParams | None = None, workers: int | None = None) -> dict:
    """AdaSpark against every pinned width on the same requests; the `adaspark sim --json` dict.

    The arms are independent runs over the same seeded world, so they run in `workers`
    processes (default: one per CPU); the results do not depend on how many."""
    arm = Arm.parse(arm)
    arms = [arm] + [arm.at_width(n) for n in widths]
    workers = min(len(arms), workers or os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_run_one, *zip(*[(curve, seed, params, a, requests)
                                                      for a in arms], strict=True)))
    else:
        world = World(seed, params)
        results = [run_arm(curve, world, a, requests) for a in arms]
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
        "rounds_by_kind": {kind: ada.rounds_by_kind.get(kind, 0) for kind in ROUND_KINDS},
    }
