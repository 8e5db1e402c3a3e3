"""The drafter on the native build (model/native/drafter.h): weights quantised once at load,
features in an fp16 cache, a whole draft in one call.

The checkpoint's float32 matrices become Q8_0 (ggml's 8-bit blocks), so the backbone runs on
the target's integer kernels; fc (it reads the target's residual streams, whose outlier channels
would coarsen int8 blocks), norms, the mask vector and the Markov and confidence heads stay
float32 arithmetic (fc's weights stored as fp16 where each is one: the same values). At seven
rows every matmul is bound by reading its weights, so 8 bits read half of bf16's bytes, and one
call replaces some sixty torch ops.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from adaspark.drafter.model import DraftModel, neox_to_pairs, rope_tables
from adaspark.drafter.runtime import DrafterCache
from adaspark.model.native import pack_blocks, quantize_q4_1, quantize_q8_0

HEAD_QUANTS = {8: quantize_q8_0, 4: quantize_q4_1}  # the head's bits -> its block type


def _q8(module: ModuleType, *weights: torch.Tensor):
    """One QWeight for weights fused along their outputs."""
    return pack_blocks(module, [quantize_q8_0(w) for w in weights])


def half_if_exact(module: ModuleType, weight: torch.Tensor, takes: str) -> torch.Tensor:
    """Weights for the native drafter: fp16 where every weight is exactly one (an exported
    checkpoint's are: half the bytes read, the same float32 values computed) and the build
    takes them (its attribute `takes`; benchmarks/native_ab.py loads older builds), else
    float32."""
    w = weight.detach().float().contiguous()
    half = w.half()
    exact = getattr(module, takes, False) and torch.equal(half.float(), w)
    return half if exact else w


def fc_weights(module: ModuleType, weight: torch.Tensor) -> torch.Tensor:
    """fc's weights for the native append (FC_HALF builds take fp16)."""
    return half_if_exact(module, weight, "FC_HALF")


def _unit_scale(w: torch.Tensor) -> float:
    """The power of two that brings w's largest magnitude into [0.5, 1) (1 for zeros)."""
    top = float(w.detach().abs().max())
    return 1.0 if top == 0.0 else 2.0 ** -math.frexp(top)[1]


def native_drafter(module: ModuleType, model: DraftModel, positions: int, head_bits: int = 8):
    """The native Drafter for a float32 DraftModel, RoPE tables for `positions` positions.

    head_bits: the head's blocks, Q8_0 (8) or Q4_1 (4: half the bytes and, on AVX2 without
    VNNI, fewer integer ops a product; it changes which tokens are proposed, never which are
    emitted).

    The native build rotates adjacent pairs: a NeoX drafter's q/k rows (and q/k norm weights)
    are reordered to pairs here (neox_to_pairs), the same rotation. A drafter without a
    confidence head gets zero weights: a confidence of 1/2 on every row, as the torch path.
    A build older than the drafter options refuses them (the torch path runs)."""
    c = model.c
    cos, sin = rope_tables(c.head_dim, c.rope_theta, positions)
    f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
    needs = (c.qk_norm or c.markov_keys == "target")
    if needs and not hasattr(module.Drafter, "set_markov_keys"):
        raise RuntimeError("this native build predates q/k norms and target-keyed Markov heads")
    pairs = (lambda w: neox_to_pairs(w.detach(), c.head_dim)) if c.rope_style == "neox" else (
        lambda w: w)
    if model.confidence is None:
        conf_w, conf_b = torch.zeros(c.dim + c.markov_rank), 0.0
    else:
        conf_w = f32(model.confidence.weight).flatten()
        conf_b = float(model.confidence.bias.detach())
    if head_bits not in HEAD_QUANTS:
        raise ValueError(f"head_bits must be one of {sorted(HEAD_QUANTS)}, not {head_bits}")
    head = pack_blocks(module, [HEAD_QUANTS[head_bits](model.head)])
    out = module.Drafter(
        c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.block_size, c.norm_eps, cos, sin,
        fc_weights(module, model.fc.weight), f32(model.ctx_norm.weight), f32(model.mask_embedding),
        f32(model.norm.weight), head, f32(model.markov_w1.weight),
        half_if_exact(module, model.markov_w2.weight, "MARKOV_HALF"), conf_w, conf_b,
        f32(model.temperature))
    for ly in model.layers:
        q, k = pairs(ly.q.weight), pairs(ly.k.weight)
        norms = {}
        if ly.q_norm is not None:
            # q/k rows scaled by a power of two sigma, and the norms' epsilon by sigma^2, give
            # the same normed q/k (RMSNorm(sigma y; sigma^2 eps) = RMSNorm(y; eps)): rows that
            # an exported drafter shrank to make its norm an identity (drafter/export.py) stay
            # within Q8_0's fp16 scales
            sigma = _unit_scale(torch.cat([q, k]))
            q, k = q * sigma, k * sigma
            norms = {"q_norm": f32(pairs(ly.q_norm.weight)), "k_norm": f32(pairs(ly.k_norm.weight)),
                     "qk_eps": c.norm_eps * sigma * sigma}
        out.add_layer(f32(ly.attn_norm.weight), f32(ly.ffn_norm.weight),
                      _q8(module, q, k, ly.v.weight), _q8(module, k, ly.v.weight),
                      _q8(module, ly.o.weight), _q8(module, ly.gate.weight, ly.up.weight),
                      _q8(module, ly.down.weight), **norms)
    if c.markov_keys == "target":
        out.set_markov_keys(model.draft_ids)
    from adaspark.drafter.runtime import markov_bound, markov_table

    table = markov_table(model.markov_w1.weight, model.markov_w2.weight,
                         model.draft_ids if c.markov_keys == "target" else None)
    if table is not None and hasattr(out, "set_markov_table"):  # a row's few candidates
        out.set_markov_table(*table)
    elif hasattr(out, "set_markov_bound"):  # the exact shortlist's per-candidate caps
        out.set_markov_bound(*markov_bound(model.markov_w2.weight))
    return out


class NativeCache(DrafterCache):
    """The drafter's K/V of context features in one fp16 tensor each, [layers, kv_heads,
    capacity, head_dim], written by the native drafter."""

    def __init__(self, drafter, model: DraftModel, capacity: int, positions: int):
        c = model.c
        self.drafter = drafter
        self.positions = positions  # the RoPE table's length: the most the cache can hold
        self.length = 0
        capacity = min(capacity, positions)
        self.k = torch.zeros(c.n_layers, c.n_kv_heads, capacity, c.head_dim, dtype=torch.float16)
        self.v = torch.zeros_like(self.k)

    def _grow(self, need: int) -> None:
        if need > self.positions:
            raise ValueError(f"the drafter's positions end at {self.positions}; {need} needed")
        cap = self.k.shape[2]
        if need <= cap:
            return
        new = min(max(need, 2 * cap), self.positions)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new, old.shape[3])
            grown[:, :, :cap] = old
            setattr(self, name, grown)

    def append(self, taps: torch.Tensor) -> None:
        """taps [n, n_taps, dim]: target hidden states of n newly committed tokens, in order."""
        n = taps.shape[0]
        if n == 0:
            return
        self._grow(self.length + n)
        self.drafter.append(self.k, self.v, taps.reshape(n, -1).float(), self.length)
        self.length += n
