"""The DSpark block drafter: a parallel backbone, a Markov head and a confidence head.

Context: the target's residual stream after `target_layers`, concatenated, projected by `fc`
(no bias) and RMS-normed, one feature row per committed token. Each drafter layer keeps K/V of
those features in `DrafterCache`, so a committed token's features are computed once.
Block: B rows [anchor, mask, ..., mask] embedded with the target's own (frozen) embedding and a
learned mask vector, at positions n..n+B-1 (n = committed tokens before the anchor). Block rows
attend to every context row and, non-causally, to every block row. Row k predicts token
anchor+k+1 over a reduced draft vocabulary; the LM head is the target's (tied) embedding rows of
that vocabulary, frozen, so the drafter learns to land in the target's output space.
Markov head: logits_k += W2(W1(previous token)), run along the picks at inference.
Confidence head: sigmoid(Linear([normed hidden_k; W1(previous token)]) / T_k).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# One draft forward is the scheduler's block type (numpy, target token ids): the drafter makes
# what the tree reads, with no second form to convert.
from adaspark.scheduler.tree import Block as DraftBlock  # noqa: F401

Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids -> [..., dim] float32


@dataclass
class DrafterConfig:
    target_layers: list[int]
    draft_vocab_size: int
    dim: int = 576
    block_size: int = 7
    n_layers: int = 1
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    markov_rank: int = 256
    markov_type: str = "low_rank"  # logits += W2(W1(previous token))
    confidence_head: bool = True
    confidence_input: list[str] = field(default_factory=lambda: ["hidden", "markov_prev"])
    mask_token: str = "learned_embedding"
    lm_head: str = "target_embedding_rows"  # frozen, rebuilt from the target at load
    topk: int = 8

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim/2] float32, the angles rope() uses."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on adjacent pairs; x [..., heads, seq, hd], pos [seq] or [b, seq]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = pos.to(torch.float32)[..., None] * inv  # [..., seq, hd/2]
    if ang.dim() == 3:  # batched positions: broadcast over heads
        ang = ang[:, None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.q = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.gate = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor):
        """feats [..., n, dim] -> K, V [..., kv_heads, n, hd]; K already rotated."""
        c = self.c
        shape = feats.shape[:-1]
        k = self.k(feats).view(*shape, c.n_kv_heads, c.head_dim).transpose(-2, -3)
        v = self.v(feats).view(*shape, c.n_kv_heads, c.head_dim).transpose(-2, -3)
        return rope(k, pos, c.rope_theta), v

    def forward_cached(self, x, pos, k_buf, v_buf, n):
        """Inference, one block x [m, dim]: its K/V go to cache slots n..n+m-1 (scratch past the
        committed prefix, overwritten next round) so attention reads the cache without a copy."""
        c = self.c
        m = x.shape[0]
        g = c.n_heads // c.n_kv_heads
        h = self.attn_norm(x)
        q = rope(self.q(h).view(m, c.n_heads, c.head_dim).transpose(0, 1), pos, c.rope_theta)
        k_buf[:, n : n + m] = rope(
            self.k(h).view(m, c.n_kv_heads, c.head_dim).transpose(0, 1), pos, c.rope_theta
        )
        v_buf[:, n : n + m] = self.v(h).view(m, c.n_kv_heads, c.head_dim).transpose(0, 1)
        # grouped-query attention as one batched matmul per KV head: [kvh, g*m, n+m]
        q = q.reshape(c.n_kv_heads, g * m, c.head_dim)
        scores = (q @ k_buf[:, : n + m].transpose(1, 2)).float() * c.head_dim**-0.5
        o = torch.softmax(scores, -1).to(x.dtype) @ v_buf[:, : n + m]
        o = o.view(c.n_heads, m, c.head_dim).transpose(0, 1).reshape(m, -1)
        x = x + self.o(o)
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def forward(self, x, pos, ctx_k, ctx_v, mask=None):
        """x [b, m, dim] block rows at positions pos; ctx_k/v [b, kvh, n, hd]; mask [b, m, n+m]."""
        c = self.c
        b, m, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.q(h).view(b, m, c.n_heads, c.head_dim).transpose(1, 2), pos, c.rope_theta)
        k = rope(self.k(h).view(b, m, c.n_kv_heads, c.head_dim).transpose(1, 2), pos, c.rope_theta)
        v = self.v(h).view(b, m, c.n_kv_heads, c.head_dim).transpose(1, 2)
        k = torch.cat([ctx_k.to(k.dtype), k], 2)
        v = torch.cat([ctx_v.to(v.dtype), v], 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask[:, None], enable_gqa=True
        )
        x = x + self.o(o.transpose(1, 2).reshape(b, m, c.n_heads * c.head_dim))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DraftModel(nn.Module):
    """Weights and batched math; `Drafter` (runtime.py) drives it one round at a time."""

    def __init__(self, c: DrafterConfig, draft_ids: torch.Tensor, head: torch.Tensor):
        """draft_ids [V_d] target ids of the draft vocabulary; head [V_d, dim] frozen LM head."""
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layers) * c.dim, c.dim, bias=False)
        self.ctx_norm = RMSNorm(c.dim, c.norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.mask_embedding = nn.Parameter(0.02 * torch.randn(c.dim))
        # W1 has one extra row for "previous token outside the draft vocabulary"
        self.markov_w1 = nn.Embedding(c.draft_vocab_size + 1, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # start as a pure parallel drafter
        self.confidence = nn.Linear(c.dim + c.markov_rank, 1)
        self.register_buffer("temperature", torch.ones(c.block_size))
        self.register_buffer("draft_ids", draft_ids.to(torch.long), persistent=False)
        self.register_buffer("head", head.detach().to(torch.float32), persistent=False)
        to_draft = torch.full((int(draft_ids.max()) + 1,), c.draft_vocab_size, dtype=torch.long)
        to_draft[draft_ids.long()] = torch.arange(len(draft_ids))
        self.register_buffer("to_draft_table", to_draft, persistent=False)

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft indices; ids outside the draft vocabulary -> V_d (OOV row of W1)."""
        t = self.to_draft_table
        inside = target_ids < len(t)
        return torch.where(inside, t[target_ids.clamp(max=len(t) - 1)], self.c.draft_vocab_size)

    def block_rows(self, anchor_emb: torch.Tensor) -> torch.Tensor:
        """anchor embeddings [..., dim] -> block input [..., B, dim]: [anchor, mask, ..., mask]."""
        mask = self.mask_embedding.to(anchor_emb.dtype).expand(
            *anchor_emb.shape[:-1], self.c.block_size - 1, self.c.dim)
        return torch.cat([anchor_emb[..., None, :], mask], -2)

    def features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., n_taps, dim] (target layer order of config) -> context features [..., dim]."""
        return self.ctx_norm(self.fc(taps.flatten(-2)))

    def backbone(self, block_emb, pos, ctx_kv, mask=None) -> torch.Tensor:
        """block_emb [b, m, dim] -> normed hidden [b, m, dim]."""
        x = block_emb
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, pos, k, v, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head.to(hidden.dtype).T

    def markov_bias(self, prev_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.markov_w1(prev_draft)
        return self.markov_w2(e), e

    def confidence_logit(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        return self.confidence(torch.cat([hidden, prev_emb.to(hidden.dtype)], -1)).squeeze(-1)
