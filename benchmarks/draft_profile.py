"""Where a drafter round's time goes: the native drafter's phases and the Python around them.

    .venv/bin/python benchmarks/draft_profile.py [--model PATH] [--context 512] [--accepted 3]
                                                 [--reps 200] [--threads 2] [--no-verify]
                                                 [--drafter DIR] [--head-bits 8|4] [--json]

A round as the engine runs it after `context` committed tokens: an 8-row target verify
(untimed; it leaves the target's weights in the caches, as a real round does), observe() the
taps of `accepted` of its rows, then draft() the next block (which appends their features
first), then the native draft once more, warm. Prints the median ms per round of each native
phase (drafter.h's phase clock: fc, context K/V, qkv, attention, o, the FFN, the head,
shortlist, Markov, top-k, confidence, all of the first draft), of the native calls as a whole,
and of the Python calls that wrap them (observe, the cache's append, draft): what the Python
adds is their difference. The context is cut back to `context` every round, so each round
drafts at the same length. Set ADASPARK_NATIVE=avx2 to profile the AVX2 build. Timing lives
here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import numpy as np
import torch

from adaspark.drafter import runtime
from adaspark.drafter.loading import default_drafter_for, load_drafter, target_info
from adaspark.drafter.runtime import MARKOV_BASIS, markov_bound
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer

VERIFY_ROWS = 8


def _timed(f):
    start = time.perf_counter()
    f()
    return (time.perf_counter() - start) * 1e3


def rounds(model: Transformer, drafter, context: int, accepted: int, reps: int,
           verify: bool = True) -> dict:
    """Per round ms lists: each native phase, then the calls ('py ...' the Python ones)."""
    model.reset()
    out = model.prefill([(13 * i) % 1000 + 100 for i in range(context + VERIFY_ROWS)],
                        tap_layers=drafter.tap_layers)
    # the last rows' taps stand in for a verify's (rows of a chain, the first `accepted` kept)
    tail = {i: h[-VERIFY_ROWS:].clone() for i, h in out.hiddens.items()}
    drafter.observe({i: h[:context] for i, h in out.hiddens.items()})
    anchor, rows = int(out.argmax[-1]), list(range(accepted))
    nat, samples = drafter.native, {}
    for rep in range(reps + 5):  # 5 warm-up rounds
        drafter.truncate(context)
        model.truncate(context)
        if verify:  # the round's verify first: it leaves the target's weights in the caches
            model.verify([anchor] * VERIFY_ROWS, list(range(VERIFY_ROWS)),
                         np.tril(np.ones((VERIFY_ROWS, VERIFY_ROWS), dtype=bool)))
        nat.phase_ms()
        t = {"py observe": _timed(lambda: drafter.observe(tail, rows=rows)),
             "py cache (append)": _timed(lambda: drafter.cache)}
        t.update({f"native {k}": v for k, v in nat.phase_ms().items() if v})
        t["py draft"] = _timed(lambda: drafter.draft(anchor))
        t.update({k: v for k, v in nat.phase_ms().items() if v})
        t["native draft call"] = _timed(partial(
            nat.draft, drafter.cache.k, drafter.cache.v,
            drafter.embed(torch.tensor([anchor]))[0].float(), drafter.cache.length, 0,
            drafter.shortlist, drafter.topk, torch.empty(0)))
        nat.phase_ms()
        if rep >= 5:
            for k, v in t.items():
                samples.setdefault(k, []).append(v)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--accepted", type=int, default=3, help="rows observed a round")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-verify", action="store_true",
                    help="no target verify before each round (the drafter's weights stay warm)")
    ap.add_argument("--drafter", default=None, help="checkpoint folder (default: the shipped one)")
    ap.add_argument("--head-bits", type=int, choices=(8, 4), default=8,
                    help="the native head in Q8_0 (8) or Q4_1 (4) blocks")
    ap.add_argument("--markov-basis", type=int, default=None,
                    help="W2 directions the Markov exactness bound computes exactly (default: "
                         "runtime.MARKOV_BASIS); the picks are the same, the work differs")
    ap.add_argument("--markov", choices=("table", "bound"), default="table",
                    help="the Markov head's exact candidates from runtime.markov_table (the "
                         "default where the vocabulary allows one) or markov_bound's caps "
                         "(--markov-basis implies it)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    model = Transformer.from_gguf(path, precision="fast",
                                  max_context=args.context + 2 * VERIFY_ROWS)
    folder = args.drafter or default_drafter_for(target_info(model, path))
    if args.markov == "bound" or args.markov_basis is not None:
        args.markov = "bound"
        runtime.TABLE_LIMIT = 0  # no table: the native drafter gets the bound's caps
    drafter = load_drafter(model, path, folder, head_bits=args.head_bits)
    if drafter.native is None:
        raise SystemExit(f"no native drafter here: {model.native_note}")
    if args.markov_basis is not None:
        drafter.native.set_markov_bound(*markov_bound(drafter.model.markov_w2.weight,
                                                      args.markov_basis))
    samples = rounds(model, drafter, args.context, args.accepted, args.reps, not args.no_verify)
    med = {k: round(statistics.median(v), 4) for k, v in samples.items()}
    phases = [k for k in med if not k.startswith(("py ", "native "))]
    result = {"isa": model.native_module.ISA, "threads": torch.get_num_threads(),
              "drafter": str(args.drafter or "shipped"), "head_bits": args.head_bits,
              "markov": args.markov, "markov_basis": args.markov_basis or MARKOV_BASIS,
              "context": args.context, "accepted": args.accepted,
              "verify_between": not args.no_verify, "median_ms": med,
              "draft_phases_sum_ms": round(sum(med[k] for k in phases), 4)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    markov = "table" if args.markov == "table" else f"basis {result['markov_basis']}"
    print(f"{result['isa']}, {result['threads']} threads, {result['drafter']} drafter, head "
          f"Q{'8_0' if args.head_bits == 8 else '4_1'}, Markov {markov}, "
          f"context {args.context}, "
          f"{args.accepted} rows observed a round; median ms of {args.reps} rounds")
    for k, v in med.items():
        print(f"  {k:<28} {v:8.4f}")
    print(f"  {'(draft phases summed)':<28} {result['draft_phases_sum_ms']:8.4f}")


if __name__ == "__main__":
    main()
