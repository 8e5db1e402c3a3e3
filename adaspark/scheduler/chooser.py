"""The width chooser (§3.4): V(n) of Eq. (7), long-run rate per band, gains, hysteresis.

API (stable):

    Chooser(pinned=None, ratio_rule=False, hysteresis=True)
        .choose(offers, s_drafter, s_ngram, fixed_ms, context) -> int
            offers: [(width, verify_ms)] ascending (CostModel.offers); s_drafter[k], s_ngram[k]:
            the drafter's and the n-gram's part of S over the first k candidates of the
            best-first order (index 0 is 0.0; width n reads index n − 1, capped at the end)
        .best(offers, s_drafter, s_ngram, fixed_ms, context) -> (width, verify_ms)
            the same score's best offer, no hysteresis, incumbent untouched (undrafted rounds)
        .tokens(width) -> float            expected tokens of `width` in the last choose()
        .value(width, verify_ms) -> float  the score it ranked by: V(n), or the ratio when cold
        .wins(width, verify_ms) -> bool    would `width` rows at that price beat the incumbent by
                                           the switching margin (the cost model's split test)
        .learn(width, context, accepted, round_ms, offered, realised_drafter, realised_ngram,
               predicted_drafter, predicted_ngram, teach=True) -> None
            after every round: `offered` the widths offered this round; realised_*[k] the
            accepted nodes of each source among the first k candidates (what the prefix of k
            candidates would have accepted), predicted_* as s_* above; teach=False for the rounds
            that teach nothing (a request's first round, a reply's last round)
        .incumbent -> int | None, .held_rounds -> int (consecutive rounds run at the incumbent)
        .state_dict() -> dict / .load_state_dict(state)   gains and band rates, exact round trip

    RidgeGain()    .value(context) -> float, .observe(predicted, realised, context), state_dict

V(n) = 1 + S(n₀) + g_d·ΔS_d(n) + g_n·ΔS_ng(n) − ρ_m·(D + T(n, c)), n₀ = the narrowest offered
width >= 8 (else the widest offered), ΔS measured from n₀ (negative below it, priced by a second
pair of gains). ρ_m is the band's achieved rate once it holds 8 rounds; before that, and under
`ratio_rule`, the chooser maximises tokens / (D + T). Hysteresis keeps the incumbent unless beaten
by 0.04 × its expected tokens (or by 4% in ratio). Ties go to the narrower width.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaspark.errors import UserError
from adaspark.scheduler.bands import CONTEXT_UNIT, context_band

REFERENCE_WIDTH = 8          # n₀ is the narrowest offered width at least this wide
GAIN_CLAMP = (0.25, 4.0)
GAIN_RIDGE = 0.02            # shrinkage toward 1, times each regressor's sum of squares
GAIN_RIDGE_FLOOR = 0.05
GAIN_DECAY = 1.0 / 256.0     # per observation
RATE_DECAY = 0.5 ** (1.0 / 64.0)   # half-life of 64 rounds
RATE_WARM_ROUNDS = 8
MARGIN = 0.04                # of the incumbent's expected tokens
RATIO_MARGIN = 1.04


class RidgeGain:
    """Realised ≈ (a + b·(u − 0.5)) · predicted, ridge-shrunk toward a = 1, b = 0, clamped."""

    def __init__(self) -> None:
        self.xx = [0.0, 0.0, 0.0]     # decayed Σ x xᵀ: [x0², x0·x1, x1²]
        self.xy = [0.0, 0.0]          # decayed Σ x·y
        self._solve()

    def _solve(self) -> None:
        a00, a01, a11 = self.xx
        l0 = GAIN_RIDGE * a00 + GAIN_RIDGE_FLOOR
        l1 = GAIN_RIDGE * a11 + GAIN_RIDGE_FLOOR
        m00, m11 = a00 + l0, a11 + l1
        r0, r1 = self.xy[0] + l0 * 1.0, self.xy[1]      # the prior pulls a toward 1, b to 0
        det = m00 * m11 - a01 * a01                      # > 0: the ridge terms are positive
        self.a = (r0 * m11 - a01 * r1) / det
        self.b = (m00 * r1 - a01 * r0) / det

    def value(self, context: float) -> float:
        g = self.a + self.b * (context / CONTEXT_UNIT - 0.5)
        return min(max(g, GAIN_CLAMP[0]), GAIN_CLAMP[1])

    def observe(self, predicted: float, realised: float, context: float) -> None:
        if not predicted > 0.0:
            return                    # no predicted marginal: the round says nothing here
        x0 = predicted
        x1 = predicted * (context / CONTEXT_UNIT - 0.5)
        keep = 1.0 - GAIN_DECAY
        a00, a01, a11 = self.xx
        self.xx = [a00 * keep + x0 * x0, a01 * keep + x0 * x1, a11 * keep + x1 * x1]
        self.xy = [self.xy[0] * keep + x0 * realised, self.xy[1] * keep + x1 * realised]
        self._solve()

    def state_dict(self) -> dict:
        return {"xx": list(self.xx), "xy": list(self.xy)}

    def load_state_dict(self, state: dict) -> None:
        try:
            xx = [float(v) for v in state["xx"]]
            xy = [float(v) for v in state["xy"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"gain state is malformed: {exc!r}") from None
        if len(xx) != 3 or len(xy) != 2:
            raise UserError("gain state is malformed: expected 3 + 2 accumulators")
        self.xx, self.xy = xx, xy
        self._solve()


class BandRate:
    """Decayed committed tokens over decayed round time: the band's achieved decode rate."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.time = 0.0
        self.rounds = 0

    def observe(self, tokens: float, round_ms: float) -> None:
        self.tokens = self.tokens * RATE_DECAY + tokens
        self.time = self.time * RATE_DECAY + round_ms
        self.rounds += 1

    @property
    def rate(self) -> float | None:
        if self.rounds < RATE_WARM_ROUNDS or not self.time > 0.0:
            return None
        return self.tokens / self.time


def _at(values: Sequence[float], width: int) -> float:
    return values[min(width - 1, len(values) - 1)]


def _tokens_at(r: dict, width: int) -> float:
    """Expected tokens of `width` rows in the scored round `r` (Chooser._scores): 1 + S(n₀) +
    the gains times the drafter's and the n-gram's ΔS from n₀, summed in that order."""
    k = min(width - 1, r["last"])
    g_d, g_n = r["gains_above"] if width >= r["n0"] else r["gains_below"]
    return (r["base"] + g_d * (r["s_drafter"][k] - r["sd0"])
            + g_n * (r["s_ngram"][k] - r["sn0"]))


def _best(scores: dict[int, float]) -> int:
    """The width of the highest score, the narrower on ties: max by (score, -width)."""
    best, top = None, None
    for w, score in scores.items():
        if best is None or score > top or (score == top and w < best):
            best, top = w, score
    return best


def _reference(widths: Sequence[int]) -> int:
    return next((w for w in widths if w >= REFERENCE_WIDTH), widths[-1])


class Chooser:
    """Chooses the round's width among the offered ones (see module docstring)."""

    def __init__(self, pinned: int | None = None, ratio_rule: bool = False,
                 hysteresis: bool = True) -> None:
        if pinned is not None and int(pinned) < 1:
            raise UserError(f"a pinned width must be at least 1 row, got {pinned!r}")
        self.pinned = None if pinned is None else int(pinned)
        self.ratio_rule = ratio_rule
        self.hysteresis = hysteresis
        self.above = (RidgeGain(), RidgeGain())   # (drafter, n-gram) gains above n₀
        self.below = (RidgeGain(), RidgeGain())   # the pair that prices rows given up below n₀
        self.rates: dict[int, BandRate] = {}
        self.incumbent: int | None = None
        self.held_rounds = 0
        self.best_width: int | None = None  # the last choose()'s best, before hysteresis
        self._round: dict | None = None           # the last choose()'s inputs, for wins()

    # ----- choosing ----------------------------------------------------------------------
    def _tokens(self, width: int) -> float:
        r = self._round
        memo = r["tokens"]
        tokens = memo.get(width)
        if tokens is None:
            memo[width] = tokens = _tokens_at(r, width)
        return tokens

    def tokens(self, width: int) -> float:
        if self._round is None:
            raise UserError("tokens() needs a choose() first")
        return self._tokens(width)

    def value(self, width: int, verify_ms: float) -> float:
        """The score the last choose() ranked by: V(n) of Eq. (7), or the ratio while the band's
        rate is unknown (or under `ratio_rule`)."""
        if self._round is None:
            raise UserError("value() needs a choose() first")
        r = self._round
        tokens = self._tokens(width)
        time = r["fixed_ms"] + verify_ms
        if r["rate"] is None:
            return tokens / time
        return tokens - r["rate"] * time

    def _beats(self, score: float, incumbent_score: float) -> bool:
        if not self.hysteresis:
            return score > incumbent_score
        if self._round["rate"] is None:
            return score > RATIO_MARGIN * incumbent_score
        return score > incumbent_score + MARGIN * self._tokens(self.incumbent)

    def _scores(self, offers, s_drafter, s_ngram, fixed_ms, context) -> dict[int, float]:
        """Score every offer; keeps this round's inputs for tokens(), value() and wins()."""
        if not offers:
            raise UserError("the chooser needs at least one offered width")
        if len(s_drafter) != len(s_ngram) or not s_drafter:
            raise UserError("s_drafter and s_ngram must be equal, non-empty per-prefix sums")
        widths = [w for w, _ in offers]
        band = self.rates.get(context_band(context))
        n0 = _reference(widths)
        last = len(s_drafter) - 1
        sd0, sn0 = s_drafter[min(n0 - 1, last)], s_ngram[min(n0 - 1, last)]
        r = self._round = {
            "n0": n0, "offers": dict(offers), "tokens": {},
            "s_drafter": s_drafter, "s_ngram": s_ngram,
            "fixed_ms": fixed_ms or 0.0,
            "rate": None if self.ratio_rule or band is None else band.rate,
            "gains_above": (self.above[0].value(context), self.above[1].value(context)),
            "gains_below": (self.below[0].value(context), self.below[1].value(context)),
            # what every width's tokens share (_tokens_at): 1 + S(n0), the prefix sums' end
            "base": 1.0 + sd0 + sn0, "sd0": sd0, "sn0": sn0, "last": last,
        }
        # value() of every offer, inlined (this is the chooser's loop, every round)
        memo, fixed, rate = r["tokens"], r["fixed_ms"], r["rate"]
        scores = {}
        for w, t in offers:
            tokens = memo.get(w)
            if tokens is None:
                memo[w] = tokens = _tokens_at(r, w)
            scores[w] = tokens / (fixed + t) if rate is None else tokens - rate * (fixed + t)
        return scores

    def best(self, offers: Sequence[tuple[int, float]], s_drafter: Sequence[float],
             s_ngram: Sequence[float], fixed_ms: float | None, context: float,
             ) -> tuple[int, float]:
        """(width, verify_ms) of the best offer by the same score as choose(), without
        hysteresis and without moving the incumbent (the draft gate's undrafted rounds)."""
        scores = self._scores(offers, s_drafter, s_ngram, fixed_ms, context)
        width = _best(scores)
        return width, self._round["offers"][width]

    def choose(self, offers: Sequence[tuple[int, float]], s_drafter: Sequence[float],
               s_ngram: Sequence[float], fixed_ms: float | None, context: float) -> int:
        if self.pinned is not None:
            return self.pinned
        scores = self._scores(offers, s_drafter, s_ngram, fixed_ms, context)
        widths = [w for w, _ in offers]
        best = _best(scores)       # ties go narrower
        self.best_width = best  # before hysteresis (the round log's n-gram evidence reads it)
        if self.incumbent not in scores:
            # The first incumbent is the widest offered width, so the gains above n₀ can learn;
            # an incumbent no longer offered is simply left.
            self.incumbent = widths[-1] if self.incumbent is None else best
            self.held_rounds = 0
        if best != self.incumbent and (not self.hysteresis
                                       or self._beats(scores[best], scores[self.incumbent])):
            self.incumbent = best
            self.held_rounds = 0
        return self.incumbent

    def wins(self, width: int, verify_ms: float) -> bool:
        """Would `width` rows verified in `verify_ms` leave the incumbent? (split test, §3.2)"""
        if self._round is None or self.incumbent is None:
            return False
        incumbent_ms = self._round["offers"].get(self.incumbent)
        if incumbent_ms is None:
            return False
        incumbent_score = self.value(self.incumbent, incumbent_ms)
        return self._beats(self.value(width, verify_ms), incumbent_score)

    # ----- learning ----------------------------------------------------------------------
    def learn(self, width: int, context: float, accepted: int, round_ms: float,
              offered: Sequence[int], realised_drafter: Sequence[float],
              realised_ngram: Sequence[float], predicted_drafter: Sequence[float],
              predicted_ngram: Sequence[float], teach: bool = True) -> None:
        self.held_rounds = self.held_rounds + 1 if width == self.incumbent else 0
        if not teach:
            return
        band = context_band(context)
        self.rates.setdefault(band, BandRate()).observe(1.0 + accepted, round_ms)
        if self.pinned is not None or not offered or not predicted_drafter:
            return
        widths = sorted(offered)
        n0 = _reference(widths)
        rows = min(int(width), len(predicted_drafter))   # the tree may come out narrower
        pairs = ((self.above[0], predicted_drafter, realised_drafter),
                 (self.above[1], predicted_ngram, realised_ngram))
        if rows > n0:              # only rounds wider than n₀ reveal the rows above it
            for gain, predicted, realised in pairs:
                gain.observe(_at(predicted, rows) - _at(predicted, n0),
                             _at(realised, rows) - _at(realised, n0), context)
        low, high = widths[0], min(rows, n0)
        if high > low:             # every round reveals what its narrower prefixes accept
            for gain, (_, predicted, realised) in zip(self.below, pairs, strict=True):
                gain.observe(_at(predicted, high) - _at(predicted, low),
                             _at(realised, high) - _at(realised, low), context)

    # ----- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "above": [g.state_dict() for g in self.above],
            "below": [g.state_dict() for g in self.below],
            "rates": [[b, r.tokens, r.time, r.rounds] for b, r in sorted(self.rates.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        try:
            above, below = (RidgeGain(), RidgeGain()), (RidgeGain(), RidgeGain())
            for gain, s in zip(above + below, list(state["above"]) + list(state["below"]),
                               strict=True):
                gain.load_state_dict(s)
            rates = {}
            for band, tokens, time, rounds in state["rates"]:
                rate = BandRate()
                rate.tokens, rate.time, rate.rounds = float(tokens), float(time), int(rounds)
                rates[int(band)] = rate
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"chooser state is malformed: {exc!r}") from None
        self.above, self.below, self.rates = above, below, rates
