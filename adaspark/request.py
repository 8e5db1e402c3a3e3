"""The request-level types: one request's timing (`Timing`), its reply under construction
(`Reply`: stops token by token, streamed text) and the finished reply (`Generation`).

The engine (engine.py), its step loop (sequence.py, batch.py) and the speculative rounds
(speculative.py) all use them, so they live here, below all of those: none of those modules
needs another to name them (no import circle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from adaspark.model.tokenizer import StreamDecoder, Tokenizer
from adaspark.scheduler.record import RoundRecord

TextCallback = Callable[[str], None]


@dataclass
class Timing:
    """Monotonic-clock timing of one request."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the KV cache from the previous request
    prefill_s: float = 0.0  # prefill of the new prompt tokens, up to the first reply token
    decode_s: float = 0.0  # every forward after the first reply token
    decode_tokens: int = 0  # reply tokens produced by those forwards
    # decode rounds (speculative.py): a plain round verifies the anchor alone, without drafting;
    # an n-gram round verifies a tree from the n-gram index alone (the draft gate)
    draft_rounds: int = 0
    plain_rounds: int = 0
    ngram_rounds: int = 0
    verified_rows: int = 0  # target rows verified, over all rounds
    accepted_tokens: int = 0  # drafted tokens the reply took (bonus tokens excluded)

    def count_round(self, record: RoundRecord, emitted: int) -> None:
        """One speculative round; emitted: the tokens the reply took of it."""
        if record.plain:
            self.plain_rounds += 1
        elif record.drafted:
            self.draft_rounds += 1
        else:
            self.ngram_rounds += 1
        self.verified_rows += record.rows
        self.accepted_tokens += min(record.accepted, emitted)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_width(self) -> float:
        """Rows verified per round (1.0 for plain decoding)."""
        rounds = self.draft_rounds + self.plain_rounds + self.ngram_rounds
        return self.verified_rows / rounds if rounds else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_tokens": self.decode_tokens, "decode_tok_s": self.decode_tok_s,
                "draft_rounds": self.draft_rounds, "plain_rounds": self.plain_rounds,
                "ngram_rounds": self.ngram_rounds,
                "verified_rows": self.verified_rows, "accepted_tokens": self.accepted_tokens,
                "mean_width": self.mean_width}


@dataclass
class Generation:
    """One reply. `token_ids` excludes a stop token (kept in `stop_token_id`); `text` ends before
    any stop string. finish_reason: "stop" (stop token or string), "length" (max tokens or the
    context is full) or "cancelled" (should_stop said so)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    stop_token_id: int | None
    timings: Timing = field(default_factory=Timing)
    seed: int | None = None  # the sampling seed (drawn when none was given); None: greedy
    # per reply token when asked: {"id", "logprob", "top": [(id, logprob), ...]}
    logprobs: list[dict] | None = None


class Reply:
    """The reply under construction: applies stops token by token and streams safe text.

    Text that might be the start of a stop string is held back from the stream until the next
    tokens show it is not, so no text past a stop is ever streamed or returned.
    """

    def __init__(self, tokenizer: Tokenizer, max_tokens: int, stop: Sequence[str] = (),
                 on_text: TextCallback | None = None):
        self._stop_ids = tokenizer.stop_ids
        self._stops = [s for s in stop if s]
        self._max_tokens = max_tokens
        self._decoder: StreamDecoder = tokenizer.stream_decoder()
        self._on_text = on_text
        self.token_ids: list[int] = []
        self.text = ""
        self._streamed = 0  # chars of self.text already given to on_text
        self.finish_reason: str | None = None
        self.stop_token_id: int | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_id: int) -> bool:
        """Take the next generated token; True when the reply is finished (stop or length)."""
        assert not self.done, "push after the reply finished"
        if token_id in self._stop_ids:
            self.stop_token_id = token_id
            return self._finish("stop")
        self.token_ids.append(token_id)
        before = len(self.text)
        self.text += self._decoder.push(token_id)
        if self._stops:
            longest = max(len(s) for s in self._stops)
            window_start = max(0, before - longest + 1)
            hits = [i for s in self._stops if (i := self.text.find(s, window_start)) != -1]
            if hits:
                self.text = self.text[:min(hits)]
                return self._finish("stop", flush=False)
        if len(self.token_ids) >= self._max_tokens:
            return self._finish("length")
        self._stream(len(self.text) - self._held_back())
        return False

    def end(self, reason: str) -> None:
        """End early: "length" when the context is full, "cancelled" when the caller asks."""
        if not self.done:
            self._finish(reason)

    def _finish(self, reason: str, flush: bool = True) -> bool:
        if flush:
            self.text += self._decoder.flush()  # a dangling partial character, as decode() shows
        self.finish_reason = reason
        self._stream(len(self.text))
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self._stops), default=0)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def _stream(self, upto: int) -> None:
        if upto > self._streamed:
            if self._on_text is not None:
                self._on_text(self.text[self._streamed:upto])
            self._streamed = upto
