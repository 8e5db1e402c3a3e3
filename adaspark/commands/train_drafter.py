"""`adaspark train-drafter`: train the DSpark drafter for a target (resumable; see pipeline.py)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from adaspark.drafter.train import TrainSettings

DEFAULT_PROMPTS = Path("../shared/data/train/prompts.jsonl")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _range(text: str) -> list[int]:
    """'3', '0-39' or '0,5-9' -> the shard indices."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--work", default="runs/drafter", help="work directory (resumable state)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="training prompts JSONL")
    p.add_argument("--n-prompts", type=int, default=2048)
    p.add_argument("--max-new", type=int, default=256, help="reply length cap")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--sources", type=lambda v: [x for x in v.split(",") if x],
                   help="draw prompts only from these sources (comma-separated prefixes)")
    p.add_argument("--first-shard", type=int, default=0,
                   help="number new data shards from here; prompts already in a shard are "
                        "skipped (a later data run with other sources or lengths)")
    p.add_argument("--heldout-shards", type=_ints, default=[0],
                   help="data shards kept out of training for early stopping and temperature "
                        "scaling, e.g. 0,34 (one per prompt mix)")
    p.add_argument("--replies", help="reply shards of `adaspark gen-data`: the data stage "
                                      "recomputes their taps instead of generating")
    p.add_argument("--tap-shards", type=_range,
                   help="with --replies: only these tap shards, e.g. 0-39 (a training stage's "
                        "window; 128 replies a shard)")
    p.add_argument("--init-from", help="a drafter checkpoint a fresh --work starts from (a "
                                        "committed stage): its weights, vocabulary and step; "
                                        "its shape must be this run's")
    p.add_argument("--data-only", action="store_true", help="stop after the data stage")
    p.add_argument("--skip-data", action="store_true",
                   help="train on the shards already in WORK/data/train; generate none")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--taps", type=_ints, default=[1, 14, 27], help="target layers, e.g. 1,14,27")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--block", type=int, default=7)
    p.add_argument("--markov-rank", type=int, default=128)
    p.add_argument("--qk-norm", action="store_true",
                   help="per-head RMSNorm of q and k before RoPE (llama.cpp's and the "
                        "published DSpark drafters' form)")
    p.add_argument("--rope-style", choices=("interleaved", "neox"), default="interleaved",
                   help="RoPE on pairs (2i, 2i+1), or NeoX's (i, i + head_dim/2)")
    p.add_argument("--ce-weight", type=float, default=TrainSettings.ce_weight,
                   help="loss weight of cross-entropy to the target's greedy token "
                        "(the DSpark reference: 0.1)")
    p.add_argument("--tv-weight", type=float, default=TrainSettings.tv_weight,
                   help="loss weight of total variation to the target's distribution "
                        "(the DSpark reference: 0.9)")
    p.add_argument("--steps", type=int, default=TrainSettings.steps)
    p.add_argument("--seqs-per-step", type=int, default=TrainSettings.seqs_per_step)
    p.add_argument("--anchors", type=int, default=TrainSettings.anchors_per_seq)
    p.add_argument("--lr", type=float, default=TrainSettings.lr)
    p.add_argument("--weight-decay", type=float, default=TrainSettings.weight_decay)
    p.add_argument("--val-every", type=int, default=TrainSettings.val_every,
                   help="held-out check every N steps; the best weights are exported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, help="stop training after this long (resume later)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--ship", action="store_true",
                   help="copy the exported checkpoint into the package's shipped drafter")


def run(args) -> int:
    import torch

    from adaspark.drafter import pipeline
    from adaspark.drafter.data import target_embedding
    from adaspark.drafter.loading import DEFAULT_DRAFTER, model_sha256
    from adaspark.model.config import ModelConfig
    from adaspark.model.gguf import read_gguf
    from adaspark.model.sources import resolve_model
    from adaspark.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    pipeline.setup_logging(work)
    model_path = resolve_model(args.model)
    gguf = read_gguf(model_path)
    config = ModelConfig.from_metadata(gguf.metadata)
    tokenizer = Tokenizer.from_gguf(gguf)
    settings = pipeline.PipelineSettings(
        work=work, prompts=Path(args.prompts), n_prompts=args.n_prompts, max_new=args.max_new,
        max_prompt_tokens=args.max_prompt_tokens, sources=args.sources,
        first_shard=args.first_shard, heldout=args.heldout_shards, vocab_size=args.vocab_size,
        taps=args.taps,
        n_layers=args.layers, block_size=args.block, markov_rank=args.markov_rank,
        qk_norm=args.qk_norm, rope_style=args.rope_style,
        train=TrainSettings(steps=args.steps, seqs_per_step=args.seqs_per_step,
                            anchors_per_seq=args.anchors, lr=args.lr, seed=args.seed,
                            weight_decay=args.weight_decay, val_every=args.val_every,
                            ce_weight=args.ce_weight, tv_weight=args.tv_weight),
        minutes=args.minutes,
        replies=Path(args.replies) if args.replies else None, tap_shards=args.tap_shards,
        init_from=Path(args.init_from) if args.init_from else None,
    )
    if not args.skip_data:
        from adaspark.model.transformer import Transformer

        target = Transformer.from_gguf(model_path)
        pipeline.make_data(settings, target, tokenizer, model_path)
        del target
        if args.data_only:
            return 0
    fingerprint = {"arch": config.arch, "n_layers": config.n_layers, "dim": config.dim,
                   "vocab_size": config.vocab_size, "model_file": model_path.name,
                   "sha256": model_sha256(model_path)}
    out = pipeline.run_pipeline(settings, gguf, target_embedding(gguf), tokenizer.stop_ids,
                                fingerprint)
    print(f"drafter checkpoint: {out}")
    if args.ship:
        DEFAULT_DRAFTER.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(out / name, DEFAULT_DRAFTER / name)
        print(f"shipped to {DEFAULT_DRAFTER}")
    return 0
