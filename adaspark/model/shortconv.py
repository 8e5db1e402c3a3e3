"""LFM2's gated short convolution, the mixer of its conv layers (llama.cpp: src/models/lfm2.cpp,
ggml_ssm_conv), on the torch path (reference and fast precision).

A conv layer, on the attention-normed row h:
    B, C, x = in_proj(h)          (the projection's output rows in that order, dim each)
    Bx = B * x
    conv = sum_k w[:, k] * Bx[t - (L-1) + k]   for k = 0 .. L-1 (tap 0 the oldest; no bias,
                                                no activation; Bx before the first token is 0)
    out = out_proj(C * conv)

The conv state is not a recurrent state kept apart: each row's Bx is written into the cache at
the row's slot, as attention writes K/V (cache.KVCache.conv), and a row's conv reads the Bx of
the L-1 rows before it ON ITS PATH: in a verified tree, its ancestors (by depth), then the
committed slots. So a tree row reads what the same row decoded alone would, whatever rows share
the call, and commit / truncate / reset / another sequence's slot carry the conv state exactly
as they carry K/V (docs/hybrid-targets.md says why this layout).

`sources` gives, per row and tap, the cache slot to read (-1: before the first token, 0); every
path (prefill, one-row step, chain, tree, the batched drafter-data paths) is that one table.
"""

from __future__ import annotations

from functools import cached_property

import torch

from adaspark.model.kernels import Linear

NO_SOURCE = -1  # a tap before the first token: reads 0


def chain_sources(positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """[..., n, L] slots of each row's taps where every row sits at the slot of its position
    and its predecessors before it (prefill, a chain, one row per sequence)."""
    taps = torch.arange(-(kernel - 1), 1, device=positions.device)
    src = positions[..., None] + taps
    return src.masked_fill(src < 0, NO_SOURCE)


def tree_sources(depths: torch.Tensor, ancestors: torch.Tensor, start: int,
                 kernel: int) -> torch.Tensor:
    """[n, L] slots of each tree row's taps: rows of the call sit at slots start + i; tap k of a
    row at depth d reads its ancestor at depth d - (L-1) + k (itself for the last tap), or the
    committed slot start + d - (L-1) + k where that depth is below the tree's root."""
    depths = depths.to(ancestors.device)
    n = depths.shape[0]
    if n == 1 and int(depths[0]) == 0:  # a decoding step: the committed slots before it
        return chain_sources(torch.tensor([start], device=ancestors.device), kernel)
    out = torch.empty(n, kernel, dtype=torch.long, device=ancestors.device)
    for k in range(kernel):
        want = depths - (kernel - 1) + k  # [n]
        hits = ancestors & (depths[None, :] == want[:, None])
        count = hits.sum(1)
        in_tree = want >= 0
        if bool(((count != 1) & in_tree).any()):
            raise ValueError("a tree row lacks exactly one ancestor at each depth above it "
                             "(ancestor mask and depths disagree)")
        committed = start + want
        out[:, k] = torch.where(in_tree, start + hits.to(torch.int8).argmax(1),
                                committed.masked_fill(committed < 0, NO_SOURCE))
    return out


class ShortConv:
    """One conv layer's weights: in_proj (B|C|x rows), the taps w [dim, L] float32 (the file
    keeps them F32), out_proj; the projections made when first used, as Block's are."""

    def __init__(self, tensors: dict, precision: str, device: torch.device, taps: torch.Tensor):
        self._tensors, self._precision, self._device = tensors, precision, device
        self.taps = taps.float().contiguous()  # [dim, L]

    @cached_property
    def in_proj(self) -> Linear:
        return Linear([self._tensors["in_proj"]], self._precision, self._device)

    @cached_property
    def out_proj(self) -> Linear:
        return Linear([self._tensors["out_proj"]], self._precision, self._device)

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out_proj]

    def __call__(self, h: torch.Tensor, kernel: str, history: torch.Tensor,
                 slots: int | torch.Tensor, sources: torch.Tensor,
                 act: torch.dtype) -> torch.Tensor:
        """h [B*n, dim] (act dtype) -> the mixer's output [B*n, dim] (act dtype). history: this
        layer's Bx slots [B, capacity, dim]; the rows' Bx go to slots start.. (an int) or to
        per-sequence slots (a [B] tensor, one row each); sources [B, n, L] (or [n, L]) the
        slots each row's taps read (NO_SOURCE: 0)."""
        b = history.shape[0]
        dim = self.taps.shape[0]
        bcx = self.in_proj(h, kernel).float().view(b, -1, 3 * dim)
        gate_b, gate_c, x = bcx.split(dim, dim=-1)
        bx = gate_b * x  # [B, n, dim]
        n = bx.shape[1]
        if isinstance(slots, int):
            history[:, slots:slots + n] = bx
        else:
            history[torch.arange(b, device=slots.device), slots] = bx[:, 0]
        sources = sources.expand(b, n, -1) if sources.dim() == 2 else sources
        valid = sources != NO_SOURCE
        rows = torch.arange(b, device=history.device)[:, None, None]
        window = history[rows, sources.clamp(min=0)].float()  # [B, n, L, dim]
        window = torch.where(valid[..., None], window, 0.0)
        conv = torch.zeros_like(bx)
        for k in range(self.taps.shape[1]):  # ggml_ssm_conv's order: oldest tap first, from 0
            conv = conv + window[:, :, k] * self.taps[:, k]
        y = (gate_c * conv).view(b * n, dim)
        return self.out_proj(y.to(act), kernel)
