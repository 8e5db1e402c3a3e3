"""Acceptance model (§3.3, Eq. 6), the head-based estimate it competes with, and the guard.

API (stable; numpy only):

    model = AcceptanceModel(gate=3.0)      gate: the 3-sigma test before leaving the prior
    model.begin_request()                  resets the request intercept, the head offset and the
                                           per-request log-loss stats (coefficients persist)
    scored = model.score(tree, context_len, head_only=False, temperature=0.0) -> Scored
        scored.q[N]        the q that prices this round (fitted while the guard prefers it and
                           head_only is False, else head-based); feed to tree.rank(tree, q)
        scored.q_fit[N], scored.q_head[N], scored.fitted_prices: bool
    label_nodes(tree, labelled_parents, parent_targets) -> Labels(nodes, parent_rank, y, n_parents)
    model.learn(scored, labelled_parents, parent_targets, placed_nodes=(), fit=True) -> RoundLoss
        labelled_parents/parent_targets: from tree.accept(...) (every accepted parent, -1 = anchor,
        and the target's argmax at its row); every child of those parents is labelled, placed or
        not. placed_nodes: the nodes verified this round (Layout.nodes[1:]); the head offset
        learns only from them. fit=False (head-based arms) learns only the head offset + guard.
        RoundLoss(nodes, fitted, head): summed per-node log losses, scored before learning.
    model.request_stats -> {"nodes", "fitted_loss", "head_loss", "rounds", "fitted_rounds"}
    model.bucket_labels -> int64[12]      labelled n-gram nodes per bucket (for exploration)
    model.coefficients -> float64[59]     read-only; see COEF_NAMES
    model.calibration -> float64[3, 10]   since this process started (not stored): per bin of
                                          the q that priced a labelled node (tenths), its
                                          count, the sum of that q and the sum of its labels
    model.state_dict() -> dict (JSON-able, exact) / model.load_state_dict(state)

Scores (all + b_req, the per-request intercept):
    pick     a0 + a1 logit h + a2 logit sigma + d_pick (depth-1) + c_pick ctx
    sibling  a3 + a4 log r + a5 logit h + a6 logit sigma + d_sib (depth-1) + c_sib ctx
    n-gram   logit p + w_bucket + c_ngram ctx                         (ctx = context_len / 8192)
    each kind also + t_kind T, T the request's sampling temperature (0 when greedy, where these
    terms vanish and never learn): under sampling a pick is right less often than its head says
    agreed drafter node:       + max(0, logit p) + w_agreed[bucket, pick/sibling]
    contradicted drafter node: - max(0, logit p) + w_contra[evidence, pick/sibling]
q_j = exp(s_j) / (1 + sum over every candidate i of j's parent of exp(s_i)) (none scores 0).
Prior: a0 = ln 2, a1 = 1, a4 = 1, the rest 0. With it a pick's q is exactly its head h, the
siblings share (1-h)/2 in proportion to r, and none gets (1-h)/2.

Learning, once per round from all its labels: FTRL-Proximal on the deviation from the prior
(rate 0.05 for the drafter/depth/context terms, 0.5 for bucket/agreed/contradicted weights,
beta 1, L2 0.01, squared-gradient cap 400) behind the gate |z| <= 3 sqrt(max(sum g^2, sum of
the model's expected g^2)); the request intercept by AdaGrad (0.15, cap 16, +-2). The head-based
estimate's per-request logit offset learns by AdaGrad (0.15, +-2) from the placed rows. The
guard scores both on each round's labels (per-node log loss) before either learns, with a decay
half-life of 256 labelled parents; the fitted model prices only while its loss is lower.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from adaspark.errors import UserError
from adaspark.scheduler.bands import CONTEXT_UNIT
from adaspark.scheduler.ftrl import AdaGradScalar, FTRLProximal
from adaspark.scheduler.tree import (
    HEAD_CLIP,
    N_BUCKETS,
    N_EVIDENCE,
    NGRAM,
    CandidateTree,
    logit,
)

N_DRAFTER = 12  # a0..a6, two depth terms, three context terms
BUCKET0 = N_DRAFTER
AGREED0 = BUCKET0 + N_BUCKETS
CONTRA0 = AGREED0 + 2 * N_BUCKETS
TEMP0 = CONTRA0 + 2 * N_EVIDENCE  # temperature: pick, sibling, n-gram
N_COEF_V1 = TEMP0  # stores written before the temperature terms
N_COEF = TEMP0 + 3
COEF_NAMES = (
    ["a0", "a1", "a2", "a3", "a4", "a5", "a6", "depth_pick", "depth_sibling",
     "ctx_pick", "ctx_sibling", "ctx_ngram"]
    + [f"bucket{b}" for b in range(N_BUCKETS)]
    + [f"agreed{b}_{w}" for b in range(N_BUCKETS) for w in ("pick", "sibling")]
    + [f"contra{e}_{w}" for e in range(N_EVIDENCE) for w in ("pick", "sibling")]
    + ["temp_pick", "temp_sibling", "temp_ngram"]
)

DRAFTER_RATE, BUCKET_RATE, BETA, L2, GATE, G2_CAP = 0.05, 0.5, 1.0, 0.01, 3.0, 400.0
REQ_RATE, REQ_BAND, REQ_G2_CAP = 0.15, 2.0, 16.0
HEAD_RATE, HEAD_BAND = 0.15, 2.0
GUARD_DECAY = 0.5 ** (1.0 / 256.0)  # per labelled parent
CALIBRATION_BINS = 10
SCORE_CLIP = 60.0
LOSS_CLIP = 1e-7


def prior_coefficients() -> np.ndarray:
    prior = np.zeros(N_COEF)
    prior[0] = math.log(2.0)  # pick: ln 2 + logit h
    prior[1] = 1.0
    prior[4] = 1.0  # sibling: log r
    return prior


def parent_softmax(parent: np.ndarray, s: np.ndarray) -> np.ndarray:
    """q_j = exp(s_j) / (1 + sum of exp(s_i) over j's parent's candidates)."""
    e = np.exp(np.minimum(np.maximum(s, -SCORE_CLIP), SCORE_CLIP))  # np.clip, without its wrapper
    slot = parent + 1
    denom = 1.0 + np.bincount(slot, weights=e, minlength=s.size + 1)
    return e / denom[slot]


def multinomial_log_loss(parent: np.ndarray, s: np.ndarray, labels: Labels) -> float:
    """Sum over labelled parents of -log P(outcome): the loss the fitted model descends."""
    q = parent_softmax(parent, s)
    none = 1.0 - np.bincount(parent + 1, weights=q, minlength=s.size + 1)
    hits = labels.nodes[labels.y]
    has_hit = np.zeros(s.size + 1, dtype=bool)
    has_hit[parent[hits] + 1] = True
    slots = np.unique(parent[labels.nodes]) + 1
    return float(-np.log(q[hits]).sum() - np.log(none[slots[~has_hit[slots]]]).sum())


@dataclass
class Labels:
    """Children of the labelled parents: node indices, the rank of each one's parent among the
    labelled parents (path order), and whether it was the target's argmax."""

    nodes: np.ndarray
    parent_rank: np.ndarray
    y: np.ndarray
    n_parents: int


def label_nodes(tree: CandidateTree, labelled_parents, parent_targets) -> Labels:
    """Every child of every labelled parent, placed or not, with its outcome."""
    parents = np.asarray(labelled_parents, dtype=np.int64).reshape(-1)
    targets = np.asarray(parent_targets, dtype=np.int64).reshape(-1)
    if parents.shape != targets.shape:
        raise UserError("labelled_parents and parent_targets must have the same length")
    slot = np.empty(tree.n_nodes + 1, dtype=np.int64)
    slot.fill(-1)
    slot[parents + 1] = np.arange(parents.size)
    rank_of = slot[tree.parent + 1]
    for ruled in (tree.forbidden, tree.certain):  # the grammar's outcome, not the drafter's
        if ruled is not None:
            rank_of[ruled] = -1
    nodes = (rank_of >= 0).nonzero()[0]
    rank = rank_of[nodes]
    return Labels(nodes, rank, tree.token[nodes] == targets[rank], int(parents.size))


@dataclass
class Scored:
    tree: CandidateTree
    X: np.ndarray
    offset: np.ndarray
    b_req: float
    q_fit: np.ndarray
    q_head: np.ndarray
    q: np.ndarray
    fitted_prices: bool

    def fitted_scores(self, weights, b_req: float) -> np.ndarray:
        """s = X @ weights + offset + b_req for this round's candidates."""
        return self.X @ np.asarray(weights, dtype=np.float64) + self.offset + b_req


@dataclass
class RoundLoss:
    nodes: int
    fitted: float
    head: float


@functools.lru_cache(maxsize=8)
def _drafter_columns(B: int, K: int) -> np.ndarray:
    """The drafter rows' columns that depend on the block's shape alone (read only): the pick's
    and the sibling's intercepts and depth - 1; every other column 0."""
    Xd = np.zeros((B, K, N_COEF))
    above = np.arange(B, dtype=np.float64)  # depth - 1
    Xd[:, 0, 0] = 1.0
    Xd[:, 0, 7] = above
    Xd[:, 1:, 3] = 1.0
    Xd[:, 1:, 8] = above[:, None]
    Xd.setflags(write=False)
    return Xd.reshape(B * K, N_COEF)


def design(tree: CandidateTree, context_len: int,
           temperature: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Feature matrix X[N, N_COEF] and fixed offset[N] so that s = X @ w + offset + b_req."""
    B, K, N = tree.B, tree.K, tree.n_nodes
    D = B * K
    if tree.n_drafter != D:
        raise UserError("the acceptance model prices trees built by CandidateTree.from_block "
                        "or CandidateTree.undrafted")
    ctx = float(context_len) / CONTEXT_UNIT
    X = np.zeros((N, N_COEF))
    if D == 0:  # an undrafted round: n-gram nodes only
        X[:, 11] = ctx
        X[:, TEMP0 + 2] = temperature
        X[np.arange(N), BUCKET0 + tree.bucket] = 1.0
        return X, tree.logit_p.copy()
    # Drafter nodes are node i*K + k (k == 0 the pick): fill them as a [B, K, N_COEF] view,
    # the columns that depend on the block's shape alone copied from _drafter_columns.
    X[:D] = _drafter_columns(B, K)
    Xd = X[:D].reshape(B, K, N_COEF)
    lh = tree.logit_head[:D:K]
    ls = tree.logit_share[:D:K]
    Xd[:, 0, 1] = lh
    Xd[:, 0, 2] = ls
    Xd[:, 0, 9] = ctx
    Xd[:, 1:, 4] = tree.log_r[:D].reshape(B, K)[:, 1:]
    Xd[:, 1:, 5] = lh[:, None]
    Xd[:, 1:, 6] = ls[:, None]
    Xd[:, 1:, 10] = ctx
    if temperature != 0.0 or math.copysign(1.0, temperature) < 0.0:  # else they stay 0.0
        Xd[:, 0, TEMP0] = temperature
        Xd[:, 1:, TEMP0 + 1] = temperature
    offset = np.zeros(N)
    if N > D:  # n-gram nodes follow the drafter's
        X[D:, 11] = ctx
        X[D:, TEMP0 + 2] = temperature
        X[np.arange(D, N), BUCKET0 + tree.bucket[D:]] = 1.0
        offset[D:] = tree.logit_p[D:]
    lp = tree.logit_p[:D]
    rows = (tree.agreed_bucket >= 0).nonzero()[0]
    if rows.size:
        X[rows, AGREED0 + 2 * tree.agreed_bucket[rows] + (rows % K != 0)] = 1.0
        offset[rows] += np.maximum(lp[rows], 0.0)
    rows = (tree.contra_evidence >= 0).nonzero()[0]
    if rows.size:
        X[rows, CONTRA0 + 2 * tree.contra_evidence[rows] + (rows % K != 0)] = 1.0
        offset[rows] -= np.maximum(lp[rows], 0.0)
    return X, offset


def _gradient(X: np.ndarray, q: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """The log loss's gradient from the labelled nodes' rows X, fitted q and labels y."""
    r = q - y
    return X.T @ r, float(r.sum())


def _fisher_diagonal(X: np.ndarray, q: np.ndarray, labels: Labels) -> np.ndarray:
    """AcceptanceModel.expected_square_gradient from the labelled nodes' rows X and q."""
    member = np.zeros((labels.n_parents, q.size))
    member[labels.parent_rank, np.arange(q.size)] = 1.0
    per_parent = member @ (X * q[:, None])
    return (X * X).T @ q - np.einsum("pj,pj->j", per_parent, per_parent)


class AcceptanceModel:
    """Fitted acceptance model + head-based estimate + guard (see module docstring)."""

    def __init__(self, gate: float = GATE):
        alpha = np.full(N_COEF, BUCKET_RATE)
        alpha[:N_DRAFTER] = DRAFTER_RATE
        alpha[TEMP0:] = DRAFTER_RATE
        self.ftrl = FTRLProximal(prior_coefficients(), alpha, beta=BETA, l2=L2, gate=gate,
                                 n_cap=G2_CAP)
        self.b_req = AdaGradScalar(REQ_RATE, REQ_BAND, REQ_G2_CAP)
        self.head_offset = AdaGradScalar(HEAD_RATE, HEAD_BAND)
        self.guard_fitted = 0.0
        self.guard_head = 0.0
        self.bucket_labels = np.zeros(N_BUCKETS, dtype=np.int64)
        # predicted against realised acceptance, for the server's dashboard: a diagnostic of
        # this process, so not part of state_dict()
        self.calibration = np.zeros((3, CALIBRATION_BINS))
        self.begin_request()

    @property
    def coefficients(self) -> np.ndarray:
        return self.ftrl.weights

    @property
    def fitted_preferred(self) -> bool:
        return self.guard_fitted < self.guard_head

    def begin_request(self) -> None:
        self.b_req.reset()
        self.head_offset.reset()
        self.request_stats = {"nodes": 0, "fitted_loss": 0.0, "head_loss": 0.0,
                              "rounds": 0, "fitted_rounds": 0}

    def score(self, tree: CandidateTree, context_len: int, head_only: bool = False,
              temperature: float = 0.0) -> Scored:
        X, offset = design(tree, context_len, temperature)
        b = self.b_req.value
        q_fit = parent_softmax(tree.parent, X @ self.ftrl.weights + offset + b)
        h = np.minimum(np.maximum(tree.head_estimate, HEAD_CLIP), 1.0 - HEAD_CLIP)
        q_head = 1.0 / (1.0 + np.exp(-(logit(h) + self.head_offset.value)))
        fitted = self.fitted_preferred and not head_only
        return Scored(tree, X, offset, b, q_fit, q_head, q_fit if fitted else q_head, fitted)

    def gradient(self, scored: Scored, labels: Labels):
        """d(multinomial log loss)/d(coefficients) and /d(b_req), at the scored round's q."""
        return _gradient(scored.X[labels.nodes], scored.q_fit[labels.nodes], labels.y)

    @staticmethod
    def expected_square_gradient(scored: Scored, labels: Labels) -> np.ndarray:
        """The coefficients' gradient variance if the model's own q were true: per parent
        x'(diag q - q q')x on the diagonal (the Fisher information). The gate's 3-sigma test
        needs it where outcomes are rare (see ftrl.FTRLProximal)."""
        return _fisher_diagonal(scored.X[labels.nodes], scored.q_fit[labels.nodes], labels)

    def learn(self, scored: Scored, labelled_parents, parent_targets, placed_nodes=(),
              fit: bool = True) -> RoundLoss:
        tree = scored.tree
        lab = label_nodes(tree, labelled_parents, parent_targets)
        idx, y = lab.nodes, lab.y
        if idx.size == 0:
            return RoundLoss(0, 0.0, 0.0)
        q_fit = scored.q_fit[idx]
        q = np.empty((2, idx.size))  # np.stack, then np.clip's values in place
        q[0], q[1] = q_fit, scored.q_head[idx]
        np.minimum(np.maximum(q, LOSS_CLIP, out=q), 1 - LOSS_CLIP, out=q)
        losses = -np.where(y, np.log(q), np.log1p(-q))  # [fitted, head] x labelled node
        # Guard: decay once per labelled parent, parents in path order.
        decay = GUARD_DECAY ** (lab.n_parents - 1 - lab.parent_rank)
        fitted_sum, head_sum = losses.sum(axis=1).tolist()
        guard_fitted, guard_head = (losses @ decay).tolist()
        keep = GUARD_DECAY ** lab.n_parents
        self.guard_fitted = self.guard_fitted * keep + guard_fitted
        self.guard_head = self.guard_head * keep + guard_head
        stats = self.request_stats
        stats["nodes"] += int(idx.size)
        stats["fitted_loss"] += fitted_sum
        stats["head_loss"] += head_sum
        stats["rounds"] += 1
        stats["fitted_rounds"] += int(scored.fitted_prices)
        self._calibrate(scored.q[idx], y)

        placed = np.zeros(tree.n_nodes, dtype=bool)
        placed[np.asarray(placed_nodes, dtype=np.int64)] = True
        on_rows = placed[idx]
        if on_rows.any():
            self.head_offset.update(float((scored.q_head[idx[on_rows]] - y[on_rows]).sum()))
        if fit:
            X = scored.X[idx]  # gathered once for both (gradient, expected_square_gradient)
            g_coef, g_b = _gradient(X, q_fit, y)
            self.ftrl.update(g_coef, _fisher_diagonal(X, q_fit, lab))
            self.b_req.update(g_b)
            ng = idx[tree.kind[idx] == NGRAM]
            if ng.size:
                self.bucket_labels += np.bincount(tree.bucket[ng], minlength=N_BUCKETS)
        return RoundLoss(int(idx.size), fitted_sum, head_sum)

    def _calibrate(self, q: np.ndarray, y: np.ndarray) -> None:
        bins = np.minimum((q * CALIBRATION_BINS).astype(np.int64), CALIBRATION_BINS - 1)
        n = CALIBRATION_BINS
        self.calibration[0] += np.bincount(bins, minlength=n)
        self.calibration[1] += np.bincount(bins, weights=q, minlength=n)
        self.calibration[2] += np.bincount(bins, weights=y.astype(np.float64), minlength=n)

    def state_dict(self) -> dict:
        return {"version": 2, "ftrl": self.ftrl.state_dict(),
                "guard": [self.guard_fitted, self.guard_head],
                "bucket_labels": self.bucket_labels.tolist()}

    def load_state_dict(self, state: dict) -> None:
        try:
            version = state.get("version")
            if version not in (1, 2):
                raise UserError(f"acceptance state version {version!r} unknown")
            ftrl = state["ftrl"]
            if version == 1:  # the temperature terms start at their prior (0), unlearned
                ftrl = {k: list(v) + [0] * (N_COEF - N_COEF_V1) for k, v in ftrl.items()}
            self.ftrl.load_state_dict(ftrl)
            self.guard_fitted, self.guard_head = (float(x) for x in state["guard"])
            labels = np.array(state["bucket_labels"], dtype=np.int64)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UserError(f"acceptance state is malformed: {exc}") from None
        if labels.shape != (N_BUCKETS,):
            raise UserError(f"acceptance state has {labels.size} bucket counts, expected 12")
        self.bucket_labels = labels
