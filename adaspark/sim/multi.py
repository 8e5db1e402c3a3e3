"""Many requests on one cost curve: each step verifies every running request's rows in one call.

    adaspark sim --curve cpu-avx2 --streams 1,2,4,8 [--policies ar,fixed:4,solo,shared]
        [--seconds 20] [--seed 0] [--json]

N request streams run side by side for a span of simulated time; each stream decodes its own
requests one after another (a finished request's stream starts its next one, so N stay running)
in its own world: stream i's drafter has acceptance level LEVELS[i % 4] (the world's ease_mean:
0.3 is the simulator's default drafter, -0.6 coldstart's "weak" one). Each stream has its own
acceptance model (scheduler/acceptance.py) that prices its tree's nodes (Q) and learns from its
verifies, as one request's scheduler would; trees are the drafter's alone (no n-gram index).

A step's time is the curve's verify of every request's rows in one call (CostCurve.step_s: the
weights' part at the total rows, each request's attention at its own rows and context), plus
the drafter's fixed cost D once when the step drafted (a drafter batched like the target), plus
each request's commit. The curve is the machine: no interference noise here.

Policies, the rows each request gets in a step:
    ar        one row each: plain decoding, no drafter
    fixed:W   a tree of W rows each (fewer where the tree has fewer useful nodes), rows summed
    solo      each request's own Eq. (7) width as if it ran alone: its tree priced by the
              curve's single-request verify at its context, against its own long-run rate
              (tokens over the time its rounds would take alone), rows summed
    shared    the shared row budget (scheduler/budget.allocate): plain rows first, then every
              request's nodes in one best-first order by Q, priced at the step's total rows
              against one long-run rate, the step's tokens over its time
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from adaspark.errors import UserError
from adaspark.scheduler.acceptance import AcceptanceModel
from adaspark.scheduler.budget import allocate
from adaspark.scheduler.chooser import BandRate
from adaspark.scheduler.tree import CandidateTree, accept, layout, rank
from adaspark.sim.curves import MAX_ROWS, CostCurve
from adaspark.sim.process import EOS, World, WorldParams, target_argmax

LEVELS = (0.3, -0.6, 1.0, -0.15)  # drafter ease_mean of stream i % 4
DEFAULT_STREAMS = (1, 2, 4, 8)
DEFAULT_POLICIES = ("ar", "fixed:4", "fixed:8", "solo", "shared")
DEFAULT_SECONDS = 20.0


@dataclass(frozen=True)
class Policy:
    name: str
    width: int | None = None  # fixed:W

    @classmethod
    def parse(cls, text: str) -> Policy:
        if text in ("ar", "solo", "shared"):
            return cls(text, 1 if text == "ar" else None)
        kind, _, width = text.partition(":")
        if kind == "fixed" and width.isdigit() and 1 <= int(width) <= MAX_ROWS:
            return cls(text, int(width))
        raise UserError(f"unknown policy {text!r}: ar, fixed:W (W in 1..{MAX_ROWS}), solo, "
                        "shared")

    @property
    def drafts(self) -> bool:
        return self.width != 1


@dataclass
class _Draft:
    tree: CandidateTree
    scored: object
    order: np.ndarray  # the useful nodes, best first
    q: np.ndarray  # their Q


class Stream:
    """One stream of requests in its own world, with its own acceptance model."""

    def __init__(self, index: int, seed: int, params: WorldParams) -> None:
        self.index = index
        self.level = params.ease_mean
        self.world = World(seed * 64 + index, params)
        self.model = AcceptanceModel()
        self.solo_rate = BandRate()
        self.tokens = 0
        self.rows = 0
        self.drafted_nodes = 0
        self.requests = 0
        self._start(0)

    def _start(self, request: int) -> None:
        self.request = self.world.request(request)
        self.context = self.request.prompt_length
        self.end = self.request.prompt_length + self.request.reply_length
        self.model.begin_request()

    def draft(self) -> _Draft:
        req = self.request
        block = self.world.block(req, self.context - 1)
        tree = CandidateTree.from_block(block, int(req.stream[self.context - 1]), (EOS,))
        scored = self.model.score(tree, self.context)
        ranking = rank(tree, scored.q)
        order = ranking.order[: ranking.n_useful]
        return _Draft(tree, scored, order, ranking.Q[order])

    def decode(self, draft: _Draft | None, nodes: int) -> int:
        """Verify this stream's rows (its next row and `nodes` of its best-first order), commit
        the accepted path; returns the tokens emitted. A finished request starts the next."""
        req, anchor = self.request, self.context - 1
        if draft is None or nodes == 0:
            committed = [int(req.stream[self.context])]
            acc = lay = None
        else:
            lay = layout(draft.tree, draft.order[:nodes])
            acc = accept(lay, target_argmax(req, anchor, lay.tokens, lay.depths, lay.mask))
            committed = acc.committed
        if EOS in committed:
            committed = committed[: committed.index(EOS) + 1]
        done = self.context + len(committed) >= self.end
        if draft is not None and not done:  # a reply's last round teaches nothing (round.py)
            placed = lay.nodes[1:] if lay is not None else np.zeros(0, dtype=np.int64)
            parents = acc.labelled_parents if acc is not None else np.array([-1])
            targets = acc.parent_targets if acc is not None else np.array([committed[0]])
            self.model.learn(draft.scored, parents, targets, placed_nodes=placed)
        self.tokens += len(committed)
        self.rows += 1 + nodes
        self.drafted_nodes += nodes
        self.context += len(committed)
        if done:
            self.requests += 1
            self._start(self.request.index + 1)
        return len(committed)


def shared_price(curve: CostCurve, contexts: Sequence[int]) -> Callable[[int], float]:
    """The shared rule's price (ms) of a step of R rows: the curve's weights' part at R, the
    attention as if the rows were spread evenly over the requests (the rule sees total rows)."""
    slope = curve.slope_ms_per_token
    total_context = float(sum(contexts))
    n = len(contexts)

    def price(rows: int) -> float:
        per_request = np.interp(rows / n, np.arange(slope.size), slope)
        return curve.base_step_ms(rows) + per_request * total_context

    return price


def _plain_rate(curve: CostCurve, contexts: Sequence[int]) -> float:
    """Tokens per ms of a plain step: the yardstick while the long-run rate is not yet warm."""
    n = len(contexts)
    return n / (1000.0 * curve.step_s([1] * n, contexts) + n * curve.commit_ms)


def _solo_nodes(curve: CostCurve, stream: Stream, draft: _Draft) -> int:
    context = stream.context
    rate = stream.solo_rate.rate or _plain_rate(curve, [context])
    (nodes,) = allocate([draft.q], lambda rows: 1000.0 * curve.verify_s(rows, context), rate,
                        cap=MAX_ROWS)
    return nodes


def _nodes(policy: Policy, curve: CostCurve, streams: list[Stream], drafts: list[_Draft],
           shared: BandRate) -> list[int]:
    if policy.width is not None:
        return [min(policy.width - 1, d.q.size) for d in drafts]
    if policy.name == "solo":
        return [_solo_nodes(curve, s, d) for s, d in zip(streams, drafts, strict=True)]
    contexts = [s.context for s in streams]
    rate = shared.rate or _plain_rate(curve, contexts)
    return allocate([d.q for d in drafts], shared_price(curve, contexts), rate)


@dataclass
class MultiResult:
    curve: str
    streams: int
    policy: str
    seconds: float = 0.0
    steps: int = 0
    tokens: int = 0
    rows: int = 0  # summed over steps
    drafted_steps: int = 0  # steps where at least one request verified a node
    per_stream: list[dict] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "curve": self.curve, "streams": self.streams, "policy": self.policy,
            "tokens_per_s": self.rate, "seconds": self.seconds, "steps": self.steps,
            "rows_per_step": self.rows / self.steps,
            "nodes_per_request_step": (self.rows / self.steps - self.streams) / self.streams,
            "drafted_step_share": self.drafted_steps / self.steps,
            "per_stream": self.per_stream,
        }


def run_streams(curve: CostCurve, streams: int, policy: Policy | str, seconds: float = 20.0,
                seed: int = 0, params: WorldParams | None = None) -> MultiResult:
    """Decode `streams` request streams for `seconds` of simulated time under one policy."""
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    base = params or WorldParams()
    group = [Stream(i, seed, replace(base, ease_mean=LEVELS[i % len(LEVELS)]))
             for i in range(streams)]
    shared = BandRate()
    out = MultiResult(curve.name, streams, policy.name)
    while out.seconds < seconds:
        drafts = [s.draft() for s in group] if policy.drafts else None
        nodes = _nodes(policy, curve, group, drafts, shared) if drafts else [0] * streams
        contexts = [s.context for s in group]
        step_s = (curve.step_s([1 + k for k in nodes], contexts) + streams * curve.commit_s
                  + (curve.fixed_s if drafts else 0.0))
        tokens = 0
        for i, s in enumerate(group):
            emitted = s.decode(drafts[i] if drafts else None, nodes[i])
            tokens += emitted
            if policy.name == "solo":  # its rate as if its round ran alone
                alone_ms = 1000.0 * (curve.fixed_s + curve.verify_s(1 + nodes[i], contexts[i])
                                     + curve.commit_s)
                s.solo_rate.observe(emitted, alone_ms)
        shared.observe(tokens, 1000.0 * step_s)
        out.seconds += step_s
        out.steps += 1
        out.tokens += tokens
        out.rows += streams + sum(nodes)
        out.drafted_steps += any(nodes)
    out.per_stream = [{"level": float(s.level), "tokens_per_s": float(s.tokens / out.seconds),
                       "rows_per_step": s.rows / out.steps, "requests_done": s.requests}
                      for s in group]
    return out


def multi_sweep(curve: CostCurve, streams: Sequence[int] = DEFAULT_STREAMS,
                policies: Sequence[str] = DEFAULT_POLICIES, seconds: float = DEFAULT_SECONDS,
                seed: int = 0) -> list[dict]:
    """Every policy at every stream count on one curve; the `adaspark sim --streams` rows."""
    parsed = [Policy.parse(p) for p in policies]
    return [run_streams(curve, n, p, seconds, seed).as_dict() for n in streams for p in parsed]


def format_table(rows: list[dict]) -> str:
    """Aggregate tok/s per stream count and policy (and its rows per request per step), then
    each stream's tok/s and rows per step under every policy."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    counts = sorted({r["streams"] for r in rows})
    at = {(r["streams"], r["policy"]): r for r in rows}
    lines = [f"curve {rows[0]['curve']}: aggregate tok/s (rows per request per step)",
             "   N " + "".join(f"{p:>18s}" for p in policies)]
    for n in counts:
        cells = "".join(f"{at[n, p]['tokens_per_s']:10.1f} ({at[n, p]['rows_per_step'] / n:4.1f})"
                        for p in policies)
        lines.append(f"{n:4d} {cells}")
    levels = ", ".join(f"{level:+.2f}" for level in LEVELS)
    lines.append(f"per stream i: tok/s/rows per step; its drafter's level LEVELS[i % 4], "
                 f"LEVELS = ({levels})")
    for n in counts:
        for p in policies:
            parts = " ".join(f"{s['tokens_per_s']:5.1f}/{s['rows_per_step']:.1f}"
                             for s in at[n, p]["per_stream"])
            lines.append(f"{n:4d} {p:8s} {parts}")
    return "\n".join(lines)
