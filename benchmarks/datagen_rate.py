"""Drafter-data generation rate: the old generator against the batched one, on the same prompts.

Arms, run one after another in this process (nothing else may run on the machine):
  old        Transformer.generate_greedy_batch in batches of --old-batch, prompts sorted by
             length (what `adaspark train-drafter`'s data stage runs, data.generate_shards),
             replies only; `old+taps` adds that stage's hidden_states_batch over prompt+reply
             (top-k logits included), the old stage's whole cost
  newK       ReplyGenerator (`adaspark gen-data`): K replies at once through the engine's
             continuous batching (`ar`, one native call a step); new1 is `ar` one reply at a time
  taps       the new path's training cost on new-K's replies: taps and top-k logits recomputed
             with the batched native prefill (drafter/taps.py)
Reports reply tokens per second per arm (stop tokens counted in both), and the new arms' replies
checked equal to `ar` alone (new1) token for token.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/datagen_rate.py --prompts 64 \\
        --arms old,new1,new16,new32,taps --out docs/results/datagen-rate/HOST.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from adaspark import cpuinfo
from adaspark.drafter.generate import GenSettings, ReplyGenerator
from adaspark.drafter.pool import Conversation, ordered, read_pool
from adaspark.drafter.replies import read_records
from adaspark.drafter.taps import sequences_from_records
from adaspark.engine import Engine
from adaspark.model.sources import resolve_model
from adaspark.model.transformer import Transformer

POOL = Path(__file__).resolve().parents[1] / "data/drafter/pool.jsonl.gz"
TAPS = [1, 14, 27]


def args_of(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="target GGUF (default: the embedded SmolLM2)")
    p.add_argument("--pool", default=str(POOL))
    p.add_argument("--prompts", type=int, default=64, help="first turns of the seeded pool")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="the old stage's default cap (its padded batch pays the longest)")
    p.add_argument("--arms", default="old,new1,new16,new32,taps")
    p.add_argument("--old-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results here (JSON)")
    return p.parse_args(argv)


def prompts_of(args, tokenizer) -> list[Conversation]:
    """The first --prompts single-turn openings of the seeded pool within the length cap."""
    out = []
    for conv in ordered(read_pool([Path(args.pool)]), args.seed):
        one = Conversation(conv.source, conv.turns[:1], conv.tools, conv.system)
        if len(one.prompt_ids(tokenizer, 0, [])) <= args.max_prompt_tokens:
            out.append(one)
        if len(out) == args.prompts:
            return out
    return out


def old_arm(target, prompts, args, with_taps: bool) -> dict:
    stops = set(args.tokenizer.stop_ids)
    order = sorted(prompts, key=len)
    target.generate_greedy_batch(order[:2], 2, stops)  # builds the torch path's weights
    if with_taps:
        target.hidden_states_batch(order[:1], TAPS, return_logits=True)
    start, tokens = time.perf_counter(), 0
    for s in range(0, len(order), args.old_batch):
        batch = order[s:s + args.old_batch]
        replies = target.generate_greedy_batch(batch, args.max_new, stops)
        tokens += sum(map(len, replies))
        if with_taps:
            target.hidden_states_batch([p + r for p, r in zip(batch, replies, strict=True)],
                                       TAPS, return_logits=True)
    seconds = time.perf_counter() - start
    return {"reply_tokens": tokens, "seconds": round(seconds, 2),
            "tok_s": round(tokens / seconds, 1)}


def main(argv=None) -> int:
    args = args_of(argv)
    path = resolve_model(args.model)
    arms = [a for a in args.arms.split(",") if a]
    context = args.max_prompt_tokens + args.max_new + 1
    engine = Engine.load(path, arm="ar", max_context=context)
    args.tokenizer = engine.tokenizer
    convs = prompts_of(args, engine.tokenizer)
    prompts = [c.prompt_ids(engine.tokenizer, 0, []) for c in convs]
    results = {"cpu": cpuinfo.name(), "machine": platform.machine(), "forward": engine.forward,
               "threads": torch.get_num_threads(), "prompts": len(prompts),
               "prompt_tokens": sum(map(len, prompts)), "max_new": args.max_new,
               "arms": {}, "ran": " ".join(sys.argv)}
    replies: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arms:
            if arm in ("old", "old+taps"):
                target = Transformer.from_gguf(path, max_context=context)
                results["arms"][arm] = old_arm(target, prompts, args, arm == "old+taps")
                del target
            elif arm.startswith("new"):
                k = int(arm[3:])
                engine.generate_ids(prompts[0], max_tokens=2)  # warm: first-call costs
                engine.reset()
                out = Path(tmp) / arm
                report = ReplyGenerator(engine, convs, out, {"model_file": path.name},
                                        GenSettings(args.max_new, args.max_prompt_tokens, k,
                                                    shard_size=10**6)).run()
                engine.reset()
                replies[arm] = {tuple(r.tokens[:r.prompt_len]): r.reply.tolist()
                                for r in read_records(out)}
                results["arms"][arm] = {"reply_tokens": report.reply_tokens,
                                        "seconds": round(report.seconds, 2),
                                        "tok_s": round(report.tok_s, 1), "concurrency": k}
            elif arm == "taps":
                source = max((a for a in replies), key=lambda a: int(a[3:]), default=None)
                if source is None:
                    raise SystemExit("the taps arm needs a new-K arm before it")
                records = read_records(Path(tmp) / source)
                start = time.perf_counter()
                seqs = sequences_from_records(engine.target, records, TAPS)
                seconds = time.perf_counter() - start
                rows = sum(len(s.tokens) - 1 for s in seqs)
                results["arms"]["taps"] = {
                    "rows": rows, "reply_tokens": sum(s.reply_len for s in seqs),
                    "seconds": round(seconds, 2),
                    "reply_tok_s": round(sum(s.reply_len for s in seqs) / seconds, 1),
                    "rows_s": round(rows / seconds, 1), "from": source}
            else:
                raise SystemExit(f"unknown arm {arm!r}")
            print(arm, json.dumps(results["arms"][arm]), flush=True)
    if "new1" in replies:  # every batched reply is `ar`'s alone
        results["equal_to_ar"] = {a: r == replies["new1"] for a, r in replies.items()}
    base = results["arms"].get("old", {}).get("tok_s")
    if base:
        results["over_old"] = {a: round(r["tok_s"] / base, 2) for a, r in
                               results["arms"].items() if "tok_s" in r}
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
