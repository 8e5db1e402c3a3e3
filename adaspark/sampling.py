"""Sampling that stays exact under speculation: position-keyed Gumbel-max.

The token at absolute position t is argmax over the vocabulary of
    (logits - penalties) / T + g(seed, t)      (after the top-k and top-p masks)
where g(seed, t) is i.i.d. Gumbel noise from a counter-based generator keyed by (seed, t), never
a stream advanced per call. Gumbel-max draws exactly from softmax((logits - penalties) / T), and
a tree row at depth d (its token sampled at start + d + 1) sees the noise plain decoding sees
there; penalties count the reply's tokens plus the row's own ancestors. So a verify stays
"one pick per row, then the accept walk", and a seed gives the same tokens whatever the arm.

Temperature 0 is argmax (penalties still apply); with no penalties and no logprobs the engine
runs its greedy path and never builds a Sampler.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from adaspark.errors import UserError

MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1
# A drawn seed has 52 bits: it and seed + i of every choice of n stay below 2^53, the integers
# a JavaScript client (openai-node) holds exactly, so it can send the seed back and replay.
DRAWN_SEED_BITS = 52
# Seeds a request may give: int64, as vLLM takes them; each maps to its own noise key (seed mod
# 2^64), so every accepted seed replays exactly what it drew (and every seed ever returned fits).
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1


class SamplingError(UserError):
    """A sampling parameter out of range; `param` names it (the server's 400 does too)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: Sampler draws one (see with_seed)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0

    def check(self) -> SamplingParams:
        """Raise SamplingError naming the first field out of range; returns self."""
        rules = [
            (0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
             "must be an integer >= 0"),
            (self.seed is None or (isinstance(self.seed, int)
                                   and MIN_SEED <= self.seed <= MAX_SEED), "seed",
             "must be an integer in [-2^63, 2^63 - 1]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (isinstance(self.top_logprobs, int)
             and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
             f"must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
        ]
        for ok, param, rule in rules:
            if not ok:
                raise SamplingError(f"{param} {rule}, got {getattr(self, param)!r}", param)
        return self

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """Exactly the engine's greedy path: no noise, no penalties, nothing to report."""
        return self.temperature == 0.0 and not self.penalised and not self.logprobs

    def with_seed(self) -> SamplingParams:
        """A seed drawn where none was given, so that any reply can be reproduced."""
        return self if self.seed is not None else \
            replace(self, seed=secrets.randbits(DRAWN_SEED_BITS))


def shifted_seed(seed: int, offset: int) -> int:
    """seed + offset (choice i of n: seed + i), wrapped into [MIN_SEED, MAX_SEED]: the same
    noise key (seed mod 2^64), and a seed a request may send to replay that choice alone."""
    return (seed + offset - MIN_SEED) % (1 << 64) + MIN_SEED


def derived_seed(base: int, *parts: object) -> int:
    """A seed for one request of a benchmark, from its base seed and where it sits (e.g. the
    conversation and turn): every arm sends the same, so their replies can be compared."""
    text = ":".join(str(x) for x in (base, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def gumbel_noise(seed: int, position: int, vocab: int) -> np.ndarray:
    """g(seed, position): [vocab] float32 Gumbel noise from Philox keyed by (seed, position).

    Philox is pure integer arithmetic, so the uniforms are the same on every machine; the two
    logs run in float64 and are rounded to float32, where a last-bit difference between CPUs'
    log kernels survives only in the rare value that lies on a float32 rounding boundary."""
    key = np.array([seed & _MASK64, position & _MASK64], dtype=np.uint64)
    raw = np.random.Philox(key=key).random_raw((vocab + 1) // 2)
    halves = np.empty(2 * raw.size, dtype=np.float64)
    halves[0::2] = raw >> np.uint64(32)
    halves[1::2] = raw & np.uint64(0xFFFFFFFF)
    u = (halves[:vocab] + 0.5) * 2.0**-32  # in (0, 1): never log(0)
    return (-np.log(-np.log(u))).astype(np.float32)


class NoiseCache:
    """g(seed, t) for the positions a request is sampling now: a tree asks for the same
    positions round after round, so each is drawn once; positions behind the caller's are
    dropped (a request only moves forward)."""

    def __init__(self, seed: int, vocab: int):
        self.seed, self.vocab = seed, vocab
        self._rows: dict[int, torch.Tensor] = {}

    def at(self, position: int) -> torch.Tensor:
        row = self._rows.get(position)
        if row is None:
            row = torch.from_numpy(gumbel_noise(self.seed, position, self.vocab))
            self._rows[position] = row
        return row

    def rows(self, positions: Sequence[int]) -> torch.Tensor:
        """[n, vocab] noise, row i for positions[i]."""
        return torch.stack([self.at(int(p)) for p in positions])

    def forget_before(self, position: int) -> None:
        for stale in [p for p in self._rows if p < position]:
            del self._rows[stale]


def _penalty(count: int, frequency: float, presence: float) -> float:
    return frequency * count + (presence if count > 0 else 0.0)


class Sampler:
    """One request's sampling: its noise, the reply's token counts (penalties) and logprobs.

    The engine calls sample() on the rows it verified and observe() on every token the reply
    takes, in order; record() keeps a logprobs entry for a token the reply took."""

    def __init__(self, params: SamplingParams, vocab: int):
        params = params.check()
        self.params = params.with_seed() if params.temperature > 0 else params
        self.vocab = vocab
        self.noise = NoiseCache(int(self.params.seed), vocab) \
            if self.params.temperature > 0 else None
        self.counts: dict[int, int] = {}
        # float32 penalty per token from the reply so far, kept up to date by observe()
        self._base = torch.zeros(vocab) if self.params.penalised else None
        self.logprobs: list[dict] = []

    @property
    def seed(self) -> int | None:
        """The noise seed (None at temperature 0, where nothing is random)."""
        return None if self.noise is None else self.noise.seed

    def observe(self, token: int) -> None:
        """The reply took `token`: later rows count it for the penalties."""
        if self._base is None:
            return
        p = self.params
        c = self.counts[token] = self.counts.get(token, 0) + 1
        self._base[token] = _penalty(c, p.frequency_penalty, p.presence_penalty)

    def adjusted(self, logits: torch.Tensor, paths: Sequence[Sequence[int]] | None = None,
                 ) -> torch.Tensor:
        """(logits - penalties) / T per row ([n, vocab] float32, a new tensor); paths[i]: the
        tokens row i's own ancestors (and itself) add to the reply before its pick."""
        p = self.params
        x = logits.float()
        if self._base is not None:
            x = x - self._base  # a copy: the forward's logits stay as they came
            for i, path in enumerate(paths or ()):
                extra: dict[int, int] = {}
                for t in path:
                    extra[int(t)] = extra.get(int(t), 0) + 1
                for t, e in extra.items():  # the same float32 value plain decoding subtracts
                    pen = torch.tensor(_penalty(self.counts.get(t, 0) + e, p.frequency_penalty,
                                                p.presence_penalty), dtype=torch.float32)
                    x[i, t] = logits[i, t].float() - pen
        if p.temperature > 0:
            x = over_temperature(x, p.temperature)
        elif x is logits:
            x = x.clone()
        return x

    def pick(self, x: torch.Tensor, positions: Sequence[int]) -> np.ndarray:
        """The sampled token of each adjusted row; positions[i]: the absolute position of the
        token row i samples (its own position + 1). Rows are picked one at a time with the same
        operations, so a row's pick never depends on which other rows share the call."""
        p = self.params
        if p.temperature == 0:
            return x.max(-1).indices.numpy().astype(np.int64)  # the masks never drop the argmax
        picks = np.empty(x.shape[0], dtype=np.int64)
        for i, position in enumerate(positions):
            y = torch.add(self.noise.at(int(position)), x[i])
            floor = allowed_floor(x[i], p.top_k, p.top_p)
            if floor is not None:
                y.masked_fill_(x[i] < floor, -torch.inf)
            picks[i] = int(y.max(-1).indices)
        self.noise.forget_before(int(min(positions)))
        return picks

    def sample(self, logits: torch.Tensor, positions: Sequence[int],
               paths: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, torch.Tensor]:
        """Picks for rows of logits [n, vocab], and the adjusted rows (for record())."""
        x = self.adjusted(logits, paths)
        return self.pick(x, positions), x

    def record(self, x_row: torch.Tensor, token: int) -> None:
        """A logprobs entry for a token the reply took, from its adjusted row: the target's
        distribution at temperature T (T = 0: at 1), penalties included, before the masks."""
        if not self.params.logprobs:
            return
        lp = torch.log_softmax(x_row.double(), -1)
        entry = {"id": int(token), "logprob": float(lp[token]), "top": []}
        if self.params.top_logprobs:
            vals, ids = lp.topk(self.params.top_logprobs)
            entry["top"] = [(int(i), float(v)) for i, v in zip(ids, vals, strict=True)]
        self.logprobs.append(entry)


def over_temperature(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """x / T per row, in float32. A row that this overflows (T tiny: 10 / 1e-40 is past
    float32's range, and below ~1.4e-45 T itself rounds to 0) is divided in float64 after its
    max is taken away: the same softmax, its top 0 and the rest at most 0 (-inf where they
    underflow), so the Gumbel-max pick is its argmax (a draw among exact ties) and every
    logprob is finite or -inf, never NaN. Finite rows keep the plain division's bits, so seeded
    replies stay what they were."""
    y = x / temperature
    bad = ~torch.isfinite(y).all(-1)
    if bad.any():
        rows = x[bad].double()
        y[bad] = ((rows - rows.max(-1, keepdim=True).values) / temperature).float()
    return y


def allowed_floor(x: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """The smallest adjusted logit row x may still pick under top-k then top-p (None: all);
    tokens tied with it stay in."""
    k = min(top_k, x.shape[-1]) if top_k else 0
    if not k and top_p >= 1.0:
        return None
    vals = x.topk(k).values if k else None  # sorted, likeliest first
    if top_p >= 1.0:
        return vals[-1]
    return nucleus_floor(x, top_p, vals)


def nucleus_floor(x: torch.Tensor, top_p: float, top: torch.Tensor | None = None,
                  ) -> torch.Tensor:
    """The smallest adjusted logit inside row x's nucleus: the fewest likeliest tokens whose
    probabilities sum to at least top_p. top: x's top-k values, likeliest first, when top-k
    applies first (the nucleus is then taken in the renormalised top k)."""
    if top is not None:
        return _nucleus_in(top, torch.logsumexp(top.double(), -1), top_p)[0]
    norm = torch.logsumexp(x, -1).double()
    m = 64
    while True:  # the nucleus is almost always inside the first 64 tokens
        vals = x.topk(min(m, x.shape[-1])).values
        floor, complete = _nucleus_in(vals, norm, top_p)
        if complete or vals.numel() == x.shape[-1]:
            return floor
        m *= 2


def _nucleus_in(vals: torch.Tensor, norm: torch.Tensor, top_p: float):
    """(floor, whether the nucleus ends inside vals) for sorted values vals."""
    probs = torch.exp(vals.double() - norm)
    before = torch.cumsum(probs, -1) - probs  # mass of the likelier tokens
    inside = int((before < top_p).sum())
    return vals[max(inside, 1) - 1], inside < vals.numel()
