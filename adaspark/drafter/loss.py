"""Training batches (many anchors of one sequence in one forward) and the DSpark reference loss.

A sequence's context features and their K/V are computed once; N anchors' blocks (N*B rows) are
queries together, each block row seeing the context before its anchor and its own block only.
Loss: w_ce*CE + w_tv*total variation + 1.0*confidence BCE, position k weighted by exp(-k/4);
the reference's w_ce/w_tv are 0.1/0.9 (WEIGHTS, also the held-out yardstick reported in a
checkpoint), training's are TrainSettings' (0.5/0.5: greedy verification accepts only argmaxes).
The target's distribution over the draft vocabulary comes from its stored top-k logits at that
position, renormalised over the ones inside the draft vocabulary (the rest of the mass is tiny).
The confidence target 1 - TV(draft, target) is detached, as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from adaspark.drafter.model import DraftModel
from adaspark.drafter.shards import Sequence

WEIGHTS = {"ce": 0.1, "tv": 0.9, "conf": 1.0}


@dataclass
class Batch:
    taps: torch.Tensor  # [n_ctx, n_taps, dim] context rows 0..n_ctx-1
    anchors: torch.Tensor  # [N] anchor positions
    block_prev: torch.Tensor  # [N, B] target id before each row's label (row 0: the anchor)
    labels: torch.Tensor  # [N, B] target id each row must predict, -1 past the reply's end
    top_ids: torch.Tensor  # [N, B, k] target's top-k ids at that row's position
    top_logits: torch.Tensor  # [N, B, k]
    valid: torch.Tensor  # [N, B] bool


def make_batch(
    seq: Sequence, tap_index: list[int], block: int, n_anchors: int, rng: np.random.Generator
) -> Batch | None:
    """Sample up to n_anchors anchors densely over the reply (positions P..T-2)."""
    T, P = len(seq.tokens), seq.prompt_len
    choices = np.arange(P, T - 1)
    if len(choices) == 0:
        return None
    anchors = np.sort(rng.choice(choices, size=min(n_anchors, len(choices)), replace=False))
    pos = anchors[:, None] + np.arange(block)[None]  # row k sits at anchor+k, predicts +1
    valid = pos + 1 <= T - 1
    posc = np.minimum(pos, T - 2)
    toks = seq.tokens.astype(np.int64)
    labels = np.where(valid, toks[np.minimum(pos + 1, T - 1)], -1)
    top_ids = seq.top_ids[posc - P].astype(np.int64)
    top_logits = seq.top_logits[posc - P].astype(np.float32)
    n_ctx = int(anchors.max())
    return Batch(
        taps=torch.from_numpy(seq.hidden[:n_ctx][:, tap_index].astype(np.float32)),
        anchors=torch.from_numpy(anchors),
        block_prev=torch.from_numpy(toks[posc]),
        labels=torch.from_numpy(labels),
        top_ids=torch.from_numpy(top_ids),
        top_logits=torch.from_numpy(top_logits),
        valid=torch.from_numpy(valid),
    )


def forward_batch(model: DraftModel, embed, b: Batch):
    """-> biased logits [N, B, V_d], confidence logits [N, B]."""
    c = model.c
    N, B = b.labels.shape
    n_ctx = b.taps.shape[0]
    feats = model.features(b.taps)
    ctx_kv = []
    for layer in model.layers:
        k, v = layer.context_kv(feats, torch.arange(n_ctx))
        ctx_kv.append((k[None], v[None]))
    rows = model.block_rows(embed(b.block_prev[:, 0]))
    pos = (b.anchors[:, None] + torch.arange(B)[None]).reshape(-1)
    # row of anchor a sees context < a and its own block, nothing of other blocks
    ctx_vis = torch.arange(n_ctx)[None] < b.anchors[:, None]  # [N, n_ctx]
    blk = torch.arange(N)
    blk_vis = (blk[:, None] == blk[None]).repeat_interleave(B, 1)  # [N, N*B]
    mask = torch.cat([ctx_vis, blk_vis], 1).repeat_interleave(B, 0)[None]
    hidden = model.backbone(rows.reshape(1, N * B, c.dim), pos, ctx_kv, mask)[0]
    logits = model.logits(hidden)
    bias, prev_emb = model.markov_bias(model.markov_key(b.block_prev.reshape(-1)))
    logits = (logits + bias).reshape(N, B, -1)
    conf = model.confidence_logit(hidden, prev_emb).reshape(N, B)
    return logits, conf


def target_distribution(model: DraftModel, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Target's softmax over the draft vocab from its top-k; -> probs [N,B,V_d], usable [N,B]."""
    V = model.c.draft_vocab_size
    idx = model.to_draft(b.top_ids)  # V == outside
    inside = idx < V
    vals = torch.where(inside, b.top_logits, torch.full_like(b.top_logits, -1e4))
    dense = torch.full((*idx.shape[:2], V + 1), -1e4)
    dense.scatter_(-1, idx, vals)
    probs = torch.softmax(dense[..., :V], -1)
    return probs, inside.any(-1)


def dspark_loss(model: DraftModel, embed, b: Batch, weights: dict[str, float] | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """weights: of "ce", "tv", "conf"; WEIGHTS (the reference's) when None."""
    logits, conf = forward_batch(model, embed, b)
    logits = logits.float()
    V = model.c.draft_vocab_size
    B = logits.shape[1]
    p_target, usable = target_distribution(model, b)
    p_draft = torch.softmax(logits, -1)
    tv = 0.5 * (p_draft - p_target).abs().sum(-1)  # [N, B]
    label = model.to_draft(b.labels.clamp(min=0))
    ce_ok = b.valid & (label < V)
    ce = F.cross_entropy(
        logits.reshape(-1, V), label.clamp(max=V - 1).reshape(-1), reduction="none"
    )
    ce = ce.reshape(tv.shape)
    conf_target = (1.0 - tv).detach().clamp(0, 1)
    bce = F.binary_cross_entropy_with_logits(conf.float(), conf_target, reduction="none")
    w = torch.exp(-torch.arange(B, dtype=torch.float32) / 4)[None].expand_as(tv)
    tv_ok = b.valid & usable

    def mean(x, ok):
        wk = w * ok
        return (x * wk).sum() / wk.sum().clamp(min=1e-6)

    parts = {"ce": mean(ce, ce_ok), "tv": mean(tv, tv_ok), "conf": mean(bce, tv_ok)}
    loss = sum((weights or WEIGHTS)[k] * v for k, v in parts.items())
    stats = {k: float(v.detach()) for k, v in parts.items()}
    stats["acc0"] = float(((logits.argmax(-1) == label) & ce_ok)[:, 0].float().mean())
    return loss, stats
