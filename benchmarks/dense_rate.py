"""Read rate of the native dense (F16, BF16) matmul over a whole model's matrices at a few rows.

    .venv/bin/python benchmarks/dense_rate.py [--model F16.gguf] [--base HEAD] [--isa avx512]
                                              [--rows 1,2,4] [--reps 7] [--dtype f16,bf16,gguf]

Every layer's matrices of a dense GGUF (q|k|v, o, gate|up, down, fused as the target fuses
them) and the LM head (the token embeddings where tied) are packed by the working tree's build
and by the base's (the sources at --base, built as benchmarks/native_ab.py builds them), and one
pass multiplies each in a decode step's order by the same 1-row (or --rows) activations: the
weights stream from memory as a decode step reads them (the model is larger than the caches a
pass leaves warm). Passes alternate base / new (A B, B A, ...); prints each arm's median ms per
pass (and min: the least disturbed, on a shared machine), the GB/s of weight bytes it reads,
new / base, and whether every output was bit-identical
(a change meant to keep the arithmetic must show 0 differing). Compare the GB/s with
benchmarks/read_rate.cpp's ceiling. bf16: the F16 values rounded to bf16 and packed as such.
gguf: every tensor packed in its own type (a quantised model's integer kernels; any --model).
Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from native_ab import base_and_new

from adaspark import cpuinfo
from adaspark.model import native
from adaspark.model.gguf import read_gguf
from adaspark.model.native import blocks

DEFAULT = Path.home() / ".cache/adaspark/synthetic/smollm2-135m-F16.gguf"
LAYER = [["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT)
    p.add_argument("--base", default="HEAD", help="git revision of the base sources")
    p.add_argument("--isa", default="avx512", help="the build to compare (both arms)")
    p.add_argument("--rows", default="1")
    p.add_argument("--reps", type=int, default=7, help="passes per arm and row count")
    p.add_argument("--dtype", default="f16", help="f16, bf16, gguf (comma-separated)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def matrices(tensors) -> list[list[str]]:
    """Tensor names per fused weight, in a decode step's order."""
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("blk.")})
    out = [[f"blk.{i}.{part}.weight" for part in fused] for i in layers for fused in LAYER]
    return out + [["output.weight" if "output.weight" in tensors else "token_embd.weight"]]


def dense(module, values: list[np.ndarray], dtype: str):
    """One QWeight of dense parts, each values array [n, k] float16 (bf16: rounded first)."""
    parts = []
    for w in values:
        if dtype == "bf16":
            w = torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16).view(torch.int16)
            w = w.numpy().view(np.uint16)
        parts.append(native._dense_part(module, w, [w]))
    return module.QWeight(parts)


def packed(module, tensors, fused: list[str], dtype: str, values):
    """The fused weight of tensors `fused`: gguf as stored, else dense (values: their F16)."""
    if dtype == "gguf":
        return native.pack(module, [tensors[n] for n in fused])
    return dense(module, [values()[n] for n in fused], dtype)


def one_pass(weights, xs: dict[int, torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    start = time.perf_counter()
    outs = [w.matmul(xs[w.k]) for w in weights]
    return time.perf_counter() - start, outs


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    modules = base_and_new(args.base, args.isa)
    tensors = read_gguf(args.model).tensors
    names = matrices(tensors)
    dense_only = [d for d in args.dtype.split(",") if d != "gguf"]
    cache: dict[str, np.ndarray] = {}

    def values() -> dict[str, np.ndarray]:  # the F16 values, read on first use
        if not cache:
            cache.update({n: blocks.dense_values(tensors[n]) for fused in names for n in fused})
        return cache

    gguf_bytes = sum(np.asarray(tensors[n].data).nbytes for fused in names for n in fused)
    nbytes = sum(v.size * 2 for v in values().values()) if dense_only else gguf_bytes
    torch.manual_seed(0)
    print(f"{cpuinfo.name()}, {args.isa}, base {args.base}, {args.threads} thread(s), "
          f"{len(names)} matrices, {nbytes / 1e6:.0f} MB a pass, {args.reps} interleaved "
          f"passes per arm\n")
    print("| dtype | rows | base ms | new ms | base GB/s | new GB/s | new / base | min: base ms "
          "| new ms | new / base | differ |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype.split(","):
        weights = {arm: [packed(m, tensors, fused, dtype, values) for fused in names]
                   for arm, m in modules.items()}
        nbytes = gguf_bytes if dtype == "gguf" else sum(v.size * 2 for v in values().values())
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in {w.k for w in weights["new"]}}
            times: dict[str, list[float]] = {"base": [], "new": []}
            differ = 0
            for rep in range(args.reps + 1):  # the first pass of each arm untimed (page-in)
                outs = {}
                for arm in (("base", "new") if rep % 2 == 0 else ("new", "base")):
                    spent, outs[arm] = one_pass(weights[arm], xs)
                    if rep:
                        times[arm].append(spent)
                differ += sum(not torch.equal(a, b) for a, b in zip(outs["base"], outs["new"],
                                                                strict=True))
            b, n = statistics.median(times["base"]), statistics.median(times["new"])
            bm, nm = min(times["base"]), min(times["new"])
            print(f"| {dtype} | {rows} | {1e3 * b:.2f} | {1e3 * n:.2f} | {nbytes / b / 1e9:.1f} | "
                  f"{nbytes / n / 1e9:.1f} | {n / b:.3f} | {1e3 * bm:.2f} | {1e3 * nm:.2f} | "
                  f"{nm / bm:.3f} | {differ} |", flush=True)
        del weights
    return 0


if __name__ == "__main__":
    sys.exit(main())
