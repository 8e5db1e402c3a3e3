"""The online verify-cost model (§3.2): which widths to offer and what each costs at a context.

API (stable):

    CostModel(ladder=(2, 4, 8, 16, 32, 64))
        .widths -> list[int]                     class tops, ascending (the learned table)
        .probe() -> int | None                   width to measure next (< 3 measurements), or None
        .offers(context) -> list[(width, price_ms)]   measured classes no wider class undercuts,
                                                 ascending; the chooser picks among these
        .price(width, context) -> float          envelope: cheapest measured class with top >= width
        .fixed_cost(context) -> float | None     predicted fixed per-round cost D (drafter + build)
        .optimistic_price(width, context, plain_ms=None) -> float | None
                                                 the least an unmeasured class may cost (the
                                                 default arm's test of whether a probe could pay)
        .observe(width, rows, context, verify_ms, fixed_ms, teach=True, drafted=True,
                 tree_rows=None) -> None
                                                 fold one round: `width` is the width the round
                                                 asked for, `rows` the rows its tree really had,
                                                 `tree_rows` the rows its whole tree could fill
                                                 (None: it says nothing of the drafter's reach)
        .maybe_split(held_width, held_rounds, context, wins, frontier=False) -> int | None
                                                 split a class where a width inside could win;
                                                 wins(width, verify_ms) -> bool comes from the
                                                 chooser ("would `width` rows at this price beat
                                                 the incumbent by the switching margin?")
        .end_request() -> int                    refit the laws that learned this request; returns
                                                 how many refits were adopted
        .state_dict() -> dict / .load_state_dict(state)    JSON-able, exact round trip

    QuantileLaw()                                one class's law (also the fixed cost D's)
        .predict(context) -> float | None        ms, before level and clock
        .learn(context, ms) / .refit() -> bool / .state_dict() / .load_state_dict(state)

Prices follow Eq. (5): law_k(c) · level_k · clock_now / clock_k. The law is a 0.15-quantile fit
of time / scale on φ(u) = [1, u, u², √u, ln(1+u)], u = c/8192 (Eq. 4), by FTRL-Proximal with
non-negative context weights; the level is the minimum over the class's last 8 verifies of
measured / law; the clock is the level of the fixed cost D, which runs every round whatever the
width, so a class measured on a quieter machine is scaled up to the machine now. Levels and clocks
are not stored: they describe this process's machine state, not the kernels. When a refit is
adopted, the level (and, for D, every class's recorded clock) is re-expressed against the new law,
so a correction the level already made is not applied a second time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from adaspark.errors import UserError
from adaspark.scheduler.bands import CONTEXT_UNIT, context_band
from adaspark.scheduler.ftrl import FTRLProximal

LADDER = (2, 4, 8, 16, 32, 64)
MEASUREMENTS = 3            # measurements before a width is priced, and samples before its law
QUANTILE = 0.15             # τ: recovers the machine's time if > 15% of rounds are undisturbed
L1, L2 = 0.002, 0.01
RATE, STABILISER, N_CAP = 0.05, 1.0, 400.0
BANK_PER_BAND = 16
LAW_CLAMP = (0.5, 3.0)      # relative to the class's lowest normalised sample
LEVEL_WINDOW = 8
LEVEL_CLAMP = (0.5, 2.0)
HOLD_BEFORE_SPLIT = 8
STEEP = 1.25
MAX_CLASSES = 24
SHORT_BUILDS_FOR_REACH = 3
RISE_SHARE = 0.5            # optimistic_price: the share of the last measured rise per row
REFIT_STEPS_PER_BAND = 288
REFIT_MIN_PASSES = 24
BASIS_SIZE = 5


def basis(context: float) -> tuple[float, float, float, float, float]:
    """φ(u) of Eq. (4): redundant on purpose, so curvature past some context can be fitted.

    Memoised for positive int and float contexts (a round prices its context several times;
    512 and 512.0 give the same φ bit for bit, so they may share an entry)."""
    kind = type(context)
    if (kind is int or kind is float) and context > 0:
        phi = _BASES.get(context)
        if phi is None:
            if len(_BASES) >= _BASES_KEPT:
                _BASES.clear()
            phi = _BASES[context] = _basis(context)
        return phi
    return _basis(context)


def _basis(context: float) -> tuple[float, float, float, float, float]:
    u = context / CONTEXT_UNIT
    return (1.0, u, u * u, math.sqrt(u), math.log1p(u))


_BASES: dict[float, tuple[float, float, float, float, float]] = {}
_BASES_KEPT = 4096


def pinball(residual: float) -> float:
    """ℓ_τ(v) = v (τ − 1[v < 0]), Koenker and Bassett's quantile loss."""
    return residual * (QUANTILE - (1.0 if residual < 0.0 else 0.0))


_PRIOR = (1.0, 0.0, 0.0, 0.0, 0.0)
_LOWER = (-math.inf, 0.0, 0.0, 0.0, 0.0)  # the intercept unbounded, context weights >= 0


def _new_ftrl() -> FTRLProximal:
    # The intercept's prior is 1, the class's scale in normalised time: the law starts at the
    # scale and the elastic net pulls toward it (from 0, a fresh law would spend hundreds of
    # steps just reaching the scale). Context weights start at 0 and stay >= 0, so the law
    # never slopes down.
    return FTRLProximal(prior=list(_PRIOR), alpha=RATE, beta=STABILISER, l1=L1,
                        l2=L2, n_cap=N_CAP, lower=list(_LOWER))


class LawFTRL:
    """The cost laws' FTRL-Proximal (_new_ftrl's settings) in plain floats: the arithmetic of
    adaspark.scheduler.ftrl.FTRLProximal step for step and bit for bit (a test holds the two
    equal). A law's step is 5 coordinates, where numpy's per-call overhead is most of the cost
    (an online step ~8x, the end-of-request refit's thousands of steps ~5x). The gate and the
    variance are unused (0), so v is only carried for the state's round trip."""

    __slots__ = ("z", "n", "m", "v", "w", "_sqrt_n")

    def __init__(self) -> None:
        self.z, self.n, self.m = [0.0] * BASIS_SIZE, [0.0] * BASIS_SIZE, [0] * BASIS_SIZE
        self.v = [0.0] * BASIS_SIZE
        self.w = _PRIOR
        self._sqrt_n = (0.0,) * BASIS_SIZE

    @property
    def weights(self) -> np.ndarray:
        w = np.array(self.w)
        w.setflags(write=False)
        return w

    def run(self, order, passes: int = 1) -> None:
        """`passes` passes over order [(φ, y)]: per sample, one pinball subgradient step.
        Coordinate 0 is the intercept (prior 1, unbounded), 1-4 the context weights (prior 0,
        kept >= 0). A coordinate's step at gradient g, as FTRLProximal takes it: t = min(n +
        g², cap); z += g - (√t - √n)/α (w - prior); w = max(prior - soft(z, l1) / ((β +
        √t)/α + l2), lower), min and max keeping their first argument on ties
        (tests/test_cost.py: bit for bit). Written out five times in the loop, state in
        locals: the end-of-request refit runs thousands of steps, and a call per coordinate
        took a third of its time."""
        z0, z1, z2, z3, z4 = self.z
        n0, n1, n2, n3, n4 = self.n
        m0, m1, m2, m3, m4 = self.m
        s0, s1, s2, s3, s4 = self._sqrt_n
        w0, w1, w2, w3, w4 = self.w
        one, zero = _PRIOR[0], _PRIOR[1]   # the priors: the intercept's, the context weights'
        under, over = -QUANTILE, 1.0 - QUANTILE
        cap, rate, beta, l1, l2 = N_CAP, RATE, STABILISER, L1, L2
        sqrt, copysign = math.sqrt, math.copysign
        for _ in range(passes):
            for (f0, f1, f2, f3, f4), y in order:
                predicted = w0 * f0
                predicted += w1 * f1
                predicted += w2 * f2
                predicted += w3 * f3
                predicted += w4 * f4
                slope = under if y > predicted else over
                g = slope * f0
                t = n0 + g * g
                if cap < t:
                    t = cap
                r = sqrt(t)
                z0 += g - (r - s0) / rate * (w0 - one)
                a = abs(z0)
                w0 = one - (copysign(a - l1, z0) if a > l1 else 0.0) / ((beta + r) / rate + l2)
                n0, s0, m0 = t, r, m0 + (g != 0.0)
                g = slope * f1
                t = n1 + g * g
                if cap < t:
                    t = cap
                r = sqrt(t)
                z1 += g - (r - s1) / rate * (w1 - zero)
                a = abs(z1)
                w1 = zero - (copysign(a - l1, z1) if a > l1 else 0.0) / ((beta + r) / rate + l2)
                if zero > w1:
                    w1 = zero
                n1, s1, m1 = t, r, m1 + (g != 0.0)
                g = slope * f2
                t = n2 + g * g
                if cap < t:
                    t = cap
                r = sqrt(t)
                z2 += g - (r - s2) / rate * (w2 - zero)
                a = abs(z2)
                w2 = zero - (copysign(a - l1, z2) if a > l1 else 0.0) / ((beta + r) / rate + l2)
                if zero > w2:
                    w2 = zero
                n2, s2, m2 = t, r, m2 + (g != 0.0)
                g = slope * f3
                t = n3 + g * g
                if cap < t:
                    t = cap
                r = sqrt(t)
                z3 += g - (r - s3) / rate * (w3 - zero)
                a = abs(z3)
                w3 = zero - (copysign(a - l1, z3) if a > l1 else 0.0) / ((beta + r) / rate + l2)
                if zero > w3:
                    w3 = zero
                n3, s3, m3 = t, r, m3 + (g != 0.0)
                g = slope * f4
                t = n4 + g * g
                if cap < t:
                    t = cap
                r = sqrt(t)
                z4 += g - (r - s4) / rate * (w4 - zero)
                a = abs(z4)
                w4 = zero - (copysign(a - l1, z4) if a > l1 else 0.0) / ((beta + r) / rate + l2)
                if zero > w4:
                    w4 = zero
                n4, s4, m4 = t, r, m4 + (g != 0.0)
        self.z, self.n, self.m = [z0, z1, z2, z3, z4], [n0, n1, n2, n3, n4], [m0, m1, m2, m3, m4]
        self._sqrt_n, self.w = (s0, s1, s2, s3, s4), (w0, w1, w2, w3, w4)

    def state_dict(self) -> dict:
        return {"z": list(self.z), "n": list(self.n), "v": list(self.v), "m": list(self.m)}

    def load_state_dict(self, state: dict) -> None:
        ftrl = _new_ftrl()  # its checks, and its weights from the state
        ftrl.load_state_dict(state)
        self.z, self.n, self.v = ftrl.z.tolist(), ftrl.n.tolist(), ftrl.v.tolist()
        self.m = ftrl.labels.tolist()
        self._sqrt_n = tuple(math.sqrt(x) for x in self.n)
        self.w = tuple(ftrl.weights.tolist())


def _train_fresh(order: list, passes: int) -> LawFTRL:
    """A fresh law trained `passes` times over `order` [(φ, y)]: the refit's inner loop."""
    ftrl = LawFTRL()
    ftrl.run(order, passes)
    return ftrl


def _dot(w, phi) -> float:
    return w[0] * phi[0] + w[1] * phi[1] + w[2] * phi[2] + w[3] * phi[3] + w[4] * phi[4]


class QuantileLaw:
    """A low-quantile law of time in context, with its bank of samples per context band."""

    def __init__(self) -> None:
        self.ftrl = LawFTRL()
        self._w = self.ftrl.w
        self.first: list[tuple[float, float]] = []   # the first 3 (context, ms): fix the scale
        self.scale: float | None = None       # lowest of the first 3 times (ms)
        self.lowest: float | None = None      # lowest normalised sample ever seen
        self.samples = 0
        self.bank: dict[int, list[tuple[float, float]]] = {}
        self.dirty = False                    # learned since the last refit (not stored)

    @property
    def fitted(self) -> bool:
        return self.scale is not None

    @property
    def lowest_ms(self) -> float | None:
        """The lowest time measured so far (ms): the price until the law is fitted."""
        if self.scale is None:
            return min(t for _, t in self.first) if self.first else None
        return self.lowest * self.scale

    def _normalised(self, phi, w=None) -> float:
        raw = _dot(self._w if w is None else w, phi)
        low = self.lowest
        return min(max(raw, LAW_CLAMP[0] * low), LAW_CLAMP[1] * low)

    def predict_basis(self, phi) -> float | None:
        if self.scale is None:
            return self.lowest_ms
        return self.scale * self._normalised(phi)

    def predict(self, context: float) -> float | None:
        return self.predict_basis(basis(context))

    def learn(self, context: float, ms: float) -> None:
        ms = float(ms)
        if not (ms > 0.0 and math.isfinite(ms)):
            raise ValueError(f"a measured time must be a positive number of ms, got {ms!r}")
        band = self.bank.setdefault(context_band(context), [])
        band.append((float(context), ms))
        if len(band) > BANK_PER_BAND:
            del band[0]
        self.samples += 1
        self.dirty = True
        if self.scale is None:
            self.first.append((float(context), ms))
            if len(self.first) == MEASUREMENTS:
                self.scale = min(t for _, t in self.first)
                self.lowest = 1.0
                for c, t in self.first:
                    self._step(basis(c), t / self.scale)
            return
        y = ms / self.scale
        self.lowest = min(self.lowest, y)
        self._step(basis(context), y)

    def _step(self, phi, y: float) -> None:
        # Subgradient of ℓ_τ(y − θ·φ) in θ: −τ·φ when the law is under the sample, (1−τ)·φ over.
        self.ftrl.run(((phi, y),))
        self._w = self.ftrl.w

    def _split_bank(self) -> tuple[list[list[tuple[float, float]]], list[tuple[float, float]]]:
        """Training samples per band (oldest first) and the samples the refit is judged on."""
        train, judged = [], []
        for _, band in sorted(self.bank.items()):
            if len(band) >= 4:
                held = len(band) // 4          # the newest quarter is held out
                train.append(band[:-held])
                judged.extend(band[-held:])
            else:                              # too small to hold out: trained and judged on
                train.append(list(band))
                judged.extend(band)
        return train, judged

    def _loss(self, samples, w) -> float:
        return sum(pinball(t / self.scale - self._normalised(basis(c), w)) for c, t in samples)

    def refit(self) -> bool:
        """End-of-request refit on the bank (§3.2); adopt it only if it wins on judged samples.

        Passes = max(24, ⌈288 · bands / training samples⌉): about 288 steps per band however
        sparse the bank, so a width run only to measure it still learns its slope."""
        self.dirty = False
        if self.scale is None:
            return False
        train, judged = self._split_bank()
        count = sum(len(b) for b in train)
        if count == 0 or not judged:
            return False
        passes = max(REFIT_MIN_PASSES, math.ceil(REFIT_STEPS_PER_BAND * len(train) / count))
        order = []                             # bands interleaved, each band oldest first
        for i in range(max(len(b) for b in train)):
            order.extend((basis(b[i][0]), b[i][1] / self.scale) for b in train if i < len(b))
        candidate = _train_fresh(order, passes)
        fresh = candidate.w
        if self._loss(judged, fresh) < self._loss(judged, self._w):
            self.ftrl, self._w = candidate, fresh
            return True
        return False

    def state_dict(self) -> dict:
        return {
            "ftrl": self.ftrl.state_dict(), "first": [[c, t] for c, t in self.first],
            "scale": self.scale,
            "lowest": self.lowest, "samples": self.samples,
            "bank": [[b, [[c, t] for c, t in s]] for b, s in sorted(self.bank.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        try:
            ftrl = LawFTRL()
            ftrl.load_state_dict(state["ftrl"])
            first = [(float(c), float(t)) for c, t in state["first"]]
            scale = None if state["scale"] is None else float(state["scale"])
            lowest = None if state["lowest"] is None else float(state["lowest"])
            samples = int(state["samples"])
            bank = {int(b): [(float(c), float(t)) for c, t in s] for b, s in state["bank"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"cost law state is malformed: {exc!r}") from None
        if (scale is None) != (lowest is None):
            raise UserError("cost law state is malformed: scale and lowest must both be set")
        self.ftrl, self.first, self.scale, self.lowest = ftrl, first, scale, lowest
        self._w = ftrl.w
        self.samples, self.bank, self.dirty = samples, bank, False


class _Level:
    """Minimum over the last 8 of measured / law, clamped: follows the machine, not stored."""

    def __init__(self) -> None:
        self.window: deque[tuple[float, float, float]] = deque(maxlen=LEVEL_WINDOW)
        self.value = 1.0

    def add(self, context: float, measured: float, law: float) -> None:
        """`law` is the law's price for this sample before it learned the sample."""
        self.window.append((context, measured, measured / law))
        self._update()

    def _update(self) -> None:
        low = min(ratio for _, _, ratio in self.window) if self.window else 1.0
        self.value = min(max(low, LEVEL_CLAMP[0]), LEVEL_CLAMP[1])

    def rebase(self, law: QuantileLaw) -> None:
        """Re-express the window against a refitted law, so the level stays a residual of it."""
        self.window = deque(((c, t, t / law.predict(c)) for c, t, _ in self.window),
                            maxlen=LEVEL_WINDOW)
        self._update()


class RowClass:
    """Widths (previous top, top]; measured and priced at its top."""

    def __init__(self, top: int) -> None:
        self.top = int(top)
        self.law = QuantileLaw()
        self.level = _Level()
        self.clock = 1.0          # the clock when this class last ran, the context it ran at,
        self.clock_context = None  # and the law of D there then: what the clock was read against
        self.clock_law = None
        self.short_builds = 0     # probe rounds whose whole tree was narrower than top
        self.widest_short = 0     # the widest of those trees

    @property
    def measured(self) -> bool:
        return self.law.samples >= MEASUREMENTS

    def price_basis(self, phi, clock_now: float) -> float | None:
        # law.predict_basis(phi) * level * clock_now / clock, inlined: the chooser's offers and
        # the split test price every measured class every round
        law = self.law
        scale = law.scale
        if scale is None:
            lowest = law.lowest_ms
            return None if lowest is None else lowest * 1.0 * clock_now / self.clock
        w, low = law._w, law.lowest
        raw = w[0] * phi[0] + w[1] * phi[1] + w[2] * phi[2] + w[3] * phi[3] + w[4] * phi[4]
        normalised = min(max(raw, LAW_CLAMP[0] * low), LAW_CLAMP[1] * low)
        return scale * normalised * self.level.value * clock_now / self.clock

    def state_dict(self) -> dict:
        return {"top": self.top, "law": self.law.state_dict(),
                "short_builds": self.short_builds, "widest_short": self.widest_short}

    @classmethod
    def from_state(cls, state: dict) -> RowClass:
        try:
            row_class = cls(int(state["top"]))
            row_class.short_builds = int(state["short_builds"])
            row_class.widest_short = int(state["widest_short"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"cost class state is malformed: {exc!r}") from None
        row_class.law.load_state_dict(state["law"])
        return row_class


class CostModel:
    """The learned table of row classes, their laws, and the fixed-cost clock (see module doc)."""

    def __init__(self, ladder=LADDER) -> None:
        tops = sorted({int(w) for w in ladder})
        if not tops or tops[0] < 2:
            raise UserError(f"the width ladder must be widths >= 2, got {ladder!r}")
        self.classes = [RowClass(w) for w in tops]
        self.fixed = QuantileLaw()          # D: drafter forward + tree build
        self.fixed_level = _Level()
        self.reach: int | None = None       # widest tree the drafter can build, once learned

    # ----- reading -----------------------------------------------------------------------
    @property
    def widths(self) -> list[int]:
        return [k.top for k in self.classes]

    @property
    def clock(self) -> float:
        return self.fixed_level.value if self.fixed.fitted else 1.0

    def probe(self) -> int | None:
        for row_class in self.classes:
            if not row_class.measured:
                return row_class.top
        return None

    def pending_inside(self) -> bool:
        """An unmeasured class lies below a measured one (a split still being measured)."""
        measured = [k.measured for k in self.classes]
        if not any(measured):
            return False
        widest = len(measured) - 1 - measured[::-1].index(True)
        return not all(measured[:widest])

    def optimistic_price(self, width: int, context: float, plain_ms: float | None = None
                         ) -> float | None:
        """The least the unmeasured class at `width` may cost: its lowest time so far (machine
        noise only adds time); else, inside the measured range, the price of the measured class
        below it (a width inside costs at least its bottom's price, §3.2); else, past the widest
        measured class, that price plus half the last measured rise per row (from the plain
        step's `plain_ms` when one class is measured), so a wide width is measured only where
        a cost rising at half the measured pace would still let it pay. None: nothing below it
        is measured, so there is nothing to compare it with."""
        row_class = self._class_at(width)
        if row_class is not None and row_class.law.lowest_ms is not None:
            return row_class.law.lowest_ms
        prices = self._prices(context)
        below = [(top, p) for top, p in prices if top < width]
        if not below:
            return None
        if any(top > width for top, _ in prices):
            return below[-1][1]
        points = ([(1, plain_ms)] if plain_ms is not None else []) + below
        b, t_b = points[-1]
        if len(points) < 2:
            return t_b
        a, t_a = points[-2]
        return t_b + RISE_SHARE * max(t_b - t_a, 0.0) / (b - a) * (width - b)

    def _prices(self, context: float) -> list[tuple[int, float]]:
        phi, clock = basis(context), self.clock
        return [(k.top, k.price_basis(phi, clock)) for k in self.classes if k.measured]

    def offers(self, context: float) -> list[tuple[int, float]]:
        prices = self._prices(context)
        offered, cheapest_wider = [], math.inf
        for top, price in reversed(prices):
            if price <= cheapest_wider:     # a wider class that is cheaper hides this one
                offered.append((top, price))
                cheapest_wider = price
        offered.reverse()
        return offered

    def price(self, width: int, context: float) -> float:
        candidates = [p for top, p in self._prices(context) if top >= width]
        if not candidates:
            raise ValueError(f"no measured width covers {width} rows")
        return min(candidates)

    def fixed_cost(self, context: float) -> float | None:
        law = self.fixed.predict(context)
        return None if law is None else law * self.clock

    # ----- learning ----------------------------------------------------------------------
    def _class_at(self, width: int) -> RowClass | None:
        for row_class in self.classes:
            if row_class.top == width:
                return row_class
        return None

    def observe(self, width: int, rows: int, context: float, verify_ms: float, fixed_ms: float,
                teach: bool = True, drafted: bool = True, tree_rows: int | None = None) -> None:
        """Fold one round in. A request's first round runs cold: call it with teach=False.
        An undrafted round (the draft gate's n-gram tree) teaches its verify time only: its D
        is not the drafter's, and a narrow n-gram tree says nothing of the drafter's reach.
        tree_rows: the rows the drafter's whole tree could fill (every node, the anchor's row
        included); a probe short of its width teaches the reach only when that whole tree was
        short too, so a tree cut by a stop token (Q = 0 below it) or by the reply's end, which
        the caller passes as None, is not taken for the drafter's limit."""
        if not teach:
            return
        if drafted:
            predicted = self.fixed.predict(context) if self.fixed.fitted else None
            if predicted is not None:
                self.fixed_level.add(context, fixed_ms, predicted)
            self.fixed.learn(context, fixed_ms)
        row_class = self._class_at(width)
        if row_class is None:
            return                          # a pinned or foreign width: not in the table
        if rows < width:
            # The tree was narrower than the width measured: the time is not this class's.
            if (drafted and not row_class.measured and tree_rows is not None
                    and tree_rows < width):
                row_class.short_builds += 1
                row_class.widest_short = max(row_class.widest_short, int(tree_rows))
                if row_class.short_builds >= SHORT_BUILDS_FOR_REACH:
                    self._learn_reach(row_class.widest_short)
            return
        if row_class.law.fitted:
            row_class.level.add(context, verify_ms, row_class.law.predict(context))
        row_class.law.learn(context, verify_ms)
        row_class.clock, row_class.clock_context = self.clock, float(context)
        row_class.clock_law = self.fixed.predict(context) if self.fixed.fitted else None

    def _learn_reach(self, reach: int) -> None:
        """The drafter cannot build past `reach` rows: no class may be priced wider. A measured
        class was filled three times, so the reach is never below it and it is never erased."""
        floor = max([self.classes[0].top] + [k.top for k in self.classes if k.measured])
        reach = max(int(reach), floor)
        self.reach = reach if self.reach is None else max(min(self.reach, reach), floor)
        kept = [k for k in self.classes if k.top <= self.reach or k.measured]
        wider = [k for k in self.classes if k.top > self.reach and not k.measured]
        if wider and (not kept or kept[-1].top < self.reach):
            kept.append(RowClass(self.reach))
        self.classes = kept

    def maybe_split(self, held_width: int, held_rounds: int, context: float,
                    wins: Callable[[int, float], bool], frontier: bool = False) -> int | None:
        """Split the interval nearest the held width where a width inside could win (§3.2).
        frontier: unmeasured classes wider than every measured one do not hold splits back (the
        default arm measures those only where they could pay); the split looks among the
        measured classes."""
        if held_rounds < HOLD_BEFORE_SPLIT or len(self.classes) >= MAX_CLASSES:
            return None
        if frontier:
            if self.pending_inside():
                return None
            table = [k for k in self.classes if k.measured]
        elif self.probe() is not None:
            return None
        else:
            table = self.classes
        phi, clock = basis(context), self.clock
        intervals = []
        for lower, upper in zip(table[:-1], table[1:], strict=True):
            bottom, top = lower.top, upper.top
            if top - bottom < 2:
                continue
            if bottom <= held_width <= top:
                distance = 0
            else:
                distance = min(abs(held_width - bottom), abs(held_width - top))
            intervals.append((distance, bottom, lower, upper))
        for _, bottom, lower, upper in sorted(intervals, key=lambda x: (x[0], x[1])):
            top = upper.top
            bottom_price = lower.price_basis(phi, clock)
            # A width inside costs at least the bottom's price and accepts at most what top − 1
            # rows accept: if even that cannot clear the margin, nothing inside can win.
            if not wins(top - 1, bottom_price):
                continue
            if upper.price_basis(phi, clock) > STEEP * bottom_price:
                new = bottom + 1 if held_width <= bottom else top - 1
            else:
                new = (bottom + top) // 2
            self.classes.insert(self.classes.index(upper), RowClass(new))
            return new
        return None

    def end_request(self) -> int:
        """Refit every law that learned during the request; returns how many were adopted."""
        adopted = 0
        for row_class in self.classes:
            if row_class.law.dirty and row_class.law.refit():
                row_class.level.rebase(row_class.law)
                adopted += 1
        if self.fixed.dirty:
            if self.fixed.refit():
                # Levels are residuals of a law: re-express the clock, and the clock each class
                # recorded, against the refitted law of D so their ratios keep their meaning.
                self.fixed_level.rebase(self.fixed)
                for k in self.classes:
                    if k.clock_law is not None:
                        new_law = self.fixed.predict(k.clock_context)
                        k.clock, k.clock_law = k.clock * k.clock_law / new_law, new_law
                adopted += 1
        return adopted

    # ----- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"classes": [k.state_dict() for k in self.classes],
                "fixed": self.fixed.state_dict(), "reach": self.reach}

    def load_state_dict(self, state: dict) -> None:
        try:
            classes = [RowClass.from_state(s) for s in state["classes"]]
            fixed = QuantileLaw()
            fixed.load_state_dict(state["fixed"])
            reach = None if state["reach"] is None else int(state["reach"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"cost model state is malformed: {exc!r}") from None
        tops = [k.top for k in classes]
        if not tops or tops != sorted(set(tops)):
            raise UserError("cost model state is malformed: class tops must ascend")
        self.classes, self.fixed, self.fixed_level, self.reach = classes, fixed, _Level(), reach
