"""The one round driver: Algorithm 1's plan → verify → accept → commit → learn, in this order.

The simulator (sim/run.py) and the overhead benchmark (benchmarks/scheduler_overhead.py) decode
through `run_round`; what differs between them is only the Target they hand in: where the draft,
the verify and the commit happen, and which clock prices the round. The engine runs the same
parts, timed the same way, as steps of its batch (speculative.RoundDecode: row() plans, the batch
verifies, take() accepts, commits and learns), so that requests share each verify call. Numpy
only, like the rest of the scheduler.

Timed parts (time.perf_counter), as the scheduler and the round log define them:
  D       the plan, with the drafter's forward when the round drafts; not verify or commit
  verify  Target.verify: the target's forward over the planned rows, picks on the host
  commit  the accept walk + Target.commit's own cache time (Committed.commit_s), so the reply's
          streaming callbacks are not charged to the round
A Target may replace the measured times with its own clock (Target.times: the simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from adaspark.scheduler.plan import Outcome, Plan
from adaspark.scheduler.record import RoundRecord, RoundTimes
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.tree import Block


@dataclass
class Committed:
    """What the target kept of a verified round."""

    rows: list[int]  # the rows whose K/V went into the caches (a prefix of outcome.rows)
    emitted: list[int]  # the tokens the reply took, in order (accepted, then the bonus)
    done: bool  # the reply ended in this round (its last round teaches less)
    commit_s: float = 0.0  # the target's own cache-commit time


class Target:
    """What a round runs on (the simulator's: sim.run.SimTarget)."""

    def draft(self) -> Block:
        """The drafter's block after the anchor (called only when the round drafts)."""
        raise NotImplementedError

    def verify(self, plan: Plan) -> np.ndarray:
        """The target's pick per planned row (its argmax when greedy)."""
        raise NotImplementedError

    def commit(self, outcome: Outcome) -> Committed:
        """Hand the accepted tokens and the bonus to the reply, commit the rows it kept."""
        raise NotImplementedError

    def times(self, plan: Plan, measured: RoundTimes) -> RoundTimes:
        """The round's times as the scheduler should learn them (default: as measured)."""
        return measured


@dataclass
class RoundResult:
    plan: Plan
    argmax: np.ndarray
    outcome: Outcome
    committed: Committed
    times: RoundTimes
    record: RoundRecord = field(repr=False)


def run_round(sched: Scheduler, target: Target, context_length: int,
              stop_ids: Sequence[int] = (), room: int | None = None) -> RoundResult:
    """One round of Algorithm 1 at `context_length` committed tokens (the anchor included);
    room: the rows the context can still hold (None: no limit)."""
    t0 = perf_counter()
    plan = sched.plan_round(context_length, target.draft, stop_ids, room)  # lines 3-12
    t1 = perf_counter()
    argmax = target.verify(plan)  # line 13
    t2 = perf_counter()
    outcome = sched.accept(plan, argmax)  # line 14
    walk_s = perf_counter() - t2
    committed = target.commit(outcome)
    times = target.times(plan, RoundTimes(t1 - t0, t2 - t1, walk_s + committed.commit_s))
    record = sched.learn(outcome, times, last_round=committed.done)  # lines 15-18
    return RoundResult(plan, argmax, outcome, committed, times, record)
