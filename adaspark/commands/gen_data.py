"""`adaspark gen-data`: the target's greedy replies for drafter training, many at once
(continuous batching), into reply shards (token ids only) that a later run resumes.

    adaspark gen-data --out data/drafter/replies --concurrency 16 --time-budget 3600

Stops cleanly at the time budget (the finished replies are written, those still running are
dropped and run again next time) and prints the reply tokens per second. Training reads the
shards through `adaspark train-drafter --replies DIR` (taps recomputed, drafter/taps.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

# every training prompt is in it already (data/drafter/README.md)
DEFAULT_POOLS = [Path("data/drafter/pool.jsonl.gz")]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="reply shard directory (resumed when it exists)")
    p.add_argument("--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--pool", nargs="+", default=[str(p) for p in DEFAULT_POOLS],
                   help="prompt pools: conversation JSONL (.gz too) or training-prompt JSONL")
    p.add_argument("--sources", type=lambda v: [x for x in v.split(",") if x],
                   help="only these sources (comma-separated prefixes)")
    p.add_argument("--tool-calls", action="store_true",
                   help="instead of the pool's conversations: each one with tools, its first "
                        "turn answered as one call of its tools under a JSON Schema (the "
                        "replies a drafter meets under response_format)")
    p.add_argument("--seed", type=int, default=0, help="the pool's order")
    p.add_argument("--max-new", type=int, default=256, help="reply length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=4096,
                   help="a turn with a longer prompt ends its conversation")
    p.add_argument("--concurrency", type=int, default=16, help="replies decoding at once")
    p.add_argument("--shard-size", type=int, default=256, help="replies per shard")
    p.add_argument("--time-budget", type=float, help="seconds (from the start, loading included)")
    p.add_argument("--threads", type=int, help="CPU threads (default: every core)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args) -> int:
    start = time.monotonic()
    import torch

    from adaspark.drafter.generate import GenSettings, ReplyGenerator
    from adaspark.drafter.pool import ordered, read_pool, tool_calls
    from adaspark.drafter.replies import read_records, target_fingerprint, totals
    from adaspark.engine import Engine
    from adaspark.errors import UserError
    from adaspark.model.sources import resolve_model

    if args.concurrency < 1 or args.shard_size < 1 or args.max_new < 1:
        raise UserError("--concurrency, --shard-size and --max-new must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    pool = read_pool(Path(p) for p in args.pool)
    if args.tool_calls:
        pool = tool_calls(pool)
    pool = ordered(pool, args.seed, args.sources)
    if not pool:
        raise UserError(f"no conversations in {args.pool} (sources {args.sources})")
    model_path = resolve_model(args.model)
    context = args.max_prompt_tokens + args.max_new + 1
    engine = Engine.load(model_path, arm="ar", max_context=context)
    settings = GenSettings(args.max_new, args.max_prompt_tokens, args.concurrency,
                           args.shard_size)
    fingerprint = target_fingerprint(model_path)
    gen = ReplyGenerator(engine, pool, Path(args.out), fingerprint, settings)
    deadline = None if args.time_budget is None else start + args.time_budget
    report = gen.run(stop_now=lambda: deadline is not None and time.monotonic() >= deadline)
    summary = {
        "stopped": report.stopped, "replies": report.records,
        "reply_tokens": report.reply_tokens, "seconds": round(report.seconds, 1),
        "tok_s": round(report.tok_s, 1), "dropped_tokens": report.dropped_tokens,
        "skipped_conversations": report.skipped, "failed": report.failed,
        "shards": [p.name for p in report.shards], "forward": engine.forward,
        "concurrency": args.concurrency, "threads": torch.get_num_threads(),
        "directory": totals(read_records(Path(args.out), fingerprint)),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{report.records} replies, {report.reply_tokens} reply tokens in "
              f"{report.seconds:.0f} s: {report.tok_s:.1f} tok/s ({engine.forward}, "
              f"{args.concurrency} at once; stopped: {report.stopped}); {args.out} now holds "
              f"{summary['directory']['records']} replies, "
              f"{summary['directory']['reply_tokens']} reply tokens")
    return 0
