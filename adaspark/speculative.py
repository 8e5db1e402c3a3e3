"""Speculative decoding: the round loop of the paper's Algorithm 1 (§3.1) on the engine's caches.

One round: draft a block after the anchor (the last target token, not yet in the cache) → the
scheduler plans the rows (drafter block + n-gram chains, q, best-first order, width) → one target
verify of those rows → the accept walk → the reply takes the accepted tokens and the bonus one by
one (so a stop inside the path cuts it exactly) → the target and drafter caches commit the rows
whose tokens the reply kept → the scheduler learns from the measured times.

A round is a step of batch.py's `Batch` (`RoundDecode`: a request alone is a batch of one, the
server's requests share each step's verify call): row() plans it (D, the draft included), the
batch verifies, take() accepts, commits and learns. The parts and their timing are those of
scheduler/driver.py's `run_round`, which the simulator and the overhead benchmark run (D,
verify, commit); a plain round skips the drafter, so its D is the plan alone.

Sampling (sampling.py): a verified row's pick is its position-keyed Gumbel-max token instead of
its argmax, made only for the rows on the path the accept walk takes (timed with the verify), and
the accept walk runs on those picks unchanged. The drafter may draft on the same noise
(`shared_noise`), so that its picks predict the perturbed target argmax, not the target's mode.

Cache invariant, checked after every round by cached.CachedTokens (its one owner):
drafter.length == target.cache.length == len(cache.ids). A token that ends the reply (stop
token, the token completing a stop string, the max-tokens-th token) is never committed, exactly
as in plain decoding, so the next turn's prefix reuse sees the same cache whichever arm produced
the reply.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from adaspark import constrained
from adaspark.errors import UserError
from adaspark.options import ModelOptions
from adaspark.sampling import Sampler
from adaspark.scheduler.arm import MAX_WIDTH, Arm
from adaspark.scheduler.budget import StepPrice, allocate
from adaspark.scheduler.chooser import BandRate
from adaspark.scheduler.merge import SharedState
from adaspark.scheduler.plan import Outcome, Plan, RequestState
from adaspark.scheduler.record import RoundRecord, RoundTimes
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.store import Store
from adaspark.scheduler.tree import Block
from adaspark.sequence import Decode

if TYPE_CHECKING:
    from adaspark.request import Timing

_log = logging.getLogger(__name__)
# While other requests run, a finished request's learned state waits for the batch's last one to
# end, at most this long: the store's save (an fsync) stalls every running stream's step. Under a
# server (idle_saves), a lone request's save waits too, for the engine's next idle moment.
SAVE_EVERY_S = 10.0
PLAN_DECAY = 0.9  # Speculator.learn_plan_time: the recent rounds' plan times (the load drifts)


@dataclass
class RoundTrace:
    """One round as the loop saw it (for the round hook: tests and debugging)."""

    plan: Plan
    argmax: np.ndarray  # the target's pick per verified row (its argmax when greedy; when
    # sampling, rows off the accepted path are not sampled: -1)
    outcome: Outcome
    committed_rows: list[int]  # the rows whose K/V went into the caches
    emitted: list[int] = field(default_factory=list)  # tokens the reply took, in order


RoundHook = Callable[[RoundTrace], None]


def sample_path(sampler: Sampler, logits: Any, plan: Plan, start: int):
    """Each row's pick along the path the accept walk takes (Plan.walk), as plain decoding
    would make it: a row at depth d samples position start + d + 1 with its ancestors' tokens
    (the path so far) in the reply. Returns the picks [rows] and the adjusted logits of each
    sampled row (for logprobs)."""
    def pick(row: int, path: list[int]) -> tuple[int, Any]:
        token, x = sampler.sample(logits[row:row + 1], [start + int(plan.depths[row]) + 1],
                                  [path] if sampler.params.penalised else None)
        return int(token[0]), x[0]

    return plan.walk(pick)


def take_path(reply: Any, sampler: Sampler | None, adjusted: dict[int, Any], outcome: Outcome
              ) -> tuple[list[int], list[int], bool]:
    """The reply takes the accepted tokens, then the bonus, one by one; the one that ends it is
    not committed (plain decoding never commits its last token either). Returns the rows to
    commit, the tokens the reply took and whether it ended."""
    emitted: list[int] = []
    keep, done = len(outcome.rows), False
    for i, token in enumerate([*outcome.tokens, outcome.bonus]):
        emitted.append(token)
        if sampler is not None:  # token i was picked on row outcome.rows[i]
            sampler.record(adjusted[outcome.rows[i]], token)
        if reply.push(token):
            keep, done = i + 1, True
            break
        if sampler is not None:
            sampler.observe(token)
    return outcome.rows[:keep], emitted, done


class RoundDecode(Decode):
    """One request's speculative rounds as steps of a Batch, beside other requests: row() plans
    its round on the shared scheduler (its own RequestState: n-gram index, anchor, counters),
    drafting on its slot's own drafter when the round drafts, the batch verifies every
    request's rows in one call (tapping the drafters' layers), take() accepts, commits its path
    to its own slot (target and drafter) and learns."""

    def __init__(self, spec: Speculator, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec = spec
        self.request: RequestState | None = None  # from the first decode step on
        self._room = 0
        self._plan: Plan | None = None
        self._plan_s = 0.0
        self._drafted = False
        self.first_round = False  # this step's round is the request's first
        # the step beside others as priced before it plans (Speculator.price_step; None alone)
        self.step: StepPrice | None = None
        self.step_tokens, self.step_s = 0, 0.0  # its last round's tokens and own time

    def advance(self, capacity: int) -> bool:
        """The first decode step: the reply takes the prefill's pick, the scheduler a request;
        every step: stop, length and cancellation."""
        if self.request is None:
            temperature = self.sampler.params.temperature if self.sampler is not None else 0.0
            self.request = self.spec.scheduler.begin_request([*self.slot.ids, self.token],
                                                             temperature=temperature)
            self.request.constraint = self.grammar  # its trees keep the legal candidates
            # the prompt's n-gram index is prompt work, before the first token: the decode
            # time (Timing.decode_s) starts after it
            self._decode_start = time.perf_counter()
            self.spec.running += 1
            if self.reply.push(self.token):
                return self._stop()
            if self.sampler is not None:
                self.sampler.observe(self.token)
        elif self.reply.done:
            return self._stop()
        if len(self.slot) >= capacity:
            self.reply.end("length")
            return self._stop()
        if self.cancelled():
            return self._stop()
        self._room = capacity - len(self.slot)
        return True

    def row(self) -> tuple[Any, np.ndarray, np.ndarray]:
        """Plan this request's round (D): its rows for Transformer.verify_many."""
        start = time.perf_counter()
        self.first_round = self.request.rounds == 0
        self._plan = self.spec.scheduler.plan_round(
            len(self.slot) + 1, self._draft, self.spec.stop_ids, self._room,
            request=self.request, step=self.step)
        self._plan_s = time.perf_counter() - start
        self._drafted = self._plan.drafted  # a cut may leave its plain row: still drafted
        return self.rows()

    def rows(self) -> tuple[Any, np.ndarray, np.ndarray]:
        plan = self._plan
        return plan.tokens, plan.depths, plan.mask

    def cut(self, keep: int) -> tuple[Any, np.ndarray, np.ndarray]:
        """Verify only the plan's first `keep` candidates (the shared row budget)."""
        self._plan = self.spec.scheduler.cut(self._plan, keep, request=self.request)
        return self.rows()

    def _draft(self) -> Block:
        """The round drafts (plan_round asks, timed in D): one draft on this request's own
        drafter, after its anchor at the end of its slot, on its own sampler's noise."""
        drafter = self.slot.drafter
        if drafter is None:  # the scheduler asks only on arms that need one
            raise RuntimeError(f"arm {self.spec.arm} drafted without a drafter")
        noise = self.spec.draft_noise(drafter, self.sampler, len(self.slot))
        return drafter.draft(self.request.anchor, noise=noise)

    def take(self, argmax: Any, logits: Any = None, step: Any = None,
             taps: Any = None) -> None:
        """Accept on the verified rows, the reply takes the path, the slot commits the kept
        rows, the scheduler learns. A round alone in its call learns as driver.run_round's;
        beside others its verify time is the shared call's, so it teaches no price
        (Speculator.learn_shared_verify teaches the call's at its total rows)."""
        sched, plan, sampler = self.spec.scheduler, self._plan, self.sampler
        start = time.perf_counter()
        adjusted: dict[int, Any] = {}
        if self.grammar is not None:  # each path row's pick under its own path's grammar state
            picks, adjusted = constrained.path_picks(self.grammar, sampler, logits.cpu(), plan,
                                                     len(self.slot), argmax)
        elif sampler is None:
            picks = argmax  # numpy: Batch._verify converts the step's once
        else:
            picks, adjusted = sample_path(sampler, logits.cpu(), plan, len(self.slot))
        walk = time.perf_counter()
        outcome = sched.accept(plan, picks)
        walk_s = time.perf_counter() - walk
        rows, emitted, done = take_path(self.reply, sampler, adjusted, outcome)
        commit = time.perf_counter()
        self.slot.kv.commit(rows)
        if self.slot.drafter is not None:  # the kept rows' taps: its drafter's next features
            # a one-row round's taps are its kept row's: all of them, without an index
            self.slot.drafter.observe_taps(taps, rows=None if plan.rows == 1 else rows)
        commit_s = time.perf_counter() - commit
        tokens = plan.tokens
        self.slot.commit([tokens[row] for row in rows])  # the path's few rows
        alone = step is None or step.sequences == 1
        verify_s = (0.0 if step is None else step.verify_s) + walk - start
        learn_start = time.perf_counter()
        record = sched.learn(outcome, RoundTimes(self._plan_s, verify_s, walk_s + commit_s),
                             last_round=done, request=self.request, cost=alone)
        self.spec.report(record, plan, len(emitted), self.timing, self.request_id,
                         lambda: RoundTrace(plan, picks, outcome, list(rows), emitted))
        end = time.perf_counter()
        if self.step is not None and not self.first_round:  # priced beside others
            # what a draft adds to the step: its plan and its learn (a tree's learning costs
            # several times a plain round's), both the host's time every request waits for
            self.spec.learn_plan_time(self._drafted, self._plan_s + end - learn_start)
        self.step_tokens, self.step_s = len(emitted), self._plan_s + end - walk
        if done:
            self._stop()

    def _stop(self) -> bool:
        """The request ends: its decode time and tokens (the tokens produced after the first,
        a stop token included, as plain decoding counts them), then the scheduler's end of
        request and the learned store."""
        super()._stop()
        produced = len(self.reply.token_ids) + (self.reply.stop_token_id is not None)
        self.timing.decode_tokens = max(0, produced - 1)
        if self.request is not None and self.request.anchor is not None:
            self.spec.running -= 1
            self.spec._end_request(self.request, beside=self.spec.running > 0)
        return False


def open_round_log(path: Path) -> IO[str]:
    """The round log opened for appending (its folder made); UserError when it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "a", encoding="utf-8")  # noqa: SIM115
    except OSError as err:
        raise UserError(f"cannot write the round log {path}: {err.strerror or err}") from None


class Speculator:
    """The drafter, scheduler, learned store and round log an engine decodes speculatively with.

    target: the engine's Transformer; drafter: a drafter.runtime.Drafter for it, or None for an
    arm that never drafts (`ngram`: no taps, no drafter cache); stop_ids: the tokenizer's end
    tokens (nothing is verified below one); store: where the scheduler's learned state is saved
    after every request (None: not kept); round_log: a JSONL path (None: off).
    """

    def __init__(self, target: Any, drafter: Any | None, scheduler: Scheduler, stop_ids=(),
                 store: Store | None = None, round_log: str | Path | None = None):
        if drafter is None and scheduler.arm.needs_drafter:
            raise UserError(f"arm {scheduler.arm.name} needs a drafter")
        self.target = target
        self.drafter = drafter
        self.scheduler = scheduler
        self.stop_ids = sorted(int(t) for t in stop_ids)
        self.store = store  # with the state it last held (save() merges against it)
        self.round_log_path = Path(round_log) if round_log else None
        # opened now: a file that cannot be written fails the load, not every request
        self._log: IO[str] | None = \
            open_round_log(self.round_log_path) if self.round_log_path else None
        self.round_hook: RoundHook | None = None
        # called after every round with its round-log record and plan (the server's metrics)
        self.observers: list[Callable[[dict, Plan], None]] = []
        self.shared_noise = True  # when sampling, the drafter drafts on the target's noise
        # the batch's steps of several requests: their tokens per ms (the row budget's rate)
        self.step_rate = BandRate()
        self.plain_floor = True  # step_price's rate at least the plain step's (False: the paper's)
        self.running = 0  # the batch's requests that began and have not ended
        # beside others: the decayed mean host ms a round (plan and learn), [undrafted, drafted]
        self.plan_ms: list[float | None] = [None, None]
        self._saved_at = time.monotonic()  # when the store was last saved (or made)
        # the server's worker calls idle() when nothing runs: the save of a request that ends
        # alone waits for it too (the next request, often already queued, starts without it)
        self.idle_saves = False
        self.unsaved = False  # a refit or save waits (for idle(), a later request, or close())

    @property
    def store(self) -> Store | None:
        return None if self._shared is None else self._shared.store

    @store.setter
    def store(self, store: Store | None) -> None:
        """The store now holds what the scheduler holds: save() merges from here on."""
        self._shared = None if store is None else SharedState(self.scheduler, store)

    @property
    def arm(self) -> str:
        return self.scheduler.arm.name

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return () if self.drafter is None else tuple(self.drafter.tap_layers)

    # ----- the batch's rounds (RoundDecode) ------------------------------------------------
    def share_rows(self, seqs: list, rows: list[tuple]) -> list[tuple]:
        """Batch.before_verify: the shared row budget (docs/round.md, "Under load"). Each
        request's plain row first, then every request's planned candidates best-first by Q,
        priced at the call's total rows against the steps' long-run rate (budget.allocate);
        each request's tree is cut to its share. A request's own chooser sized its plan, so
        the budget only cuts. Off with one request (its round is the solo one), before the
        steps' rate is measured, or where no measured price holds the plain rows."""
        price = self._priced(seqs)
        if price is None:
            return rows
        sched, fixed, candidates = self.scheduler, 0, []
        for seq, row in zip(seqs, rows, strict=True):
            q = sched.candidates(seq._plan) if isinstance(seq, RoundDecode) else None
            if q is None:  # its rows stand as planned
                fixed += len(row[0]) - 1
            candidates.append(np.zeros(0) if q is None else q)
        if not any(len(q) for q in candidates):  # plain rows (and fixed plans) only: no cut
            return rows

        def step_ms(total: int) -> float:
            return price.step_ms(total + fixed)

        shares = allocate(candidates, step_ms, price.rate)
        return [seq.cut(share) if share < len(q) else row
                for seq, row, q, share in zip(seqs, rows, candidates, shares, strict=True)]

    def step_price(self, seqs: list) -> StepPrice | None:
        """The step of these requests as budget.allocate prices it: their plain rows, the
        scheduler's price of a call by its total rows at their mean context, read once
        (Scheduler.step_prices: rows past the measured classes only at an unmeasured class's
        top, which the call then measures) and the steps' long-run rate, at least the rate
        of the plain step itself (its rows over its price): the rate the batch learns is its
        own, and where drafting lowers it, extra rows would look cheaper and draw more
        drafting; a row must beat plain decoding of these requests. None: one request (its
        round is the solo one), the rate not yet measured, or no price for the plain rows."""
        rate = self.step_rate.rate
        if len(seqs) < 2 or rate is None:
            return None
        ctx = sum(len(seq.slot) + 1 for seq in seqs) / len(seqs)  # exact: integer lengths
        rows, sched = len(seqs), self.scheduler
        plain_ms = sched.step_price(rows, ctx)  # the step_prices() entry of its plain rows
        if not math.isfinite(plain_ms):
            return None
        if self.plain_floor and plain_ms > 0.0:
            rate = max(rate, rows / plain_ms)
        return StepPrice.lazy(rows, lambda: sched.step_prices(rows, rows * MAX_WIDTH, ctx),
                              rate, self.draft_ms)

    def learn_plan_time(self, drafted: bool, plan_s: float) -> None:
        """A round's host time beside others: its plan (its D, the draft call's included where
        it drafted) and its learn; the decayed mean of each kind, whose difference is what a
        draft adds to a step under the load now (StepPrice.draft_ms; the cost model's D is
        its quiet quantile)."""
        ms, mean = 1000.0 * plan_s, self.plan_ms[int(drafted)]
        self.plan_ms[int(drafted)] = ms if mean is None else (
            PLAN_DECAY * mean + (1.0 - PLAN_DECAY) * ms)

    @property
    def draft_ms(self) -> float | None:
        """What a draft adds to a round's host time beside others: the drafted rounds' mean less
        the undrafted ones' (plan_ms, as learn_plan_time keeps it); None until both ran."""
        undrafted, drafted = self.plan_ms
        return None if drafted is None or undrafted is None else drafted - undrafted

    def _priced(self, seqs: list) -> StepPrice | None:
        """The price this step's requests planned by (price_step), read once a step; again
        where the planned requests are not the ones it priced (one failed its plan)."""
        steps = {id(seq.step) if isinstance(seq, RoundDecode) else None for seq in seqs}
        first = seqs[0].step if isinstance(seqs[0], RoundDecode) else None
        if len(steps) == 1 and first is not None and first.rows == len(seqs):
            return first
        return self.step_price(seqs)

    def price_step(self, seqs: list) -> None:
        """Batch.before_plan: each request plans its round against the step's price and rate
        (StepPrice), the ones the row budget then cuts by, so that a draft the budget would
        throw away is not made (Scheduler.plan_round's `step`)."""
        step = self.step_price(seqs)
        for seq in seqs:
            if isinstance(seq, RoundDecode):
                seq.step = step

    def learn_shared_verify(self, seqs: list, step: Any) -> None:
        """Batch.after_verify: a call over several requests' rounds teaches its time at its
        total rows, at their rows' mean context (docs/batching.md), not in a round that is
        some request's first (it runs cold, as a first round teaches no price); and the
        steps' long-run rate (their tokens over their time) that the row budget prices by."""
        rounds = [seq for seq in seqs if isinstance(seq, RoundDecode) and seq._plan is not None]
        if step.sequences < 2 or not rounds:
            return
        rows = [seq._plan.rows for seq in rounds]
        ctx = sum(r * seq._plan.context_length for r, seq in zip(rows, rounds, strict=True)
                  ) / sum(rows)
        first = any(seq.first_round for seq in rounds)
        self.scheduler.learn_shared_verify(step.rows, ctx, 1000.0 * step.verify_s,
                                           teach=not first)
        if not first and not any(seq.finished for seq in rounds):  # an end cuts a round short
            self.step_rate.observe(sum(seq.step_tokens for seq in rounds),
                                   1000.0 * (step.verify_s + sum(s.step_s for s in rounds)))

    def report(self, record: RoundRecord, plan: Plan, emitted: int, timing: Timing,
               request_id: str | None, trace: Callable[[], RoundTrace]) -> None:
        """A round's record to the request's timing (`emitted`: the tokens the reply took), the
        round log, the observers and the hook (trace() makes what it reads: most rounds have
        no hook)."""
        record.arm, record.request = self.arm, request_id
        timing.count_round(record, emitted)
        if self.round_log_path is not None or self.observers:  # the JSON row has readers
            row = record.to_json()
            self._write(row)
            for observe in self.observers:
                observe(row, plan)
        if self.round_hook is not None:
            self.round_hook(trace())

    def draft_noise(self, drafter: Any, sampler: Sampler | None, start: int):
        """The request's noise at the block's positions (the anchor at `start`) over the draft
        vocabulary, times T (the drafter's argmax of l + T g is the Gumbel-max pick of
        softmax(l / T)); None: greedy."""
        if sampler is None or sampler.noise is None or not self.shared_noise:
            return None
        block = drafter.block_size
        g = sampler.noise.rows(range(start + 1, start + block + 1))
        return g[:, drafter.model.draft_ids] * sampler.params.temperature

    # ----- persistence ---------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        if self.round_log_path is None:
            return
        if self._log is None:  # closed, and decoding again
            self._log = open_round_log(self.round_log_path)
        self._log.write(json.dumps(record) + "\n")

    def _end_request(self, request: RequestState | None = None, beside: bool = False) -> None:
        """The cost model's refit, then the learned state and the round log reach the disk.
        beside: other requests still run in the batch; the refit (a few ms of Python) and the
        store's save (an fsync), which would stall their step, then wait for the last of them
        to end, or SAVE_EVERY_S (close() saves what still waits). Under idle_saves the save of
        a request that ends alone waits as well, for idle() or SAVE_EVERY_S. The reply stands
        whatever fails here: a refit or a save that raises is logged, never the request's
        failure."""
        now = time.monotonic()
        recent = now - self._saved_at < SAVE_EVERY_S
        wait = beside and recent
        try:
            self.scheduler.end_request(request, refit=not wait)
        except Exception:  # noqa: BLE001 - a bug in the refit: the reply is whole already
            _log.exception("the learned laws' refit failed after a request")
        if self._log is not None:
            self._log.flush()
        if wait or (self.idle_saves and recent):
            self.unsaved = True
            return
        self._saved_at, self.unsaved = now, False
        self.save("after this request")

    def idle(self) -> None:
        """Nothing runs (the server's worker asks): the refit and the save that waited."""
        if not self.unsaved:
            return
        try:
            self.scheduler.refit()  # only the laws that learned since their last refit
        except Exception:  # noqa: BLE001 - still save what was learned
            _log.exception("the learned laws' refit failed while idle")
        self._saved_at, self.unsaved = time.monotonic(), False
        self.save("while idle")

    def save(self, when: str = "now") -> None:
        """The learned state to the store, merged with what another process on the same store
        saved meanwhile (scheduler/merge.py), under the store's lock; a failure is logged (the
        last good store stays on disk)."""
        if self._shared is None:
            return
        try:
            self._shared.save()
        except UserError as err:
            _log.warning("learned state not saved %s: %s", when, err)
        except Exception:  # noqa: BLE001 - a bug in the merge: the store stays as it was
            _log.exception("learned state not saved %s", when)  # (Store.update counted it)

    def close(self) -> None:
        """The end of the engine: the refit and the save that waited for other requests (and
        every request's rounds so far), then the round log is closed. Only on the engine's
        thread, after its last step."""
        try:
            self.scheduler.refit()
        except Exception:  # noqa: BLE001 - still save what was learned
            _log.exception("the learned laws' last refit failed")
        self.unsaved = False
        self.save("at shutdown")
        if self._log is not None:
            self._log.close()
            self._log = None


# What `serve`, `generate` and `chat` run without --arm: AdaSpark with the draft gate, which on
# the project's 2-core CPUs decodes 1.22-1.34x plain decoding against 1.08-1.23x for the paper's
# `adaspark` (benchmarks/arms.py, short subset, docs/results/zen5-s36/; level with `ngram` there:
# issue 44's drafter does not yet add to the n-gram fill). Every arm emits the target's greedy
# tokens; the paper's arms stay available by name for its protocol (`adaspark bench`).
DEFAULT_ARM = "adaspark,gate"
# ... and for a model with no drafter (none shipped for its file, none given): the paper's n-gram
# fill alone, priced and sized like the drafted arms' trees, a plain row where they do not pay.
NO_DRAFTER_ARM = "ngram"


def load_speculator(target: Any, model_path: Path, stop_ids, options: ModelOptions
                    ) -> Speculator | None:
    """The speculator for options.arm, or None for `ar` (the engine's plain decode loop).

    An arm of None means DEFAULT_ARM when a drafter exists for the model (options.drafter, or
    the shipped one when it was trained for this model file), else NO_DRAFTER_ARM with a
    warning; a named drafting arm without a drafter is an error; `ngram` never loads one."""
    from adaspark.drafter.loading import load_drafter, target_info
    from adaspark.learned_store import drafter_sha256, fingerprint, open_store, restore

    arm = options.arm
    if arm is not None and not arm.draft:
        return None
    info = target_info(target, model_path)
    checkpoint = _checkpoint(arm, options, info)
    if arm is None:
        arm = Arm.parse(DEFAULT_ARM if checkpoint is not None else NO_DRAFTER_ARM)
    draft = None if checkpoint is None else load_drafter(target, model_path, checkpoint)
    scheduler = Scheduler(arm)
    drafter_hash = None if checkpoint is None else drafter_sha256(checkpoint)
    learned = open_store(options.store, fingerprint(info["sha256"], drafter_hash, target, arm))
    refused = restore(scheduler, learned, options.fresh)
    if refused:
        _log.warning("%s", refused)
    return Speculator(target, draft, scheduler, stop_ids, learned, options.round_log)


def _checkpoint(arm: Arm | None, options: ModelOptions, info: dict) -> Path | None:
    """The drafter checkpoint the arm runs (None: no drafter). An arm left to the default
    without a drafter for this model falls back to NO_DRAFTER_ARM; `ngram` loads none."""
    from adaspark.drafter.loading import default_drafter_for

    if arm is not None and not arm.needs_drafter:
        if options.drafter:
            _log.warning("arm %s runs without a drafter: %s is not loaded", arm.name,
                         options.drafter)
        return None
    try:
        return Path(options.drafter) if options.drafter else default_drafter_for(info)
    except UserError as err:
        if arm is not None:
            raise
        _log.warning("%s; decoding with the n-gram arm (%s), which needs none", err,
                     NO_DRAFTER_ARM)
        return None
