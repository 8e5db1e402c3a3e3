"""The round API the engine calls: one AdaSpark round of Algorithm 1 (§3.1), as plan then learn.

    sched = Scheduler(Arm.parse("adaspark"))
    sched.load_state_dict(store.load() or {})        # learned state outlives requests only here
    sched.begin_request(committed_tokens)            # prompt (+ any token prefill committed)
    while decoding:
        if sched.should_draft(context_length, stop_ids):   # False for `ar`, plain, gated
            plan = sched.plan(block, context_length, stop_ids)     # Algorithm 1, lines 3-12
        else:
            plan = sched.plan_undrafted(context_length, stop_ids)  # n-gram tree or 1 row
        argmax, verify_s = target.verify(plan.tokens, plan.depths, plan.mask)    # line 13
        outcome = sched.accept(plan, argmax)         # rows to commit, tokens, bonus (line 14)
        record = sched.learn(outcome, verify_s, fixed_s, commit_s, last_round)  # lines 15-18
    sched.end_request()                              # the cost model's refit
    store.save(sched.state_dict())

`Arm` selects the paper's arms with switches on one scheduler (see `Arm.parse`). Every decision
and everything learned lives here and in the modules it drives: tree.py (candidates, order,
layout, accept walk), ngram.py (the request's text), acceptance.py (q), cost.py (verify prices),
chooser.py (the width), gate.py (whether to draft at all, modifier `gate`). The engine owns
tensors and clocks and hands in numbers only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
MAX_WIDTH = 64
STATE_VERSION = 1


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

    BASES = ("ar", "chain3", "chain", "tree:N", "cost", "adaspark", "adaspark:N")
    MODIFIERS = ("head", "no-ngram", "ratio", "no-hysteresis", "plain", "gate")

    @classmethod
    def parse(cls, text: str) -> Arm:
        """`ar`, `chain3`, `chain`, `tree:N`, `cost`, `adaspark`, `adaspark:N`, optionally with
        comma-separated modifiers: head, no-ngram, ratio, no-hysteresis, plain, gate."""
        base, *mods = [part.strip() for part in str(text).split(",")]
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
                    "plain": {"plain_rounds": True}, "gate": {"gate": True}}
        for mod in mods:
            if mod not in switches:
                raise UserError(f"arm {text!r}: unknown modifier {mod!r}; "
                                f"modifiers: {', '.join(cls.MODIFIERS)}")
            arm = replace(arm, **switches[mod])
        return replace(arm, name=str(text).strip())


@dataclass
class Plan:
    """The rows to verify: row 0 is the anchor, rows depth-first, parents before children."""

    context_length: int
    tokens: np.ndarray  # int64[n]
    depths: np.ndarray  # int64[n]; position of row i = start + depths[i]
    parents: np.ndarray  # int64[n] parent row, -1 for row 0
    mask: np.ndarray  # bool[n, n]: row i sees row j iff j is i or an ancestor of i
    width_chosen: int  # the width asked for (may exceed rows when the tree runs out)
    chosen_by: str  # "chooser", "probe", "pinned", "chain", "plain" or "undrafted"
    width_offered: list[int] = field(default_factory=list)
    predicted_S: float = 0.0  # expected accepted candidates of the verified tree
    predicted_T_s: float | None = None  # the cost model's price of the width (seconds)
    explored: bool = False  # the last row is an exploration row (§3.3)
    fitted_prices: bool = False  # the fitted acceptance model priced the tree
    drafted: bool = True  # the drafter ran for this round (False: plain or undrafted)
    _tree: CandidateTree | None = field(default=None, repr=False)
    _scored: Scored | None = field(default=None, repr=False)
    _ranking: Ranking | None = field(default=None, repr=False)
    _layout: Layout | None = field(default=None, repr=False)

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


def _as_block(block) -> Block:
    if isinstance(block, Block):
        return block
    if isinstance(block, Mapping):
        try:
            return Block(block["picks"], block["topk_ids"], block["topk_logits"], block["head"])
        except KeyError as err:
            raise ValueError(f"drafter block is missing {err}") from None
    raise ValueError(f"a drafter block must be a tree.Block or a mapping, not {type(block)}")


class Scheduler:
    """One per engine: the cost model, acceptance model and chooser; an n-gram index per request.
    """

    def __init__(self, arm: Arm | str | None = None, time_parts: bool = False) -> None:
        self.arm = Arm.parse(arm) if isinstance(arm, str) else (arm or Arm())
        pinned = self.arm.pinned
        self.cost = CostModel()
        self.acceptance = AcceptanceModel()
        self.chooser = Chooser(pinned=pinned, ratio_rule=self.arm.ratio_rule,
                               hysteresis=self.arm.hysteresis)
        self.plain_law = QuantileLaw()  # the 1-row step, for plain rounds (width 1 is no class)
        self.index: NgramIndex | None = None
        self._anchor: int | None = None  # the last committed token; None between requests
        self.temperature = 0.0  # the request's sampling temperature (acceptance feature)
        self._round = 0  # rounds of this request
        self._plain_run = 0  # plain rounds in a row
        self.gate = DraftGate()
        self._bucket: int | None = None  # this round's gate bucket (None: the gate is off)
        self._undrafted: CandidateTree | None = None  # the n-gram tree the gate looked at
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
        self._bucket, self._undrafted = None, None

    def end_request(self) -> int:
        """The end-of-request refit of the cost laws; returns how many refits were adopted."""
        self.index, self._anchor = None, None
        return self.cost.end_request() + int(self.plain_law.dirty and self.plain_law.refit())

    def _need_request(self) -> None:
        if self._anchor is None:
            raise ValueError("call begin_request() before planning a round")

    # ----- planning ----------------------------------------------------------------------
    def should_draft(self, context_length: int, stop_ids: Sequence[int] = ()) -> bool:
        """Whether this round drafts at all; False means run `plan_undrafted()` instead.

        With plain rounds on, a round is plain when the band's long-run speculative rate is
        below a plain decode step's rate (V of Eq. 7 at width 1 beats every width when
        1 - rho * T(1) > 0); the 1-row step is first measured like any width (3 rounds).
        With the gate on, the n-gram index's own tree at the anchor sets the round's bucket and
        the gate picks the faster mode there (gate.py); a request's first round and the cost
        model's probes always draft (a probe measures a width only the drafter can fill)."""
        self._bucket, self._undrafted = None, None
        if not self.arm.draft:
            return False
        if self.arm.gate:
            if self._round == 0 or self.cost.probe() is not None:
                return True
            self._undrafted = self._ngram_tree(stop_ids)
            tree = self._undrafted
            # node 0 is the first proposal after the anchor (chains() starts there)
            self._bucket = evidence_of_bucket(int(tree.bucket[0])) if tree.n_nodes else NO_PROPOSAL
            return self.gate.choose(self._bucket)
        if not self.arm.plain_rounds or self._round == 0 or self.cost.probe() is not None:
            return True
        if self.plain_law.samples < MEASUREMENTS:
            return False
        band = self.chooser.rates.get(context_band(context_length))
        rate = None if band is None else band.rate
        if rate is None or self._plain_run >= PLAIN_RECHECK:
            return True
        return rate >= 1.0 / self.plain_law.predict(context_length)

    def plain(self, context_length: int) -> Plan:
        """The 1-row round: the anchor alone, its argmax is the one committed token."""
        self._need_request()
        tokens = np.array([self._anchor], dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        predicted = self.plain_law.predict(context_length)
        return Plan(int(context_length), tokens, zero, np.full(1, -1, dtype=np.int64),
                    np.ones((1, 1), dtype=bool), 1, "plain",
                    predicted_T_s=None if predicted is None else predicted / 1000.0,
                    drafted=False)

    def _ngram_tree(self, stop_ids: Sequence[int]) -> CandidateTree:
        tree = CandidateTree.undrafted(self._anchor, stop_ids)
        if self.index is not None:
            self.index.chains(tree)
        return tree

    def plan_undrafted(self, context_length: int, stop_ids: Sequence[int] = ()) -> Plan:
        """A round without the drafter: with the gate on, the n-gram index's tree at the anchor
        priced and cut like any tree, a plain step (once measured) among the offers (the
        undrafted round's own D, no hysteresis: it does not move the chooser's incumbent);
        else, or when the index proposes nothing, plain()."""
        self._need_request()
        ctx = int(context_length)
        if not self.arm.gate or not self.arm.draft:
            return self.plain(ctx)
        tree = self._undrafted if self._undrafted is not None else self._ngram_tree(stop_ids)
        self._undrafted = None
        offers = self.cost.offers(ctx)
        if tree.n_nodes == 0 or not offers:
            return self.plain(ctx)
        scored = self.acceptance.score(tree, ctx, head_only=not self.arm.fitted,
                                       temperature=self.temperature)
        ranking = rank(tree, scored.q)
        if ranking.n_useful == 0:
            return self.plain(ctx)
        plain_ms = self.plain_law.predict(ctx)  # a weak proposal may not be worth a row
        if plain_ms is not None:
            offers = [(1, plain_ms), *offers]
        width, price_ms = self.chooser.best(offers, ranking.S_drafter.tolist(),
                                            ranking.S_ngram.tolist(), self.gate.fixed_ms, ctx)
        if width == 1:
            return self.plain(ctx)
        kept = ranking.order[: min(width - 1, ranking.n_useful)]
        lay = layout(tree, kept, anchor_token=self._anchor)
        return Plan(
            context_length=ctx, tokens=lay.tokens, depths=lay.depths, parents=lay.parent_rows,
            mask=lay.mask, width_chosen=int(width), chosen_by="undrafted",
            width_offered=[w for w, _ in offers], predicted_S=float(ranking.Q[kept].sum()),
            predicted_T_s=price_ms / 1000.0, fitted_prices=scored.fitted_prices, drafted=False,
            _tree=tree, _scored=scored, _ranking=ranking, _layout=lay,
        )

    def plan(self, block, context_length: int, stop_ids: Sequence[int] = ()) -> Plan:
        """Algorithm 1, lines 3-12: candidates, q, best-first order, width, depth-first rows.

        block: the drafter's block after the anchor (a tree.Block, or a mapping with picks[B],
        topk_ids[B,K], topk_logits[B,K], head[B]); context_length: the committed tokens, the
        anchor included; stop_ids: tokens after which nothing is verified."""
        self._need_request()
        if not self.arm.draft:
            return self.plain(context_length)
        ctx = int(context_length)
        t = self._start()
        tree = CandidateTree.from_block(_as_block(block), self._anchor, stop_ids)
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
        if self.arm.chain is not None:
            kept = self._chain(tree, self.arm.chain)
            width, chosen_by = kept.size + 1, "chain"
        else:
            width, chosen_by, offered, price_ms = self._width(ranking, ctx)
            kept = ranking.order[: min(width - 1, ranking.n_useful)]
        t = self._lap("width", t)
        explored = False
        if self.index is not None and self.arm.chain is None and self.index.exploration_due(tree):
            swapped = exploration_swap(tree, kept, ranking.Q, self.acceptance.bucket_labels)
            explored = not np.array_equal(swapped, kept)
            kept = swapped
        lay = layout(tree, kept, anchor_token=self._anchor)
        if price_ms is None and chosen_by != "probe":
            price_ms = self._price(width, ctx)
        self._lap("layout", t)
        return Plan(
            context_length=ctx, tokens=lay.tokens, depths=lay.depths, parents=lay.parent_rows,
            mask=lay.mask, width_chosen=int(width), chosen_by=chosen_by, width_offered=offered,
            predicted_S=float(ranking.Q[kept].sum()),
            predicted_T_s=None if price_ms is None else price_ms / 1000.0,
            explored=explored, fitted_prices=scored.fitted_prices,
            _tree=tree, _scored=scored, _ranking=ranking, _layout=lay,
        )

    def _width(self, ranking: Ranking, ctx: int) -> tuple[int, str, list[int], float | None]:
        if self.arm.pinned is not None:
            return self.arm.pinned, "pinned", [], None
        probe = self.cost.probe()
        if probe is not None:
            return probe, "probe", [], None
        offers = self.cost.offers(ctx)
        width = self.chooser.choose(offers, ranking.S_drafter.tolist(), ranking.S_ngram.tolist(),
                                    self.cost.fixed_cost(ctx), ctx)
        return width, "chooser", [w for w, _ in offers], dict(offers).get(width)

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
        if plan._layout is None:  # a plain round
            return Outcome(plan, [0], [], int(am[0]))
        t = self._start()
        acc = accept(plan._layout, am)
        self._lap("accept walk", t)
        return Outcome(plan, list(acc.rows), list(acc.tokens), int(acc.bonus), list(acc.nodes),
                       acc.labelled_parents, acc.parent_targets)

    # ----- learning ----------------------------------------------------------------------
    def learn(self, outcome: Outcome, verify_s: float, fixed_s: float, commit_s: float,
              last_round: bool = False) -> dict:
        """Algorithm 1, lines 15-18; returns the round's log record.

        verify_s: the measured verify; fixed_s: the round's fixed cost D (drafter forward and
        tree build); commit_s: the cache commit. The first round of a request teaches the cost
        model nothing (it runs cold); the last round of a reply teaches no acceptance, gain or
        rate (the reply's end cuts it short)."""
        plan = outcome.plan
        ctx = plan.context_length
        first = self._round == 0
        self.width_rounds[plan.rows] = self.width_rounds.get(plan.rows, 0) + 1
        verify_ms, fixed_ms, commit_ms = 1000.0 * verify_s, 1000.0 * fixed_s, 1000.0 * commit_s
        record = {
            "context": ctx, "width_offered": plan.width_offered,
            "width_chosen": plan.width_chosen, "chosen_by": plan.chosen_by, "rows": plan.rows,
            "accepted": len(outcome.tokens), "accepted_drafter": 0, "accepted_ngram": 0,
            "accepted_agreed": 0, "fixed_s": fixed_s, "verify_s": verify_s,
            "commit_s": commit_s, "predicted_S": plan.predicted_S,
            "predicted_T_s": plan.predicted_T_s, "explored": plan.explored,
            "fitted_prices": plan.fitted_prices, "labels": 0,
            "logloss_fitted": 0.0, "logloss_head": 0.0,
        }
        if plan.chosen_by == "plain":
            self._plain_run += 1
            if not first:
                self.plain_law.learn(ctx, verify_ms)
        else:
            self._plain_run = 0
            self._learn_tree_round(outcome, record, first, last_round, verify_ms, fixed_ms,
                                   commit_ms)
        if self._bucket is not None and not first:
            if not plan.drafted:
                self.gate.learn_fixed(fixed_ms)
            if not last_round:
                self.gate.learn(self._bucket, plan.drafted, len(outcome.tokens) + 1,
                                fixed_ms + verify_ms + commit_ms)
        record["drafted"], record["gate_bucket"] = plan.drafted, self._bucket
        if self.index is not None:
            t = self._start()
            self.index.extend(outcome.committed)
            self._lap("ngram extend", t)
        self._anchor = int(outcome.bonus)
        self._round += 1
        return record

    def _learn_tree_round(self, outcome: Outcome, record: dict, first: bool, last: bool,
                          verify_ms: float, fixed_ms: float, commit_ms: float) -> None:
        plan, tree, ranking = outcome.plan, outcome.plan._tree, outcome.plan._ranking
        ctx = plan.context_length
        nodes = np.asarray(outcome.nodes, dtype=np.int64)
        is_ngram = tree.kind[nodes] == NGRAM
        agreed = (~is_ngram) & (tree.agreed_bucket[nodes] >= 0)
        record["accepted_ngram"] = int(is_ngram.sum())
        record["accepted_agreed"] = int(agreed.sum())
        record["accepted_drafter"] = int(nodes.size - is_ngram.sum() - agreed.sum())
        t = self._start()
        # Line 15: the cost model, then a split where a width inside a class could win.
        self.cost.observe(plan.width_chosen, plan.rows, ctx, verify_ms, fixed_ms,
                          teach=not first, drafted=plan.drafted)
        t = self._lap("learn cost", t)
        # Line 16: the band's rate and the gains, from what each prefix of the order accepted.
        position = np.empty(tree.n_nodes, dtype=np.int64)
        position[ranking.order] = np.arange(tree.n_nodes)
        hit = np.zeros(tree.n_nodes + 1)
        hit_ng = np.zeros(tree.n_nodes + 1)
        hit[position[nodes[~is_ngram]] + 1] = 1.0
        hit_ng[position[nodes[is_ngram]] + 1] = 1.0
        self.chooser.learn(
            plan.width_chosen, ctx, len(outcome.tokens), fixed_ms + verify_ms + commit_ms,
            plan.width_offered, np.cumsum(hit).tolist(), np.cumsum(hit_ng).tolist(),
            ranking.S_drafter.tolist(), ranking.S_ngram.tolist(), teach=not first and not last)
        t = self._lap("learn chooser", t)
        if plan.chosen_by == "chooser" and not first:
            self.cost.maybe_split(self.chooser.incumbent, self.chooser.held_rounds, ctx,
                                  self.chooser.wins)
            t = self._lap("split", t)
        # Line 17: the guard, then every child of every accepted parent.
        if not last:
            loss = self.acceptance.learn(
                plan._scored, outcome.labelled_parents, outcome.parent_targets,
                placed_nodes=plan._layout.nodes[1:], fit=self.arm.fitted)
            record["labels"] = loss.nodes
            record["logloss_fitted"] = loss.fitted
            record["logloss_head"] = loss.head
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
