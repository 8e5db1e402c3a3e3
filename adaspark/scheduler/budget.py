"""The shared row budget (docs/round.md, "Under load"): one verify call for every request's rows.

API (stable; numpy only):

    allocate(candidates, step_ms, rate, cap=None) -> list[int]
        candidates: per running request, the Q of its candidate nodes in best-first order
            (non-increasing, so every prefix is a tree: Proposition 1), e.g.
            ranking.Q[ranking.order[: ranking.n_useful]]
        step_ms(total_rows) -> float: the price (ms) of one verify call over that many rows,
            every request's at its own context (the cost model's price at the step's rows)
        rate: the long-run rate (tokens per ms) that step time has to beat: the whole step's,
            every request's tokens over the steps' time
        cap: the most rows one step may verify (None: no cap below the candidates)
        returns how many of its candidates each request verifies (its rows: 1 + that)

    StepPrice(rows, step_ms, rate)   one step as a request sees it before it plans: the rows so
        far (every running request's plain row), the price of a call and the batch's rate
    StepPrice.table(rows, prices, rate, draft_ms=None)   the same from the price of every
        total row count (prices[t]: t rows; inf where a call may not go, past the end too),
        read once a step so that the draft decision and the budget cost no cost-model
        evaluations; draft_ms: what a draft adds to a plan beside others, as measured
    StepPrice.lazy(rows, make, rate, draft_ms=None)   table() of make()'s prices, made at the
        step's first read of them (most steps under load never read them)
    draft_pays(s_drafted, s_undrafted, draft_ms, step) -> bool
        s_*[k]: the expected accepted candidates of a tree's first k candidates best-first
        (index 0 is 0.0); draft_ms: what drafting adds to the request's D. True when the
        drafted tree's best prefix at the step's marginal price, less the draft's time at the
        step's rate, beats the undrafted tree's (the n-gram's, which costs no draft)

The rule is Eq. (7) over the step instead of one request. Every request's plain next row is
verified (N rows, N expected tokens). Then all requests' candidates are merged into one
best-first order by Q (ties: the lower request index, then its own order), and the step takes
the prefix of k merged nodes that maximises

    V(k) = N + S(k) - rate * step_ms(N + k),   S(k) = the Q summed over the first k,

ties to the smaller k. At the chosen k no longer prefix pays: every extension adds fewer expected
tokens than its added time earns at the long-run rate (the marginal tokens per marginal ms stay
under `rate`), and a step in the price (a kernel switch) is crossed only when the nodes past it
pay for the whole step. Scoring every prefix, not node by node, is what lets it cross such a
step. With one request it is the single-request chooser's choice (V(n) with gains 1, every width
offered). D, the drafter's fixed cost, is spent before the rule runs, so it does not enter.

Drafting is decided before the budget runs (draft_pays): a draft is spent before its tree is
seen, so the tree a draft would make is its expected one (the gate's drafted curve per bucket,
gate.py), priced as the budget will price it, at the marginal rows past the step's plain ones
and the same rate, with the draft's own time counted; otherwise the request offers its n-gram
tree (no draft) and its plain row.

As requests are added the long-run rate grows (N plain rows cost far less than N steps) while a
row's price does not fall, so a node needs a higher Q to pay: speculation recedes under load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


def merged_order(candidates: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """(Q, owner) of every candidate in one best-first order: Q descending; ties go to the
    lower request index, then to the request's own order (so each request keeps a prefix)."""
    qs = [np.asarray(c, dtype=np.float64).reshape(-1) for c in candidates]
    for i, q in enumerate(qs):
        if np.any(np.diff(q) > 0.0) or np.any(q < 0.0) or not np.all(np.isfinite(q)):
            raise ValueError(f"request {i}: Q must be finite, >= 0 and non-increasing")
    q_all = np.concatenate(qs) if qs else np.zeros(0)
    owner = np.concatenate([np.full(q.size, i, dtype=np.int64) for i, q in enumerate(qs)]
                           ) if qs else np.zeros(0, dtype=np.int64)
    order = np.lexsort((owner, -q_all))  # stable: within a request its own order stays
    return q_all[order], owner[order]


def allocate(candidates: Sequence[Sequence[float]], step_ms: Callable[[int], float],
             rate: float, cap: int | None = None) -> list[int]:
    """Candidates each request verifies this step (see the module docstring)."""
    n = len(candidates)
    if n == 0:
        return []
    if cap is not None and cap < n:
        raise ValueError(f"a step of {n} requests needs at least {n} rows, the cap is {cap}")
    if not rate >= 0.0:
        raise ValueError(f"the long-run rate must be >= 0 tokens per ms, got {rate!r}")
    q, owner = merged_order(candidates)
    useful = int(np.count_nonzero(q > 0.0))  # a node that cannot be accepted never pays
    room = useful if cap is None else min(useful, cap - n)
    S = np.concatenate([[0.0], np.cumsum(q[:room])])
    price = np.array([step_ms(n + k) for k in range(room + 1)], dtype=np.float64)
    best = int(np.argmax(_net(S, price, rate)))  # the first maximum: ties go to fewer rows
    return np.bincount(owner[:best], minlength=n).tolist()


def _net(s: np.ndarray, price: np.ndarray, rate: float) -> np.ndarray:
    """S - rate * price, -inf where the price is inf (a total the call may not have), even at
    a rate of zero."""
    return np.where(np.isfinite(price), s - rate * np.where(np.isfinite(price), price, 0.0),
                    -np.inf)


@dataclass(frozen=True)
class StepPrice:
    """One step before its requests plan: `rows` so far (every running request's plain row),
    step_ms(total rows) the price of the call, `rate` the batch's long-run tokens per ms (the
    one allocate() prices by)."""

    rows: int
    step_ms: Callable[[int], float]
    rate: float
    # what drafting adds to a request's plan beside others as the batch measured it (ms; None:
    # not measured, the cost model's D prices it)
    draft_ms: float | None = None
    # table()/lazy(): what makes the price by total rows that step_ms reads, and it once made
    _make: Callable[[], np.ndarray] | None = field(default=None, compare=False, repr=False)
    _made: list = field(default_factory=list, init=False, compare=False, repr=False)
    # value() by curve, within this step: its requests read the same curves (a bucket's
    # drafted one, the empty tree's) and the step's price does not change
    _values: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def table(cls, rows: int, prices: np.ndarray, rate: float,
              draft_ms: float | None = None) -> StepPrice:
        prices = np.asarray(prices, dtype=np.float64)
        return cls.lazy(rows, lambda: prices, rate, draft_ms)

    @classmethod
    def lazy(cls, rows: int, make: Callable[[], np.ndarray], rate: float,
             draft_ms: float | None = None) -> StepPrice:
        """table() of make()'s prices, made when the step first reads them: under load most
        steps' requests all plan their plain row and never do."""
        held: list[StepPrice] = []

        def step_ms(total: int) -> float:
            prices = held[0].prices
            return float(prices[total]) if 0 <= total < prices.size else np.inf

        held.append(cls(rows, step_ms, rate, draft_ms, make))
        return held[0]

    @property
    def prices(self) -> np.ndarray | None:
        """The price by total rows (prices[t]: t rows; inf where a call may not go), or None
        where step_ms is a plain callable."""
        if self._make is None:
            return None
        if not self._made:
            self._made.append(np.asarray(self._make(), dtype=np.float64))
        return self._made[0]

    def value(self, s: Sequence[float]) -> float:
        """The best prefix of a tree added to the step: max over k of S(k) - rate * (the
        price of the step's rows plus k, less that of its rows alone); 0 for no candidate."""
        s = np.asarray(s, dtype=np.float64).reshape(-1)
        if not s.size:
            return 0.0
        key = s.tobytes()
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = self._value(s)
        return value

    def _value(self, s: np.ndarray) -> float:
        prices = self.prices
        if prices is not None:  # one slice of the table
            extra = np.full(s.size, np.inf)
            part = prices[self.rows:self.rows + s.size]
            extra[:part.size] = part
        else:
            extra = np.array([self.step_ms(self.rows + k) for k in range(s.size)])
        return float(np.max(_net(s, extra - extra[0], self.rate)))


def draft_pays(s_drafted: Sequence[float], s_undrafted: Sequence[float], draft_ms: float,
               step: StepPrice) -> bool:
    """Draft this round: the drafted tree's best prefix at the step's marginal price, less the
    draft's time at the step's rate, beats the undrafted tree's (module docstring)."""
    return (step.value(s_drafted) - step.rate * max(float(draft_ms), 0.0)
            > step.value(s_undrafted))
