"""The candidate tree of one round (§2.2, §3.1): nodes, best-first order, S(n), layout, accept walk.

API (stable; numpy only):

    Block(picks[B] int, topk_ids[B,K] int, topk_logits[B,K] float, head[B] float)
        The drafter's output for one round. topk_ids[:, 0] == picks; topk_logits are the raw
        (Markov-biased) logits of those ids, best first; head is the confidence head in (0, 1).

    CandidateTree.from_block(block, anchor: int, stop_ids=()) -> CandidateTree
        Drafter nodes only: node i*K + k is topk_ids[i, k] (k == 0: the pick, else a sibling).
    CandidateTree.undrafted(anchor, stop_ids=()) -> CandidateTree
        No drafter nodes (a round that skips the drafter); chains() then adds the anchor's.
        ngram.NgramIndex.chains(tree) appends n-gram nodes and marks agreed/contradicted nodes.
        Flat arrays over all N nodes (the anchor is not a node; parent -1 means the anchor;
        every parent precedes its children; drafter nodes come first):
          token, parent, kind (PICK/SIBLING/NGRAM), depth (anchor 0), head_estimate (pick: head,
          sibling: share of the top-K mass, n-gram: source precision), bucket (n-gram nodes,
          else -1), logit_p (the n-gram proposal's source precision logit, where any), stop,
          agreed_bucket (drafter node also proposed by a chain: the proposal's bucket, else -1),
          contra_evidence (drafter node whose parent has a different n-gram proposal: its
          evidence 0..3, else -1).
        Arrays over the n_drafter = B*K drafter nodes only: position (block row), logit_head,
          logit_share (the position's logit sigma), log_r (sibling's share of the siblings'
          total, floored at -30; 0 for picks).
        .pick_nodes -> int64[B]   .has_ngram -> bool   .n_nodes -> int

    rank(tree, q) -> Ranking     q[N] = P(accepted | parent accepted), from acceptance.py
        .order[N]   best-first by Q, lower index first on ties; every prefix is a tree
        .Q[N]       product of q along the path; 0 for a stop token and everything below it
        .S_drafter[N+1], .S_ngram[N+1]   sums of Q over the first k nodes of the order, split by
                    source; S(n) for a width of n rows = S_drafter[n-1] + S_ngram[n-1]
        .n_useful   nodes with Q > 0;   .S(n) -> float

    layout(tree, kept, anchor_token=None) -> Layout
        kept: node indices closed under parents (a prefix of order, possibly with the
        exploration swap). Rows depth-first, children in the order they appear in `kept`
        (likeliest first). Layout.tokens[n] (row 0 = anchor), .parent_rows[n] (row 0: -1),
        .depths[n] (row 0: 0), .mask[n,n] bool (row i sees row j iff j is i or an ancestor),
        .nodes[n] (row -> node, row 0: -1), .n_rows

    accept(layout, argmax) -> Accepted      argmax[n]: the target's argmax at each row
        .rows (accepted rows, starting with row 0), .nodes, .tokens (accepted candidates),
        .bonus (argmax at the last accepted row), .committed (tokens + [bonus]),
        .labelled_parents (-1 then the accepted nodes), .parent_targets (argmax at each of them)

Bucket helpers shared with ngram.py, acceptance.py and round.py: bucket_of(kind, strong, run),
evidence_of(kind, strong), evidence_of_bucket(bucket), N_BUCKETS = 12, N_EVIDENCE = 4.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

PICK, SIBLING, NGRAM = 0, 1, 2
COPY, FOLLOWER = 0, 1  # n-gram source kinds
N_EVIDENCE = 4  # (kind copy/follower) x (evidence strong/weak)
N_BUCKETS = 12  # evidence x run (0, 1-2, 3+ n-gram tokens directly above)
LOG_R_FLOOR = -30.0
HEAD_CLIP = 1e-7
# Q is ranked on an integer log scale: integer sums are associative, so a child's key is never
# above its parent's whatever order the path product is accumulated in (floats can be, by an ulp).
_LOG_SCALE = float(2**40)
_LOG_ZERO = -(2**50)


def evidence_of(kind: int, strong: bool) -> int:
    """Evidence index 0..3: copy >= 16 tokens, copy 4-15, follower count >= 2, follower 1."""
    return kind * 2 + (0 if strong else 1)


def bucket_of(kind: int, strong: bool, run: int) -> int:
    """Bucket index 0..11 of an n-gram proposal with `run` n-gram tokens directly above it."""
    run_class = 0 if run <= 0 else (1 if run <= 2 else 2)
    return evidence_of(kind, strong) * 3 + run_class


def evidence_of_bucket(bucket: int) -> int:
    """The evidence index 0..3 of a bucket index 0..11 (bucket_of's inverse, run dropped)."""
    return bucket // (N_BUCKETS // N_EVIDENCE)


def logit(p):
    return np.log(p) - np.log1p(-p)


def _minus_ones(n: int) -> np.ndarray:
    """np.full(n, -1, dtype=np.int64), without its wrapper's cost."""
    out = np.empty(n, dtype=np.int64)
    out.fill(-1)
    return out


@functools.lru_cache(maxsize=32)
def _block_shape(B: int, K: int):
    """Shape arrays shared by every block of this size (read-only): position, kind, parent,
    depth. Node i*K + k is candidate k at position i; position i hangs from pick i-1."""
    position = np.repeat(np.arange(B, dtype=np.int64), K)
    kind = np.where(np.arange(B * K) % K == 0, PICK, SIBLING).astype(np.int8)
    parent = (position - 1) * K
    parent[position == 0] = -1
    depth = position + 1
    for arr in (position, kind, parent, depth):
        arr.setflags(write=False)
    return position, kind, parent, depth


@functools.lru_cache(maxsize=32)
def _stop_ids(stop_ids) -> tuple[np.ndarray, frozenset]:
    """The stop ids as a sorted read-only array and a set: the same few every round."""
    ids = np.asarray(sorted(set(int(t) for t in stop_ids)), dtype=np.int64)
    ids.setflags(write=False)
    return ids, frozenset(ids.tolist())


@dataclass
class Block:
    """One drafter block, the one form the drafter returns and the tree reads (numpy, target
    token ids): picks[B] int64, topk_ids[B,K] int64 (column 0 = picks), topk_logits[B,K] float32
    (the drafter's biased logits), head[B] float32 (calibrated P(pick k accepted | picks before
    it accepted))."""

    picks: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    head: np.ndarray


class CandidateTree:
    """Candidates of one round as flat arrays (see module docstring)."""

    # bool[N]: nodes a request's grammar forbids, and nodes it makes certain (the only legal
    # token at their place); None: no grammar, or no such node (constrain())
    forbidden: np.ndarray | None = None
    certain: np.ndarray | None = None

    def __init__(self, anchor: int, B: int, K: int, arrays: dict, stop_ids=()):
        self.anchor = int(anchor)
        self.B, self.K = B, K
        self.stop_ids, self.stop_set = _stop_ids(
            stop_ids if isinstance(stop_ids, (tuple, frozenset)) else tuple(stop_ids))
        for name, value in arrays.items():
            setattr(self, name, value)
        # n-gram nodes not yet folded in: parents, tokens, buckets, logit_ps, depths
        self._pending: tuple[list, ...] = ([], [], [], [], [])
        self._seal_stop()

    @classmethod
    def from_block(cls, block: Block, anchor: int, stop_ids=()) -> CandidateTree:
        ids = np.asarray(block.topk_ids, dtype=np.int64)
        logits = np.asarray(block.topk_logits, dtype=np.float64)
        picks = np.asarray(block.picks, dtype=np.int64).reshape(-1)
        head = np.asarray(block.head, dtype=np.float64).reshape(-1)
        if ids.ndim != 2 or ids.shape[1] < 1 or ids.shape[0] < 1:
            raise ValueError(f"drafter block topk_ids must be [B, K], got shape {ids.shape}")
        B, K = ids.shape
        if logits.shape != (B, K) or picks.shape != (B,) or head.shape != (B,):
            raise ValueError(
                f"drafter block shapes disagree: topk_ids {ids.shape}, topk_logits "
                f"{logits.shape}, picks {picks.shape}, head {head.shape}")
        if (ids[:, 0] != picks).any():
            raise ValueError("drafter block topk_ids[:, 0] must equal the picks")
        if not (np.isfinite(logits).all() and np.isfinite(head).all()):
            raise ValueError("drafter block logits and head must be finite")

        z = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        with np.errstate(divide="ignore"):
            log_sib = np.log(e[:, 1:].sum(axis=1))  # -inf when K == 1
        # logit sigma, log-sum-exp form (np.clip's value, without its wrapper's cost)
        logit_share = np.minimum(np.maximum(z[:, 0] - log_sib, -30.0), 30.0)
        log_r = np.maximum(z - log_sib[:, None], LOG_R_FLOOR)
        log_r[:, 0] = 0.0
        share = e / e.sum(axis=1, keepdims=True)
        h = np.minimum(np.maximum(head, HEAD_CLIP), 1.0 - HEAD_CLIP)
        share[:, 0] = h  # a pick's head-based estimate is its confidence head

        N = B * K
        position, kind, parent, depth = _block_shape(B, K)
        no_bucket = _minus_ones(N)
        arrays = {
            "token": ids.reshape(-1).copy(),
            "parent": parent,
            "kind": kind,
            "depth": depth,
            "position": position,
            "logit_head": np.repeat(logit(h), K),
            "logit_share": np.repeat(logit_share, K),
            "log_r": log_r.reshape(-1),
            "head_estimate": share.reshape(-1),
            "bucket": no_bucket,
            "agreed_bucket": no_bucket.copy(),
            "contra_evidence": no_bucket.copy(),
            "logit_p": np.zeros(N),
        }
        tree = cls(anchor, B, K, arrays, stop_ids)
        tree._n_drafter = N
        return tree

    @classmethod
    def undrafted(cls, anchor: int, stop_ids=()) -> CandidateTree:
        """No drafter nodes: a round planned from the n-gram chains alone (the draft gate)."""
        return cls.from_parents([], [], anchor=anchor, stop_ids=stop_ids)

    @classmethod
    def from_parents(cls, parents, tokens, kinds=None, anchor: int = 0,
                     stop_ids=()) -> CandidateTree:
        """A tree of any shape (tests, simulator): parents[i] < i or -1; kinds default PICK."""
        parent = np.asarray(parents, dtype=np.int64).reshape(-1)
        N = parent.size
        if np.any(parent >= np.arange(N)) or np.any(parent < -1):
            raise ValueError("every parent must precede its child (parents[i] in [-1, i))")
        depth = np.zeros(N, dtype=np.int64)
        for i, p in enumerate(parent.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        kind = (np.zeros(N, dtype=np.int8) if kinds is None
                else np.asarray(kinds, dtype=np.int8).reshape(-1))
        D = int(np.count_nonzero(kind != NGRAM))
        if np.any(kind[:D] == NGRAM):
            raise ValueError("drafter nodes must come before n-gram nodes")
        arrays = {
            "token": np.asarray(tokens, dtype=np.int64).reshape(-1), "parent": parent,
            "kind": kind, "depth": depth, "head_estimate": np.full(N, 0.5),
            "bucket": np.full(N, -1, dtype=np.int64), "logit_p": np.zeros(N),
            "agreed_bucket": np.full(N, -1, dtype=np.int64),
            "contra_evidence": np.full(N, -1, dtype=np.int64),
            "position": depth[:D] - 1, "logit_head": np.zeros(D), "logit_share": np.zeros(D),
            "log_r": np.zeros(D),
        }
        tree = cls(anchor, 0, 0, arrays, stop_ids)
        tree._n_drafter = D
        return tree

    # --- n-gram nodes (ngram.py builds them; see NgramIndex.chains) -------------------------

    @property
    def n_nodes(self) -> int:
        return self.token.size + len(self._pending[0])

    @property
    def n_drafter(self) -> int:
        return self._n_drafter

    @property
    def pick_nodes(self) -> np.ndarray:
        return np.arange(self.B, dtype=np.int64) * self.K

    @property
    def has_ngram(self) -> bool:
        return self.n_nodes > self._n_drafter

    def node_depth(self, node: int) -> int:
        if node < 0:
            return 0
        if node < self.token.size:
            return int(self.depth[node])
        return self._pending[4][node - self.token.size]

    def add_ngram(self, parent: int, token: int, bucket: int, logit_p: float) -> int:
        """Append one n-gram node below `parent`; returns its index. Call seal() when done."""
        return self.add_ngram_chain(parent, [token], [bucket], [logit_p])

    def add_ngram_chain(self, parent: int, tokens: list, buckets: list, logit_ps: list) -> int:
        """Append a chain below `parent` (each token the child of the one before); returns the
        index of its last node. Call seal() when done."""
        first = self.n_nodes
        depth = self.node_depth(parent) + 1
        m = len(tokens)
        par, tok, buck, lp, dep = self._pending
        par.append(parent)
        par.extend(range(first, first + m - 1))
        tok.extend(tokens)
        buck.extend(buckets)
        lp.extend(logit_ps)
        dep.extend(range(depth, depth + m))
        return first + m - 1

    def mark_agreed(self, node: int, bucket: int, logit_p: float) -> None:
        self.agreed_bucket[node] = bucket
        self.contra_evidence[node] = -1
        self.logit_p[node] = logit_p

    def mark_contradicted(self, nodes, evidence: int, logit_p: float) -> None:
        self.contra_evidence[nodes] = evidence
        self.logit_p[nodes] = logit_p

    def seal(self) -> None:
        """Fold the appended n-gram nodes into the flat arrays."""
        if not self._pending[0]:
            return
        m = len(self._pending[0])
        par, tok, buck, lp, dep = self._pending
        lp = np.array(lp, dtype=np.float64)
        n = self.token.size

        def cat(name, tail, dtype):
            # one allocation per array: the old nodes, then the tail (np.concatenate's values)
            old = getattr(self, name)
            out = np.empty(n + m, dtype=dtype)
            out[:n] = old
            out[n:] = tail
            setattr(self, name, out)

        cat("token", tok, np.int64)
        cat("parent", par, np.int64)
        cat("kind", NGRAM, np.int8)
        cat("depth", dep, np.int64)
        cat("head_estimate", 1.0 / (1.0 + np.exp(-lp)), np.float64)
        cat("bucket", buck, np.int64)
        cat("logit_p", lp, np.float64)
        cat("agreed_bucket", -1, np.int64)
        cat("contra_evidence", -1, np.int64)
        self._pending = ([], [], [], [], [])
        self._seal_stop()

    def constrain(self, illegal: np.ndarray, certain: np.ndarray) -> None:
        """Mark the nodes whose path the request's grammar forbids (scheduler/plan.py's
        TreeConstraint), ranked like a stop's subtree (Q = 0) so that they never take a row,
        and the nodes it makes certain, which the scheduler prices at q = 1. Neither teaches
        the acceptance model: their outcome is the grammar's, not the drafter's."""
        illegal = np.asarray(illegal, dtype=bool).reshape(-1)
        certain = np.asarray(certain, dtype=bool).reshape(-1)
        if illegal.shape != (self.n_nodes,) or certain.shape != (self.n_nodes,):
            raise ValueError(f"illegal has {illegal.size} nodes and certain {certain.size}, "
                             f"the tree {self.n_nodes}")
        self.forbidden = illegal if illegal.any() else None
        self.certain = certain if certain.any() else None

    def _seal_stop(self) -> None:
        # a handful of stop ids: one broadcast compare beats np.isin's sort at this size
        if self.stop_ids.size == 1:
            self.stop = self.token == self.stop_ids[0]
        else:
            self.stop = (self.token[:, None] == self.stop_ids[None, :]).any(axis=1)


@dataclass
class Ranking:
    order: np.ndarray
    Q: np.ndarray
    S_drafter: np.ndarray
    S_ngram: np.ndarray
    n_useful: int

    def S(self, n: int) -> float:
        """Expected accepted candidates of the best tree of n rows (anchor + n-1 nodes)."""
        k = min(max(n - 1, 0), self.order.size)
        return float(self.S_drafter[k] + self.S_ngram[k])


def path_log_keys(tree: CandidateTree, q: np.ndarray) -> np.ndarray:
    """Integer log of Q per node (scaled by 2**40); stop tokens and their subtrees get -inf-ish."""
    N = tree.n_nodes
    val = np.zeros(N + 1, dtype=np.int64)  # slot N stands for the anchor: log Q = 0
    if q.all():
        log_q = np.log(q)
    else:  # log 0 = -inf, floored below
        with np.errstate(divide="ignore"):
            log_q = np.log(q)
    val[:N] = np.maximum(log_q * _LOG_SCALE, _LOG_ZERO)
    if tree.stop.any():
        val[:N][tree.stop] = _LOG_ZERO
    if tree.forbidden is not None:
        val[:N][tree.forbidden] = _LOG_ZERO
    ptr = np.empty(N + 1, dtype=np.int64)
    ptr[N] = N
    ptr[:N] = tree.parent
    ptr[ptr < 0] = N
    # Pointer jumping: after k steps each node holds the sum over its 2**k nearest path nodes.
    span, depth_max = 1, int(tree.depth.max(initial=0))
    while span < depth_max:
        val += val[ptr]
        ptr = ptr[ptr]
        span *= 2
    return val[:N]


def rank(tree: CandidateTree, q) -> Ranking:
    """Best-first order by Q (Proposition 1) and S(n) for every n in one pass."""
    q = np.asarray(q, dtype=np.float64)
    if q.shape != (tree.n_nodes,):
        raise ValueError(f"q has shape {q.shape}, the tree has {tree.n_nodes} nodes")
    keys = path_log_keys(tree, q)
    order = np.argsort(-keys, kind="stable")
    Q = np.exp(keys / _LOG_SCALE)
    Q[keys <= _LOG_ZERO] = 0.0
    Qo = Q[order]
    S_all = np.zeros(q.size + 1)
    S_ngram = np.zeros(q.size + 1)
    Qo.cumsum(out=S_all[1:])
    if not tree.has_ngram:  # S_ngram stays 0 and S_all - 0 is S_all
        return Ranking(order, Q, S_all, S_ngram, int(np.count_nonzero(Q)))
    (Qo * (tree.kind[order] == NGRAM)).cumsum(out=S_ngram[1:])
    return Ranking(order, Q, S_all - S_ngram, S_ngram, int(np.count_nonzero(Q)))


@dataclass
class Layout:
    tokens: np.ndarray
    parent_rows: np.ndarray
    depths: np.ndarray
    mask: np.ndarray
    nodes: np.ndarray
    child_row: dict = field(repr=False, default_factory=dict)

    @property
    def n_rows(self) -> int:
        return int(self.tokens.size)


def layout(tree: CandidateTree, kept, anchor_token: int | None = None) -> Layout:
    """Lay the kept nodes out depth-first, row 0 the anchor (see module docstring)."""
    kept = np.asarray(kept, dtype=np.int64).reshape(-1)
    kept_list = kept.tolist()
    children: dict[int, list[int]] = {}
    for node, p in zip(kept_list, tree.parent[kept].tolist(), strict=True):
        children.setdefault(p, []).append(node)
    missing = children.keys() - set(kept_list) - {-1}
    if missing:
        raise ValueError(f"kept nodes are not a tree: parent {min(missing)} is missing")

    n = len(kept_list) + 1
    nodes = [-1]
    parent_rows = [-1]
    stack = [(c, 0) for c in reversed(children.get(-1, ()))]
    while stack:
        node, p_row = stack.pop()
        row = len(nodes)
        nodes.append(node)
        parent_rows.append(p_row)
        below = children.get(node)
        if below:
            stack.extend((c, row) for c in reversed(below))
    # Preorder rows: row j is an ancestor of row i iff j <= i < j + size of j's subtree.
    size = [1] * n
    for row in range(n - 1, 0, -1):
        size[parent_rows[row]] += size[row]
    rows = np.arange(n)
    end = rows + np.array(size)
    mask = (rows[None, :] <= rows[:, None]) & (rows[:, None] < end[None, :])

    nodes_arr = np.array(nodes, dtype=np.int64)
    tokens = np.empty(n, dtype=np.int64)
    tokens[0] = tree.anchor if anchor_token is None else int(anchor_token)
    tokens[1:] = tree.token[nodes_arr[1:]]
    depths = np.zeros(n, dtype=np.int64)
    depths[1:] = tree.depth[nodes_arr[1:]]
    keys = zip(parent_rows[1:], tokens[1:].tolist(), strict=True)
    child_row = dict(zip(keys, range(1, n), strict=True))
    return Layout(tokens, np.array(parent_rows, dtype=np.int64), depths, mask, nodes_arr,
                  child_row)


@dataclass
class Accepted:
    rows: list
    nodes: list
    tokens: list
    bonus: int
    labelled_parents: np.ndarray
    parent_targets: np.ndarray

    @property
    def committed(self) -> list:
        return self.tokens + [self.bonus]


def accept(lay: Layout, argmax) -> Accepted:
    """Greedy accept: walk from the root while a child's token equals its parent row's argmax."""
    am = np.asarray(argmax).reshape(-1)
    if am.size != lay.n_rows:
        raise ValueError(f"argmax has {am.size} rows, the layout has {lay.n_rows}")
    am_list = am.tolist()
    rows = [0]
    row = 0
    while True:
        child = lay.child_row.get((row, am_list[row]))
        if child is None:
            break
        rows.append(child)
        row = child
    nodes = [int(lay.nodes[r]) for r in rows[1:]]
    tokens = [am_list[r] for r in rows[:-1]]
    return Accepted(rows, nodes, tokens, int(am_list[row]),
                    np.array([-1] + nodes, dtype=np.int64),
                    np.array([am_list[r] for r in rows], dtype=np.int64))
