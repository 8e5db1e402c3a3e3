"""Each GGUF type's blocks as the native kernels read them, one function per type.

Integer types become (bits, u, d, m): u uint8 [N, nb, 32] in element order, d and m float32
[N, nb] (one scale and offset per block of 32) or [N, nb, 2] (per half block of 16: Q6_K), with
each element's value d*u + m exactly as gguf's own dequantiser computes it (up to the rounding
of its one product and sum). bits: the codes' width, 4, 5, 6 or 8 (u < 2^bits).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

from adaspark.model.gguf import GGUFTensor

Q = GGMLQuantizationType
GROUP = 32
SUPER = 256  # inputs per K-quant super-block

Blocks = tuple[int, np.ndarray, np.ndarray, np.ndarray]


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 codes: element j in byte j's low nibble, j+16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bit5(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes of high bits -> [.., 32] (bit j of the little-endian word)."""
    word = qh.copy().view(np.uint32)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def q4_0(b):
    d = _fp16(b, 0)
    return 4, _nibbles(b[..., 2:]), d, -8 * d


def q4_1(b):
    return 4, _nibbles(b[..., 4:]), _fp16(b, 0), _fp16(b, 2)


def q8_0(b):
    u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    d = _fp16(b, 0)
    return 8, u, d, -128 * d


def q5_0(b):
    d = _fp16(b, 0)
    return 5, _nibbles(b[..., 6:]) | (_bit5(b[..., 2:6]) << 4), d, -16 * d


def q5_1(b):
    return 5, _nibbles(b[..., 8:]) | (_bit5(b[..., 4:8]) << 4), _fp16(b, 0), _fp16(b, 2)


def _k_scales(b) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per block of 32, d*sc and -dmin*min in float32 (exact: an fp16 times a
    6-bit integer), by gguf's own unpacking of the 6-bit scales. b: [N, supers, bytes]."""
    n, s, _ = b.shape
    sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    d = _fp16(b, 0)[..., None] * sc.reshape(n, s, 8).astype(np.float32)
    m = -(_fp16(b, 2)[..., None] * mn.reshape(n, s, 8).astype(np.float32))
    return d.reshape(n, s * 8), m.reshape(n, s * 8)


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes of low nibbles -> [N, supers * 8, 32]: per 64 elements, 32 bytes,
    low nibbles first."""
    n, s, _ = qs.shape
    low = qs.reshape(n, s, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    return (low & 0x0F).reshape(n, s * 8, 32)


def q4_k(b):
    d, m = _k_scales(b)
    return 4, _k_low(b[..., 16:144]), d, m


def q5_k(b):
    d, m = _k_scales(b)
    n, s, _ = b.shape
    high = b[..., 16:48].reshape(n, s, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    return 5, _k_low(b[..., 48:176]) | ((high & 1).reshape(n, s * 8, 32) << 4), d, m


def q6_k(b):
    """Per 16 inputs an int8 scale times the super-block's fp16 d (exact in float32), codes
    q - 32 with q 6-bit: u = q, and m = -32 d per half block."""
    n, s, _ = b.shape
    low = b[..., :128].reshape(n, s, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    high = b[..., 128:192].reshape(n, s, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1)
    u = ((low & 0x0F).reshape(n, s * 8, 32) | ((high & 3).reshape(n, s * 8, 32) << 4))
    scales = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, s, 16]
    d = (_fp16(b, 208)[..., None] * scales).reshape(n, s * 8, 2)
    return 6, u.astype(np.uint8), d, -32 * d


Factors = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def k_factors(t: GGUFTensor) -> Factors | None:
    """A K-quant's scales as GGUF keeps them: (d fp16 [N, supers], its small integers per block
    [N, nb] (per half block [N, nb, 2]: Q6_K's int8), and the same for the minimums, negated:
    -dmin and min (None for Q6_K)), so that unsigned_blocks' d is d_super * d exactly; None for
    other types."""
    if t.qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return None
    n, k = t.shape
    _, size, _ = INTEGER[t.qtype]
    b = np.ascontiguousarray(t.data).reshape(n, k // SUPER, size)
    if t.qtype == Q.Q6_K:
        sc = b[..., 192:208].copy().view(np.int8).reshape(n, k // GROUP, 2)
        return _fp16(b, 208).astype(np.float16), sc, None, None
    sc, mn = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
    return (_fp16(b, 0).astype(np.float16), sc.reshape(n, k // GROUP).astype(np.uint8),
            (-_fp16(b, 2)).astype(np.float16), mn.reshape(n, k // GROUP).astype(np.uint8))


# type: (its function, bytes per block, inputs per block)
INTEGER = {Q.Q4_0: (q4_0, 18, GROUP), Q.Q4_1: (q4_1, 20, GROUP), Q.Q8_0: (q8_0, 34, GROUP),
           Q.Q5_0: (q5_0, 22, GROUP), Q.Q5_1: (q5_1, 24, GROUP), Q.Q4_K: (q4_k, 144, SUPER),
           Q.Q5_K: (q5_k, 176, SUPER), Q.Q6_K: (q6_k, 210, SUPER)}
DENSE = {Q.F16: np.float16, Q.BF16: np.uint16, Q.F32: np.float32}  # bf16 as its raw bits


def unsigned_blocks(t: GGUFTensor) -> Blocks:
    """An integer type's tensor in (bits, u, d, m) form."""
    if t.qtype not in INTEGER:
        raise ValueError(f"{t.qtype.name} cannot be packed for the native forward")
    unpack, size, inputs = INTEGER[t.qtype]
    n, k = t.shape
    return unpack(np.ascontiguousarray(t.data).reshape(n, k // inputs, size))


def dense_values(t: GGUFTensor) -> np.ndarray:
    """A dense type's tensor [N, k] as stored (bf16 as uint16 bits)."""
    n, k = t.shape
    return np.ascontiguousarray(t.data).view(np.uint8).view(DENSE[t.qtype]).reshape(n, k)


def why_not(t: GGUFTensor) -> str:
    """'' if the kernels take the tensor, else why not (in a few words)."""
    if t.qtype not in INTEGER and t.qtype not in DENSE:
        return f"type {t.qtype.name}"
    k = t.shape[-1] if len(t.shape) == 2 else 0
    inputs = INTEGER[t.qtype][2] if t.qtype in INTEGER else GROUP
    if len(t.shape) != 2 or k % inputs or k % GROUP:
        return f"{t.qtype.name} with {k} inputs (not whole blocks of {max(inputs, GROUP)})"
    return ""
