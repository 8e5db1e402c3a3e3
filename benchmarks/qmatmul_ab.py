"""A/B of the quantised matmul alone: the native build against its sources at a git revision.

    .venv/bin/python benchmarks/qmatmul_ab.py [--base HEAD] [--isa avx2] [--rows 1,2,4,8,16]
                                              [--reps 40] [--threads 1]

The embedded model's matrices of each kind (an FFN down and the fused gate|up and q|k|v of
layer 0, Q4_1; the Q8_0 LM head), packed by the working tree's build and by the base's (built
as benchmarks/native_ab.py builds it), multiplied by the same random rows in one process,
interleaved (A B, B A, ...), each call right after an untimed one (weights as warm as the
cache holds them). Prints min and median ms of each and whether the two builds' outputs are
bit-identical (a kernel change meant to keep the arithmetic must show 0 differing). Timing
lives here, never in tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from native_ab import base_and_new

from adaspark import cpuinfo
from adaspark.model import native
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model

WEIGHTS = {"down": ["blk.0.ffn_down.weight"],
           "gate|up": ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"],
           "q|k|v": ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
           "head": ["token_embd.weight"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of the base sources")
    p.add_argument("--isa", default="avx2", help="the build to compare (both arms)")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    modules = base_and_new(args.base, args.isa)
    tensors = read_gguf(resolve_model(None)).tensors
    weights = {(arm, name): native.pack(m, [tensors[t] for t in parts])
               for arm, m in modules.items() for name, parts in WEIGHTS.items()}
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    times: dict[tuple[str, int, str], list[float]] = {}
    differ = []
    for rep in range(args.reps):
        for name in WEIGHTS:
            for r in rows:
                k = weights[("new", name)].k
                x = torch.randn(r, k) * (1 + 5 * torch.rand(r, 1))  # rows of unlike scales
                outs = {}
                for arm in (("base", "new") if rep % 2 == 0 else ("new", "base")):
                    w = weights[(arm, name)]
                    w.matmul(x)
                    start = time.perf_counter()
                    outs[arm] = w.matmul(x)
                    times.setdefault((name, r, arm), []).append(time.perf_counter() - start)
                if not torch.equal(outs["base"], outs["new"]):
                    differ.append((name, r))
    print(f"{cpuinfo.name()}, {args.isa}, base {args.base}, {args.threads} thread(s), "
          f"{args.reps} interleaved reps; calls whose outputs differ: {len(differ)}\n")
    print("| weight | rows | base min ms | new min ms | new / base (min) | base median | "
          "new median | new / base (median) |\n|---|---|---|---|---|---|---|---|")
    for name in WEIGHTS:
        for r in rows:
            b, n = times[(name, r, "base")], times[(name, r, "new")]
            mb, mn = statistics.median(b), statistics.median(n)
            print(f"| {name} | {r} | {1e3 * min(b):.4f} | {1e3 * min(n):.4f} | "
                  f"{min(n) / min(b):.3f} | {1e3 * mb:.4f} | {1e3 * mn:.4f} | {mn / mb:.3f} |")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
