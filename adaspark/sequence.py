"""One request as the engine's step loop runs it: `Decode` owns the request's prompt, its KV slot
(a cached.CachedTokens over its own cache), its sampler, its Reply (stops, streaming), its
timing and its cancellation.

A request first prefills its prompt, a chunk of PREFILL_CHUNK rows per step (the chunks a
whole Transformer.prefill runs, so the K/V are the same), the last chunk giving the first reply
token; then plain decoding is a loop of parts around one target row, and batch.py runs the
parts of every running request around one shared forward:
  advance()  the reply takes the pending token; stop, length and cancellation are checked here
  row()      the one row to verify: the pending token at depth 0 at the end of the slot
  take()     that row's output: commit the row, pick the next pending token
(a speculative arm's round runs in the same parts: speculative.RoundDecode).
A request alone (Engine.generate) and a request beside others (the server) run the same chunks
and parts, and the forward's rows do not depend on their neighbours, so its tokens are the
same either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np

from adaspark import constrained
from adaspark.cached import CachedTokens
from adaspark.model.transformer import PREFILL_CHUNK
from adaspark.sampling import Sampler

if TYPE_CHECKING:
    from adaspark.grammar import GrammarState
    from adaspark.request import Reply, Timing

StopRequest = Callable[[], bool]  # polled between forwards; True cancels the request
ONE_ROW = (np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool))  # depth 0, sees itself


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """How many leading items a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable(slot: CachedTokens, prompt: list[int]) -> int:
    """How many cached tokens of `slot` the prompt keeps: at least its last token runs again,
    its logits give the first reply token."""
    return min(common_prefix(slot.trusted_prefix(), prompt), len(prompt) - 1)


def next_token(argmax: Any, logits: Any, sampler: Sampler | None, position: int,
               grammar: GrammarState | None = None) -> int:
    """The pick at `position` after the last of these rows (argmax [rows]; logits [rows, vocab],
    read only when sampling or under a grammar): its argmax, its seeded sample (recorded for
    logprobs), or either under `grammar`, which then advances over it (constrained.pick)."""
    if grammar is not None:
        token, x = constrained.pick(grammar, sampler, logits[-1], position, top=argmax[-1])
        if sampler is not None:
            sampler.record(x, token)
        return token
    if sampler is None:
        return int(argmax[-1])
    picks, x = sampler.sample(logits[-1:], [position])
    token = int(picks[0])
    sampler.record(x[0], token)
    return token


class Decode:
    """One request's plain decode, step by step (see the module's docstring)."""

    def __init__(self, prompt: list[int], reply: Reply, timing: Timing,
                 sampler: Sampler | None = None, should_stop: StopRequest | None = None,
                 request_id: str | None = None, grammar: GrammarState | None = None) -> None:
        self.prompt = prompt
        self.reply = reply
        self.timing = timing
        self.sampler = sampler
        self.should_stop = should_stop
        self.request_id = request_id
        # the reply's grammar (response_format): every pick is masked by it (constrained.py)
        self.grammar = grammar
        self.slot: CachedTokens | None = None
        self.token: int | None = None  # picked, not yet taken by the reply
        self.error: BaseException | None = None  # what ended it, when it failed
        self._unfilled: list[int] = []  # prompt tokens still to prefill
        self._start = self._decode_start = 0.0

    @property
    def finished(self) -> bool:
        return self.error is not None or self.reply.done

    @property
    def needs_logits(self) -> bool:
        """Whether its picks read the verified rows' logits (sampling, or a grammar's mask)."""
        return self.sampler is not None or self.grammar is not None

    @property
    def prefilling(self) -> bool:
        return bool(self._unfilled)

    def start(self, slot: CachedTokens) -> None:
        """Take `slot` (now this request's), keeping the prefix it shares with the prompt."""
        self._start = time.perf_counter()
        self.slot = slot
        keep = reusable(slot, self.prompt)
        slot.keep(keep)
        self._unfilled = self.prompt[keep:]
        self.timing.reused_tokens = keep

    def next_chunk(self, size: int = PREFILL_CHUNK) -> list[int]:
        """The next `size` prompt tokens to prefill."""
        return self._unfilled[:size]

    def prompt_ends(self, chunk: Seq[int]) -> bool:
        """Whether `chunk` (next_chunk's) is the prompt's last: its first token follows it."""
        return len(chunk) == len(self._unfilled)

    def wants_logits(self, chunk: Seq[int]) -> bool:
        """Whether prefilling `chunk` needs its logits: the last chunk of a request whose
        picks read them (needs_logits)."""
        return self.needs_logits and self.prompt_ends(chunk)

    def prefilled(self, chunk: list[int], out: Any) -> None:
        """The target's cache holds `chunk` now (out: its prefill's output, alone or in
        Transformer.prefill_many): the drafter follows, the last chunk picks the first token."""
        if self.slot.drafter is not None:  # a drafting arm's: its features follow the target's
            self.slot.drafter.observe(out.hiddens)
            self.slot.drafter.catch_up()  # chunk by chunk, not all in the first draft's step
        self.slot.commit(chunk)
        self._unfilled = self._unfilled[len(chunk):]
        if not self._unfilled:
            # the pick after the prompt's last row, which sits at len(prompt) - 1
            self.token = next_token(out.argmax, out.logits, self.sampler, len(self.prompt),
                                    self.grammar)
            self._decode_start = time.perf_counter()
            self.timing.prefill_s = self._decode_start - self._start

    def wanted(self) -> bool:
        """Polled before each prompt chunk: False once cancelled (see cancelled)."""
        return not self.cancelled()

    def cancelled(self) -> bool:
        """Polled while prefilling: a request cancelled then ends without a token."""
        if self.should_stop is None or not self.should_stop():
            return False
        self.reply.end("cancelled")
        return True

    def advance(self, capacity: int) -> bool:
        """The reply takes the pending token; True when the request wants another row."""
        if self.reply.push(self.token):
            return self._stop()
        if self.sampler is not None:
            self.sampler.observe(self.token)
        if len(self.slot) >= capacity:
            self.reply.end("length")
            return self._stop()
        if self.cancelled():
            return self._stop()
        return True

    def row(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """(tokens, depths, ancestor mask) of this step's row, for Transformer.verify_many."""
        return self.rows()

    def rows(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """This step's rows as they stand (row()'s; a round's plan, cut or whole)."""
        return [self.token], *ONE_ROW

    def take(self, argmax: Any, logits: Any = None, step: Any = None,
             taps: Any = None) -> None:
        """The verified row's output: commit it, pick the next token (argmax [1], numpy;
        logits [1, vocab] when its picks read them, needs_logits; step: the shared call,
        batch.Step, which plain decoding does not learn from; taps: the tapped layers' rows,
        [1, taps, dim], which only a drafter reads). The row sits at len(slot) - 1 after the
        commit; its pick one position on (under the grammar, whose state stands after
        self.token)."""
        self.slot.kv.commit([0])
        self.slot.commit([self.token])
        self.token = next_token(argmax, logits, self.sampler, len(self.slot), self.grammar)
        self.timing.decode_tokens += 1
        self.timing.plain_rounds += 1
        self.timing.verified_rows += 1

    def fail(self, err: BaseException) -> None:
        """End with an error; the slot may hold part of a step, so it forgets everything."""
        self.error = err
        try:
            if self.slot is not None:
                self.slot.reset()
        finally:  # the request ends (its scheduler request too) even where the reset raised
            self._stop()

    def _stop(self) -> bool:
        if self._decode_start:
            self.timing.decode_s = time.perf_counter() - self._decode_start
        return False
