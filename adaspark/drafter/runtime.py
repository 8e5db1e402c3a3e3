"""The drafter as the engine drives it: a feature cache that follows the target's committed tokens,
and one draft forward per round.

The engine's round, with `d = Drafter(...)`:
    out = target.prefill(prompt, tap_layers=d.tap_layers); d.observe(out.hiddens)
    loop: block = d.draft(anchor)                 # anchor = last committed token, not yet verified
          out = target.verify(rows, ..., tap_layers=d.tap_layers); target.commit(path)
          d.observe(out.hiddens, rows=path)       # same accepted rows, root first
Only the accepted rows' features are computed and appended, which leaves the cache exactly as a
gather of all verified rows into the contiguous prefix would, without computing the rest. The
taps are only kept at observe(); the features are computed at the next draft (or when `cache` is
read), for every token since the last one in one batch: a round that skips the drafter (a plain
round, the draft gate's n-gram rounds) then costs the drafter nothing.
Invariant: d.length == target.cache.length.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch

from adaspark.drafter.model import DraftBlock, DraftModel, Embed

_log = logging.getLogger(__name__)
_NO_NOISE = torch.empty(0)  # the native draft's noise argument without noise


def _run_of(rows: list[int], n: int) -> slice | None:
    """rows as a slice of n rows where they are consecutive and ascending (a chain's accepted
    path), else None."""
    if not rows or rows[0] < 0 or rows[-1] >= n:
        return None
    return slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None


def _rows_index(rows: Sequence[int] | None, n: int) -> slice | torch.Tensor:
    """The index of `rows` among n (None: all of them): a slice where they are a run (a view,
    no gather), else an index tensor."""
    if rows is None:
        return slice(None)
    run = _run_of(rows := list(rows), n)
    return run if run is not None else torch.as_tensor(rows, dtype=torch.long)


class DrafterCache:
    """Per drafter layer K/V of the context features, positions 0..length-1."""

    def __init__(self, model: DraftModel, capacity: int = 1024):
        c = model.c
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.length = 0
        shape = (c.n_kv_heads, capacity, c.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype) for _ in range(c.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype) for _ in range(c.n_layers)]

    def _grow(self, need: int) -> None:
        cap = self.k[0].shape[1]
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                grown = torch.zeros(t.shape[0], new, t.shape[2], dtype=t.dtype)
                grown[:, :cap] = t
                buf[i] = grown

    @torch.inference_mode()
    def append(self, taps: torch.Tensor) -> None:
        """taps [n, n_taps, dim]: target hidden states of n newly committed tokens, in order."""
        n = taps.shape[0]
        if n == 0:
            return
        self._grow(self.length + n)
        feats = self.model.features(taps.to(self.dtype))
        pos = torch.arange(self.length, self.length + n)
        for i, layer in enumerate(self.model.layers):
            k, v = layer.context_kv(feats, pos)
            self.k[i][:, self.length : self.length + n] = k
            self.v[i][:, self.length : self.length + n] = v
        self.length += n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate drafter cache of {self.length} to {length}")
        self.length = length


class Drafter:
    """Runtime interface the engine calls each round (see module docstring)."""

    def __init__(
        self, model: DraftModel, embed: Embed, capacity: int = 1024, dtype=torch.bfloat16,
        shortlist: int = 64, native: ModuleType | None = None, positions: int = 8192,
        embedding=None, head_bits: int = 8,
    ):
        """dtype: weights and cache at inference on the torch path. At 7 rows every matmul is
        bound by reading its weights, so bf16 (native on AVX512-BF16 CPUs) halves the draft time.
        shortlist: candidates per row the Markov bias is applied to where that provably
        keeps the exact pick (markov_chain), else every candidate.
        native: the native build's module (the target's): the whole draft in one call on Q8_0
        weights (drafter/native.py), positions up to `positions`; None: the torch path.
        embedding: the target's packed embedding table (the native module's QWeight whose rows
        `embed` gives) or None: with it the native draft looks the anchor up itself and
        returns target ids, no tensor work around the call.
        head_bits: the native head's blocks (drafter/native.py), 8 (Q8_0) or 4 (Q4_1)."""
        self.shortlist = shortlist
        self.native = None
        if native is not None:
            from adaspark.drafter.native import native_drafter

            try:
                self.native = native_drafter(native, model, positions, head_bits)
                dtype = torch.float32  # what stays in torch (ids, embeddings) is float32
                # target id <-> draft index as numpy, so a round's lookups are no torch ops
                self._draft_ids = model.draft_ids.numpy()
                self._to_draft = model.to_draft_table.numpy()
            except RuntimeError as err:  # a shape the native drafter does not take
                _log.warning("drafter: the native draft cannot run this checkpoint (%s); the "
                             "torch path runs", str(err).splitlines()[0])
        self._by_token = self.native is not None and embedding is not None
        if self._by_token:
            self.native.set_vocab(embedding, model.to_draft_table, model.draft_ids)
        if self.native is None and dtype != torch.float32:
            model = copy.deepcopy(model).to(dtype)
            model.head = model.head.to(dtype)
        self.model = model.eval()
        self.dtype = dtype
        self.embed = embed
        self._capacity, self._positions = capacity, positions
        self._cache = self._new_cache()
        self._pending: list[torch.Tensor] = []  # observed taps [n, n_taps, dim] not yet in cache
        self._pending_len = 0
        c = model.c
        self.block_size = c.block_size
        self.topk = c.topk
        self.tap_layers: tuple[int, ...] = tuple(c.target_layers)
        # the Markov matvec runs 7 times in a row: fp32 MKL gemv beats bf16 there
        self._w1 = model.markov_w1.weight.detach().float()
        self._w2 = model.markov_w2.weight.detach().float()
        self._w2_max = float(self._w2.double().norm(dim=1).max())
        self._key_of_pick = model.draft_ids if c.markov_keys == "target" else None
        self._table = (markov_table(self._w1, self._w2, self._key_of_pick)
                       if self.native is None else None)
        self._bound = (markov_bound(self._w2) if self.native is None and self._table is None
                       else None)
        self._temperature = model.temperature.float()
        if dtype != torch.float32 and model.confidence is not None:
            model.confidence.float()

    def _new_cache(self) -> DrafterCache:
        if self.native is None:
            return DrafterCache(self.model, self._capacity)
        from adaspark.drafter.native import NativeCache

        return NativeCache(self.native, self.model, self._capacity, self._positions)

    def fork(self) -> Drafter:
        """Another sequence's drafter (a batch slot's): the same weights, its own empty
        feature cache; drafts and observes on one never touch the other's."""
        other = copy.copy(self)
        other._cache = self._new_cache()
        other._pending, other._pending_len = [], 0
        return other

    @property
    def cache(self) -> DrafterCache:
        """The feature cache, every observed token in it."""
        self.catch_up()
        return self._cache

    def catch_up(self) -> None:
        """Append the observed tokens' features now (a prompt's, with its prefill: otherwise
        the first draft after it appends them all)."""
        if self._pending:
            taps = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
            self._pending, self._pending_len = [], 0
            self._cache.append(taps)

    @property
    def length(self) -> int:
        return self._cache.length + self._pending_len

    def reset(self) -> None:
        self._cache.length = 0
        self._pending, self._pending_len = [], 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate drafter cache of {self.length} to {length}")
        if length < self._cache.length:
            self._pending, self._pending_len = [], 0
            self._cache.truncate(length)
            return
        keep = length - self._cache.length  # observed but not yet appended
        taps = torch.cat(self._pending)[:keep] if keep else None
        self._pending = [taps] if keep else []
        self._pending_len = keep

    def observe(self, hiddens: dict[int, torch.Tensor], rows: Sequence[int] | None = None):
        """Append committed tokens' features from a prefill/verify's tapped hiddens.

        hiddens: layer -> [n, dim]; rows: the accepted rows (root first), or None for all rows.
        """
        missing = [layer for layer in self.tap_layers if layer not in hiddens]
        if missing:
            raise ValueError(f"the target forward did not tap layers {missing} for the drafter")
        # stack copies: the target may reuse its output buffers before the next draft
        idx = _rows_index(rows, len(hiddens[self.tap_layers[0]]))
        self._append(torch.stack([hiddens[layer][idx] for layer in self.tap_layers], -2))

    def observe_taps(self, taps: torch.Tensor, rows: Sequence[int] | None = None) -> None:
        """observe() of taps already stacked, [n, len(tap_layers), dim] in tap_layers' order,
        and copied out of the target's buffers (a batch stacks its step's once:
        batch.Batch._verify); rows: as observe's."""
        if taps.dim() != 3 or taps.shape[1] != len(self.tap_layers):
            raise ValueError(f"taps of shape {tuple(taps.shape)}: expected [n, "
                             f"{len(self.tap_layers)}, dim]")
        self._append(taps if rows is None else taps[_rows_index(rows, len(taps))])

    def _append(self, taps: torch.Tensor) -> None:
        if taps.shape[0]:
            self._pending.append(taps)
            self._pending_len += taps.shape[0]

    def draft(self, anchor: int, noise: torch.Tensor | None = None) -> DraftBlock:
        """Draft the B tokens after `anchor`, which sits at position self.length. noise: [B,
        V_d] added to the backbone logits first (sampling: the target's Gumbel noise times T),
        so the picks and candidates are the perturbed ones."""
        cache = self.cache
        cache._grow(cache.length + self.block_size)  # the block's K/V: slots past the prefix
        if self.native is not None:
            return self._draft_native(int(anchor), noise)
        return self._draft_torch(torch.tensor([anchor]), noise)

    def _draft_native(self, anchor: int, noise: torch.Tensor | None) -> DraftBlock:
        cache = self._cache
        noise = _NO_NOISE if noise is None else noise.float()
        if self._by_token:  # the whole round's draft in the one call
            picks, top_i, top_v, conf = self.native.draft_token(
                cache.k, cache.v, anchor, cache.length, self.shortlist, self.topk, noise)
            return DraftBlock(picks=picks.numpy(), topk_ids=top_i.numpy(),
                              topk_logits=top_v.numpy(), head=conf.numpy())
        # the anchor's W1 row: its id, or its draft index (ids past the table: outside)
        if self.model.c.markov_keys == "target":
            prev = anchor
        else:
            prev = (int(self._to_draft[anchor]) if anchor < len(self._to_draft)
                    else len(self._draft_ids))
        picks, top_i, top_v, conf = self.native.draft(
            cache.k, cache.v, self.embed(torch.tensor([anchor]))[0].float(), cache.length, prev,
            self.shortlist, self.topk, noise)
        ids = self._draft_ids
        return DraftBlock(picks=ids[picks.numpy()], topk_ids=ids[top_i.numpy()],
                          topk_logits=top_v.numpy(), head=conf.numpy())

    @torch.inference_mode()
    def _draft_torch(self, anchor_t: torch.Tensor, noise: torch.Tensor | None) -> DraftBlock:
        m, cache, B = self.model, self._cache, self.block_size
        n = cache.length
        x = m.block_rows(self.embed(anchor_t)[0].to(self.dtype))
        pos = torch.arange(n, n + B)
        for layer, k_buf, v_buf in zip(m.layers, cache.k, cache.v, strict=True):
            x = layer.forward_cached(x, pos, k_buf, v_buf, n)
        hidden = m.norm(x)  # [B, dim]
        logits = m.logits(hidden).float()  # [B, V_d]
        if noise is not None:
            logits += noise
        chain = markov_chain(logits, self._w1, self._w2, self._w2_max,
                             int(m.markov_key(anchor_t)), self._key_of_pick, self.shortlist,
                             self.topk, self._bound, self._table)
        conf = m.confidence_logit(hidden.float(), chain.prev_emb) / self._temperature
        return DraftBlock(
            picks=m.draft_ids[chain.picks].numpy(),
            topk_ids=m.draft_ids[chain.top_i].numpy(),
            topk_logits=chain.top_v.numpy(),  # float32
            head=torch.sigmoid(conf).numpy(),
        )


MARKOV_BASIS = 8  # W2's top directions the exactness bound computes exactly (markov_bound)


class MarkovBound(NamedTuple):
    """What markov_chain's per-candidate cap needs, precomputed once: basis [r, K] (W2's top
    right singular directions, orthonormal), proj [K, V_d] = (W2 basis)^T, res [V_d] the norm
    of each W2 row's part outside the basis and norms [V_d] each row's norm (both rounded up)."""
    basis: torch.Tensor
    proj: torch.Tensor
    res: torch.Tensor
    norms: torch.Tensor


def markov_bound(w2: torch.Tensor, k: int = MARKOV_BASIS, chunk: int = 32768) -> MarkovBound:
    """The bound's tables for W2 [V_d, r]: a trained W2 has a few dominant directions (the
    shipped one: singular values 279, 34, 23, 20, ... 3.4), so w2_j.e = (w2_j B).(B^T e) +
    rest_j.rest_e, whose second term is small next to Cauchy-Schwarz on the whole row."""
    w = w2.detach().double()
    k = min(k, w.shape[1])
    gram = sum(w[i:i + chunk].T @ w[i:i + chunk] for i in range(0, len(w), chunk))
    basis = torch.linalg.eigh(gram).eigenvectors[:, -k:]  # ascending: the top k last
    proj, res, norms = [], [], []
    for i in range(0, len(w), chunk):
        part = w[i:i + chunk]
        p = part @ basis
        proj.append(p)
        res.append((part - p @ basis.T).norm(dim=1))
        norms.append(part.norm(dim=1))
    up = 1 + 2.0**-20  # float32 storage rounds down at most 2^-24: the caps stay caps
    return MarkovBound(basis.float().contiguous(), torch.cat(proj).T.float().contiguous(),
                       (torch.cat(res) * up).float(), (torch.cat(norms) * up).float())


MARKOV_HIGH = 64  # per W1 row, the candidates of the largest biases markov_table keeps
TABLE_LIMIT = 1 << 28  # table rows x V_d: a table at most ~2 s to make on two cores


class MarkovTable(NamedTuple):
    """Per W1 row p that a chain looks up (row = row_of[p], -1 where the table has none), its
    bias vector W2 W1[p]'s M largest entries' candidates, high [rows, M], and tau [rows], the
    next largest (rounded up): every other candidate's bias is at most tau, so only candidates
    whose backbone logit comes within tau of the row's K-th best can still enter its top K. A
    trained Markov head boosts a few followers of each token: beyond the shortlist and them,
    few (stage 4 on the evaluation's replies: 66 a row on average, median 0, against 886 that
    markov_bound's caps let through for the pick alone)."""
    high: torch.Tensor
    tau: torch.Tensor
    row_of: torch.Tensor


def markov_table(w1: torch.Tensor, w2: torch.Tensor, key_of_pick: torch.Tensor | None = None,
                 m: int = MARKOV_HIGH, chunk: int = 1024) -> MarkovTable | None:
    """The table of W1 [keys, r] and W2 [V_d, r] (float32 products, as a candidate's bias is
    computed; the chain's slack covers their rounding) over the W1 rows a pick can key
    (key_of_pick [V_d], a target-keyed head's; None: every row), or None where those rows x
    V_d pass TABLE_LIMIT (markov_bound's caps serve it) or V_d <= m. A row outside the table
    (a target-keyed head's first row, keyed by an anchor outside the draft vocabulary) takes
    every candidate."""
    w1, w2 = w1.detach().float().contiguous(), w2.detach().float().contiguous()
    keys, V = len(w1), len(w2)
    rows = (torch.arange(keys) if key_of_pick is None
            else torch.unique(key_of_pick.long().clamp(0, keys - 1)))
    if len(rows) * V > TABLE_LIMIT or V <= m:
        return None
    digest = hashlib.blake2b(w1.numpy().tobytes(), digest_size=16)
    digest.update(w2.numpy().tobytes())
    digest.update(rows.numpy().tobytes())
    key = (digest.hexdigest(), m)
    if key not in _TABLES:  # a server's slots and the tests load the same weights again
        if len(_TABLES) >= 4:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = _make_table(w1, w2, rows, m, chunk)
    return _TABLES[key]


_TABLES: dict[tuple[str, int], MarkovTable] = {}  # the tables made, by their weights' digest


def _make_table(w1: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor, m: int,
                chunk: int) -> MarkovTable:
    high = torch.empty(len(rows), m, dtype=torch.int32)
    tau = torch.empty(len(rows))
    for i in range(0, len(rows), chunk):
        vals, idx = torch.topk(w1[rows[i:i + chunk]] @ w2.T, m + 1, dim=1)
        high[i:i + chunk] = idx[:, :m].to(torch.int32)
        tau[i:i + chunk] = vals[:, m]
    row_of = torch.full((len(w1),), -1, dtype=torch.int32)
    row_of[rows] = torch.arange(len(rows), dtype=torch.int32)
    up = 2.0**-20  # float32 rounding of the stored value: tau stays an upper bound
    return MarkovTable(high.contiguous(), (tau + up * tau.abs()).contiguous(), row_of)


def table_threshold(kth: float, tau: float, w2_max: float, e_norm: float, rank: int) -> float:
    """The least backbone logit l_j (as l_j + 2^-22 |l_j|) with which a candidate outside the
    shortlist and its key's high set can still reach `kth`, the K-th best biased value among
    them (so the top K of the whole vocabulary is among the candidates, not only the pick):
    its bias is at most tau plus the rounding of the table's r-term products and of the
    chain's own ((r + 8) 2^-24 |w2_j||e| each), and one add's rounding (2^-22 of the
    magnitudes, generous). -inf where fewer than K candidates give a K-th."""
    if kth == -math.inf:
        return kth
    slack = 2 * (rank + 8) * 2.0**-24 * w2_max * e_norm
    return kth - tau - slack - 2.0**-22 * (abs(kth) + abs(tau) + slack)


def _reaching(logits_row: torch.Tensor, e: torch.Tensor, bound: MarkovBound, best: float
              ) -> torch.Tensor:
    """The candidates whose cap on their biased logit reaches `best` (any that could win)."""
    return torch.nonzero(markov_caps(logits_row, e, bound) >= best).flatten()


def markov_caps(logits_row: torch.Tensor, e: torch.Tensor, bound: MarkovBound) -> torch.Tensor:
    """Per candidate j, a cap on its biased logit as the exact path computes it in float32,
    logit_j + w2_j.e: (w2_j B).(B^T e) + |rest of w2_j| |rest of e| (Cauchy-Schwarz on the
    parts outside the basis B), plus (r + 2K + 8) 2^-24 (|logit_j| + 2 |w2_j| |e|) for the
    rounding of this float pass and of the exact path's r-term dot and add (generous)."""
    basis = bound.basis.double()
    e64 = e.double()
    pe = basis.T @ e64
    up = 1 + 2.0**-20
    re_ = float((e64 - basis @ pe).norm()) * up
    en = float(e64.norm()) * up
    r, k = len(e), basis.shape[1]
    c = (r + 2 * k + 8) * 2.0**-24  # this float pass's rounding and the exact path's
    return (logits_row + c * logits_row.abs() + pe.float() @ bound.proj + bound.res * re_
            + bound.norms * (2 * c * en))


class Chain(NamedTuple):
    picks: torch.Tensor  # [B] draft indices
    top_i: torch.Tensor  # [B, K] draft indices, the pick first
    top_v: torch.Tensor  # [B, K] their biased logits
    prev_emb: torch.Tensor  # [B, r] W1 row of each row's previous token


def shortlist_is_exact(best: float, last_short: float, w2_max: float, e_norm: float,
                       rank: int) -> bool:
    """Whether a row's best Markov-biased shortlist logit beats every candidate outside the
    shortlist. An outside candidate j has base_j <= last_short (the shortlist holds the best
    base logits) and bias w2_j.e <= |w2_j| |e| <= w2_max |e| (Cauchy-Schwarz); its float value
    exceeds that by at most the rounding of an r-term dot and one add (rank * 2^-23 of
    |w2_j||e|, 2^-22 of the sum, both generous). Strictly above the cap: no outside candidate
    can reach the pick, not even to tie it."""
    bias_cap = w2_max * e_norm * (1.0 + rank * 2.0**-23)
    cap = last_short + bias_cap
    return best > cap + 2.0**-22 * (abs(last_short) + bias_cap)


def markov_chain(logits: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w2_max: float,
                 first_key: int, key_of_pick: torch.Tensor | None, shortlist: int,
                 topk: int, bound: MarkovBound | None = None,
                 table: MarkovTable | None = None) -> Chain:
    """The Markov head along the picks: row i's logits plus W2 W1[previous], its pick the exact
    argmax over the whole draft vocabulary (ties to the lower index), as the peers compute it.
    The bias is applied to each row's `shortlist` best backbone candidates only (seven
    [V_d x r] matvecs cost a quarter of the draft on this CPU) where shortlist_is_exact proves
    no other candidate can win; else, with `bound`, to the shortlist and every candidate whose
    cap (_reaching: exact along W2's top directions, Cauchy-Schwarz on the rest) reaches the
    shortlist's best (the shipped drafter: some 100 of 8192), else to every candidate. With
    `table` (markov_table), each row's candidates are the shortlist, its previous pick's high
    set and every other candidate whose backbone logit reaches table_threshold: the top K of
    the whole vocabulary, siblings included.
    first_key: W1's row of the anchor; key_of_pick: W1's row of each draft index (None: the
    index itself)."""
    B, V = logits.shape
    S = min(shortlist, V)
    short_v, short_i = logits.topk(S, -1)
    prev = first_key
    picks = torch.empty(B, dtype=torch.long)
    K = min(topk, V)
    top_i = torch.empty(B, K, dtype=torch.long)
    top_v = torch.empty(B, K)
    prev_emb = torch.empty(B, w1.shape[1])
    for i in range(B):
        e = w1[prev]
        prev_emb[i] = e
        cand, vals = short_i[i], short_v[i] + w2[short_i[i]] @ e
        if table is not None and int(table.row_of[prev]) < 0:  # a row the table lacks
            cand, vals = torch.arange(V), logits[i] + w2 @ e
        elif table is not None:
            t = int(table.row_of[prev])
            high = table.high[t].long()
            cand = torch.cat([cand, high[~torch.isin(high, cand)]])
            vals = logits[i, cand] + w2[cand] @ e
            row = logits[i]
            kth = float(vals.topk(K).values[-1]) if len(vals) >= K else -math.inf
            thr = table_threshold(kth, float(table.tau[t]), w2_max,
                                  float(e.double().norm()) * (1 + 2.0**-20), w1.shape[1])
            reach = torch.nonzero(row + 2.0**-22 * row.abs() >= thr).flatten()
            extra = reach[~torch.isin(reach, cand)]
            if len(extra):
                cand = torch.cat([cand, extra])
                vals = torch.cat([vals, logits[i, extra] + w2[extra] @ e])
        elif S < V and not shortlist_is_exact(float(vals.max()), float(short_v[i, -1]), w2_max,
                                            float(e.norm()), w1.shape[1]):
            if bound is None:
                cand, vals = torch.arange(V), logits[i] + w2 @ e
            else:
                reach = _reaching(logits[i], e, bound, float(vals.max()))
                extra = reach[~torch.isin(reach, cand)]
                if len(extra):
                    cand = torch.cat([cand, extra])
                    vals = logits[i, cand] + w2[cand] @ e
        # best first, ties to the lower index: sort by index, then stably by value
        by_id = torch.argsort(cand)
        order = by_id[torch.sort(vals[by_id], descending=True, stable=True).indices[:K]]
        if len(order) < K:  # a shortlist shorter than K (tiny vocabularies)
            order = torch.cat([order, order[-1:].expand(K - len(order))])
        top_i[i], top_v[i] = cand[order], vals[order]
        picks[i] = int(cand[order[0]])
        prev = int(picks[i]) if key_of_pick is None else int(key_of_pick[picks[i]])
    return Chain(picks, top_i, top_v, prev_emb)
