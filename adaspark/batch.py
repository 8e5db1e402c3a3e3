"""Continuous batching of plain decoding: the running requests advance together, one target row
each per step, all rows in one forward (Transformer.verify_many: one native call).

A step is schedule -> run -> postprocess:
  schedule     every running Decode takes its pending token (stops, length, cancellation);
               those that finished leave and free their slot
  run          each request still prefilling runs its next prompt chunk; one verify of every
               decoding request's row, each over its own KV slot
  postprocess  each request commits its row and picks its next token
Requests join between steps (`add`: a free slot and the first prompt chunk) and leave at any
step; a long prompt is prefilled a chunk per step, so the others keep streaming. A slot
keeps the ids it holds after its request leaves, so the next request that shares a prefix with
it (the next turn of a conversation) reuses that prefix; the engine's own cache is slot 0.

One failing request never takes the others down: a failure in a request's own part fails that
request alone, and a shared forward that raises is run again one request at a time, so only the
request whose row fails is failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from adaspark import threads
from adaspark.cached import CachedTokens
from adaspark.model.transformer import PREFILL_CHUNK
from adaspark.sequence import Decode, common_prefix


class BatchTarget(Protocol):
    """What a Batch needs of the target model (transformer.Transformer is one)."""

    def new_cache(self) -> Any:
        """An empty KV cache for another sequence."""

    def using(self, cache: Any) -> AbstractContextManager[None]:
        """prefill / verify / commit on `cache` meanwhile."""

    def prefill(self, tokens: Sequence[int], *, return_logits: bool = False) -> Any:
        """Append committed tokens to the cache; the last row's argmax (and logits)."""

    def verify_many(self, caches: Sequence[Any], rows: Sequence[tuple], *,
                    return_logits: bool = False) -> Any:
        """Each sequence's rows at the end of its cache, in one forward where possible."""


class Batch:
    """The running Decodes of one target and their KV slots (at most `max_slots`)."""

    def __init__(self, target: BatchTarget, first_slot: CachedTokens, capacity: int,
                 max_slots: int = 1, prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.target = target
        self.capacity = capacity  # tokens a slot holds: the context
        self.max_slots = max_slots
        self.prefill_chunk = prefill_chunk  # prompt rows per request per step
        self.slots: list[CachedTokens] = [first_slot]
        self.running: list[Decode] = []

    @property
    def full(self) -> bool:
        return len(self.running) >= self.max_slots

    def add(self, seq: Decode) -> bool:
        """Give `seq` a free slot and prefill its first prompt chunk; it runs on from the next
        step. False when it failed (seq.error says why: e.g. a token past the vocabulary)."""
        if self.full:
            raise RuntimeError("no free slot: check Batch.full before adding")
        try:
            seq.start(self._slot_for(seq.prompt))
            seq.prefill_chunk(self.target, self.prefill_chunk)
        except Exception as err:  # this request's failure only (the slot was reset)
            seq.fail(err)
            return False
        self.running.append(seq)
        return True

    def drop(self, seq: Decode, err: BaseException) -> None:
        """Take `seq` out of the batch, failed by `err` (its slot forgets what it held)."""
        if not seq.finished:
            seq.fail(err)
        self.running = [other for other in self.running if other is not seq]

    def _slot_for(self, prompt: list[int]) -> CachedTokens:
        """The free slot sharing the longest prefix with `prompt`; a new slot rather than one
        holding another conversation, while the pool may grow."""
        busy = {id(s.slot) for s in self.running}
        free = [slot for slot in self.slots if id(slot) not in busy]
        best = max(free, key=lambda slot: common_prefix(slot.trusted_prefix(), prompt),
                   default=None)
        if best is not None and (common_prefix(best.ids, prompt) > 0 or not best.ids):
            return best
        if len(self.slots) < self.max_slots:
            self.slots.append(CachedTokens(self.target, kv=self.target.new_cache()))
            return self.slots[-1]
        return best

    def step(self) -> list[Decode]:
        """Advance every running request by one token; returns those that finished."""
        threads.adapt()  # fewer threads while other processes keep cores busy
        live, done = [], []
        for seq in self.running:
            try:
                if seq.prefilling:
                    if seq.cancelled():
                        done.append(seq)
                    else:
                        seq.prefill_chunk(self.target, self.prefill_chunk)
                elif seq.advance(self.capacity):
                    live.append(seq)
                else:
                    done.append(seq)
            except Exception as err:  # e.g. its stream callback raised, its prompt failed
                seq.fail(err)
                done.append(seq)
        if live:
            done += self._run(live)
        self.running = [seq for seq in self.running if not seq.finished]
        return done

    def _run(self, live: list[Decode]) -> list[Decode]:
        """One verify of every live request's row, then each takes its own; returns the
        requests that failed."""
        logits = any(seq.sampler is not None for seq in live)
        try:
            out = self.target.verify_many([seq.slot.kv for seq in live],
                                          [seq.row() for seq in live], return_logits=logits)
        except Exception as err:
            if len(live) == 1:
                live[0].fail(err)
                return live
            return [seq for one in live for seq in self._run([one])]  # find who fails
        failed = []
        for i, seq in enumerate(live):
            try:
                seq.take(int(out.argmax[i]), None if out.logits is None else out.logits[i:i + 1])
            except Exception as err:
                seq.fail(err)
                failed.append(seq)
        return failed

