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
it decides to draft (not for `ar` or `ngram`, a plain round, or a gated n-gram round), so this
module never touches the drafter. Everything a round decided travels in its Plan (the gate's bucket
included), so learn() needs no state left behind by planning.

`Arm` (arm.py) selects the paper's arms with switches on one scheduler; a round's Plan and
Outcome and a request's RequestState are plan.py's. Every decision and everything learned
lives here and in the modules it drives: tree.py (candidates, order, layout, accept walk),
ngram.py (the request's text), acceptance.py (q), cost.py (verify prices), chooser.py (the
width), gate.py (whether to draft at all, modifier `gate`). The engine owns tensors and clocks
and hands in numbers only.

Two places where this follows Algorithm 1 rather than a looser reading of §3 (docs/round.md):
a request's first round teaches the acceptance model (only line 15, the cost model, skips it:
the first round runs cold, but its labels are true), and an exploration round (line 12) teaches
the gains like any round.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from copy import copy
from dataclasses import replace
from time import perf_counter

import numpy as np

from adaspark.errors import UserError
from adaspark.scheduler.acceptance import AcceptanceModel, Scored
from adaspark.scheduler.arm import Arm
from adaspark.scheduler.bands import context_band
from adaspark.scheduler.budget import StepPrice, draft_pays
from adaspark.scheduler.chooser import Chooser
from adaspark.scheduler.cost import MEASUREMENTS, CostModel, QuantileLaw
from adaspark.scheduler.gate import NO_PROPOSAL, DraftGate
from adaspark.scheduler.ngram import NgramIndex, exploration_swap
from adaspark.scheduler.plan import Draft, Outcome, Plan, RequestState
from adaspark.scheduler.record import ChosenBy, RoundRecord, RoundTimes
from adaspark.scheduler.tree import (
    NGRAM,
    Block,
    CandidateTree,
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
STATE_VERSION = 1
# Modifier `classes` (Table 9): the width table is the 8-bit matrix kernel's row classes, every 8
# rows up to 64, fixed (no splits) instead of the ladder the cost model refines (§3.2).
KERNEL_CLASSES = (8, 16, 24, 32, 40, 48, 56, 64)
# The n-gram bucket and precision logit of a token a request's grammar forces (_constrain):
# the strongest evidence (a long copy) and a near-certain source; its q is 1 whatever they say.
FORCED_BUCKET = 0
FORCED_LOGIT_P = 30.0


# a plain round's depths, parents and mask: the same every round, shared (nothing writes into
# a plan's arrays; not read-only, since torch warns on a read-only array, as sequence.ONE_ROW)
_PLAIN_ROW = (np.zeros(1, dtype=np.int64), np.full(1, -1, dtype=np.int64),
              np.ones((1, 1), dtype=bool))


def _useful_curve(ranking: Ranking) -> np.ndarray:
    """S(k) of a ranked tree's first k candidates best-first, up to its useful ones (index 0:
    no candidate), as budget.StepPrice.value reads a tree."""
    return (ranking.S_drafter + ranking.S_ngram)[: ranking.n_useful + 1]


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
        # the request a plan or learn is for: begin_request's, or the one handed to them
        self.request: RequestState | None = None
        # paced, the gate counts round time in plain steps (_gate_time)
        self.gate = DraftGate(unit="step" if self.arm.paced else "ms")
        # host seconds per part of the round, summed (benchmarks/scheduler_overhead.py)
        self.part_times: dict[str, float] | None = {} if time_parts else None
        # rounds by rows verified since this process started (not stored): the width share
        self.width_rounds: dict[int, int] = {}
        # rounds learned from, over every process that saved into its store (stored; two
        # writers' counts add: scheduler/merge.py)
        self.rounds_learned = 0
        self._last_ranked: tuple | None = None  # (tree, (scored, ranking)): _ranked's last
        self._empty_tree: tuple | None = None  # (stop ids, tree): _undrafted_tree's

    def _lap(self, part: str, since: float) -> float:
        if self.part_times is None:
            return since
        now = perf_counter()
        self.part_times[part] = self.part_times.get(part, 0.0) + now - since
        return now

    def _start(self) -> float:
        return 0.0 if self.part_times is None else perf_counter()

    # ----- request -----------------------------------------------------------------------
    def begin_request(self, committed_tokens: Sequence[int], temperature: float = 0.0
                      ) -> RequestState:
        """A new request whose committed text so far is `committed_tokens` (its last token is
        the first round's anchor); temperature: its sampling temperature (0: greedy), a feature
        of the acceptance model. Returns its state, which becomes the current request: hand it
        to plan_round/learn/end_request to run several requests on this one scheduler."""
        tokens = np.asarray(committed_tokens, dtype=np.int64).reshape(-1)
        if tokens.size == 0:
            raise ValueError("a request needs at least one committed token (the anchor)")
        acc = self.acceptance
        # fresh per-request parts of the acceptance model, so another request's stay as they are
        acc.b_req, acc.head_offset = copy(acc.b_req), copy(acc.head_offset)
        acc.begin_request()
        self.request = RequestState(
            index=NgramIndex(tokens) if self.arm.ngram else None, anchor=int(tokens[-1]),
            temperature=float(temperature),
            acceptance=(acc.b_req, acc.head_offset, acc.request_stats))
        return self.request

    def end_request(self, request: RequestState | None = None, refit: bool = True) -> int:
        """The request ends; then the end-of-request refit of the cost laws (refit=False: the
        caller runs `refit()` later, e.g. once a batch's other requests are done); returns how
        many refits were adopted."""
        request = self.request if request is None else request
        if request is not None:
            request.index, request.anchor = None, None
        if request is self.request:
            self.request = None
        return self.refit() if refit else 0

    def refit(self) -> int:
        """The cost laws' refit over their sample banks; how many refits were adopted."""
        return self.cost.end_request() + int(self.plain_law.dirty and self.plain_law.refit())

    def _use(self, request: RequestState | None) -> RequestState:
        """Make `request` (None: the current one) the request this call plans or learns for."""
        if request is not None and request is not self.request:
            self.request = request
            acc = self.acceptance
            acc.b_req, acc.head_offset, acc.request_stats = request.acceptance
        if self.request is None or self.request.anchor is None:
            raise ValueError("call begin_request() before planning a round")
        return self.request

    @property
    def index(self) -> NgramIndex | None:
        """The current request's n-gram index (None: no request, or the arm has none)."""
        return None if self.request is None else self.request.index

    @property
    def temperature(self) -> float:
        return 0.0 if self.request is None else self.request.temperature

    # ----- planning ----------------------------------------------------------------------
    def plan_round(self, context_length: int, draft: Draft, stop_ids: Sequence[int] = (),
                   room: int | None = None, request: RequestState | None = None,
                   step: StepPrice | None = None) -> Plan:
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
        width or an affordable probe can verify it (see _width). Arm `ngram` never drafts
        (draft is never called): see _ngram_round.

        step: the batch's step beside other requests (None: alone, as above). From its second
        round on, a round that would draft drafts only where the tree a draft is expected to
        make pays at the step's marginal price and rate, its draft's time counted
        (_draft_pays_in); otherwise it offers the n-gram tree at the anchor, or one row where
        no prefix of that tree pays at the step's price either."""
        req = self._use(request)
        ctx = int(context_length)
        bucket = None
        if not self.arm.draft:
            plan = self._plain(ctx)
        elif self.arm.ngram_only:
            plan = self._ngram_round(ctx, stop_ids)
        elif self.arm.paced and req.rounds > 0 and self.plain_law.samples < MEASUREMENTS:
            plan = self._plain(ctx)  # paced: first the step every width has to beat
        elif self.arm.gate and req.rounds > 0 and (self.arm.paced or self.cost.probe() is None):
            tree = self._ngram_tree(stop_ids)
            # node 0 is the first proposal after the anchor (chains() starts there)
            bucket = evidence_of_bucket(int(tree.bucket[0])) if tree.n_nodes else NO_PROPOSAL
            drafts = (self.gate.choose(bucket)
                      and (not self.arm.paced or self._can_verify_a_draft(ctx, step))
                      and self._draft_pays_in(step, bucket, tree, ctx))
            plan = (self._drafted(draft(), ctx, stop_ids, step) if drafts
                    else self._undrafted(tree, ctx, step))
        elif self._plain_pays(ctx):
            plan = self._plain(ctx)
        elif step is not None and req.rounds > 0 and not self._draft_pays_in(
                step, None, tree := self._ngram_tree(stop_ids), ctx):
            plan = self._undrafted(tree, ctx, step)
        else:
            plan = self._drafted(draft(), ctx, stop_ids, step)
        if plan.drafted and plan._ranking is not None:  # the tree a draft makes, per bucket
            ranking = plan._ranking
            self.gate.learn_tree(bucket, ranking.Q[ranking.order[: ranking.n_useful]])
        if room is not None and plan.rows > room:  # the context cannot hold it: one row fits
            plan = self._plain(ctx)
        plan.gate_bucket = bucket
        req.chooser_round = self.chooser._round
        return plan

    # ----- under load: the shared row budget (budget.py) ----------------------------------
    @staticmethod
    def candidates(plan: Plan) -> np.ndarray | None:
        """The Q of the plan's candidates in its best-first order, which budget.allocate may
        cut to any prefix (a prefix is a tree); None when its rows are not such a prefix (an
        exploration swap, a chain)."""
        if plan.layout is None:
            return np.zeros(0)
        kept = plan._ranking.order[: plan.rows - 1]
        if not np.array_equal(np.sort(kept), np.sort(plan.layout.nodes[1:])):
            return None
        return plan._ranking.Q[kept]

    def cut(self, plan: Plan, keep: int, request: RequestState | None = None) -> Plan:
        """`plan` with its first `keep` candidates only (the shared row budget's allocation);
        0 is the plain row. Its width becomes its rows, as the chooser learns a round."""
        if plan.layout is None or keep >= plan.rows - 1:
            return plan
        self._use(request)
        if keep <= 0:
            cut = self._plain(plan.context_length)
        else:
            ranking = plan._ranking
            kept = ranking.order[:keep]
            lay = layout(plan.tree, kept, anchor_token=self.request.anchor)
            cut = replace(plan, tokens=lay.tokens, depths=lay.depths, parents=lay.parent_rows,
                          mask=lay.mask, width_chosen=keep + 1, layout=lay,
                          predicted_S=float(ranking.Q[kept].sum()), predicted_T_s=None)
        cut.gate_bucket = plan.gate_bucket
        return cut

    def step_price(self, rows: int, context: float) -> float:
        """The price (ms) of one verify call of `rows` rows at `context`: the plain step for
        one row, else the cheapest measured class that holds them; past the measured classes
        the least they may cost (cost.optimistic_price, the paced probes' test), so a step
        that could pay there verifies those rows and a call of a class's top rows measures it
        (learn_shared_verify); inf where nothing is measured to extrapolate from."""
        plain_ms = self.plain_law.predict(context)
        if rows == 1:
            return math.inf if plain_ms is None else plain_ms
        try:
            return self.cost.price(rows, context)
        except ValueError:  # nothing measured holds that many rows
            price = self.cost.optimistic_price(rows, context, plain_ms)
            return math.inf if price is None else price

    def step_prices(self, rows: int, most: int, context: float) -> np.ndarray:
        """The price (ms) of one shared verify call by its total rows 0..most at `context`, for
        a step of `rows` plain rows (budget.StepPrice.table; one cost-model read a step): the
        step's own rows at step_price's price (they run whatever they cost); a larger total at
        the cheapest measured class that holds it, else only at an unmeasured class's top, at
        its optimistic price (a call of exactly those rows measures it: learn_shared_verify);
        inf between, where a call would teach nothing and its price is only a guess."""
        prices = np.full(most + 1, np.inf)
        offers = self.cost.offers(context)  # ascending tops, non-decreasing prices
        if offers:
            tops = np.array([w for w, _ in offers])
            at = np.searchsorted(tops, np.arange(most + 1))  # the first offer holding t rows
            held = at < tops.size
            prices[held] = np.array([p for _, p in offers])[at[held]]
        plain_ms = self.plain_law.predict(context)
        for k in self.cost.classes:
            if k.top <= most and not k.measured and not math.isfinite(prices[k.top]):
                price = self.cost.optimistic_price(k.top, context, plain_ms)
                prices[k.top] = math.inf if price is None else price
        if most >= 1:  # one row is the plain step, no class
            prices[1] = math.inf if plain_ms is None else plain_ms
        if 0 <= rows <= most:
            prices[rows] = self.step_price(rows, context)
        return prices

    def _draft_pays_in(self, step: StepPrice | None, bucket: int | None, tree: CandidateTree,
                       ctx: int) -> bool:
        """Beside others (`step`): the bucket's expected drafted tree (gate.drafted_curve; a
        bucket without one yet: the trees of rounds drafted outside any bucket, the first
        rounds') at the step's marginal price, less the draft's own time (the drafted D over
        the undrafted one; as the batch measured it beside others where it has: StepPrice's
        draft_ms) at the step's rate, beats this anchor's n-gram tree, which costs no
        draft (budget.draft_pays): the shared budget prices both so after the plans. Alone, or
        while no drafted tree is known at all (a draft teaches it): True."""
        curve = None if step is None else self.gate.drafted_curve(bucket)
        if curve is None and step is not None:
            curve = self.gate.drafted_curve(None)
        if curve is None:
            return True
        undrafted = _useful_curve(self._ranked(tree, ctx)[1]) if tree.n_nodes else np.zeros(1)
        draft_ms = step.draft_ms
        if draft_ms is None:
            draft_ms = (self.cost.fixed_cost(ctx) or 0.0) - (self.gate.fixed_ms or 0.0)
        return draft_pays(curve, undrafted, draft_ms, step)

    def _can_verify_a_draft(self, ctx: int, step: StepPrice | None = None) -> bool:
        """Paced: a width is measured, or (alone: beside others a probe measures nothing,
        _width) the budget still allows the narrowest probe."""
        return bool(self.cost.offers(ctx)) or (step is None and self._probe_budget_left())

    def _probe_budget_left(self) -> bool:
        return self.request.probe_loss_ms <= PROBE_BUDGET * self.request.decode_ms

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
        if not self.arm.plain_rounds or self.request.rounds == 0 or self.cost.probe() is not None:
            return False
        if self.plain_law.samples < MEASUREMENTS:
            return True  # the 1-row step is first measured like any width (3 rounds)
        band = self.chooser.rates.get(context_band(ctx))
        rate = None if band is None else band.rate
        if rate is None or self.request.plain_run >= PLAIN_RECHECK:
            return False
        return rate < 1.0 / self.plain_law.predict(ctx)

    def _plain(self, ctx: int) -> Plan:
        """The 1-row round: the anchor alone, its argmax is the one committed token."""
        tokens = np.array([self.request.anchor], dtype=np.int64)
        predicted = self.plain_law.predict(ctx)
        return Plan(ctx, tokens, *_PLAIN_ROW, 1, ChosenBy.PLAIN,
                    predicted_T_s=None if predicted is None else predicted / 1000.0,
                    drafted=False)

    def _ngram_tree(self, stop_ids: Sequence[int]) -> CandidateTree:
        tree = self._undrafted_tree(stop_ids)
        index = self.index
        # most rounds the index proposes nothing at the anchor: chains would add nothing
        if index is not None and index.proposes():
            index.chains(tree)
        self._constrain(tree)
        return tree

    def _constrain(self, tree: CandidateTree) -> None:
        """The request's grammar (if any): the candidates it forbids take no rows; the tokens
        it forces (each the only legal one) are appended where the candidates end, as n-gram
        nodes of the strongest evidence, and they and the candidates it makes certain are
        priced at q = 1 (_certain; tree.constrain)."""
        constraint = self.request.constraint
        if constraint is None:
            return
        survey = constraint.survey(tree.token, tree.parent)
        n = tree.n_nodes
        for parent, chain in survey.forced:
            tree.add_ngram_chain(parent, chain, [FORCED_BUCKET] * len(chain),
                                 [FORCED_LOGIT_P] * len(chain))
        tree.seal()
        extra = tree.n_nodes - n
        tree.constrain(np.append(survey.illegal, np.zeros(extra, dtype=bool)),
                       np.append(survey.certain, np.ones(extra, dtype=bool)))

    @staticmethod
    def _certain(scored: Scored) -> Scored:
        """A candidate the grammar makes certain is accepted whenever its parent is: q = 1."""
        certain = scored.tree.certain
        if certain is not None:
            scored.q = np.where(certain, 1.0, scored.q)
        return scored

    def _undrafted_tree(self, stop_ids: Sequence[int]) -> CandidateTree:
        """CandidateTree.undrafted at the anchor, as a copy of an empty tree made once per
        stop ids (most rounds under load build one: building it anew costs more than the rest
        of a plain round's plan). Its arrays are empty, so nothing can write into them, and
        seal() replaces them; the copy gets its own pending lists."""
        key = tuple(stop_ids)
        if self._empty_tree is None or self._empty_tree[0] != key:
            self._empty_tree = (key, CandidateTree.undrafted(0, key))
        tree = object.__new__(CandidateTree)
        tree.__dict__.update(self._empty_tree[1].__dict__)
        tree.anchor = int(self.request.anchor)
        tree._pending = ([], [], [], [], [])
        return tree

    def _ngram_round(self, ctx: int, stop_ids: Sequence[int]) -> Plan:
        """Arm `ngram`: the n-gram index's tree at the anchor, priced by the acceptance model
        and sized by the chooser (Eq. 7) among the measured widths and a plain step; one row
        until that step is measured, when the index proposes nothing worth a row, or when the
        step pays more. A width is measured (a probe) only in a round whose tree fills it and
        could pay there at its optimistic price, within the request's PROBE_BUDGET: the same
        paced cold start as the default arm, without the drafter that fills its probes."""
        if self.plain_law.samples < MEASUREMENTS:
            return self._plain(ctx)  # first the step every width has to beat
        tree = self._ngram_tree(stop_ids)
        if tree.n_nodes == 0:
            return self._plain(ctx)
        scored, ranking = self._ranked(tree, ctx)
        if ranking.n_useful == 0:
            return self._plain(ctx)
        plain_ms = self.plain_law.predict(ctx)
        offers = [(1, plain_ms), *self._covering(self.cost.offers(ctx), ranking.n_useful + 1)]
        probe = self._ngram_probe(ranking, offers, ctx, plain_ms)
        s_drafter, s_ngram = ranking.S_drafter.tolist(), ranking.S_ngram.tolist()
        price_ms = None
        if probe is not None:
            width, chosen_by = probe, ChosenBy.PROBE
        else:  # choose() returns ngram:N's pinned width (the simulator's sweep) as it is
            width = self.chooser.choose(offers, s_drafter, s_ngram, self.gate.fixed_ms, ctx)
            chosen_by = ChosenBy.CHOOSER if self.arm.pinned is None else ChosenBy.PINNED
            price_ms = dict(offers).get(width) or self._price(width, ctx)
        if width == 1:
            return self._plain(ctx)
        return self._undrafted_plan(tree, scored, ranking, width, ctx, chosen_by,
                                    [w for w, _ in offers] if probe is None else [], price_ms)

    def _ranked(self, tree: CandidateTree, ctx: int):
        """Lines 5-6 on a tree: its q by the acceptance model, then its best-first order (the
        same tree's once: the draft decision beside others scores the n-gram tree that the
        undrafted round then plans with)."""
        last = self._last_ranked
        if last is not None and last[0] is tree:
            return last[1]
        scored = self._certain(self.acceptance.score(tree, ctx, head_only=not self.arm.fitted,
                                                     temperature=self.temperature))
        self._last_ranked = (tree, (scored, rank(tree, scored.q)))
        return self._last_ranked[1]

    def _undrafted_plan(self, tree: CandidateTree, scored, ranking: Ranking, width: int,
                        ctx: int, chosen_by, offered: list[int], price_ms: float | None) -> Plan:
        """The rows of a tree no drafter made (an n-gram tree) cut to `width`."""
        kept = ranking.order[: min(width - 1, ranking.n_useful)]
        lay = layout(tree, kept, anchor_token=self.request.anchor)
        return Plan(
            context_length=ctx, tokens=lay.tokens, depths=lay.depths, parents=lay.parent_rows,
            mask=lay.mask, width_chosen=int(width), chosen_by=chosen_by,
            width_offered=offered, predicted_S=float(ranking.Q[kept].sum()),
            predicted_T_s=None if price_ms is None else price_ms / 1000.0,
            fitted_prices=scored.fitted_prices, drafted=False,
            tree=tree, layout=lay, _scored=scored, _ranking=ranking,
        )

    @staticmethod
    def _covering(offers: list[tuple[int, float]], rows: int) -> list[tuple[int, float]]:
        """The offers up to the narrowest that holds `rows`: a wider one verifies the same
        tree (an n-gram chain is often shorter than the widths) at a higher price."""
        kept = []
        for width, price in offers:
            kept.append((width, price))
            if width >= rows:
                break
        return kept

    def _ngram_probe(self, ranking: Ranking, offers: list[tuple[int, float]], ctx: int,
                     plain_ms: float) -> int | None:
        """Arm `ngram`: the width to measure this round, or None. The narrowest unmeasured
        class the tree fills (an n-gram tree narrower than the width would not measure it),
        not in a request's first round (it runs cold and teaches no cost), while the budget
        lasts and only where the chooser's score puts it first at its optimistic price: the
        least it may cost (cost.py), at least a plain step where nothing below is measured."""
        if (self.arm.pinned is not None or self.request.rounds == 0
                or not self._probe_budget_left()):
            return None
        rows = ranking.n_useful + 1
        probe = next((k.top for k in self.cost.classes if not k.measured and k.top <= rows),
                     None)
        if probe is None:
            return None
        price = self.cost.optimistic_price(probe, ctx, plain_ms)
        trial = sorted([*((w, p) for w, p in offers if w != probe),
                        (probe, plain_ms if price is None else max(price, plain_ms))])
        width, _ = self.chooser.best(trial, ranking.S_drafter.tolist(), ranking.S_ngram.tolist(),
                                     self.gate.fixed_ms, ctx)
        return probe if width == probe else None

    def _undrafted(self, tree: CandidateTree, ctx: int, step: StepPrice | None = None) -> Plan:
        """A gated round without the drafter: the n-gram index's tree at the anchor priced and
        cut like any tree, a plain step (once measured) among the offers (the undrafted round's
        own D, no hysteresis: it does not move the chooser's incumbent); one row when the
        index proposes nothing worth a row, or beside others (`step`) when no prefix of the
        tree pays at the step's marginal price (the row budget would cut it to its plain row)."""
        if tree.n_nodes == 0:  # most rounds: nothing to price
            return self._plain(ctx)
        offers = self.cost.offers(ctx)
        if not offers:
            return self._plain(ctx)
        scored, ranking = self._ranked(tree, ctx)
        if ranking.n_useful == 0 or (
                step is not None and step.value(_useful_curve(ranking)) <= 0.0):
            return self._plain(ctx)
        plain_ms = self.plain_law.predict(ctx)  # a weak proposal may not be worth a row
        if plain_ms is not None:
            offers = [(1, plain_ms), *offers]
        width, price_ms = self.chooser.best(offers, ranking.S_drafter.tolist(),
                                            ranking.S_ngram.tolist(), self.gate.fixed_ms, ctx)
        if width == 1:
            return self._plain(ctx)
        return self._undrafted_plan(tree, scored, ranking, width, ctx, ChosenBy.UNDRAFTED,
                                    [w for w, _ in offers], price_ms)

    def _drafted(self, block: Block, ctx: int, stop_ids: Sequence[int],
                 step: StepPrice | None = None) -> Plan:
        """Lines 3-12 on the drafter's block: candidates, q, best-first order, width, rows.
        step: the batch's step beside others (None: alone), where no width is probed (_width)."""
        t = self._start()
        tree = CandidateTree.from_block(block, self.request.anchor, stop_ids)
        t = self._lap("candidates", t)
        if self.index is not None:
            self.index.chains(tree)
            t = self._lap("ngram chains", t)
        self._constrain(tree)
        scored = self._certain(self.acceptance.score(tree, ctx, head_only=not self.arm.fitted,
                                                     temperature=self.temperature))
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
            width, chosen_by, offered, price_ms, widened = self._width(ranking, ctx,
                                                                       step is not None)
            kept = ranking.order[: min(width - 1, ranking.n_useful)]
        t = self._lap("width", t)
        explored = False
        if self.index is not None and self.arm.chain is None and self.index.exploration_due(tree):
            swapped = exploration_swap(tree, kept, ranking.Q, self.acceptance.bucket_labels)
            explored = not np.array_equal(swapped, kept)
            kept = swapped
        lay = layout(tree, kept, anchor_token=self.request.anchor)
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

    def _width(self, ranking: Ranking, ctx: int, beside: bool = False
               ) -> tuple[int, ChosenBy, list[int], float | None, bool]:
        """(width, chosen_by, offered widths, price ms, whether the n-gram widened it).
        beside: the round shares its verify call with other requests' rows, whose time is not
        this width's price (learn_shared_verify teaches a class only from a call of exactly
        its top rows), so a probe would measure nothing: it picks among the measured widths
        (a probe only where none is measured: the paper's ladder has nothing else to offer)."""
        if self.arm.pinned is not None:
            return self.arm.pinned, ChosenBy.PINNED, [], None, False
        probe = self.cost.probe()
        offers = self.cost.offers(ctx)
        if probe is not None and not (beside and offers) and (
                not self.arm.paced or self._probe_pays(probe, ranking, ctx)):
            return probe, ChosenBy.PROBE, [], None, False
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
        """The spine: picks from the first position on, ending after a stop token or before
        the first pick the request's grammar forbids."""
        nodes = tree.pick_nodes[:picks]
        if tree.forbidden is not None and tree.forbidden[nodes].any():
            nodes = nodes[: int(np.argmax(tree.forbidden[nodes]))]
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
    def learn(self, outcome: Outcome, times: RoundTimes, last_round: bool = False,
              request: RequestState | None = None, cost: bool = True) -> RoundRecord:
        """Algorithm 1, lines 15-18; returns the round's record (record.py).

        times: the round's measured D (drafter forward and plan), verify and commit. The first
        round of a request teaches the cost model, the rate and the gains nothing (it runs
        cold); the last round of a reply teaches no acceptance, gain or rate (the reply's end
        cuts it short). request: whose round (None: the current one); cost=False: the verify
        was shared with other requests' rows, so its time is not this plan's width's price
        (the caller teaches it at the call's total rows: learn_shared_verify), nor the gate's
        rate of a request alone (beside others the step's rate decides: _draft_pays_in)."""
        req = self._use(request)
        self.chooser._round = req.chooser_round  # the split test scores this request's round
        plan = outcome.plan
        ctx = plan.context_length
        first = req.rounds == 0
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
            self.request.plain_run += 1
            if not first and cost:
                self.plain_law.learn(ctx, verify_ms)
            if self.arm.ngram_only:  # most of its rounds: the long-run rate Eq. 7 prices with
                self.chooser.learn(1, ctx, 0, round_ms, [], [0.0], [0.0], [0.0], [0.0],
                                   teach=not first and not last_round)
        else:
            self.request.plain_run = 0
            self._learn_tree_round(outcome, record, first, last_round, times, cost)
            if self.arm.ngram_only and not first:
                self.gate.learn_fixed(fixed_ms)  # D of a round planned without a drafter
        if plan.gate_bucket is not None and not first:
            if not plan.drafted:
                self.gate.learn_fixed(fixed_ms)
            if not last_round and cost:  # beside others, the step's rate decides (budget.py)
                self.gate.learn(plan.gate_bucket, plan.drafted, len(outcome.tokens) + 1,
                                self._gate_time(ctx, round_ms))
        if self.index is not None:
            t = self._start()
            self.index.extend([*outcome.tokens, outcome.bonus])  # outcome.committed's tokens
            self._lap("ngram extend", t)
        self.request.anchor = int(outcome.bonus)
        self.request.rounds += 1
        self.rounds_learned += 1
        return record

    def learn_shared_verify(self, rows: int, context: float, verify_ms: float,
                            teach: bool = True) -> None:
        """One verify call over several requests' rows (continuous batching): its time is the
        price of its total rows, at the rows' mean context (docs/batching.md). One row is the
        plain step; otherwise it teaches the class whose top is `rows` (a class is priced at
        its top), and no other: the chooser's widths stay a single request's."""
        if not teach:
            return
        if rows == 1:
            self.plain_law.learn(context, verify_ms)
        else:
            widest = self._widest_measured() if self.arm.paced else 0
            self.cost.observe(rows, rows, context, verify_ms, 0.0, drafted=False)
            if self.arm.paced and self._widest_measured() != widest:
                self.gate.restart()

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
        self.request.decode_ms += round_ms
        if self.arm.paced and plan.chosen_by is ChosenBy.PROBE and self.plain_law.samples:
            plain_ms = self.plain_law.predict(plan.context_length)
            self.request.probe_loss_ms += round_ms - tokens * plain_ms

    def _learn_tree_round(self, outcome: Outcome, record: RoundRecord, first: bool, last: bool,
                          times: RoundTimes, cost: bool = True) -> None:
        plan, tree, ranking = outcome.plan, outcome.plan.tree, outcome.plan._ranking
        ctx = plan.context_length
        verify_ms, fixed_ms = 1000.0 * times.verify_s, 1000.0 * times.fixed_s
        round_ms = fixed_ms + verify_ms + 1000.0 * times.commit_s
        # each node's source: 0 the drafter, 1 the n-gram index, 2 a drafter node it agreed with
        source = np.where(tree.kind == NGRAM, 1, np.where(tree.agreed_bucket >= 0, 2, 0))
        nodes = np.asarray(outcome.nodes, dtype=np.int64)
        is_ngram = source[nodes] == 1
        record.accepted_drafter, record.accepted_ngram, record.agreed = np.bincount(
            source[nodes], minlength=3).tolist()
        placed = plan.layout.nodes[1:]
        record.rows_drafter, record.rows_ngram, record.rows_agreed = np.bincount(
            source[placed], minlength=3).tolist()
        t = self._start()
        # Line 15: the cost model, then a split where a width inside a class could win.
        # A reply's last round may end inside the tree: it says nothing of the drafter's reach.
        widest = self._widest_measured() if self.arm.paced else 0  # only paced reads it
        self.cost.observe(plan.width_chosen, plan.rows, ctx, verify_ms, fixed_ms,
                          teach=not first and cost, drafted=plan.drafted,
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
                "gate": self.gate.state_dict(), "rounds": self.rounds_learned}

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
            rounds = int(state.get("rounds", 0))  # stores saved before the count have none
        except KeyError as err:
            raise UserError(f"scheduler state is missing {err}") from None
        except (TypeError, ValueError) as err:
            raise UserError(f"scheduler state has a malformed round count: {err}") from None
        self.rounds_learned = rounds
