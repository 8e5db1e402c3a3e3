"""`adaspark eval-drafter`: the drafter on held-out prompts (the evaluation conversations' first
turns): chain acceptance by position, tokens per round, top-K hits, calibration, draft time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_CONVERSATIONS = Path("../shared/data/eval/conversations.jsonl")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", help="drafter checkpoint directory (default: the shipped one)")
    p.add_argument("--work", default="runs/drafter", help="where held-out replies are cached")
    p.add_argument("--conversations", default=str(DEFAULT_CONVERSATIONS))
    p.add_argument("--max-prompts", type=int, help="evaluate on the first N first turns only")
    p.add_argument("--max-new", type=int, default=256, help="reply length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--native", action="store_true",
                   help="replay and time the draft the engine runs: the native build's, on "
                        "quantised weights (default: the torch path)")
    p.add_argument("--head-bits", type=int, choices=(8, 4), default=8,
                   help="with --native: the head in Q8_0 (8) or Q4_1 (4) blocks")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")


def prompt_sources(seqs, items, tokenizer) -> list[str]:
    """Each held-out sequence's dataset, found by its prompt tokens ("?" when none matches)."""
    from adaspark.drafter.data import encode_item

    source = {tuple(encode_item(tokenizer, it)): str(it.get("source") or "?") for it in items}
    return [source.get(tuple(s.tokens[: s.prompt_len].tolist()), "?") for s in seqs]


def run(args) -> int:
    import torch

    from adaspark.drafter.checkpoint import load_checkpoint
    from adaspark.drafter.data import (
        first_turns,
        generate_shards,
        select_prompts,
        target_embedding,
    )
    from adaspark.drafter.evaluate import evaluate, interleaved_timing
    from adaspark.drafter.loading import default_drafter_for, model_sha256
    from adaspark.drafter.runtime import Drafter
    from adaspark.drafter.shards import read_shards
    from adaspark.errors import UserError
    from adaspark.model.config import ModelConfig
    from adaspark.model.gguf import read_gguf
    from adaspark.model.sources import resolve_model
    from adaspark.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model_path = resolve_model(args.model)
    gguf = read_gguf(model_path)
    c = ModelConfig.from_metadata(gguf.metadata)
    info = {"arch": c.arch, "n_layers": c.n_layers, "dim": c.dim, "vocab_size": c.vocab_size,
            "model_file": model_path.name, "sha256": model_sha256(model_path)}
    drafter_path = Path(args.drafter) if args.drafter else default_drafter_for(info)
    embed = target_embedding(gguf)
    model = load_checkpoint(drafter_path, info, embed)
    taps = list(model.c.target_layers)

    eval_dir = Path(args.work) / "data" / "eval"
    target = None
    tokenizer = Tokenizer.from_gguf(gguf)
    items = first_turns(Path(args.conversations))
    if not list(eval_dir.glob("shard_*.safetensors")):
        from adaspark.model.transformer import Transformer

        target = Transformer.from_gguf(model_path)
        prompts = select_prompts(items, tokenizer, len(items), 0, args.max_prompt_tokens,
                                 shuffle=False)
        generate_shards(target, tokenizer, prompts, eval_dir, taps, args.max_new, batch=4)
    seqs, _ = read_shards(eval_dir, taps)
    if target is None:
        from adaspark.model.transformer import Transformer

        target = Transformer.from_gguf(model_path)
    options = {}
    if args.native:
        if target.native_module is None:
            raise UserError("--native: no native build runs here (scripts/setup.sh builds it)")
        options = {"native": target.native_module, "dtype": torch.float32,
                   "head_bits": args.head_bits,
                   "positions": max(len(s.tokens) for s in seqs) + 2 * model.c.block_size}
    result = evaluate(model, embed, seqs, list(range(len(taps))), max_seqs=args.max_prompts,
                      groups=prompt_sources(seqs, items, tokenizer), runtime=options)
    result.update(drafter=str(drafter_path), draft_path="native" if args.native else "torch",
                  head_bits=args.head_bits if args.native else None)
    result["replay_draft_ms"] = result.pop("draft_ms")
    # the drafter on the engine's own embedding, timed alternately with a one-row target forward
    if args.native:
        options.update(positions=target.cache.capacity + model.c.block_size,
                       embedding=getattr(target, "packed_embeddings", None))
    runtime = Drafter(load_checkpoint(drafter_path, info, target.embed), target.embed, **options)
    result.update(interleaved_timing(runtime, target))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}")
    return 0
