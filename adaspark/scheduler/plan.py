"""What one round carries between the Scheduler and the engine: its Plan (the rows to verify),
its Outcome (what the verify committed) and a request's RequestState between its rounds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from adaspark.scheduler.acceptance import Scored
from adaspark.scheduler.ngram import NgramIndex
from adaspark.scheduler.record import ChosenBy
from adaspark.scheduler.tree import Block, CandidateTree, Layout, Ranking


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

    def walk(self, pick: Callable[[int, list[int]], tuple[int, Any]]
             ) -> tuple[np.ndarray, dict[int, Any]]:
        """The picks along the path the accept walk takes, as plain decoding makes them:
        pick(row, path) gives row's token (path: its ancestors' picks) and what the caller
        keeps for that row; the walk goes on to the child holding that token. The walk reads
        no other row, so those stay -1 and cost nothing. (picks [rows], kept by row)"""
        child = {(int(parent), int(token)): row for row, (parent, token)
                 in enumerate(zip(self.parents, self.tokens, strict=True)) if row}
        picks = np.full(self.rows, -1, dtype=np.int64)
        kept: dict[int, Any] = {}
        path: list[int] = []
        row: int | None = 0
        while row is not None:
            token, kept[row] = pick(row, path)
            picks[row] = token
            path = [*path, token]
            row = child.get((row, token))
        return picks, kept


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


class TreeConstraint(Protocol):
    """What a request's output must obey (grammar.GrammarState, standing after its anchor):
    the candidates it forbids take no rows; the tokens it forces are candidates priced certain
    (tree.CandidateTree.constrain)."""

    def survey(self, tokens: np.ndarray, parents: np.ndarray) -> Any:
        """Of the nodes tokens[i] below parents[i] (-1 the anchor): .illegal bool[n] (the
        nodes whose path it forbids), .certain bool[n] (legal nodes that are the only legal
        token at their place) and .forced, [(parent node, tokens)]: chains it forces below
        legal nodes none of whose candidates is legal, each token the only legal one."""


@dataclass
class RequestState:
    """What one request's rounds carry from round to round (Scheduler.begin_request makes it);
    everything else the scheduler holds is learned across requests and shared by all of them."""

    index: NgramIndex | None  # the request's own text (None: the arm has no n-gram index)
    anchor: int | None  # the last committed token, the next round's row 0; None once ended
    temperature: float = 0.0  # its sampling temperature (a feature of the acceptance model)
    rounds: int = 0  # rounds of this request
    plain_run: int = 0  # plain rounds in a row
    decode_ms: float = 0.0  # its round time so far (the paced arm's budget)
    probe_loss_ms: float = 0.0  # its probe rounds' time beyond plain steps' for their tokens
    # the acceptance model's per-request parts: (b_req, head_offset, request_stats)
    acceptance: tuple = ()
    # the chooser's scores from this request's last plan, which learn()'s split test reads
    # (another request may have planned in between)
    chooser_round: dict | None = field(default=None, repr=False)
    # its structured output's grammar (None: free text): forbidden candidates are priced at 0
    constraint: TreeConstraint | None = field(default=None, repr=False)
