"""Static KV cache: preallocated to the context, committed tokens in a contiguous prefix.

A verify writes its n rows' K/V at slots length .. length+n-1 without advancing `length`;
commit gathers the accepted rows into slots length .. length+len(path)-1 and advances it.
Sliding-window layers (Gemma 3's local ones) keep every slot as well: a committed slot's index
is its position, and the forward masks by position, so commit and truncate need nothing more.
Short-convolution layers (LFM2's) keep each slot's B*x in `conv` the same way (shortconv.py):
their conv state is the last L-1 committed slots, so commit, truncate and reset carry it too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from adaspark.errors import UserError

_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
    """Zeros; on the CPU from calloc (numpy's zeros), whose large blocks the OS maps in only
    when first written: a cache costs memory as its context fills, not the whole context at
    load (torch.zeros writes every page)."""
    if torch.device(device).type == "cpu" and dtype in _NUMPY:
        return torch.from_numpy(np.zeros(shape, _NUMPY[dtype]))
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", batch: int = 1,
                 conv_layers: int = 0, conv_dim: int = 0):
        """n_layers: the attention layers (K/V); conv_layers: the short-convolution layers,
        whose B*x rows of conv_dim values go to `conv` [conv_layers, batch, capacity, dim]."""
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        # zeros, not empty: masked-out slots still enter the reference attention as 0 * value
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)
        self.conv = lazy_zeros((conv_layers, batch, capacity, conv_dim), dtype, device)
        self.capacity = capacity
        self.length = 0  # committed tokens (single-sequence use)

    def check_room(self, rows: int) -> None:
        if self.length + rows > self.capacity:
            raise UserError(f"context full: {self.length} committed + {rows} new tokens exceed "
                            f"the context of {self.capacity}")

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [batch, n_kv_heads, n, head_dim] into slots start .. start+n-1."""
        n = k.shape[2]
        self.k[layer, :, :, start:start + n] = k
        self.v[layer, :, :, start:start + n] = v

    def commit(self, rows: Sequence[int]) -> None:
        """Move verified rows (indices from the last verify, root first) into the prefix."""
        rows = [int(r) for r in rows]
        self.check_room(max(rows, default=-1) + 1)
        if rows != list(range(len(rows))):  # a path that is already in place moves nothing
            src = torch.tensor(rows, device=self.k.device) + self.length
            dst = slice(self.length, self.length + len(rows))
            self.k[:, :, :, dst] = self.k.index_select(3, src)
            self.v[:, :, :, dst] = self.v.index_select(3, src)
            self.conv[:, :, dst] = self.conv.index_select(2, src)
        self.length += len(rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole context's slots (K, V and the conv layers' B*x)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.conv))

    def copy_prefix(self, other: KVCache, length: int) -> None:
        """Hold `other`'s first `length` committed slots (K/V and conv rows), nothing after:
        another sequence's prompt, shared without a forward (its bits are what a prefill of
        the same tokens would write: docs/batching.md, "Exactness")."""
        if not 0 <= length <= other.length or length > self.capacity:
            raise ValueError(f"cannot copy {length} slots of a cache of {other.length}")
        self.k[:, :, :, :length] = other.k[:, :, :, :length]
        self.v[:, :, :, :length] = other.v[:, :, :, :length]
        self.conv[:, :, :length] = other.conv[:, :, :length]
        self.length = length

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
