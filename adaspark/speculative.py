"""Speculative decoding: the round loop of the paper's Algorithm 1 (§3.1) on the engine's caches.

One round: draft a block after the anchor (the last target token, not yet in the cache) → the
scheduler plans the rows (drafter block + n-gram chains, q, best-first order, width) → one target
verify of those rows → the accept walk → the reply takes the accepted tokens and the bonus one by
one (so a stop inside the path cuts it exactly) → the target and drafter caches commit the rows
whose tokens the reply kept → the scheduler learns from the measured times.

The round itself is scheduler/driver.py's `run_round` (the simulator and the overhead benchmark
run the same one); this module is its Target on the engine: the drafter's forward, the target's
verify, the reply and the cache commits. The driver defines the timed parts (D, verify, commit);
a plain round skips the drafter, so its D is the plan alone.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from adaspark import threads
from adaspark.cached import CachedTokens
from adaspark.errors import UserError
from adaspark.options import ModelOptions
from adaspark.sampling import Sampler
from adaspark.scheduler.driver import Committed, Target, run_round
from adaspark.scheduler.round import Arm, Outcome, Plan, Scheduler
from adaspark.scheduler.store import Store
from adaspark.scheduler.tree import Block

if TYPE_CHECKING:
    from adaspark.engine import Timing

_log = logging.getLogger(__name__)


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
    """Each row's pick along the path the accept walk takes, as plain decoding would make it:
    a row at depth d samples position start + d + 1 with its ancestors' tokens (the path so
    far) in the reply. The walk reads no other row, so those stay -1 and cost nothing.
    Returns the picks [rows] and the adjusted logits of each sampled row (for logprobs)."""
    child = {(int(parent), int(token)): row for row, (parent, token)
             in enumerate(zip(plan.parents, plan.tokens, strict=True)) if row}
    picks = np.full(plan.rows, -1, dtype=np.int64)
    adjusted: dict[int, Any] = {}
    path: list[int] = []
    row: int | None = 0
    while row is not None:
        pick, x = sampler.sample(logits[row:row + 1], [start + int(plan.depths[row]) + 1],
                                 [path] if sampler.params.penalised else None)
        picks[row], adjusted[row] = int(pick[0]), x[0]
        path = [*path, int(pick[0])]
        row = child.get((row, int(pick[0])))
    return picks, adjusted


class _EngineTarget(Target):
    """The driver's Target on the engine: drafter, target verify, reply and cache commits."""

    def __init__(self, spec: Speculator, anchor: int, reply: Any, cache: CachedTokens,
                 sampler: Sampler | None) -> None:
        self.spec, self.anchor, self.reply, self.cache, self.sampler = (
            spec, anchor, reply, cache, sampler)
        self._out: Any = None
        self._adjusted: dict[int, Any] = {}

    def draft(self) -> Block:
        start = self.spec.target.cache.length  # the anchor's position
        return self.spec.drafter.draft(self.anchor, noise=self.spec._draft_noise(start))

    def verify(self, plan: Plan) -> np.ndarray:
        spec, sampler = self.spec, self.sampler
        start = spec.target.cache.length
        self._out = out = spec.target.verify(plan.tokens, plan.depths, plan.mask,
                                             tap_layers=spec.tap_layers,
                                             return_logits=sampler is not None)
        if sampler is None:
            return out.argmax.cpu().numpy()  # the copy waits for an asynchronous device
        argmax, self._adjusted = sample_path(sampler, out.logits.cpu(), plan, start)
        return argmax

    def commit(self, outcome: Outcome) -> Committed:
        # The reply takes the accepted tokens, then the bonus; the one that ends it is not
        # committed (plain decoding never commits its last token either).
        sampler, emitted = self.sampler, []
        keep, done = len(outcome.rows), False
        for i, token in enumerate([*outcome.tokens, outcome.bonus]):
            emitted.append(token)
            if sampler is not None:  # token i was picked on row outcome.rows[i]
                sampler.record(self._adjusted[outcome.rows[i]], token)
            if self.reply.push(token):
                keep, done = i + 1, True
                break
            if sampler is not None:
                sampler.observe(token)
        rows = outcome.rows[:keep]
        t = time.perf_counter()
        self.spec.target.commit(rows)
        self.spec.drafter.observe(self._out.hiddens, rows=rows)
        commit_s = time.perf_counter() - t
        self.cache.commit(outcome.plan.tokens[rows])
        return Committed(rows, emitted, done, commit_s)


class Speculator:
    """The drafter, scheduler, learned store and round log an engine decodes speculatively with.

    target: the engine's Transformer; drafter: a drafter.runtime.Drafter for it; stop_ids: the
    tokenizer's end tokens (nothing is verified below one); store: where the scheduler's learned
    state is saved after every request (None: not kept); round_log: a JSONL path (None: off).
    """

    def __init__(self, target: Any, drafter: Any, scheduler: Scheduler, stop_ids=(),
                 store: Store | None = None, round_log: str | Path | None = None):
        self.target = target
        self.drafter = drafter
        self.scheduler = scheduler
        self.stop_ids = sorted(int(t) for t in stop_ids)
        self.store = store
        self.round_log_path = Path(round_log) if round_log else None
        self._log: IO[str] | None = None
        self.round_hook: RoundHook | None = None
        # called after every round with its round-log record and plan (the server's metrics)
        self.observers: list[Callable[[dict, Plan], None]] = []
        self.shared_noise = True  # when sampling, the drafter drafts on the target's noise
        self._sampler: Sampler | None = None  # the request's, while decode() runs

    @property
    def arm(self) -> str:
        return self.scheduler.arm.name

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.tap_layers)

    # ----- caches --------------------------------------------------------------------------
    def reset(self) -> None:
        self.drafter.reset()

    def after_prefill(self, keep: int, hiddens: dict) -> None:
        """The target kept `keep` cached tokens and prefilled the rest with these taps."""
        self.drafter.truncate(min(keep, self.drafter.length))
        self.drafter.observe(hiddens)

    # ----- one reply -----------------------------------------------------------------------
    def decode(self, anchor: int, reply: Any, cache: CachedTokens, capacity: int,
               timing: Timing, should_stop: Callable[[], bool] | None = None,
               request_id: str | None = None, sampler: Sampler | None = None) -> None:
        """Decode after the prefill until the reply finishes. anchor: the prefill's pick;
        reply: the engine's Reply (stops); cache: the engine's cached tokens, extended with
        every committed token; timing: the request's, whose round counters and decode time
        this writes; sampler: None is greedy."""
        sched = self.scheduler
        start = time.perf_counter()
        temperature = sampler.params.temperature if sampler is not None else 0.0
        sched.begin_request([*cache.ids, anchor], temperature=temperature)
        self._sampler = sampler
        try:
            with cache.guard():
                done = reply.push(anchor)
                if sampler is not None:
                    sampler.observe(anchor)
                target = _EngineTarget(self, anchor, reply, cache, sampler)
                while not done:
                    length = self.target.cache.length
                    if length >= capacity:
                        reply.end("length")
                        break
                    if should_stop is not None and should_stop():
                        reply.end("cancelled")
                        break
                    done = self._round(target, capacity - length, timing, request_id)
                timing.decode_s = time.perf_counter() - start
        finally:
            self._sampler = None
            self._end_request()

    def _round(self, target: _EngineTarget, room: int, timing: Timing,
               request_id: str | None) -> bool:
        threads.adapt()  # fewer threads while other processes keep cores busy
        ctx = self.target.cache.length + 1  # committed tokens, the anchor included
        result = run_round(self.scheduler, target, ctx, self.stop_ids, room)
        target.anchor = result.outcome.bonus
        record = result.record
        record.arm, record.request = self.arm, request_id
        timing.count_round(record, len(result.committed.emitted))
        if self.round_log_path is not None or self.observers:  # the JSON row has readers
            row = record.to_json()
            self._write(row)
            for observe in self.observers:
                observe(row, result.plan)
        if self.round_hook is not None:
            self.round_hook(RoundTrace(result.plan, result.argmax, result.outcome,
                                       list(result.committed.rows), result.committed.emitted))
        return result.committed.done

    def _draft_noise(self, start: int):
        """The target's noise at the block's positions over the draft vocabulary, times T (the
        drafter's argmax of l + T g is the Gumbel-max pick of softmax(l / T)); None: greedy."""
        sampler = self._sampler
        if sampler is None or sampler.noise is None or not self.shared_noise:
            return None
        block = self.drafter.block_size
        g = sampler.noise.rows(range(start + 1, start + block + 1))
        return g[:, self.drafter.model.draft_ids] * sampler.params.temperature

    # ----- persistence ---------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        if self.round_log_path is None:
            return
        if self._log is None:
            try:
                self.round_log_path.parent.mkdir(parents=True, exist_ok=True)
                self._log = open(self.round_log_path, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as err:
                raise UserError(f"cannot write the round log {self.round_log_path}: "
                                f"{err.strerror or err}") from None
        self._log.write(json.dumps(record) + "\n")

    def _end_request(self) -> None:
        """The cost model's refit, then the learned state and the round log reach the disk."""
        self.scheduler.end_request()
        if self._log is not None:
            self._log.flush()
        if self.store is not None:
            try:
                self.store.save(self.scheduler.state_dict())
            except UserError as err:  # the reply stands; the last good store stays on disk
                _log.warning("learned state not saved after this request: %s", err)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


# What `serve`, `generate` and `chat` run without --arm: AdaSpark with the draft gate, which on
# the project's 2-core CPU decodes 1.43x plain decoding against 1.20x for the paper's `adaspark`
# (benchmarks/arms.py, short subset). Every arm emits the target's greedy tokens; the paper's
# arms stay available by name for its protocol (`adaspark bench`).
DEFAULT_ARM = "adaspark,gate"


def load_speculator(target: Any, model_path: Path, stop_ids, options: ModelOptions
                    ) -> Speculator | None:
    """The speculator for options.arm, or None for `ar` (the engine's plain decode loop).

    An arm of None means DEFAULT_ARM when a drafter exists for the model (the shipped one, or
    options.drafter), else plain decoding with a warning; a named drafting arm without a
    drafter is an error."""
    from adaspark.drafter.loading import default_drafter_for, load_drafter, target_info
    from adaspark.learned_store import drafter_sha256, fingerprint, open_store, restore

    arm = options.arm or Arm.parse(DEFAULT_ARM)
    if not arm.draft:
        return None
    info = target_info(target, model_path)
    try:
        checkpoint = Path(options.drafter) if options.drafter else default_drafter_for(info)
    except UserError as err:
        if options.arm is not None:
            raise
        _log.warning("%s; decoding without speculation (arm ar)", err)
        return None
    draft = load_drafter(target, model_path, checkpoint)
    scheduler = Scheduler(arm)
    learned = open_store(options.store,
                         fingerprint(info["sha256"], drafter_sha256(checkpoint), target, arm))
    refused = restore(scheduler, learned, options.fresh)
    if refused:
        _log.warning("%s", refused)
    return Speculator(target, draft, scheduler, stop_ids, learned, options.round_log)
