"""Speculative decoding: the round loop of the paper's Algorithm 1 (§3.1) on the engine's caches.

One round: draft a block after the anchor (the last target token, not yet in the cache) → the
scheduler plans the rows (drafter block + n-gram chains, q, best-first order, width) → one target
verify of those rows → the accept walk → the reply takes the accepted tokens and the bonus one by
one (so a stop inside the path cuts it exactly) → the target and drafter caches commit the rows
whose tokens the reply kept → the scheduler learns from the measured times.

Timed parts (time.perf_counter), as the scheduler and the round log define them:
  D       drafter forward + plan (candidates, q, order, width, layout); not verify or commit
  verify  the target's forward over the planned rows (argmax copied to the host)
  commit  the accept walk + the target and drafter cache commits
A plain round (the scheduler's width 1, arm switch `plain`) skips the drafter: D is the plan alone.

Sampling (sampling.py): a verified row's pick is its position-keyed Gumbel-max token instead of
its argmax, made only for the rows on the path the accept walk takes (timed with the verify), and
the accept walk runs on those picks unchanged. The drafter may draft on the same noise
(`shared_noise`), so that its picks predict the perturbed target argmax, not the target's mode.

Cache invariant, checked after every round: drafter.length == target.cache.length ==
len(cached_ids). A token that ends the reply (stop token, the token completing a stop string, the
max-tokens-th token) is never committed, exactly as in plain decoding, so the next turn's prefix
reuse sees the same cache whichever arm produced the reply.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from adaspark.errors import UserError
from adaspark.sampling import Sampler
from adaspark.scheduler.round import Arm, Outcome, Plan, Scheduler
from adaspark.scheduler.store import Store
from adaspark.scheduler.tree import NGRAM, Block

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


@dataclass
class RoundCounts:
    """Per-reply round statistics (the engine copies them into its Timing)."""

    draft_rounds: int = 0
    plain_rounds: int = 0
    ngram_rounds: int = 0  # tree rounds from the n-gram index alone (the draft gate)
    verified_rows: int = 0
    accepted_tokens: int = 0  # drafted tokens the reply took (bonus tokens excluded)
    decode_s: float = 0.0  # the rounds, without the request's end (refit, store save)


def round_record(record: dict, plan: Plan, arm: str, request: str | None) -> dict:
    """The scheduler's learn() record in the round-log schema of adaspark/bench/rounds.py."""
    out = {
        "arm": arm, "request": request, "ctx": record["context"],
        "width_offered": plan.width_offered, "width": plan.width_chosen, "rows": plan.rows,
        "accepted": record["accepted"], "accepted_drafter": record["accepted_drafter"],
        "accepted_ngram": record["accepted_ngram"], "agreed": record["accepted_agreed"],
        "D": record["fixed_s"], "verify": record["verify_s"], "commit": record["commit_s"],
        "pred_S": None if plan.chosen_by == "plain" else plan.predicted_S,
        "pred_T": plan.predicted_T_s, "cold": plan.chosen_by == "probe",
        "plain": plan.chosen_by == "plain", "chosen_by": plan.chosen_by,
        "drafted": plan.drafted, "gate_bucket": record["gate_bucket"],
    }
    if plan._tree is not None and plan._layout is not None:
        nodes = plan._layout.nodes[1:]
        ngram = plan._tree.kind[nodes] == NGRAM
        agreed = ~ngram & (plan._tree.agreed_bucket[nodes] >= 0)
        out["rows_ngram"] = int(ngram.sum())
        out["rows_agreed"] = int(agreed.sum())
        out["rows_drafter"] = int(nodes.size - ngram.sum() - agreed.sum())
    return out


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
        self._check_aligned()

    def _check_aligned(self) -> None:
        if self.drafter.length != self.target.cache.length:
            raise RuntimeError(f"drafter cache holds {self.drafter.length} tokens, the target's "
                               f"{self.target.cache.length}")

    # ----- one reply -----------------------------------------------------------------------
    def decode(self, anchor: int, reply: Any, cached_ids: list[int], capacity: int,
               should_stop: Callable[[], bool] | None = None,
               request_id: str | None = None, sampler: Sampler | None = None) -> RoundCounts:
        """Decode after the prefill until the reply finishes. anchor: the prefill's pick;
        reply: the engine's Reply (stops); cached_ids: the engine's list of the tokens in the
        target cache, extended in place with every committed token; sampler: None is greedy."""
        counts = RoundCounts()
        sched = self.scheduler
        start = time.perf_counter()
        temperature = sampler.params.temperature if sampler is not None else 0.0
        sched.begin_request([*cached_ids, anchor], temperature=temperature)
        self._sampler = sampler
        try:
            done = reply.push(anchor)
            if sampler is not None:
                sampler.observe(anchor)
            while not done:
                length = self.target.cache.length
                if length >= capacity:
                    reply.end("length")
                    break
                if should_stop is not None and should_stop():
                    reply.end("cancelled")
                    break
                anchor, done = self._round(anchor, reply, cached_ids, capacity - length,
                                           counts, request_id)
            counts.decode_s = time.perf_counter() - start
        except BaseException:
            # a half-finished round leaves the caches undefined: the next request starts clean
            self.target.reset()
            self.drafter.reset()
            cached_ids.clear()
            raise
        finally:
            self._sampler = None
            self._end_request()
        return counts

    def _round(self, anchor: int, reply: Any, cached_ids: list[int], room: int,
               counts: RoundCounts, request_id: str | None) -> tuple[int, bool]:
        sched, target, sampler = self.scheduler, self.target, self._sampler
        start = target.cache.length  # the anchor's position
        ctx = start + 1  # committed tokens, the anchor included
        t0 = time.perf_counter()
        if sched.should_draft(ctx, self.stop_ids):
            drafted = self.drafter.draft(anchor, noise=self._draft_noise(start))
            block = Block(drafted.picks, drafted.topk_ids, drafted.topk_logits, drafted.head)
            plan = sched.plan(block, ctx, self.stop_ids)
        else:
            plan = sched.plan_undrafted(ctx, self.stop_ids)
        if plan.rows > room:  # the context cannot hold this tree: one row still fits
            plan = sched.plain(ctx)
        t1 = time.perf_counter()
        out = target.verify(plan.tokens, plan.depths, plan.mask, tap_layers=self.tap_layers,
                            return_logits=sampler is not None)
        if sampler is None:
            argmax = out.argmax.cpu().numpy()  # the copy waits for an asynchronous device
        else:
            argmax, adjusted = sample_path(sampler, out.logits.cpu(), plan, start)
        t2 = time.perf_counter()
        outcome = sched.accept(plan, argmax)
        walk_s = time.perf_counter() - t2

        # The reply takes the accepted tokens, then the bonus; the one that ends it is not
        # committed (plain decoding never commits its last token either).
        emitted: list[int] = []
        keep = len(outcome.rows)
        done = False
        for i, token in enumerate([*outcome.tokens, outcome.bonus]):
            emitted.append(token)
            if sampler is not None:  # token i was picked on row outcome.rows[i]
                sampler.record(adjusted[outcome.rows[i]], token)
            if reply.push(token):
                keep, done = i + 1, True
                break
            if sampler is not None:
                sampler.observe(token)
        rows = outcome.rows[:keep]

        t3 = time.perf_counter()
        target.commit(rows)
        self.drafter.observe(out.hiddens, rows=rows)
        commit_s = walk_s + time.perf_counter() - t3
        cached_ids.extend(int(t) for t in plan.tokens[rows])
        self._check_aligned()

        record = sched.learn(outcome, t2 - t1, t1 - t0, commit_s, last_round=done)
        if plan.chosen_by == "plain":
            counts.plain_rounds += 1
        elif plan.drafted:
            counts.draft_rounds += 1
        else:
            counts.ngram_rounds += 1
        counts.verified_rows += plan.rows
        counts.accepted_tokens += min(len(outcome.tokens), len(emitted))
        row = round_record(record, plan, self.arm, request_id)
        self._write(row)
        for observe in self.observers:
            observe(row, plan)
        if self.round_hook is not None:
            self.round_hook(RoundTrace(plan, argmax, outcome, list(rows), emitted))
        return outcome.bonus, done

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
            self.store.save(self.scheduler.state_dict())

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


# What `serve`, `generate` and `chat` run without --arm: AdaSpark with the draft gate, which on
# the project's 2-core CPU decodes 1.43x plain decoding against 1.20x for the paper's `adaspark`
# (benchmarks/arms.py, short subset). Every arm emits the target's greedy tokens; the paper's
# arms stay available by name for its protocol (`adaspark bench`).
DEFAULT_ARM = "adaspark,gate"


def load_speculator(target: Any, model_path: Path, stop_ids, arm: str | None = None,
                    drafter: str | Path | None = None, store: str | Path | None = None,
                    fresh: bool = False, round_log: str | Path | None = None,
                    ) -> Speculator | None:
    """The speculator for an arm, or None for `ar` (the engine's plain decode loop).

    arm None means DEFAULT_ARM when a drafter exists for the model (the shipped one, or
    `drafter`), else plain decoding with a warning; a named drafting arm without a drafter is an
    error.
    drafter: a checkpoint directory (None: the shipped one for this model file)."""
    from adaspark.drafter.loading import default_drafter_for, load_drafter, target_info
    from adaspark.learned_store import drafter_sha256, fingerprint, open_store, restore

    parsed = Arm.parse(arm or DEFAULT_ARM)
    if not parsed.draft:
        return None
    info = target_info(target, model_path)
    try:
        checkpoint = Path(drafter) if drafter else default_drafter_for(info)
    except UserError as err:
        if arm is not None:
            raise
        _log.warning("%s; decoding without speculation (arm ar)", err)
        return None
    draft = load_drafter(target, model_path, checkpoint)
    scheduler = Scheduler(parsed)
    learned = open_store(store, fingerprint(info["sha256"], drafter_sha256(checkpoint), target))
    refused = restore(scheduler, learned, fresh)
    if refused:
        _log.warning("%s", refused)
    return Speculator(target, draft, scheduler, stop_ids, learned, round_log)
