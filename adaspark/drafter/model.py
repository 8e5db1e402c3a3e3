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

The options the published formats need (docs/drafter-formats.md), each off in the shipped drafter:
per-head q/k RMSNorm before RoPE, RoPE on NeoX halves instead of interleaved pairs, the mask as a
target token's embedding row instead of a learned vector, W1 keyed by target id instead of draft
index, no confidence head, and an LM head of the file's own rows.
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
    mask_token: str = "learned_embedding"  # or "target_token": the target's row mask_token_id
    lm_head: str = "target_embedding_rows"  # frozen, rebuilt from the target at load; or "stored"
    topk: int = 8
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (both peers have it)
    rope_style: str = "interleaved"  # RoPE on pairs (2i, 2i+1); "neox": on (i, i + head_dim/2)
    # "target_token": the row the block's masks take; "learned_embedding": the row an exported
    # GGUF writes the learned vector into (None: chosen at export)
    mask_token_id: int | None = None
    markov_keys: str = "draft"  # W1's rows: "draft" index (+1 row for outside); "target" id
    target_vocab_size: int = 0  # W1's rows when markov_keys == "target"

    def __post_init__(self):
        choices = {"rope_style": ("interleaved", "neox"), "markov_keys": ("draft", "target"),
                   "mask_token": ("learned_embedding", "target_token"),
                   "lm_head": ("target_embedding_rows", "stored"), "markov_type": ("low_rank",)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"drafter {name} {getattr(self, name)!r}: not one of {allowed}")
        if self.mask_token == "target_token" and self.mask_token_id is None:
            raise ValueError("mask_token 'target_token' needs mask_token_id")
        if self.markov_keys == "target" and self.target_vocab_size < 1:
            raise ValueError("markov_keys 'target' needs target_vocab_size")

    @property
    def markov_rows(self) -> int:
        """W1's rows: one per draft index and one for outside, or one per target id."""
        return self.target_vocab_size if self.markov_keys == "target" else self.draft_vocab_size + 1

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


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, neox: bool = False) -> torch.Tensor:
    """Rotary embedding on adjacent pairs (neox: on the two halves, frequency i rotating
    (x_i, x_{i+hd/2})); x [..., heads, seq, hd], pos [seq] or [b, seq]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = pos.to(torch.float32)[..., None] * inv  # [..., seq, hd/2]
    if ang.dim() == 3:  # batched positions: broadcast over heads
        ang = ang[:, None]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    if neox:
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def neox_to_pairs(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k weight rows (or q/k norm weights) of NeoX heads reordered so that RoPE on adjacent
    pairs computes the same rotation: row 2i <- row i, row 2i+1 <- row i + hd/2 of each head.
    q and k move alike, so every score q.k keeps its terms."""
    shape = rows.shape
    return rows.reshape(-1, 2, head_dim // 2, *shape[1:]).transpose(1, 2).reshape(shape)


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
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.neox = c.rope_style == "neox"

    def _rope(self, x: torch.Tensor, pos: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """Per-head q or k [..., heads, seq, hd]: its norm (if any), then RoPE."""
        if norm is not None:
            x = norm(x)
        return rope(x, pos, self.c.rope_theta, self.neox)

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor):
        """feats [..., n, dim] -> K, V [..., kv_heads, n, hd]; K already rotated."""
        c = self.c
        shape = feats.shape[:-1]
        k = self.k(feats).view(*shape, c.n_kv_heads, c.head_dim).transpose(-2, -3)
        v = self.v(feats).view(*shape, c.n_kv_heads, c.head_dim).transpose(-2, -3)
        return self._rope(k, pos, self.k_norm), v

    def forward_cached(self, x, pos, k_buf, v_buf, n):
        """Inference, one block x [m, dim]: its K/V go to cache slots n..n+m-1 (scratch past the
        committed prefix, overwritten next round) so attention reads the cache without a copy."""
        c = self.c
        m = x.shape[0]
        g = c.n_heads // c.n_kv_heads
        h = self.attn_norm(x)
        q = self._rope(self.q(h).view(m, c.n_heads, c.head_dim).transpose(0, 1), pos, self.q_norm)
        k_buf[:, n : n + m] = self._rope(
            self.k(h).view(m, c.n_kv_heads, c.head_dim).transpose(0, 1), pos, self.k_norm)
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
        q = self._rope(self.q(h).view(b, m, c.n_heads, c.head_dim).transpose(1, 2), pos,
                       self.q_norm)
        k = self._rope(self.k(h).view(b, m, c.n_kv_heads, c.head_dim).transpose(1, 2), pos,
                       self.k_norm)
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

    def __init__(self, c: DrafterConfig, draft_ids: torch.Tensor, head: torch.Tensor,
                 mask_row: torch.Tensor | None = None):
        """draft_ids [V_d] target ids of the draft vocabulary; head [V_d, dim] frozen LM head;
        mask_row [dim]: the target's embedding of c.mask_token_id (mask_token "target_token")."""
        super().__init__()
        self.c = c
        self.fc = nn.Linear(len(c.target_layers) * c.dim, c.dim, bias=False)
        self.ctx_norm = RMSNorm(c.dim, c.norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        if c.mask_token == "learned_embedding":
            self.mask_embedding = nn.Parameter(0.02 * torch.randn(c.dim))
        else:  # a frozen row of the target's embedding, rebuilt at load like the head
            if mask_row is None or mask_row.shape != (c.dim,):
                raise ValueError(f"mask token {c.mask_token_id}: its embedding row [dim] needed")
            self.register_buffer("mask_embedding", mask_row.detach().float(), persistent=False)
        # keyed by draft index, W1 has one extra row for "previous token outside the draft
        # vocabulary"; keyed by target id (the peers' form), one row per target id
        self.markov_w1 = nn.Embedding(c.markov_rows, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)  # start as a pure parallel drafter
        self.confidence = nn.Linear(c.dim + c.markov_rank, 1) if c.confidence_head else None
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

    def markov_key(self, target_ids: torch.Tensor) -> torch.Tensor:
        """W1's row of each (previous) target id."""
        return target_ids if self.c.markov_keys == "target" else self.to_draft(target_ids)

    def markov_key_of_draft(self, draft_idx: torch.Tensor) -> torch.Tensor:
        """W1's row of each draft index (a pick's)."""
        return self.draft_ids[draft_idx] if self.c.markov_keys == "target" else draft_idx

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

    def markov_bias(self, prev_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_key: W1 rows (markov_key of the previous tokens)."""
        e = self.markov_w1(prev_key)
        return self.markov_w2(e), e

    def confidence_logit(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit; without one, zeros (sigmoid 1/2: no opinion)."""
        if self.confidence is None:
            return hidden.new_zeros(hidden.shape[:-1])
        return self.confidence(torch.cat([hidden, prev_emb.to(hidden.dtype)], -1)).squeeze(-1)
