"""The draft gate (our extension, arm modifier `gate`): before each round, draft or not.

On a small CPU target the drafter forward is a large share of a round: on the project's 2-core
machine one draft costs about a third of a plain decode step and each verified row an eighth,
while the request's own text (the n-gram index) costs next to nothing to consult. A drafter
right a third of the time then pays on some rounds and loses on others; which, depends mostly on
what the n-gram index already proposes at the anchor. So before drafting, the scheduler asks the
index alone; the evidence of its first proposal (strong copy, copy, follower seen twice, once,
or nothing) is the round's bucket. Per bucket the gate keeps the achieved decode rate of
drafted rounds and of undrafted ones (the n-gram tree alone, or a plain 1-row round where the
index proposes nothing): decayed committed tokens over decayed round time, the rounds' own
clocks with D included, as the chooser's band rate (§3.4). It runs the faster mode, and the
slower one once every EXPLORE rounds of the bucket, so that a drafter or a text that changes is
noticed; until both modes have a rate in a bucket (BandRate's warm-up) it alternates.

    gate = DraftGate(unit="ms")                   unit: of the round times learn() is given,
                                                  "ms" or "step" (plain steps, the paced arm)
    gate.choose(bucket) -> bool                   True: draft this round
    gate.learn(bucket, drafted, tokens, round_time) after every round that teaches (not a
                                                  request's first or a reply's last); the time
                                                  in ms, or in plain steps at the round's
                                                  context (the paced default arm, round.py)
    gate.restart()                                forget the rates: the widths changed (paced)
    gate.fixed_ms                                 D of an undrafted round (planning alone), for
                                                  the chooser's price of its widths
    gate.learn_tree(bucket, q)                    a drafted tree's Q in its best-first order
    gate.drafted_curve(bucket) -> array | None    the decayed mean of those trees' S(k) (index
                                                  0 is 0.0): the tree a draft is expected to
                                                  make, which the batch prices before drafting
                                                  (budget.draft_pays); not stored
    gate.state_dict() / load_state_dict(state)    JSON-able, exact round trip; rates stored in
                                                  another unit are not loaded (the gate warms)
"""

from __future__ import annotations

import numpy as np

from adaspark.errors import UserError
from adaspark.scheduler.chooser import BandRate

EXPLORE = 16  # rounds of a bucket in the faster mode before one round of the other
FIXED_DECAY = 0.9  # the undrafted D's moving average (it is the plan alone: stable)
TREE_DECAY = 0.9  # the drafted curve's: a bucket's recent trees (the text drifts)
NO_PROPOSAL = -1  # the bucket of a round whose anchor has no n-gram proposal
UNITS = ("ms", "step")  # of round times: milliseconds, or plain steps at the round's context
_ZERO_CURVE = np.zeros(1)  # a bucket's sum before its first tree (read only)
_ZERO_CURVE.setflags(write=False)


class DraftGate:
    """Per bucket, the drafted and the undrafted mode's decode rates (see module docstring)."""

    def __init__(self, unit: str = "ms") -> None:
        if unit not in UNITS:
            raise ValueError(f"the gate's time unit must be one of {UNITS}, got {unit!r}")
        self.unit = unit
        self.rates: dict[int, tuple[BandRate, BandRate]] = {}  # bucket -> (undrafted, drafted)
        self.streak: dict[int, int] = {}  # bucket -> rounds in a row of its faster mode
        self.fixed_ms: float | None = None
        self.curves: dict[int | None, tuple[float, np.ndarray]] = {}  # bucket -> (weight, sum)

    def _pair(self, bucket: int) -> tuple[BandRate, BandRate]:
        if bucket not in self.rates:
            self.rates[bucket] = (BandRate(), BandRate())
        return self.rates[bucket]

    def faster(self, bucket: int) -> bool | None:
        """True: drafting is faster in this bucket; None while either mode is still warming."""
        undrafted, drafted = (r.rate for r in self._pair(bucket))
        if undrafted is None or drafted is None:
            return None
        return drafted >= undrafted

    def choose(self, bucket: int) -> bool:
        undrafted, drafted = self._pair(bucket)
        best = self.faster(bucket)
        if best is None:  # warming: the mode with fewer rounds
            return drafted.rounds <= undrafted.rounds
        if self.streak.get(bucket, 0) >= EXPLORE:
            self.streak[bucket] = 0
            return not best
        self.streak[bucket] = self.streak.get(bucket, 0) + 1
        return best

    def learn(self, bucket: int, drafted: bool, tokens: int, round_time: float) -> None:
        self._pair(bucket)[int(bool(drafted))].observe(float(tokens), float(round_time))

    def restart(self) -> None:
        """Forget both modes' rates (not the undrafted D): what they were measured on changed,
        so every bucket warms again."""
        self.rates, self.streak = {}, {}

    def learn_fixed(self, fixed_ms: float) -> None:
        """D of an undrafted round."""
        f = float(fixed_ms)
        self.fixed_ms = f if self.fixed_ms is None else (
            FIXED_DECAY * self.fixed_ms + (1.0 - FIXED_DECAY) * f)

    def learn_tree(self, bucket: int | None, q) -> None:
        """A drafted tree's Q in its best-first order (its candidates that can be accepted)
        into the bucket's decayed mean S(k); a shorter tree holds its last S beyond its end."""
        q = np.asarray(q, dtype=np.float64).reshape(-1)
        weight, total = self.curves.get(bucket, (0.0, _ZERO_CURVE))
        n = max(q.size + 1, total.size)
        # S(k) and the decayed sum, each holding its last value past its end (np.pad's "edge",
        # in place: this runs every drafted round)
        s = np.empty(n)
        s[0] = 0.0
        np.cumsum(q, out=s[1:q.size + 1])
        s[q.size + 1:] = s[q.size]
        decayed = np.empty(n)
        decayed[:total.size] = total
        decayed[total.size:] = total[-1]
        decayed *= TREE_DECAY
        decayed += s
        self.curves[bucket] = (TREE_DECAY * weight + 1.0, decayed)

    def drafted_curve(self, bucket: int | None) -> np.ndarray | None:
        if bucket not in self.curves:
            return None
        weight, total = self.curves[bucket]
        return total / weight

    # ----- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rates": [[b, *(x for r in pair for x in (r.tokens, r.time, r.rounds))]
                          for b, pair in sorted(self.rates.items())],
                "fixed_ms": self.fixed_ms, "unit": self.unit}

    def load_state_dict(self, state: dict) -> None:
        try:
            rates = {}
            for b, t0, s0, n0, t1, s1, n1 in state["rates"]:
                pair = (BandRate(), BandRate())
                for r, (t, s, n) in zip(pair, ((t0, s0, n0), (t1, s1, n1)), strict=True):
                    r.tokens, r.time, r.rounds = float(t), float(s), int(n)
                rates[int(b)] = pair
            fixed = state["fixed_ms"]
            fixed = None if fixed is None else float(fixed)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"draft gate state is malformed: {exc!r}") from None
        if state.get("unit", "ms") != self.unit:  # rates in another unit compare nothing here
            rates = {}
        self.rates, self.fixed_ms, self.streak = rates, fixed, {}
