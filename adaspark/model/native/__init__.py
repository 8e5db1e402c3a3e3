"""The native forward: load the build this CPU runs best, repack weights for it.

`load()` returns the compiled module (module.cpp and the headers it includes) or None with a
one-line reason; the torch path runs then. ADASPARK_NATIVE=avx2 forces a build (tests run every
path the build has), ADASPARK_NATIVE=off turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from functools import cache
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType

from adaspark import cpuinfo
from adaspark.model.gguf import GGUFTensor
from adaspark.model.native.paths import BUILD_DIR, PREFERENCE, module_name, source_hash

Q = GGMLQuantizationType
GROUP = 32
PACKABLE = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
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


# --- repacking GGUF blocks into value = d*u + m, u unsigned ---------------------------------------

def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


Blocks = tuple[int, np.ndarray, np.ndarray, np.ndarray]  # bits, u [N, nb, 32], d, m [N, nb]


def unsigned_blocks(t: GGUFTensor) -> Blocks:
    """(bits, u uint8 [N, nb, 32] in element order, d [N, nb], m [N, nb]) with each element's
    value d*u + m exactly as the GGUF block defines it."""
    n, k = t.shape
    if t.qtype in (Q.Q4_0, Q.Q4_1):
        size = 18 if t.qtype == Q.Q4_0 else 20
        b = t.data.reshape(n, k // GROUP, size)
        qs = b[..., size - 16:]
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # byte j: element j and j+16
        d = _fp16(b, 0)
        m = _fp16(b, 2) if t.qtype == Q.Q4_1 else -8 * d
        return 4, u, d, m
    if t.qtype == Q.Q8_0:
        b = t.data.reshape(n, k // GROUP, 34)
        u = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        d = _fp16(b, 0)
        return 8, u, d, -128 * d
    raise ValueError(f"{t.qtype.name} cannot be packed for the native forward")


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


def pack(module: ModuleType, tensors: Sequence[GGUFTensor]):
    """One QWeight for GGUF tensors fused along their outputs (q|k|v, gate|up)."""
    return pack_blocks(module, [unsigned_blocks(t) for t in tensors])


def pack_blocks(module: ModuleType, parts: Sequence[Blocks]):
    """One QWeight for weights in unsigned-block form fused along their outputs, in kernels.h's
    layout: groups of 16 outputs, per block 8 chunks of 4 inputs x 16 outputs."""
    if len({p[0] for p in parts}) > 1:  # one packing per weight: widen 4-bit parts to 8 bits
        parts = [(8, *p[1:]) for p in parts]
    bits = parts[0][0]
    u, d, m = (np.concatenate([p[i] for p in parts], axis=0) for i in (1, 2, 3))
    n, nb, _ = u.shape
    pad = -n % 16
    u = np.pad(u, ((0, pad), (0, 0), (0, 0)))
    d, m = (np.pad(a, ((0, pad), (0, 0))) for a in (d, m))
    groups = (n + pad) // 16
    # [group, out16, block, chunk8, 4] -> [group, block, chunk8, out16, 4]
    chunks = u.reshape(groups, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(groups, nb, 8, 64)
    q = chunks[:, :, 0::2] | (chunks[:, :, 1::2] << 4) if bits == 4 else chunks
    half = [np.ascontiguousarray(a.reshape(groups, 16, nb).transpose(0, 2, 1)).astype(np.float16)
            for a in (d, m)]
    for a, full in zip(half, (d, m), strict=True):  # m = -8d or -128d must stay exact
        if not np.array_equal(a.astype(np.float32).transpose(0, 2, 1).reshape(-1, nb), full):
            raise ValueError("a block scale does not fit fp16 exactly")
    middle = 1 << (bits - 1)  # Q8_0's m = -128 d and Q4_0's m = -8 d: integer arithmetic
    zero = middle if np.array_equal(m, -middle * d) else 0
    return module.QWeight(bits, n, nb * GROUP,
                          torch.from_numpy(np.ascontiguousarray(q).reshape(-1)),
                          *(torch.from_numpy(a.reshape(-1)) for a in half), zero)


def error_scales(t: GGUFTensor) -> torch.Tensor:
    """[2, blocks] float32: per block, the largest sum of |w| over the outputs (the int8
    rounding of half a step per input costs at most that much per unit step) and the largest
    sum of |d*u| + |m| (what float rounding scales with). Their use: target.h's head."""
    _, u, d, m = unsigned_blocks(t)
    w = np.abs(d[..., None] * u.astype(np.float32) + m[..., None]).sum(-1)
    terms = (np.abs(d[..., None] * u.astype(np.float32)) + np.abs(m[..., None])).sum(-1)
    return torch.from_numpy(np.stack([w.max(0), terms.max(0)]).astype(np.float32) * (1 + 2**-10))


def row_norms(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows]: each row's Euclidean norm, rounded up (target.h's head bounds a logit's
    activation rounding by it)."""
    return (w.double().norm(dim=-1) * (1 + 2**-20)).float()


def packable(tensors: Sequence[GGUFTensor]) -> bool:
    return all(t.qtype in PACKABLE and t.shape[1] % GROUP == 0 for t in tensors)
