"""Verify cost of the target by row count, context and kernel, and plain decode speed.

    .venv/bin/python benchmarks/verify_cost.py [--quick] [--model PATH] [--threads 2]

Rows 1..64 at contexts 512, 2048, 8192: the median time of one verify (a binary tree of that
many rows, no commit) for each kernel and for the kernel the table picks, repetitions
interleaved across widths and kernels so a busy machine affects them alike. Then plain decode
(1-row verify + commit per token, fast kernels) in tokens per second, next to llama.cpp's
66.5 tok/s for the same file on this machine class (llama-cpp-python 0.3.36, 2 threads).
Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# OpenMP's default (spinning idle threads) is ~2x faster on a quiet machine than
# OMP_WAIT_POLICY=PASSIVE, and ~2x slower on a busy one: benchmark on a quiet machine, as is.
import numpy as np
import torch

from adaspark.model.kernels import KERNELS, LADDER
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer

LLAMA_CPP_TOK_S = 66.5


def binary_tree(n: int) -> tuple[list[int], np.ndarray]:
    """Depths and ancestor mask of n rows, row i's parent (i-1)//2."""
    parents = [(i - 1) // 2 for i in range(n)]
    mask = np.eye(n, dtype=bool)
    depths = [0] * n
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depths[i] = depths[parents[i]] + 1
    return depths, mask


def verify_times(model: Transformer, widths, reps: int) -> dict[tuple[int, str], float]:
    """Median ms per (width, kernel); kernel "auto" is what the table picks."""
    trees = {n: binary_tree(n) for n in widths}
    samples: dict[tuple[int, str], list[float]] = {}
    for _ in range(reps):
        for n in widths:
            for kernel in (*KERNELS, "auto"):
                depths, mask = trees[n]
                tokens = [(17 * i) % 1000 + 100 for i in range(n)]
                start = time.perf_counter()
                model.verify(tokens, depths, mask, kernel=None if kernel == "auto" else kernel)
                samples.setdefault((n, kernel), []).append(time.perf_counter() - start)
    return {key: statistics.median(v) * 1e3 for key, v in samples.items()}


def plain_decode_tok_s(model: Transformer, prompt_len: int, tokens: int) -> tuple[float, float]:
    """Tokens per second of wall time, and CPU ms per token (all threads; telling on a busy
    machine, where wall time measures the other processes too)."""
    model.reset()
    token = int(model.prefill([(7 * i) % 1000 + 100 for i in range(prompt_len)]).argmax[-1])
    for _ in range(3):  # warm-up, then forget it
        model.verify([token], [0], [[True]])
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        token = int(model.verify([token], [0], [[True]]).argmax[0])
        model.commit([0])
    return tokens / (time.perf_counter() - start), (time.process_time() - cpu) / tokens * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    ap.add_argument("--quick", action="store_true", help="fewer widths, contexts, repetitions")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = (1, 2, 4, 8, 16, 32, 64) if args.quick else LADDER
    contexts = (2048, 512) if args.quick else (8192, 2048, 512)
    reps = args.reps or (5 if args.quick else 9)

    start = time.perf_counter()
    model = Transformer.from_gguf(resolve_model(args.model), precision="fast",
                                  max_context=max(contexts) + max(widths))
    print(f"loaded in {time.perf_counter() - start:.1f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"kernel table ({model.kernels.source}):",
          " ".join(f"{n}:{k}" for n, k in model.kernels.best.items()))

    model.prefill([(11 * i) % 1000 + 100 for i in range(max(contexts))])
    for ctx in contexts:  # descending, so one prefill serves every context
        model.truncate(ctx)
        times = verify_times(model, widths, reps)
        print(f"\ncontext {ctx}: verify ms (median of {reps})")
        print(f"{'rows':>5} " + " ".join(f"{k:>8}" for k in KERNELS) + f" {'chosen':>8} pick")
        for n in widths:
            cells = " ".join(f"{times[(n, k)]:8.2f}" for k in KERNELS)
            print(f"{n:>5} {cells} {times[(n, 'auto')]:8.2f} {model.kernels.choose(n)}")

    for prompt_len in (32, 512):
        tok_s, cpu_ms = plain_decode_tok_s(model, prompt_len, 64 if args.quick else 200)
        print(f"\nplain decode after a {prompt_len}-token prompt: {tok_s:.1f} tok/s "
              f"(llama.cpp: {LLAMA_CPP_TOK_S} tok/s); CPU {cpu_ms:.1f} ms/token")


if __name__ == "__main__":
    main()
