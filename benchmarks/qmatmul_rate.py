"""Integer rate of the native quantised matmul by rows: what each extra verify row costs.

    .venv/bin/python benchmarks/qmatmul_rate.py [--threads 1] [--reps 200] [--rows 1,2,4,8,16]
                                                [--isa avx2,avxvnni,...] [--json FILE]

For each build this CPU runs (or those named) and each weight shape of the embedded model (an
FFN matrix of Q4_1 and the Q8_0 LM head, real weights), the median time of `QWeight.matmul` at
each row count, interleaved across builds and rows, and the multiply-accumulates per second of
rows added between the second row count and the widest: (R - r) * n * k / (T(R) - T(r)), each
call timed right after an untimed one so that the weight is as warm as the cache holds it.
Compare it with the instruction mix's peak on the same core (benchmarks/int8_rate.cpp). Timing
lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from adaspark import cpuinfo
from adaspark.model import native
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model

WEIGHTS = {"ffn_down Q4_1 576x1536": "blk.0.ffn_down.weight",
           "ffn_up Q4_1 1536x576": "blk.0.ffn_up.weight",
           "head Q8_0 49152x576": "token_embd.weight"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--isa", help="builds to time, comma-separated (default: all this CPU runs)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="min: the least-disturbed call, for a machine shared with other work")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    isas = args.isa.split(",") if args.isa else native.runnable_isas()
    modules = {}
    for isa in isas:
        module, why = native.load_isa(isa)
        if module is None:
            raise SystemExit(f"{isa}: {why}")
        modules[isa] = module
    tensors = read_gguf(resolve_model(None)).tensors
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    xs = {r: torch.randn(r, 1536) for r in rows}
    weights = {(isa, label): native.pack(m, [tensors[name]])
               for isa, m in modules.items() for label, name in WEIGHTS.items()}
    samples: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.reps):
        for (isa, label), w in weights.items():
            for r in rows:
                x = xs[r][:, :w.k].contiguous()
                w.matmul(x)  # warm: the weight in cache, so the time is the arithmetic's
                start = time.perf_counter()
                w.matmul(x)
                samples.setdefault((isa, label, r), []).append(time.perf_counter() - start)
    stat = statistics.median if args.stat == "median" else min
    med = {key: stat(v) for key, v in samples.items()}
    print(f"{cpuinfo.name()}, {args.threads} thread(s), {args.reps} interleaved reps, "
          f"{args.stat} of each\n")
    print("| build | weight | " + " | ".join(f"{r} rows ms" for r in rows)
          + " | GMAC/s of the added rows |")
    print("|---|---|" + "---|" * (len(rows) + 1))
    out = []
    for (isa, label), w in weights.items():
        times = [1000 * med[(isa, label, r)] for r in rows]
        narrow, wide = rows[1], rows[-1]  # past one row, which may wait on memory alone
        spent = med[(isa, label, wide)] - med[(isa, label, narrow)]
        extra = (wide - narrow) * w.n * w.k / spent
        print(f"| {isa} | {label} | " + " | ".join(f"{t:.3f}" for t in times)
              + f" | {extra / 1e9:.1f} |")
        out.append({"isa": isa, "weight": label, "rows": rows, "ms": times,
                    "extra_row_gmac_s": extra / 1e9})
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpuinfo.name(), "args": vars(args),
                                               "results": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
