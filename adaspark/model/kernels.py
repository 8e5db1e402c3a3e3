"""Linear layers, each held in the forms its precision needs, and the choice of kernel by rows.

Kernels ("fast" precision on a CPU):
  int4  GGUF 4-bit blocks kept packed, multiplied by torch's `_weight_int4pack_mm_for_cpu`
        (bf16 activations, one scale and zero per 32 inputs, as in Q4_0/Q4_1). Q8_0 weights are
        split exactly into two 4-bit planes, q = 16*hi + lo, laid side by side along the input
        so one int4 call computes them (the tied LM head is Q8_0; a per-channel int8 requant
        flips ~4% of argmaxes, this split only rounds the block scales to bf16).
  bf16  dense bf16 weights (oneDNN: AVX-512 bf16 here, AMX where the CPU has it): a nearly
        flat cost up to ~16 rows, so it wins for wide verifies.
Reference precision keeps float32 weights dequantised by the gguf package.

The int4 cost grows with rows and bf16 barely does, so each row count has one fastest kernel:
`KernelTable` holds it, measured once per model and machine (cached on disk) or a default table.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from platformdirs import user_cache_dir

from adaspark import cpuinfo
from adaspark.model.gguf import GGUFTensor

Q = GGMLQuantizationType
GROUP = 32  # inputs per scale in Q4_0 / Q4_1 / Q8_0 blocks and in the int4 pack
KERNELS = ("int4", "bf16")
LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# Used when calibration is off: whole-model matmuls measured on the project's 2-core AVX-512
# machine: int4 7.8 ms at 1 row, 11.2 at 4, 34.9 at 16; bf16 ~30 ms flat to 16 rows.
DEFAULT_INT4_MAX_ROWS = 12
CALIBRATION_VERSION = "2"  # part of the cache key: a new rule never reads an old answer


# --- repacking GGUF blocks ---------------------------------------------------------------------

def _fp16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF 4-bit layout: byte j holds element j (low nibble) and element j+16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_planes(t: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8 [N, K'] in 0..15, scale [N, K'/32], zero [N, K'/32]) with value = (q-8)*s + z.

    Q8_0 gives K' = 2K: the high plane (signed hi times 16d) then the low plane (lo times d)."""
    n, k = t.shape
    if t.qtype == Q.Q4_0:
        b = t.data.reshape(n, k // GROUP, 18)
        d = _fp16_field(b, 0)
        return _nibbles(b[..., 2:]).reshape(n, k), d, np.zeros_like(d)
    if t.qtype == Q.Q4_1:
        b = t.data.reshape(n, k // GROUP, 20)
        d, m = _fp16_field(b, 0), _fp16_field(b, 2)
        return _nibbles(b[..., 4:]).reshape(n, k), d, m + 8 * d
    if t.qtype == Q.Q8_0:
        b = t.data.reshape(n, k // GROUP, 34)
        d = _fp16_field(b, 0)
        q = b[..., 2:].view(np.int8).astype(np.int16)
        hi, lo = (q >> 4) + 8, q & 0x0F  # q = 16*(hi-8) + lo, hi-8 in -8..7, lo in 0..15
        planes = np.concatenate([hi.reshape(n, k), lo.reshape(n, k)], axis=1).astype(np.uint8)
        return planes, np.concatenate([16 * d, d], 1), np.concatenate([0 * d, 8 * d], 1)
    raise ValueError(f"{t.qtype.name} has no int4 form")


class Int4Weight:
    """A [N, K] weight packed for `_weight_int4pack_mm_for_cpu`."""

    def __init__(self, tensors: Sequence[GGUFTensor], device: torch.device):
        parts = [int4_planes(t) for t in tensors]  # fused projections: stacked along N
        q, s, z = (np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        self.expand = q.shape[1] // tensors[0].shape[1]  # 2 for Q8_0's two planes
        q = torch.from_numpy(q.astype(np.int32))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2).to(device)
        sz = np.stack([s.T, z.T], axis=-1)  # [K'/32, N, 2]
        self.scales_zeros = torch.from_numpy(sz).to(torch.bfloat16).contiguous().to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.expand > 1:
            x = x.repeat(1, self.expand)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP,
                                                          self.scales_zeros)


# --- one projection in every form its precision runs -------------------------------------------

class Linear:
    """y = x W^T (+ b). W is one GGUF tensor or several fused along the output rows (q|k|v).

    Fast precision has an int4 form (where every part is 4-bit or Q8_0) and a bf16 form, each
    built from the GGUF blocks when first used (`build()` builds both): with the native forward
    they serve only the batched drafter-data paths, so a load does not pay for them.
    Reference keeps float32.
    """

    def __init__(self, tensors: Sequence[GGUFTensor], precision: str, device: torch.device,
                 bias: torch.Tensor | None = None):
        self.tensors = list(tensors)
        self.device = device
        self.out_features = sum(t.shape[0] for t in self.tensors)
        self.in_features = self.tensors[0].shape[1]
        self.bias = None if bias is None else bias.to(device)
        self.fp32: torch.Tensor | None = None
        if precision == "reference":
            self.fp32 = self._dense().to(device)
        elif self.bias is not None:
            self.bias = self.bias.to(torch.bfloat16)

    def _dense(self) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([t.dequantize() for t in self.tensors], axis=0))

    @cached_property
    def bf16(self) -> torch.Tensor:
        return self._dense().to(torch.bfloat16).to(self.device)

    @cached_property
    def int4(self) -> Int4Weight | None:
        if self.device.type == "cpu" and all(t.qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0)
                                             for t in self.tensors):
            return Int4Weight(self.tensors, self.device)
        return None

    def build(self) -> None:
        """Both fast forms now (the torch path's first request should not wait for them)."""
        if self.fp32 is None:
            _ = self.bf16, self.int4

    def __call__(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """x [M, K] (bf16 in fast precision, float32 in reference) -> [M, N], same dtype."""
        if self.fp32 is not None:
            return exact_linear(x, self.fp32, self.bias)
        if kernel == "int4" and self.int4 is not None:
            y = self.int4(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.bf16, self.bias)


def exact_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 x W^T whose every row is independent of the other rows in the call.

    The CPU fp32 GEMM picks its kernel (and blocking) by the row count and the thread count,
    so a row's last bits would depend on how many rows share the call; running every call as
    GEMMs of exactly 4 rows (the last padded with zeros) gives each row one kernel whatever the
    width, keeping reference verifies bit-for-bit comparable across tree widths."""
    m = x.shape[0]
    pad = -m % 4
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    y = torch.cat([F.linear(x[i:i + 4], w) for i in range(0, m + pad, 4)])[:m]
    return y if bias is None else y + bias


# --- choosing the kernel by row count ----------------------------------------------------------

class KernelTable:
    """The fastest kernel for each verify width; rows past the ladder's top use `wide` (bf16,
    flat in rows, unless the table is one kernel's)."""

    def __init__(self, best: dict[int, str], times_ms: dict[str, dict[int, float]] | None = None,
                 source: str = "given", wide: str = "bf16"):
        self.best = dict(sorted(best.items()))
        self.times_ms = times_ms or {}
        self.source = source  # how it was chosen, for benchmark and log lines
        self.wide = wide

    @classmethod
    def default(cls, source: str = "default table") -> KernelTable:
        return cls({n: "int4" if n <= DEFAULT_INT4_MAX_ROWS else "bf16" for n in LADDER},
                   source=source)

    @classmethod
    def only(cls, kernel: str) -> KernelTable:
        """Every row count on `kernel`, prefill chunks too: the native forward's table, where a
        token's K/V and a row's output must not depend on how many rows shared its call (a
        prompt over a cached prefix equals its whole prefill, docs/batching.md "Exactness")."""
        return cls({n: kernel for n in LADDER}, source=f"{kernel} only", wide=kernel)

    def choose(self, rows: int) -> str:
        for n, kernel in self.best.items():
            if rows <= n:
                return kernel
        return self.wide


def crossover_table(times: dict[str, dict[int, float]]) -> dict[int, str]:
    """int4 up to one width, bf16 above: int4's cost grows with rows and bf16's barely does,
    so there is one crossover. Placing it where the summed time over the ladder is least keeps
    one noisy sample (another process on the cores) from flipping a single width."""
    widths = sorted(times["int4"])

    def total(cut: int) -> float:
        return sum(times["int4" if n <= cut else "bf16"][n] for n in widths)

    cut = min([0, *widths], key=total)
    return {n: "int4" if n <= cut else "bf16" for n in widths}


def measure_kernels(linears: Sequence[Linear], reps: int = 5,
                    ladder: Sequence[int] = LADDER) -> dict[str, dict[int, float]]:
    """Minimum time (ms) to run all `linears` once, per kernel and row count.

    Kernels and widths are interleaved and the minimum over repetitions is kept, so a busy
    machine (other processes on the same cores) slows the measurement but does not skew it."""
    xs = {k: torch.randn(max(ladder), k).to(torch.bfloat16)
          for k in {lin.in_features for lin in linears}}
    best: dict[str, dict[int, float]] = {k: {} for k in KERNELS}
    with torch.inference_mode():
        for _ in range(reps):
            for n in ladder:
                for kernel in KERNELS:
                    start = time.perf_counter()
                    for lin in linears:
                        lin(xs[lin.in_features][:n], kernel)
                    ms = (time.perf_counter() - start) * 1e3
                    best[kernel][n] = min(best[kernel].get(n, float("inf")), ms)
    return best


def calibrated_table(linears: Sequence[Linear], model_key: str) -> KernelTable:
    """Measure once per (model, machine, torch, threads); later loads read the cached answer.

    On a machine already busier than its cores (load average), timings say more about the
    other processes than about the kernels: use the default table and measure another time."""
    machine = "|".join([CALIBRATION_VERSION, platform.machine(), cpuinfo.name(),
                        torch.__version__, str(torch.get_num_threads())])
    key = hashlib.sha256(f"{model_key}|{machine}".encode()).hexdigest()[:16]
    path = Path(user_cache_dir("adaspark")) / "kernels" / f"{key}.json"
    try:
        saved = json.loads(path.read_text())
        return KernelTable({int(n): k for n, k in saved["best"].items()},
                           {k: {int(n): t for n, t in v.items()}
                            for k, v in saved["times_ms"].items()}, f"calibration {path}")
    except (OSError, ValueError, KeyError):
        pass
    if os.getloadavg()[0] > (os.cpu_count() or 1) - 0.5:
        return KernelTable.default("default table (machine too busy to calibrate)")
    times = measure_kernels(linears)
    best = crossover_table(times)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"machine": machine, "model": model_key, "best": best,
                               "times_ms": times}, indent=1))
    os.replace(tmp, path)
    return KernelTable(best, times, f"measured now, saved to {path}")
