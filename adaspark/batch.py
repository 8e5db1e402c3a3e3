"""Continuous batching: the running requests advance together, all their rows in one forward per
step (Transformer.verify_many: one native call): one row each for plain decoding, a round's tree
each for a speculative arm (speculative.RoundDecode: it plans in row(), drafting on its slot's
own drafter when the round drafts, and accepts, commits and learns in take(); the verify taps
the drafters' layers).

A step is schedule -> run -> postprocess:
  schedule     every running Decode takes its pending token (stops, length, cancellation);
               those that finished leave and free their slot
  run          the prefilling requests' next prompt chunks (Transformer.prefill_many):
               those whose prompt ends this step one forward each, shortest first, each
               taking its first token (streamed) as soon as its own forward ends; the chunks
               of longer prompts after them, in one forward; then one verify of every
               decoding request's rows, each over its own KV slot (a request whose prompt
               ended this step among them)
  postprocess  each request takes its rows' output: commits and picks its next token
Requests join between steps (`join`: a free slot; its first chunk runs in the next step) and
leave at any step; a long prompt is prefilled a chunk per step, so the others keep streaming.
Prompts that arrive together and end in the same step prefill one after another, shortest
first: a prefill is compute-bound here, so one forward of several prompts costs about their
sum and each of them waited for all of it; one at a time, each first token waits only for the
prompts shorter than its own (docs/results/zen3-s20/). A slot
keeps the ids it holds after its request leaves, so the next request that shares a prefix with
it (the next turn of a conversation) reuses that prefix; the engine's own cache is slot 0.

One failing request never takes the others down: a failure in a request's own part fails that
request alone, and a shared forward that raises is run again one request at a time, so only the
request whose row fails is failed. The speculator's hooks around the shared call are guarded
too: a step price that raises is made again for each request alone (each plans as if alone; one
whose own price raises fails), a row budget that raises leaves every plan whole for that step,
and shared learning that raises is dropped for that step (logged; the replies are whole). A
request whose failing raises again (its end-of-request work) is still failed, and its slot is
never used again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from adaspark import threads
from adaspark.cached import CachedTokens
from adaspark.model.transformer import PREFILL_CHUNK
from adaspark.sequence import Decode, common_prefix

_log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Step:
    """One shared verify call: its time, the rows it verified and the requests they were."""

    verify_s: float
    rows: int
    sequences: int


class BatchTarget(Protocol):
    """What a Batch needs of the target model (transformer.Transformer is one)."""

    def new_cache(self) -> Any:
        """An empty KV cache for another sequence."""

    def using(self, cache: Any) -> AbstractContextManager[None]:
        """prefill / verify / commit on `cache` meanwhile."""

    def prefill_many(self, caches: Sequence[Any], chunks: Sequence[Sequence[int]], *,
                     tap_layers: Sequence[int] = (), return_logits: bool = False) -> list[Any]:
        """prefill() of each sequence's chunk at the end of its cache, in one forward where
        possible; a failure leaves every cache as it was."""

    def verify_many(self, caches: Sequence[Any], rows: Sequence[tuple], *,
                    tap_layers: Sequence[int] = (), return_logits: bool = False) -> Any:
        """Each sequence's rows at the end of its cache, in one forward where possible
        (hiddens: each tap layer's rows, in the same order)."""


class Batch:
    """The running Decodes of one target and their KV slots (at most `max_slots`)."""

    def __init__(self, target: BatchTarget, first_slot: CachedTokens, capacity: int,
                 max_slots: int = 1, prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.target = target
        self.capacity = capacity  # tokens a slot holds: the context
        self.max_slots = max_slots
        self.prefill_chunk = prefill_chunk  # prompt rows per request per step
        self.slots: list[CachedTokens] = [first_slot]
        # a drafting arm's: each new slot's own drafter (Drafter.fork) and the target layers
        # every verify taps for the drafters' features
        self.new_drafter: Callable[[], Any] | None = None
        self.tap_layers: tuple[int, ...] = ()
        self.running: list[Decode] = []
        # the speculator's share of one call: before it, (requests, their rows) -> the rows to
        # verify (the shared row budget cuts trees); after it and every take, (requests, Step)
        # (the call's time teaches the price of its total rows)
        # and before the requests plan, the step's requests (the speculator prices the step, so
        # each decides whether its round drafts against that price)
        self.before_plan: Callable[[list[Decode]], None] | None = None
        self.before_verify: Callable[[list[Decode], list[tuple]], list[tuple]] | None = None
        self.after_verify: Callable[[list[Decode], Step], None] | None = None

    @property
    def full(self) -> bool:
        return len(self.running) >= self.max_slots

    def add(self, seq: Decode) -> bool:
        """join() and prefill `seq`'s first prompt chunk now; False when it failed (seq.error
        says why: e.g. a token past the vocabulary)."""
        if not self.join(seq):
            return False
        if self._prefill([seq]):
            self.running.remove(seq)
            return False
        return True

    @property
    def shares_prompts(self) -> bool:
        """Whether join() can share a running request's prompt (slots without drafters)."""
        return self.new_drafter is None

    def join(self, seq: Decode, source: Decode | None = None) -> bool:
        """Give `seq` a free slot: its first prompt chunk runs in the next step, before the
        step's verify (step()). source: a running request whose slot holds seq's prompt
        (another choice of the same request): its K/V are copied to seq's slot, so only
        the prompt's last token is prefilled again (where shares_prompts). False when it
        failed."""
        if self.full:
            raise RuntimeError("no free slot: check Batch.full before adding")
        try:
            slot = self._slot_for(seq.prompt)
            if source is not None and self.shares_prompts and source.slot is not slot:
                length = min(common_prefix(source.slot.ids, seq.prompt), len(seq.prompt) - 1)
                if common_prefix(slot.trusted_prefix(), seq.prompt) < length:
                    with slot.guard():  # a copy cut short leaves nothing half-held
                        slot.copy_prefix(source.slot, length)
            seq.start(slot)
        except Exception as err:  # this request's failure only
            self._fail(seq, err)
            return False
        self.running.append(seq)
        return True

    def drop(self, seq: Decode, err: BaseException) -> None:
        """Take `seq` out of the batch, failed by `err` (its slot forgets what it held)."""
        if not seq.finished:
            self._fail(seq, err)
        self.running = [other for other in self.running if other is not seq]

    def _fail(self, seq: Decode, err: BaseException) -> None:
        """seq.fail(err); where failing raises again (its slot's reset, its end-of-request
        work), `seq` is failed all the same (Decode.fail sets its error first) and its slot,
        whose state is unknown now, leaves the pool."""
        try:
            seq.fail(err)
        except Exception:
            _log.exception("failing a request raised again; its KV slot is retired")
            self.slots = [slot for slot in self.slots if slot is not seq.slot]

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
            drafter = None if self.new_drafter is None else self.new_drafter()
            self.slots.append(CachedTokens(self.target, drafter, kv=self.target.new_cache()))
            return self.slots[-1]
        return best

    def step(self) -> list[Decode]:
        """Advance every running request by one token; returns those that finished. The
        prompt chunks run first; a request whose last chunk ran streams its first token as
        soon as its forward ends and verifies its next row in this step's call."""
        threads.adapt()  # fewer threads while other processes keep cores busy
        live, done, filling = [], [], []
        for seq in self.running:
            if seq.prefilling:
                (filling if self._ok(seq, seq.wanted) else done).append(seq)
            else:
                (live if self._ok(seq, seq.advance, self.capacity) else done).append(seq)

        def first_token(seq: Decode) -> None:  # its prompt is in: it streams and decodes now
            (live if self._ok(seq, seq.advance, self.capacity) else done).append(seq)

        done += self._prefill(filling, first_token)
        if live:
            failed = self._run(live)
            # ...and those whose round ended the reply (a speculative take() pushes tokens)
            done += failed + [seq for seq in live if seq.finished and seq not in failed]
        self.running = [seq for seq in self.running if not seq.finished]
        return done

    def _prefill(self, seqs: list[Decode],
                 first_token: Callable[[Decode], None] | None = None) -> list[Decode]:
        """Each request's next prompt chunk: the ones that end a prompt a forward each,
        shortest first, then the others' in one forward; first_token(seq) right after the
        forward that ended seq's prompt. Returns the requests that failed."""
        chunks = [seq.next_chunk(self.prefill_chunk) for seq in seqs]
        ending = sorted((i for i, seq in enumerate(seqs) if seq.prompt_ends(chunks[i])),
                        key=lambda i: len(chunks[i]))
        ongoing = [i for i in range(len(seqs)) if i not in ending]
        failed: list[Decode] = []
        for group in [[i] for i in ending] + ([ongoing] if ongoing else []):
            failed += self._forward([seqs[i] for i in group], [chunks[i] for i in group])
            for i in group:
                if first_token is not None and seqs[i] not in failed and not seqs[i].prefilling:
                    first_token(seqs[i])
        return failed

    def _forward(self, seqs: list[Decode], chunks: list[list[int]]) -> list[Decode]:
        """These requests' chunks in one forward (Transformer.prefill_many); returns those that
        failed. A shared call that raises changed no cache: it runs again one request at a
        time, so only the request whose chunk fails is failed."""
        if not seqs:
            return []
        try:  # the drafters' features: the layers every verify taps
            outs = self.target.prefill_many(
                [seq.slot.kv for seq in seqs], chunks, tap_layers=self.tap_layers,
                return_logits=any(s.wants_logits(c) for s, c in zip(seqs, chunks, strict=True)))
        except Exception as err:
            if len(seqs) > 1:
                return [f for seq, chunk in zip(seqs, chunks, strict=True)
                        for f in self._forward([seq], [chunk])]
            self._fail(seqs[0], err)  # its slot forgets what it held
            return seqs
        failed = []
        for seq, chunk, out in zip(seqs, chunks, outs, strict=True):
            try:
                with seq.slot.guard():
                    seq.prefilled(chunk, out)
            except Exception as err:
                self._fail(seq, err)
                failed.append(seq)
        return failed

    def _run(self, live: list[Decode]) -> list[Decode]:
        """Each live request's rows (a speculative one plans its round here), one verify of
        them all, then each takes its own; returns the requests that failed."""
        planned, rows, failed = [], [], []
        if self.before_plan is not None:
            failed = self._price(live)
        for seq in live:
            if seq in failed:
                continue
            try:
                rows.append(seq.row())
                planned.append(seq)
            except Exception as err:  # its own plan failed
                self._fail(seq, err)
                failed.append(seq)
        if planned and self.before_verify is not None:
            planned, rows, unread = self._share(planned, rows)
            failed += unread
        return failed + (self._verify(planned, rows) if planned else [])

    def _price(self, seqs: list[Decode]) -> list[Decode]:
        """before_plan over `seqs`; where it raises, again for each request alone (priced as
        if alone), failing only those whose own call raises. Returns the failed."""
        try:
            self.before_plan(seqs)
            return []
        except Exception as err:
            if len(seqs) == 1:
                self._fail(seqs[0], err)
                return seqs
            _log.warning("the step's price failed; each request plans alone this step",
                         exc_info=True)
        return [f for seq in seqs for f in self._price([seq])]

    def _share(self, planned: list[Decode], rows: list[tuple]
               ) -> tuple[list[Decode], list[tuple], list[Decode]]:
        """before_verify (the shared row budget) over the planned requests; where it raises,
        each request verifies its plan as it stands (rows(): whole, or as far as a cut got),
        failing only a request whose rows cannot be read. (requests, their rows, failed)"""
        try:
            return planned, list(self.before_verify(planned, rows)), []
        except Exception:
            _log.warning("the shared row budget failed; each plan is verified whole this step",
                         exc_info=True)
        kept, kept_rows, failed = [], [], []
        for seq in planned:
            try:
                kept_rows.append(seq.rows())
                kept.append(seq)
            except Exception as err:
                self._fail(seq, err)
                failed.append(seq)
        return kept, kept_rows, failed

    def _verify(self, live: list[Decode], rows: list[tuple]) -> list[Decode]:
        logits = any(seq.needs_logits for seq in live)
        start = time.perf_counter()
        try:
            out = self.target.verify_many([seq.slot.kv for seq in live], rows,
                                          tap_layers=self.tap_layers, return_logits=logits)
        except Exception as err:
            if len(live) == 1:
                self._fail(live[0], err)
                return live
            return [seq for one, row in zip(live, rows, strict=True)  # find who fails
                    for seq in self._verify([one], [row])]
        step = Step(time.perf_counter() - start, sum(len(r[0]) for r in rows), len(live))
        # once a step, not once a request: the picks as numpy; the taps [rows, taps, dim] in
        # tap_layers' order (a copy where the forward gave them layer by layer: the target may
        # reuse its buffers), each request's rows a view of them (Drafter.observe_taps)
        argmax = out.argmax.cpu().numpy()
        if not self.tap_layers:
            taps = None
        elif out.tap_rows is not None and tuple(out.hiddens) == self.tap_layers:
            taps = out.tap_rows  # the forward's own tensor in our order, made for this call
        else:
            taps = torch.stack([out.hiddens[layer] for layer in self.tap_layers], -2)
        failed, at = [], 0
        for seq, row in zip(live, rows, strict=True):
            n, at = len(row[0]), at + len(row[0])
            try:
                seq.take(argmax[at - n:at], None if out.logits is None
                         else out.logits[at - n:at], step,
                         taps=None if taps is None else taps[at - n:at])
            except Exception as err:
                self._fail(seq, err)
                failed.append(seq)
        if self.after_verify is not None:
            try:
                self.after_verify(live, step)
            except Exception:  # learning only: every request took its tokens already
                _log.warning("learning from the shared verify failed; this step teaches "
                             "nothing", exc_info=True)
        return failed

    def _ok(self, seq: Decode, call: Callable[..., bool], *args: Any) -> bool:
        """call(*args) for `seq`; one that raises (its stream callback, its prompt) fails
        `seq` alone: False."""
        try:
            return call(*args)
        except Exception as err:
            self._fail(seq, err)
            return False
