"""The native forward: load the build this CPU runs best, repack weights for it.

`load()` returns the compiled module (module.cpp and the headers it includes) or None with a
one-line reason; the torch path runs then. ADASPARK_NATIVE=avx2 forces a build (tests run every
path the build has), ADASPARK_NATIVE=off turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType

from adaspark import cpuinfo
from adaspark.model.gguf import GGUFTensor
from adaspark.model.native import blocks
from adaspark.model.native.paths import BUILD_DIR, PREFERENCE, module_name, source_hash

Q = GGMLQuantizationType
GROUP = 32
# Values a chunk of rows holds while being packed or measured (a multiple of 16 rows): the
# temporaries are a few times a chunk, not a few times a vocabulary.
CHUNK_VALUES = 1 << 18
PACKABLE = (*blocks.INTEGER, *blocks.DENSE)
# what each build was compiled for (paths.ISA_FLAGS), as /proc/cpuinfo names it
_CPU_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c"},
              "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
              "avx2": {"avx2", "fma", "f16c"}}


def runnable_isas() -> list[str]:
    """The builds this CPU can run, best first."""
    flags = cpuinfo.flags()
    return [isa for isa in PREFERENCE if _CPU_NEEDS[isa] <= flags]


@cache
def load_isa(isa: str) -> tuple[ModuleType | None, str]:
    """One build's module, or None and why not."""
    so = next((BUILD_DIR / isa).glob(f"{module_name(isa)}*.so"), None)
    if so is None:
        return None, f"no {isa} build (run scripts/setup.sh)"
    stamp = BUILD_DIR / isa / "source.sha256"
    if not stamp.exists() or stamp.read_text().strip() != source_hash():
        return None, f"the {isa} build is older than its sources (run scripts/setup.sh)"
    if isa not in runnable_isas():
        return None, f"this CPU cannot run the {isa} build"
    name = module_name(isa)
    if name in sys.modules:  # an extension initialises once per process
        return sys.modules[name], ""
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, ""


def load() -> tuple[ModuleType | None, str]:
    """The build to use (ADASPARK_NATIVE names one, or 'off'), or None and why not."""
    wanted = os.environ.get("ADASPARK_NATIVE", "auto")
    if wanted == "off":
        return None, "turned off by ADASPARK_NATIVE=off"
    reasons = []
    for isa in ([wanted] if wanted != "auto" else list(PREFERENCE)):
        module, why = load_isa(isa)
        if module is not None:
            return module, ""
        reasons.append(why)
    return None, "; ".join(reasons) or "no build runs on this CPU"


# --- repacking GGUF blocks into value = d*u + m, u unsigned (blocks.py), or dense floats --------

Blocks = blocks.Blocks  # bits, u [N, nb, 32], d, m [N, nb] or [N, nb, 2]
unsigned_blocks = blocks.unsigned_blocks


def quantize_q8_0(w: torch.Tensor) -> Blocks:
    """A float [n, k] weight as Q8_0 (ggml's: per block of 32, d = max|w|/127 in fp16, w ~ d*q
    with q = round(w/d) in -127..127), in unsigned_blocks' form."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"a weight of {k} inputs is not whole blocks of {GROUP}")
    x = w.detach().float().cpu().numpy().reshape(n, k // GROUP, GROUP)
    d = (np.abs(x).max(-1) / 127).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(x * inv[..., None]), -127, 127)
    return 8, (q + 128).astype(np.uint8), d, -128 * d


def quantize_q4_1(w: torch.Tensor) -> Blocks:
    """A float [n, k] weight as Q4_1 (ggml's: per block of 32, m = min(w) and d = (max - min)/15
    in fp16, w ~ d*u + m with u = round((w - m)/d) in 0..15), in unsigned_blocks' form."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"a weight of {k} inputs is not whole blocks of {GROUP}")
    x = w.detach().float().cpu().numpy().reshape(n, k // GROUP, GROUP)
    lo = x.min(-1).astype(np.float16).astype(np.float32)
    d = ((x.max(-1) - lo) / 15).astype(np.float16).astype(np.float32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    u = np.clip(np.rint((x - lo[..., None]) * inv[..., None]), 0, 15)
    return 4, u.astype(np.uint8), d, lo


def as_rows(t: GGUFTensor) -> GGUFTensor:
    """A 3-D expert tensor [experts, rows, inputs] as one matrix [experts * rows, inputs] (a
    view of its blocks): packed whole, each expert's rows are then a slice of the packed
    weight (moe.h part_slice). 2-D tensors as they are."""
    if len(t.shape) != 3:
        return t
    e, rows, k = t.shape
    return GGUFTensor(t.name, t.qtype, (e * rows, k), np.asarray(t.data).reshape(e * rows, -1))


def pack(module: ModuleType, tensors: Sequence[GGUFTensor]):
    """One QWeight for GGUF tensors fused along their outputs (q|k|v, gate|up), each in its own
    type (a part)."""
    return module.QWeight([_part(module, t) for t in tensors])


def pack_blocks(module: ModuleType, parts: Sequence[Blocks]):
    """One QWeight for weights in unsigned-block form fused along their outputs."""
    return module.QWeight([_integer_part(module, len(p[1]), [p]) for p in parts])


def pack_embeddings(module: ModuleType, t: GGUFTensor):
    """The embedding table as a QWeight whose rows() are its gguf values: packed where the
    kernels take its type, else its float32 values as a dense part."""
    if packable([t]):
        return pack(module, [t])
    values = t.dequantize()
    return module.QWeight([_dense_part(module, values, [values])])


def _chunk_rows(k: int) -> int:
    return max(16, CHUNK_VALUES // max(k, 1) // 16 * 16)


def row_chunks(t: GGUFTensor, rows: int | None = None) -> Iterator[GGUFTensor]:
    """t as consecutive tensors of `rows` rows (default: about CHUNK_VALUES values, whole
    groups of 16), views of its data."""
    n, k = t.shape
    rows = rows or _chunk_rows(k)
    data = np.asarray(t.data).reshape(n, -1)
    for r in range(0, n, rows):
        yield GGUFTensor(t.name, t.qtype, (min(rows, n - r), k), data[r:r + rows])


def _part(module: ModuleType, t: GGUFTensor):
    if t.qtype in blocks.DENSE:
        return _dense_part(module, blocks.dense_values(t),
                           (blocks.dense_values(c) for c in row_chunks(t)))
    return _integer_part(module, t.shape[0], (unsigned_blocks(c) for c in row_chunks(t)),
                         blocks.k_factors(t))


def _by_groups(a: np.ndarray) -> tuple[np.ndarray, int]:
    """[n, ...] padded with zero rows to whole groups of 16, as [groups, 16, ...]."""
    pad = -len(a) % 16
    a = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(len(a) // 16, 16, *a.shape[1:]), len(a) // 16


def _dense_part(module: ModuleType, w: np.ndarray, chunks: Iterable[np.ndarray]):
    """Dense weights [n, k] in fdot.h's layout: [groups, k, 16], from w's rows in chunks of
    whole groups."""
    n, k = w.shape
    out = np.empty(((n + 15) // 16, k, 16), w.dtype)
    at = 0
    for c in chunks:
        g, groups = _by_groups(c)
        out[at:at + groups] = g.transpose(0, 2, 1)
        at += groups
    q = torch.from_numpy(out.reshape(-1))
    if w.dtype == np.uint16:  # bf16 bits
        q = q.view(torch.int16).view(torch.bfloat16)
    return module.QPart(n, k, q)


def _zero(d: np.ndarray, m: np.ndarray, bits: int) -> int:
    """z where every m is exactly -z*d (an integer path), else 0 (the m term in float)."""
    at = np.flatnonzero(d)
    ratio = -float(m.flat[at[0]]) / float(d.flat[at[0]]) if at.size else 0.0
    if not 0 < ratio < 1 << bits:
        return 0
    z = round(ratio)
    return z if np.array_equal(m, -np.float32(z) * d) else 0


def _codes(u: np.ndarray, bits: int) -> np.ndarray:
    """Codes [n, nb, 32] as qweight.h stores them: [groups, nb, block bytes / 16]."""
    _, nb, _ = u.shape
    if int(u.max(initial=0)) >= 1 << bits:
        raise ValueError(f"codes over {bits} bits")
    ug, groups = _by_groups(u)
    # [group, out16, block, chunk8, 4] -> [group, block, chunk8, out16, 4]
    chunks = ug.reshape(groups, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(groups, nb, 8, 64)
    q = chunks if bits == 8 else _nibble_planes(chunks, bits)
    return q.reshape(groups, nb, -1)


def _integer_part(module: ModuleType, n: int, parts: Iterable[Blocks],
                  factors: blocks.Factors | None = None):
    """One type's blocks (given as consecutive chunks of whole groups of 16 rows, n rows in
    all) in kernels' layout (qweight.h): groups of 16 outputs, per block 8 chunks of 4 inputs
    x 16 outputs; scales [groups, blocks, halves, 16]: K-quants' as their factors (an fp16 per
    8 blocks times small integers per block), others fp16 where every one is exactly an fp16,
    else float32."""
    q, ds, ms, at = None, [], [], 0
    for bits, u, d, m in parts:
        codes = _codes(u, bits)
        if q is None:
            q = np.empty(((n + 15) // 16, *codes.shape[1:]), np.uint8)
        q[at:at + len(codes)] = codes
        at += len(codes)
        ds.append(d)
        ms.append(m)
    nb = q.shape[1]
    halves = 2 if ds[0].ndim == 3 else 1
    d, m = (np.concatenate(a).reshape(n, nb, halves).astype(np.float32) for a in (ds, ms))
    del ds, ms
    zero = _zero(d, m, bits)
    if halves == 2 and not zero:
        raise ValueError("scales per half block need m = -zero*d")
    scales = [_scale_layout(a) for a in (d, m)]
    with np.errstate(over="ignore"):  # a scale past fp16's range: float32 then
        exact = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in scales)
    scales = [a.astype(np.float16) if exact else a for a in scales]
    supers = [np.zeros(0, np.float16)] * 2
    if factors is not None:  # 1.25 bytes a scale, not 2 or 4
        scales, supers = _factor_layout(factors, d, m, zero, nb)
    if zero:  # m is not read with a zero (halves 2: the second half's d takes its place)
        scales[1], supers[1] = scales[1][:0], supers[1][:0]
    return module.QPart(bits, n, nb * GROUP, torch.from_numpy(np.ascontiguousarray(q).reshape(-1)),
                        *(torch.from_numpy(a.reshape(-1)) for a in scales), zero, halves,
                        *(torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in supers))


def _scale_layout(a: np.ndarray) -> np.ndarray:
    """[n, nb, halves] -> [groups, nb, halves, 16]."""
    return np.ascontiguousarray(_by_groups(a)[0].transpose(0, 2, 3, 1))


def _factor_layout(factors: blocks.Factors, d: np.ndarray, m: np.ndarray, zero: int, nb: int):
    """K-quant factors in qweight.h's layout, checked to give the scales exactly."""
    d_super, d_small, m_super, m_small = factors
    if m_super is None:  # Q6_K: a zero instead of minimums
        m_super, m_small = d_super, d_small
    n = len(d)
    halves = d.shape[-1]
    smalls = [_scale_layout(a.reshape(n, nb, halves)) for a in (d_small, m_small)]
    supers = [np.ascontiguousarray(_by_groups(a)[0].transpose(0, 2, 1)) for a in (d_super, m_super)]
    checked = [(smalls[0], supers[0], d)] + ([] if zero else [(smalls[1], supers[1], m)])
    for small, sup, full in checked:
        product = np.repeat(sup.astype(np.float32), 8, axis=1)[:, :, None, :] * small
        if not np.array_equal(product, _scale_layout(full)):
            raise ValueError("K-quant scale factors do not give the block scales")
    return smalls, supers


def _nibble_planes(chunks: np.ndarray, bits: int) -> np.ndarray:
    """Codes of 4 to 6 bits [groups, nb, 8 chunks, 64] as qweight.h stores them: the low nibbles
    of chunks 2i, 2i+1 in one 64-byte row, then bits - 4 rows of high bits (5 bits: bit j of a
    byte for chunk j; 6 bits: bits 2j, 2j+1 of row p for chunk 4p + j)."""
    low, high = chunks & 0x0F, chunks >> 4
    rows = [low[:, :, 0::2] | (low[:, :, 1::2] << 4)]
    if bits == 5:
        rows.append(sum(high[:, :, j:j + 1] << j for j in range(8)).astype(np.uint8))
    if bits == 6:
        for p in range(2):
            rows.append(sum(high[:, :, 4 * p + j:4 * p + j + 1] << 2 * j
                            for j in range(4)).astype(np.uint8))
    return np.concatenate(rows, axis=2)


def _per_element(b: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """d, m of each element [N, nb, 32]."""
    _, u, d, m = b
    if d.ndim == 2:
        return d[..., None], m[..., None]
    return np.repeat(d, 16, axis=-1), np.repeat(m, 16, axis=-1)


def error_scales(t: GGUFTensor, rows: int | None = None) -> torch.Tensor:
    """[2, blocks] float32: per block, the largest sum of |w| over the outputs (the int8
    rounding of half a step per input costs at most that much per unit step) and the largest
    sum of |d*u| + |m| (what float rounding scales with). Their use: target.h's head. A dense
    weight's float32 chains (k/2 + 1 roundings of their terms) fit that formula's budget with
    4 times the sum of |w| in the second place. Taken `rows` outputs at a time: a vocabulary's
    float temporaries would otherwise be several times the packed head."""
    parts = [_error_scales(c) for c in row_chunks(t, rows)]
    return torch.from_numpy(np.max(parts, axis=0) * np.float32(1 + 2**-10))


def _error_scales(t: GGUFTensor) -> np.ndarray:
    if t.qtype in blocks.DENSE:
        n, k = t.shape
        w = np.abs(t.dequantize().astype(np.float32)).reshape(n, k // GROUP, GROUP).sum(-1)
        return np.stack([w.max(0), 4 * w.max(0)])
    b = unsigned_blocks(t)
    d, m = _per_element(b)
    u = b[1].astype(np.float32)
    w = np.abs(d * u + m).sum(-1)
    terms = (np.abs(d * u) + np.abs(m)).sum(-1)
    return np.stack([w.max(0), terms.max(0)]).astype(np.float32)


def row_norms(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows]: each row's Euclidean norm, rounded up (target.h's head bounds a logit's
    activation rounding by it)."""
    return (w.double().norm(dim=-1) * (1 + 2**-20)).float()


def packed_row_norms(w) -> torch.Tensor:
    """row_norms of a QWeight's rows as gguf dequantises them, a chunk of rows at a time."""
    rows, out = _chunk_rows(w.k), torch.empty(w.n)
    for r in range(0, w.n, rows):  # into one tensor: no small survivors between temporaries
        out[r:r + rows] = row_norms(w.rows(torch.arange(r, min(r + rows, w.n))))
    return out


def unpackable(tensors: Sequence[GGUFTensor]) -> str:
    """'' if the native forward takes every tensor, else one line naming the first it does not
    take and why."""
    for t in tensors:
        why = blocks.why_not(t)
        if why:
            return f"the native forward does not take {t.name} ({why})"
    return ""


def packable(tensors: Sequence[GGUFTensor]) -> bool:
    return not unpackable(tensors)
