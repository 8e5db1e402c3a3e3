"""Verify cost of the target by row count and context, plain decode speed, host overhead.

    .venv/bin/python benchmarks/verify_cost.py [--quick] [--model PATH] [--threads 2]
                                               [--torch] [--json] [--out FILE]

Rows 1..64 at contexts 512, 2048, 8192: the median time of one verify (a binary tree of that
many rows, no commit) with the engine's own choice (the native forward where built), and with
`--torch` also each torch kernel on a torch-only model; repetitions interleaved across widths
and kernels so a busy machine affects them alike. Then plain decode (1-row verify + commit per
token) in tokens per second, and the host overhead of a 1-row verify: its time minus the time
of the native forward and head called directly; and a full-block draft of the shipped drafter
at context 512 against a 1-row verify there. `--json` prints one object with `verify_ms` as
{context: {rows: ms}} (the engine's choice), `draft_ms` and `plain_decode_tok_s`. Compare with
llama.cpp only side by side: benchmarks/vs_llamacpp.py. Timing lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

# OpenMP's default (spinning idle threads) is ~2x faster on a quiet machine than
# OMP_WAIT_POLICY=PASSIVE, and ~2x slower on a busy one: benchmark on a quiet machine, as is.
import numpy as np
import torch

from adaspark import cpuinfo
from adaspark.errors import UserError
from adaspark.model.kernels import KERNELS, LADDER
from adaspark.model.shortconv import tree_sources
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer


def binary_tree(n: int) -> tuple[list[int], np.ndarray]:
    """Depths and ancestor mask of n rows, row i's parent (i-1)//2."""
    parents = [(i - 1) // 2 for i in range(n)]
    mask = np.eye(n, dtype=bool)
    depths = [0] * n
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
        depths[i] = depths[parents[i]] + 1
    return depths, mask


def verify_times(models: dict[str, tuple[Transformer, str | None]], widths,
                 reps: int) -> dict[tuple[int, str], float]:
    """Median ms per (width, arm); an arm is a model and the kernel it is forced to (None: the
    model's own choice)."""
    trees = {n: binary_tree(n) for n in widths}
    samples: dict[tuple[int, str], list[float]] = {}
    for _ in range(reps):
        for n in widths:
            for name, (model, kernel) in models.items():
                depths, mask = trees[n]
                tokens = [(17 * i) % 1000 + 100 for i in range(n)]
                start = time.perf_counter()
                model.verify(tokens, depths, mask, kernel=kernel)
                samples.setdefault((n, name), []).append(time.perf_counter() - start)
    return {key: statistics.median(v) * 1e3 for key, v in samples.items()}


def host_overhead_ms(model: Transformer, reps: int = 50) -> dict[str, float] | None:
    """A 1-row verify through the Python API against the native forward + head called directly
    on the same inputs (medians, interleaved): the difference is the host's share."""
    if model.native is None:
        return None
    start = model.cache.length
    tokens, positions = torch.tensor([321]), torch.tensor([start])
    anc = torch.ones(1, 1, dtype=torch.bool)
    conv = {}  # a hybrid's conv layers read the committed B*x, as verify's rows do
    if model.config.conv_layers:
        conv = {"conv": model.cache.conv, "conv_src": tree_sources(
            torch.zeros(1, dtype=torch.long), anc, start, model.config.conv_kernel)}
    whole, native = [], []
    for _ in range(reps):
        t = time.perf_counter()
        model.verify([321], [0], [[True]])
        whole.append(time.perf_counter() - t)
        t = time.perf_counter()
        rows, _ = model.native.forward(model.cache.k, model.cache.v, tokens, positions, start,
                                       anc, [], **conv)
        model.native.head(rows)
        native.append(time.perf_counter() - t)
    w, n = statistics.median(whole) * 1e3, statistics.median(native) * 1e3
    return {"verify_ms": w, "native_calls_ms": n, "host_ms": w - n}


def draft_times(model: Transformer, path: Path, context: int = 512, reps: int = 30
                ) -> dict[str, float] | None:
    """A full-block draft of the shipped drafter (native where built) against a 1-row verify,
    both after the same `context` tokens (medians, interleaved); None without a drafter."""
    from adaspark.drafter.loading import default_drafter_for, load_drafter, target_info

    try:
        drafter = load_drafter(model, path, default_drafter_for(target_info(model, path)))
    except UserError:
        return None
    model.reset()
    out = model.prefill([(13 * i) % 1000 + 100 for i in range(context)],
                        tap_layers=drafter.tap_layers)
    drafter.observe(out.hiddens)
    anchor = int(out.argmax[-1])
    drafts, verifies = [], []
    for _ in range(reps):
        t = time.perf_counter()
        drafter.draft(anchor)
        drafts.append(time.perf_counter() - t)
        t = time.perf_counter()
        model.verify([anchor], [0], [[True]])
        verifies.append(time.perf_counter() - t)
    d, v = statistics.median(drafts) * 1e3, statistics.median(verifies) * 1e3
    return {"context": context, "draft_ms": d, "verify_1row_ms": v, "draft_over_verify": d / v,
            "native": getattr(drafter, "native", None) is not None}


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
    ap.add_argument("--torch", action="store_true", help="also time the torch kernels")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", type=Path, help="also write the JSON object to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    say = (lambda *a, **k: None) if args.json else print
    widths = (1, 2, 4, 8, 16, 32, 64) if args.quick else LADDER
    contexts = (2048, 512) if args.quick else (8192, 2048, 512)
    reps = args.reps or (5 if args.quick else 9)

    start = time.perf_counter()
    path = resolve_model(args.model)
    capacity = max(contexts) + max(widths)
    model = Transformer.from_gguf(path, precision="fast", max_context=capacity)
    chosen = model.kernels.choose(1) if model.native is not None else "torch table"
    arms: dict[str, tuple[Transformer, str | None]] = {"chosen": (model, None)}
    if args.torch:
        os.environ["ADASPARK_NATIVE"] = "off"
        torch_model = Transformer.from_gguf(path, precision="fast", max_context=capacity)
        arms.update({k: (torch_model, k) for k in KERNELS})
    say(f"loaded in {time.perf_counter() - start:.1f} s; {cpuinfo.name()}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"{os.getloadavg()[0]:.1f}; chosen: {chosen} {model.native_note}")

    prompt = [(11 * i) % 1000 + 100 for i in range(max(contexts))]
    for m in {id(m): m for m, _ in arms.values()}.values():
        m.prefill(prompt)
    result: dict = {"cpu": cpuinfo.name(), "threads": torch.get_num_threads(), "chosen": chosen,
                    "load_average": os.getloadavg()[0], "verify_ms": {}}
    for ctx in contexts:  # descending, so one prefill serves every context
        for m, _ in arms.values():
            m.truncate(ctx)
        times = verify_times(arms, widths, reps)
        result["verify_ms"][str(ctx)] = {str(n): round(times[(n, "chosen")], 3) for n in widths}
        if args.torch:
            result.setdefault("torch_verify_ms", {})[str(ctx)] = {
                k: {str(n): round(times[(n, k)], 3) for n in widths} for k in KERNELS}
        say(f"\ncontext {ctx}: verify ms (median of {reps})")
        say(f"{'rows':>5} " + " ".join(f"{k:>8}" for k in arms) + "  x one row")
        for n in widths:
            cells = " ".join(f"{times[(n, k)]:8.2f}" for k in arms)
            say(f"{n:>5} {cells}  {times[(n, 'chosen')] / times[(1, 'chosen')]:5.2f}")
        if ctx == 512:
            result["host_overhead_1row_ctx512"] = host_overhead_ms(model)
            say(f"host overhead of a 1-row verify: {result['host_overhead_1row_ctx512']}")

    drafted = draft_times(model, path, reps=max(3 * reps, 15))
    result["draft_ms"] = None if drafted is None else round(drafted["draft_ms"], 3)
    result["draft_vs_verify_ctx512"] = drafted
    say(f"\na full-block draft at context 512 against a 1-row verify: {drafted}")

    result["plain_decode_tok_s_by_prompt"] = {}
    for prompt_len in (32, 512):
        tok_s, cpu_ms = plain_decode_tok_s(model, prompt_len, 64 if args.quick else 200)
        result["plain_decode_tok_s_by_prompt"][str(prompt_len)] = round(tok_s, 1)
        say(f"\nplain decode after a {prompt_len}-token prompt: {tok_s:.1f} tok/s; "
            f"CPU {cpu_ms:.1f} ms/token")
    result["plain_decode_tok_s"] = result["plain_decode_tok_s_by_prompt"]["32"]
    if args.json:
        print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
