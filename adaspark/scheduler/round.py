"""The round API the engine calls: one AdaSpark round of Algorithm 1 (§3.1), as plan then learn.

    sched = Scheduler(Arm.parse("adaspark"))
    sched.load_state_dict(store.load() or {})        # learned state outlives requests only here
    sched.begin_request(committed_tokens)            # prompt (+ any token prefill committed)
    while decoding:                                  # driver.run_round does these four steps
        plan = sched.plan_round(context_length, draft, stop_ids, room)   # lines 3-12
        argmax = target.verify(plan.tokens, plan.depths, plan.mask)      # line 13
        outcome = sched.accept(plan, argmax)         # rows to commit, tokens, bonus (line 14)
        record = sched.learn(outcome, RoundTimes(D, verify, commit), last_round)  # lines 15-18
    sched.end_request()                              # the cost model's refit
    store.save(sched.state_dict())

`draft()` returns the drafter's tree.Block after the anchor; plan_round calls it only in a round
it decides to draft (not for `ar`, a plain round, or a gated n-gram round), so this module never
touches the drafter. Everything a round decided travels in its Plan (the gate's bucket
included), so learn() needs no state left behind by planning.

`Arm` selects the paper's arms with switches on one scheduler (see `Arm.parse`). Every decision
and everything learned lives here and in the modules it drives: tree.py (candidates, order,
layout, accept walk), ngram.py (the request's text), acceptance.py (q), cost.py (verify prices),
chooser.py (the width), gate.py (whether to draft at all, modifier `gate`). The engine owns
tensors and clocks and hands in numbers only.

Two places where this follows Algorithm 1 rather than a looser reading of §3 (docs/round.md):
a request's first round teaches the acceptance model (only line 15, the cost model, skips it:
the first round runs cold, but its labels are true), and an exploration round (line 12) teaches
the gains like any round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from time import perf_counter

import numpy as np

from adaspark.errors import UserError
from adaspark.scheduler.acceptance import AcceptanceModel, Scored
from adaspark.scheduler.bands import context_band
from adaspark.scheduler.chooser import Chooser
from adaspark.scheduler.cost import MEASUREMENTS, CostModel, QuantileLaw
from adaspark.scheduler.gate import NO_PROPOSAL, DraftGate
from adaspark.scheduler.ngram import NgramIndex, exploration_swap
from adaspark.scheduler.record import ChosenBy, RoundRecord, RoundTimes
from adaspark.scheduler.tree import (
    NGRAM,
    Block,
    CandidateTree,
    Layout,
    Ranking,
    accept,
    evidence_of_bucket,
    layout,
    rank,
)

PLAIN_RECHECK = 16  # plain rounds in a row before drafting once more to re-measure the rate
# The default arm's measurement budget (docs/round.md): a request's probe rounds may lose, against
# plain steps in the same time, at most this share of the request's decode time so far.
PROBE_BUDGET = 0.05
MAX_WIDTH = 64
STATE_VERSION = 1
# Modifier `classes` (Table 9): the width table is the 8-bit matrix kernel's row classes, every 8
# rows up to 64, fixed (no splits) instead of the ladder the cost model refines (§3.2).
KERNEL_CLASSES = (8, 16, 24, 32, 40, 48, 56, 64)


@dataclass(frozen=True)
class Arm:
    """Switches that select one of the paper's arms; the default is AdaSpark."""

    name: str = "adaspark"
    draft: bool = True  # False: autoregressive, every round is a plain 1-row round
    chain: int | None = None  # a chain of at most this many picks (the spine only)
    pinned: int | None = None  # a fixed width instead of the chooser's
    fitted: bool = True  # False: the head-based estimate prices every tree
    ngram: bool = True
    ratio_rule: bool = False  # the per-round ratio instead of the long-run rate
    hysteresis: bool = True
    plain_rounds: bool = False  # skip drafting when a plain decode step is worth more
    gate: bool = False  # per round, draft or plan from the n-gram index alone (gate.py)
    classes: bool = False  # widths fixed to the kernel's row classes (KERNEL_CLASSES)
    # The default arm's cold start (docs/round.md): the plain step is measured first, and a
    # width only where this round's tree says it could pay, within the request's PROBE_BUDGET.
    # `gate` switches it on with the gate; `ladder` measures the paper's whole ladder instead.
    paced: bool = False

    BASES = ("ar", "chain3", "chain", "tree:N", "cost", "adaspark", "adaspark:N")
    MODIFIERS = ("head", "no-ngram", "ratio", "no-hysteresis", "plain", "gate", "classes",
                 "ladder")

    @classmethod
    def parse(cls, text: str | Arm) -> Arm:
        """`ar`, `chain3`, `chain`, `tree:N`, `cost`, `adaspark`, `adaspark:N`, optionally with
        modifiers after commas or plus signs (`adaspark,gate` == `adaspark+gate`: the bench
        spells arms with `+` because its arm list is comma-separated): head, no-ngram, ratio,
        no-hysteresis, plain, gate (with the paced cold start), classes, ladder (the paper's
        whole ladder of probes under the gate). The name keeps the comma spelling."""
        if isinstance(text, Arm):
            return text
        base, *mods = [part.strip() for part in str(text).replace("+", ",").split(",")]
        name, _, width = base.partition(":")
        pinned = None
        if width:
            if name not in ("tree", "adaspark"):
                raise UserError(f"arm {base!r}: only tree:N and adaspark:N take a width")
            try:
                pinned = int(width)
            except ValueError:
                raise UserError(f"arm {base!r}: the width must be an integer") from None
            if not 1 <= pinned <= MAX_WIDTH:
                raise UserError(f"arm {base!r}: the width must lie in 1..{MAX_WIDTH}")
        if name == "ar":
            arm = cls(name=base, draft=False, ngram=False)
        elif name == "chain3":
            arm = cls(name=base, chain=3, fitted=False, ngram=False)
        elif name == "chain":
            arm = cls(name=base, chain=MAX_WIDTH, fitted=False, ngram=False)
        elif name == "tree" and pinned is not None:
            arm = cls(name=base, pinned=pinned, fitted=False, ngram=False)
        elif name == "cost":
            arm = cls(name=base, fitted=False, ngram=False)
        elif name == "adaspark":
            arm = cls(name=base, pinned=pinned)
        else:
            raise UserError(f"unknown arm {base!r}; arms: {', '.join(cls.BASES)}")
        switches = {"head": {"fitted": False}, "no-ngram": {"ngram": False},
                    "ratio": {"ratio_rule": True}, "no-hysteresis": {"hysteresis": False},
                    "plain": {"plain_rounds": True}, "gate": {"gate": True, "paced": True},
                    "classes": {"classes": True}, "ladder": {"paced": False}}
        for mod in mods:
            if mod not in switches:
                raise UserError(f"arm {text!r}: unknown modifier {mod!r}; "
                                f"modifiers: {', '.join(cls.MODIFIERS)}")
            arm = replace(arm, **switches[mod])
        if "ladder" in mods:  # whatever the order of the modifiers
            arm = replace(arm, paced=False)
        return replace(arm, name=",".join([base, *mods]))

    def at_width(self, width: int) -> Arm:
        """This arm pinned to `width` (its base at :width, its modifiers kept): the sweep's."""
        base, *mods = self.name.split(",")
        return Arm.parse(",".join([f"{base.partition(':')[0]}:{int(width)}", *mods]))


@dataclass
class Plan:
    """The rows to verify: row 0 is the anchor, rows depth-first, parents before children."""

    context_length: int
    tokens: np.ndarray  # int64[n]
    depths: np.ndarray  # int64[n]; position of row i = start + depths[i]
    parents: np.ndarray  # int64[n] parent row, -1 for row 0
    mask: np.ndarray  # bool[n, n]: row i sees row j iff j is i or an ancestor of i
    width_chosen: int  # the width asked for (may exceed rows when the tree runs out)
    chosen_by: ChosenBy
    width_offered: list[int] = field(default_factory=list)
    predicted_S: float = 0.0  # expected accepted candidates of the verified tree
    predicted_T_s: float | None = None  # the cost model's price of the width (seconds)
    explored: bool = False  # the last row is an exploration row (§3.3)
    fitted_prices: bool = False  # the fitted acceptance model priced the tree
    drafted: bool = True  # the drafter ran for this round (False: plain or undrafted)
    gate_bucket: int | None = None  # the draft gate's bucket at the anchor (None: gate off)
    ngram_widened: bool = False  # the n-gram candidates moved the chooser wider (Cor. 4)
    tree: CandidateTree | None = field(default=None, repr=False)  # None: a plain round
    layout: Layout | None = field(default=None, repr=False)
    _scored: Scored | None = field(default=None, repr=False)
    _ranking: Ranking | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return int(self.tokens.size)


@dataclass
class Outcome:
    """What one verify committed: the accepted path and the bonus token."""

    plan: Plan
    rows: list[int]  # accepted rows, starting with row 0 (the anchor): the rows to commit
    tokens: list[int]  # accepted candidates' tokens
    bonus: int  # the target's argmax after the last accepted row
    nodes: list[int] = field(default_factory=list)
    labelled_parents: np.ndarray | None = field(default=None, repr=False)
    parent_targets: np.ndarray | None = field(default=None, repr=False)

    @property
    def committed(self) -> np.ndarray:
        return np.array(self.tokens + [self.bonus], dtype=np.int64)


Draft = Callable[[], Block]  # the drafter's block after the anchor, made on demand


class Scheduler:
    """One per engine: the cost model, acceptance model and chooser; an n-gram index per request.
    """

    def __init__(self, arm: Arm | str | None = None, time_parts: bool = False) -> None:
        self.arm = Arm.parse(arm) if arm is not None else Arm()
        self.cost = CostModel(KERNEL_CLASSES) if self.arm.classes else CostModel()
        self.acceptance = AcceptanceModel()
        self.chooser = Chooser(pinned=self.arm.pinned, ratio_rule=self.arm.ratio_rule,
                               hysteresis=self.arm.hysteresis)
        self.plain_law = QuantileLaw()  # the 1-row step, for plain rounds (width 1 is no class)
        self.index: NgramIndex | None = None
        self._anchor: int | None = None  # the last committed token; None between requests
        self.temperature = 0.0  # the request's sampling temperature (acceptance feature)
        self._round = 0  # rounds of this request
        self._plain_run = 0  # plain rounds in a row
        self._decode_ms = 0.0  # this request's round time so far (the paced arm's budget)
        self._probe_loss_ms = 0.0  # its probe rounds' time beyond plain steps' for their tokens
        # paced, the gate counts round time in plain steps (_gate_time)
        self.gate = DraftGate(unit="step" if self.arm.paced else "ms")
        # host seconds per part of the round, summed (benchmarks/scheduler_overhead.py)
        self.part_times: dict[str, float] | None = {} if time_parts else None
        # rounds by rows verified since this process started (not stored): the width share
        self.width_rounds: dict[int, int] = {}

    def _lap(self, part: str, since: float) -> float:
        if self.part_times is None:
            return since
        now = perf_counter()
        self.part_times[part] = self.part_times.get(part, 0.0) + now - since
        return now

    def _start(self) -> float:
        return 0.0 if self.part_times is None else perf_counter()

    # ----- request -----------------------------------------------------------------------
    def begin_request(self, committed_tokens: Sequence[int], temperature: float = 0.0) -> None:
        """A new request whose committed text so far is `committed_tokens` (its last token is
        the first round's anchor); temperature: its sampling temperature (0: greedy), a feature
        of the acceptance model."""
        tokens = np.asarray(committed_tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("a request needs at least one committed token (the anchor)")
        self.index = NgramIndex(tokens) if self.arm.ngram else None
        self._anchor = int(tokens[-1])
        self.temperature = float(temperature)
        self.acceptance.begin_request()
        self._round = 0
        self._plain_run = 0
        self._decode_ms = self._probe_loss_ms = 0.0

    def end_request(self) -> int:
        """The end-of-request refit of the cost laws; returns how many refits were adopted."""
        self.index, self._anchor = None, None
        return self.cost.end_request() + int(self.plain_law.dirty and self.plain_law.refit())

    # ----- planning ----------------------------------------------------------------------
    def plan_round(self, context_length: int, draft: Draft, stop_ids: Sequence[int] = (),
                   room: int | None = None) -> Plan:
        """Algorithm 1, lines 3-12: this round's rows to verify.

        context_length: the committed tokens, the anchor included; draft: called at most once,
        only when the round drafts, for the drafter's block after the anchor; stop_ids: tokens
        after which nothing is verified; room: the rows the context can still hold (None: no
        limit), a wider plan gives way to one row.

        A round drafts unless the arm never does (`ar`), a plain decode step is worth more
        (modifier `plain`: the band's long-run speculative rate is below a 1-row step's, V of
        Eq. 7 at width 1 beats every width, once that step is measured), or the draft gate
        (modifier `gate`) finds the n-gram index's own tree at the anchor the faster mode in
        its bucket; then the round verifies that tree (priced and cut like any tree) or one
        row. A request's first round and the cost model's probes always draft (a probe
        measures a width only the drafter can fill). Under the paced cold start (`gate`, not
        `ladder`) the gate decides from the second round on, probes pending or not: plain
        rounds until the plain step is measured, then a drafted round only where a measured
        width or an affordable probe can verify it (see _width)."""
        if self._anchor is None:
            raise ValueError("call begin_request() before planning a round")
        ctx = int(context_length)
        bucket = None
        if not self.arm.draft:
            plan = self._plain(ctx)
        elif self.arm.paced and self._round > 0 and self.plain_law.samples < MEASUREMENTS:
            plan = self._plain(ctx)  # paced: first the step every width has to beat
        elif self.arm.gate and self._round > 0 and (self.arm.paced or self.cost.probe() is None):
            tree = self._ngram_tree(stop_ids)
            # node 0 is the first proposal after the anchor (chains() starts there)
            bucket = evidence_of_bucket(int(tree.bucket[0])) if tree.n_nodes else NO_PROPOSAL
            drafts = self.gate.choose(bucket) and (not self.arm.paced
                                                   or self._can_verify_a_draft(ctx))
            plan = self._drafted(draft(), ctx, stop_ids) if drafts else self._undrafted(tree, ctx)
        elif self._plain_pays(ctx):
            plan = self._plain(ctx)
        else:
            plan = self._drafted(draft(), ctx, stop_ids)
        if room is not None and plan.rows > room:  # the context cannot hold it: one row fits
            plan = self._plain(ctx)
        plan.gate_bucket = bucket
        return plan

    def _can_verify_a_draft(self, ctx: int) -> bool:
        """Paced: a width is measured, or the budget still allows the narrowest probe."""
        return bool(self.cost.offers(ctx)) or self._probe_budget_left()

    def _probe_budget_left(self) -> bool:
        return self._probe_loss_ms <= PROBE_BUDGET * self._decode_ms

    def _probe_pays(self, probe: int, ranking: Ranking, ctx: int) -> bool:
        """Paced: measure `probe` this round only if nothing is measured yet, or the budget
        allows it and this round's tree at the probe's optimistic price (cost.py) beats every
        measured width by the chooser's own score."""
        offers = self.cost.offers(ctx)
        if not offers:
            return True
        if not self._probe_budget_left():
            return False
        price = self.cost.optimistic_price(probe, ctx, self.plain_law.predict(ctx))
        if price is None:
            return True
        trial = sorted([*((w, p) for w, p in offers if w != probe), (probe, price)])
        width, _ = self.chooser.best(trial, ranking.S_drafter.tolist(), ranking.S_ngram.tolist(),
                                     self.cost.fixed_cost(ctx), ctx)
        return width == probe

    def _plain_pays(self, ctx: int) -> bool:
        """Modifier `plain`: a plain step's rate beats the band's speculative rate."""
        if not self.arm.plain_rounds or self._round == 0 or self.cost.probe() is not None:
            return False
        if self.plain_law.samples < MEASUREMENTS:
            return True  # the 1-row step is first measured like any width (3 rounds)
        band = self.chooser.rates.get(context_band(ctx))
        rate = None if band is None else band.rate
        if rate is None or self._plain_run >= PLAIN_RECHECK:
            return False
        return rate < 1.0 / self.plain_law.predict(ctx)

    def _plain(self, ctx: int) -> Plan:
        """The 1-row round: the anchor alone, its argmax is the one committed token."""
        tokens = np.array([self._anchor], dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        predicted = self.plain_law.predict(ctx)
        return Plan(ctx, tokens, zero, np.full(1, -1, dtype=np.int64),
                    np.ones((1, 1), dtype=bool), 1, ChosenBy.PLAIN,
                    predicted_T_s=None if predicted is None else predicted / 1000.0,
                    drafted=False)

    def _ngram_tree(self, stop_ids: Sequence[int]) -> CandidateTree:
        tree = CandidateTree.undrafted(self._anchor, stop_ids)
        if self.index is not None:
            self.index.chains(tree)
        return tree

    def _undrafted(self, tree: CandidateTree, ctx: int) -> Plan:
        """A gated round without the drafter: the n-gram index's tree at the anchor priced and
        cut like any tree, a plain step (once measured) among the offers (the undrafted round's
        own D, no hysteresis: it does not move the chooser's incumbent); one row when the
        index proposes nothing worth a row."""
        offers = self.cost.offers(ctx)
        if tree.n_nodes == 0 or not offers:
            return self._plain(ctx)
        scored = self.acceptance.score(tree, ctx, head_only=not self.arm.fitted,
                                       temperature=self.temperature)
        ranking = rank(tree, scored.q)
        if ranking.n_useful == 0:
            return self._plain(ctx)
        plain_ms = self.plain_law.predict(ctx)  # a weak proposal may not be worth a row
        if plain_ms is not None:
            offers = [(1, plain_ms), *offers]
        width, price_ms = self.chooser.best(offers, ranking.S_drafter.tolist(),
                                            ranking.S_ngram.tolist(), self.gate.fixed_ms, ctx)
        if width == 1:
            return self._plain(ctx)
        kept = ranking.order[: min(width - 1, ranking.n_useful)]
        lay = layout(tree, kept, anchor_token=self._anchor)
        return Plan(
            context_length=ctx, tokens=lay.tokens, depths=lay.depths, parents=lay.parent_rows,
            mask=lay.mask, width_chosen=int(width), chosen_by=ChosenBy.UNDRAFTED,
            width_offered=[w for w, _ in offers], predicted_S=float(ranking.Q[kept].sum()),
            predicted_T_s=price_ms / 1000.0, fitted_prices=scored.fitted_prices, drafted=False,
            tree=tree, layout=lay, _scored=scored, _ranking=ranking,
        )

    def _drafted(self, block: Block, ctx: int, stop_ids: Sequence[int]) -> Plan:
        """Lines 3-12 on the drafter's block: candidates, q, best-first order, width, rows."""
        t = self._start()
        tree = CandidateTree.from_block(block, self._anchor, stop_ids)
        t = self._lap("candidates", t)
        if self.index is not None:
            self.index.chains(tree)
            t = self._lap("ngram chains", t)
        scored = self.acceptance.score(tree, ctx, head_only=not self.arm.fitted,
                                       temperature=self.temperature)
        t = self._lap("q", t)
        ranking = rank(tree, scored.q)
        t = self._lap("order", t)
        offered: list[int] = []
        price_ms = None
        widened = False
        if self.arm.chain is not None:
            kept = self._chain(tree, self.arm.chain)
            width, chosen_by = kept.size + 1, ChosenBy.CHAIN
        else:
            width, chosen_by, offered, price_ms, widened = self._width(ranking, ctx)
            kept = ranking.order[: min(width - 1, ranking.n_useful)]
        t = self._lap("width", t)
        explored = False
        if self.index is not None and self.arm.chain is None and self.index.exploration_due(tree):
            swapped = exploration_swap(tree, kept, ranking.Q, self.acceptance.bucket_labels)
            explored = not np.array_equal(swapped, kept)
            kept = swapped
        lay = layout(tree, kept, anchor_token=self._anchor)
        if price_ms is None and chosen_by is not ChosenBy.PROBE:
            price_ms = self._price(width, ctx)
        self._lap("layout", t)
        return Plan(
            context_length=ctx, tokens=lay.tokens, depths=lay.depths, parents=lay.parent_rows,
            mask=lay.mask, width_chosen=int(width), chosen_by=chosen_by, width_offered=offered,
            predicted_S=float(ranking.Q[kept].sum()),
            predicted_T_s=None if price_ms is None else price_ms / 1000.0,
            explored=explored, fitted_prices=scored.fitted_prices, ngram_widened=widened,
            tree=tree, layout=lay, _scored=scored, _ranking=ranking,
        )

    def _width(self, ranking: Ranking, ctx: int
               ) -> tuple[int, ChosenBy, list[int], float | None, bool]:
        """(width, chosen_by, offered widths, price ms, whether the n-gram widened it)."""
        if self.arm.pinned is not None:
            return self.arm.pinned, ChosenBy.PINNED, [], None, False
        probe = self.cost.probe()
        if probe is not None and (not self.arm.paced or self._probe_pays(probe, ranking, ctx)):
            return probe, ChosenBy.PROBE, [], None, False
        offers = self.cost.offers(ctx)
        s_drafter, s_ngram = ranking.S_drafter.tolist(), ranking.S_ngram.tolist()
        fixed_ms = self.cost.fixed_cost(ctx)
        alone = None
        if s_ngram and s_ngram[-1] > 0.0:  # Corollary 4's evidence, scored before choose()
            alone, _ = self.chooser.best(offers, s_drafter, [0.0] * len(s_ngram), fixed_ms, ctx)
        # choose() scores last: its round is the one wins() and tokens() read afterwards
        width = self.chooser.choose(offers, s_drafter, s_ngram, fixed_ms, ctx)
        widened = alone is not None and self.chooser.best_width > alone
        return width, ChosenBy.CHOOSER, [w for w, _ in offers], dict(offers).get(width), widened

    def _price(self, width: int, ctx: int) -> float | None:
        try:
            return self.cost.price(width, ctx)
        except ValueError:  # nothing measured covers it yet
            return None

    @staticmethod
    def _chain(tree: CandidateTree, picks: int) -> np.ndarray:
        """The spine: picks from the first position on, ending after a stop token."""
        nodes = tree.pick_nodes[:picks]
        stops = np.flatnonzero(tree.stop[nodes])
        return nodes[: stops[0] + 1] if stops.size else nodes

    # ----- verify outcome ----------------------------------------------------------------
    def accept(self, plan: Plan, argmax) -> Outcome:
        """The greedy accept walk over the verified rows (Algorithm 1, line 14)."""
        am = np.asarray(argmax, dtype=np.int64).reshape(-1)
        if am.size != plan.rows:
            raise ValueError(f"argmax has {am.size} rows, the plan has {plan.rows}")
        if plan.layout is None:  # a plain round
            return Outcome(plan, [0], [], int(am[0]))
        t = self._start()
        acc = accept(plan.layout, am)
        self._lap("accept walk", t)
        return Outcome(plan, list(acc.rows), list(acc.tokens), int(acc.bonus), list(acc.nodes),
                       acc.labelled_parents, acc.parent_targets)

    # ----- learning ----------------------------------------------------------------------
    def learn(self, outcome: Outcome, times: RoundTimes, last_round: bool = False
              ) -> RoundRecord:
        """Algorithm 1, lines 15-18; returns the round's record (record.py).

        times: the round's measured D (drafter forward and plan), verify and commit. The first
        round of a request teaches the cost model, the rate and the gains nothing (it runs
        cold); the last round of a reply teaches no acceptance, gain or rate (the reply's end
        cuts it short)."""
        plan = outcome.plan
        ctx = plan.context_length
        first = self._round == 0
        self.width_rounds[plan.rows] = self.width_rounds.get(plan.rows, 0) + 1
        verify_ms, fixed_ms = 1000.0 * times.verify_s, 1000.0 * times.fixed_s
        round_ms = fixed_ms + verify_ms + 1000.0 * times.commit_s
        self._charge(plan, round_ms, len(outcome.tokens) + 1)
        record = RoundRecord(
            ctx=ctx, width=plan.width_chosen, rows=plan.rows, chosen_by=plan.chosen_by,
            accepted=len(outcome.tokens), D=times.fixed_s, verify=times.verify_s,
            commit=times.commit_s, width_offered=list(plan.width_offered),
            pred_S=None if plan.chosen_by is ChosenBy.PLAIN else plan.predicted_S,
            pred_T=plan.predicted_T_s, drafted=plan.drafted, gate_bucket=plan.gate_bucket,
            explored=plan.explored, fitted_prices=plan.fitted_prices,
            ngram_widened=plan.ngram_widened)
        if plan.tree is None:
            self._plain_run += 1
            if not first:
                self.plain_law.learn(ctx, verify_ms)
        else:
            self._plain_run = 0
            self._learn_tree_round(outcome, record, first, last_round, times)
        if plan.gate_bucket is not None and not first:
            if not plan.drafted:
                self.gate.learn_fixed(fixed_ms)
            if not last_round:
                self.gate.learn(plan.gate_bucket, plan.drafted, len(outcome.tokens) + 1,
                                self._gate_time(ctx, round_ms))
        if self.index is not None:
            t = self._start()
            self.index.extend(outcome.committed)
            self._lap("ngram extend", t)
        self._anchor = int(outcome.bonus)
        self._round += 1
        return record

    def _widest_measured(self) -> int:
        return max((k.top for k in self.cost.classes if k.measured), default=0)

    def _gate_time(self, ctx: int, round_ms: float) -> float:
        """The round's time as the gate's rates count it. Paced: in plain steps at the round's
        context, so rounds at a long context (every mode slower) and at a short one weigh
        alike; in ms, one mode run mostly at long contexts and the other at short ones would
        be compared by their contexts rather than by their speed."""
        plain_ms = self.plain_law.predict(ctx) if self.arm.paced else None
        return round_ms if plain_ms is None else round_ms / plain_ms

    def _charge(self, plan: Plan, round_ms: float, tokens: int) -> None:
        """The paced budget's books: every round's time, and what a probe round lost against
        plain steps making the same tokens (negative where the probe paid)."""
        self._decode_ms += round_ms
        if self.arm.paced and plan.chosen_by is ChosenBy.PROBE and self.plain_law.samples:
            self._probe_loss_ms += round_ms - tokens * self.plain_law.predict(plan.context_length)

    def _learn_tree_round(self, outcome: Outcome, record: RoundRecord, first: bool, last: bool,
                          times: RoundTimes) -> None:
        plan, tree, ranking = outcome.plan, outcome.plan.tree, outcome.plan._ranking
        ctx = plan.context_length
        verify_ms, fixed_ms = 1000.0 * times.verify_s, 1000.0 * times.fixed_s
        round_ms = fixed_ms + verify_ms + 1000.0 * times.commit_s
        nodes = np.asarray(outcome.nodes, dtype=np.int64)
        is_ngram = tree.kind[nodes] == NGRAM
        agreed = (~is_ngram) & (tree.agreed_bucket[nodes] >= 0)
        record.accepted_ngram = int(is_ngram.sum())
        record.agreed = int(agreed.sum())
        record.accepted_drafter = int(nodes.size - is_ngram.sum() - agreed.sum())
        placed = plan.layout.nodes[1:]
        placed_ngram = tree.kind[placed] == NGRAM
        placed_agreed = ~placed_ngram & (tree.agreed_bucket[placed] >= 0)
        record.rows_ngram = int(placed_ngram.sum())
        record.rows_agreed = int(placed_agreed.sum())
        record.rows_drafter = int(placed.size - record.rows_ngram - record.rows_agreed)
        t = self._start()
        # Line 15: the cost model, then a split where a width inside a class could win.
        # A reply's last round may end inside the tree: it says nothing of the drafter's reach.
        widest = self._widest_measured()
        self.cost.observe(plan.width_chosen, plan.rows, ctx, verify_ms, fixed_ms,
                          teach=not first, drafted=plan.drafted,
                          tree_rows=None if last else tree.n_nodes + 1)
        if self.arm.paced and self._widest_measured() != widest:
            # Paced, the gate runs while widths are still being measured: its rates compare
            # the two modes on the widths of their time, so a wider width starts them again.
            self.gate.restart()
        t = self._lap("learn cost", t)
        # Line 16: the band's rate and the gains, from what each prefix of the order accepted.
        position = np.empty(tree.n_nodes, dtype=np.int64)
        position[ranking.order] = np.arange(tree.n_nodes)
        hit = np.zeros(tree.n_nodes + 1)
        hit_ng = np.zeros(tree.n_nodes + 1)
        hit[position[nodes[~is_ngram]] + 1] = 1.0
        hit_ng[position[nodes[is_ngram]] + 1] = 1.0
        self.chooser.learn(
            plan.width_chosen, ctx, len(outcome.tokens), round_ms,
            plan.width_offered, np.cumsum(hit).tolist(), np.cumsum(hit_ng).tolist(),
            ranking.S_drafter.tolist(), ranking.S_ngram.tolist(), teach=not first and not last)
        t = self._lap("learn chooser", t)
        if plan.chosen_by is ChosenBy.CHOOSER and not first and not self.arm.classes:
            self.cost.maybe_split(self.chooser.incumbent, self.chooser.held_rounds, ctx,
                                  self.chooser.wins, frontier=self.arm.paced)
            t = self._lap("split", t)
        # Line 17: the guard, then every child of every accepted parent.
        if not last:
            loss = self.acceptance.learn(
                plan._scored, outcome.labelled_parents, outcome.parent_targets,
                placed_nodes=placed, fit=self.arm.fitted)
            record.labels = loss.nodes
            record.logloss_fitted = loss.fitted
            record.logloss_head = loss.head
            self._lap("learn acceptance", t)

    def snapshot(self, contexts=None) -> dict:
        """What the scheduler has learned now, as plain JSON-able values (snapshot.py)."""
        from adaspark.scheduler.snapshot import snapshot

        return snapshot(self, contexts)

    # ----- persistence -------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything learned that outlives a request, JSON-able (for store.Store.save)."""
        return {"version": STATE_VERSION, "cost": self.cost.state_dict(),
                "acceptance": self.acceptance.state_dict(),
                "chooser": self.chooser.state_dict(), "plain": self.plain_law.state_dict(),
                "gate": self.gate.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore from state_dict(); an empty mapping (an empty store) changes nothing."""
        if not state:
            return
        if state.get("version") != STATE_VERSION:
            raise UserError(f"scheduler state version {state.get('version')!r} is not "
                            f"{STATE_VERSION}")
        try:
            self.cost.load_state_dict(state["cost"])
            self.acceptance.load_state_dict(state["acceptance"])
            self.chooser.load_state_dict(state["chooser"])
            self.plain_law.load_state_dict(state["plain"])
            if "gate" in state:  # stores saved before the gate existed have none
                self.gate.load_state_dict(state["gate"])
        except KeyError as err:
            raise UserError(f"scheduler state is missing {err}") from None
