"""`adaspark train-drafter`: data -> vocabulary -> training -> temperature scaling -> checkpoint.

Every stage leaves its result under the work directory and is skipped when it is already
there, so the same command resumes a killed run:
  WORK/data/train/shard_*.safetensors   target replies + hidden states (shard 0 is held out);
                                        generated here, or with `replies` recomputed from
                                        `adaspark gen-data`'s reply shards (taps.py)
  WORK/vocab.npy                        draft vocabulary (target ids)
  WORK/train_state.pt                   model + optimiser + step
  WORK/checkpoint/                      the exported drafter (config.json, model.safetensors)
  WORK/train.log                        the log
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaspark.drafter import calibrate, vocab
from adaspark.drafter.checkpoint import load_checkpoint, save_checkpoint
from adaspark.drafter.loss import WEIGHTS
from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.drafter.shards import read_shards, shard_path, shard_tokens
from adaspark.drafter.train import TrainSettings, loss_weights, train, validation_loss
from adaspark.errors import UserError

log = logging.getLogger("adaspark.drafter")


@dataclass
class PipelineSettings:
    work: Path
    prompts: Path
    n_prompts: int = 2048
    max_new: int = 256
    max_prompt_tokens: int = 512
    per_shard: int = 128
    sources: list[str] | None = None  # prompt sources (prefixes) to draw from; None: all
    first_shard: int = 0  # number the new shards from here (a later run with other sources)
    heldout: list[int] = field(default_factory=lambda: [0])  # shards kept out of training
    vocab_size: int = 8192
    taps: list[int] = field(default_factory=lambda: [1, 14, 27])
    n_layers: int = 1
    block_size: int = 7
    markov_rank: int = 128
    qk_norm: bool = False  # per-head q/k RMSNorm (the peers' form; no cost: draft_shape.py)
    rope_style: str = "interleaved"  # or "neox" (the peers')
    train: TrainSettings = field(default_factory=TrainSettings)
    minutes: float | None = None  # stop training after this long (resume later)
    replies: Path | None = None  # reply shards (gen-data): the data stage recomputes their taps
    tap_shards: list[int] | None = None  # with replies: only these tap shards (None: all)
    # a checkpoint a fresh work directory starts from (a stage committed by an earlier session):
    # its weights, vocabulary and step; Adam's moments restart
    init_from: Path | None = None


def setup_logging(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(work / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def make_data(s: PipelineSettings, target, tokenizer, model_path: Path | None = None) -> None:
    from adaspark.drafter.data import generate_shards, load_prompt_items, select_prompts
    from adaspark.drafter.shards import shard_prompts

    out_dir = s.work / "data" / "train"
    if s.replies is not None:  # the replies exist: their taps and top-k logits only
        from adaspark.drafter.replies import target_fingerprint
        from adaspark.drafter.taps import write_tap_shards

        if model_path is None:
            raise ValueError("make_data from reply shards needs the target's model path")
        write_tap_shards(target, s.replies, out_dir, s.taps, target_fingerprint(model_path),
                         s.per_shard, shards=s.tap_shards)
        return
    items = load_prompt_items(s.prompts)
    # only the shards before this run's own, so a resumed run selects the same prompts
    held = shard_prompts(out_dir, s.first_shard)
    prompts = select_prompts(items, tokenizer, s.n_prompts, s.train.seed, s.max_prompt_tokens,
                             sources=s.sources, skip=held)
    generate_shards(target, tokenizer, prompts, out_dir, s.taps, s.max_new, s.per_shard,
                    first_shard=s.first_shard)


def load_data(work: Path, taps: list[int], heldout: tuple[int, ...] | list[int] = (0,)):
    """-> training sequences, held-out sequences (grouped by held-out shard, in `heldout`'s
    order), index of `taps` in the hiddens."""
    data = work / "data" / "train"
    seqs, _ = read_shards(data, taps)
    held = []
    for i in heldout:
        if not shard_path(data, i).exists():
            raise UserError(f"held-out shard {i} is missing from {data}")
        held.append({tokens.tobytes() for tokens, _ in shard_tokens(shard_path(data, i))})
    groups: list[list] = [[] for _ in held]
    train = []
    for seq in seqs:
        key = seq.tokens.tobytes()
        at = next((g for g, keys in enumerate(held) if key in keys), None)
        (train if at is None else groups[at]).append(seq)
    if not train:
        raise UserError("training needs a data shard besides the held-out ones")
    return train, groups, list(range(len(taps)))


def vocab_counts(s: PipelineSettings, train_seqs, vocab_size: int) -> np.ndarray:
    """The reply-token counts the draft vocabulary is chosen from (once: WORK/vocab.npy): with
    reply shards, every reply record outside the held-out tap shards, not only a stage's
    window (the vocabulary outlives the window, and the first one sees a fraction of the
    replies); else the training sequences."""
    if s.replies is None:
        return vocab.reply_token_counts(train_seqs, vocab_size)
    from adaspark.drafter.replies import read_records

    held = set(s.heldout)  # tap shard i holds records [i * per_shard, (i + 1) * per_shard)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, record in enumerate(read_records(s.replies)):
        if i // s.per_shard not in held:
            np.add.at(counts, record.reply.astype(np.int64), 1)
    return counts


def build_model(s: PipelineSettings, draft_ids: np.ndarray, embed, gguf=None) -> DraftModel:
    ids = torch.from_numpy(draft_ids)
    c = DrafterConfig(
        target_layers=list(s.taps), draft_vocab_size=len(ids), dim=embed.embedding_dim,
        block_size=s.block_size, n_layers=s.n_layers, markov_rank=s.markov_rank,
        qk_norm=s.qk_norm, rope_style=s.rope_style,
    )
    torch.manual_seed(s.train.seed)
    with torch.no_grad():
        model = DraftModel(c, ids, embed(ids))
        if gguf is not None and "output_norm.weight" in gguf.tensors:
            # the head is the target's; start its norm where the target's final norm is
            w = gguf.tensors["output_norm.weight"].dequantize()
            model.norm.weight.copy_(torch.from_numpy(w))
    return model


def seed_state(model: DraftModel, start: DraftModel, s: PipelineSettings, state: Path) -> None:
    """The training state of a stage that starts from `start` (init_from's checkpoint): its
    weights in `model` (the settings' shape: UserError where it differs), at the step its stage
    ended (the schedule goes on from there), Adam's moments fresh."""
    from adaspark.drafter.train import param_groups, save_state

    if start.c != model.c:
        diff = {k: (v, getattr(model.c, k)) for k, v in start.c.to_dict().items()
                if getattr(model.c, k) != v}
        raise UserError(f"{s.init_from} is another drafter shape than this run's: {diff} "
                        "(checkpoint, this run)")
    model.load_state_dict(start.state_dict())
    info = json.loads((Path(s.init_from) / "config.json").read_text()).get("info", {})
    step = int(info.get("steps", 0))
    opt = torch.optim.AdamW(param_groups(model, s.train.weight_decay), lr=s.train.lr)
    save_state(state, model, opt, step, s.train)
    log.info("seeded from %s at step %d (Adam's moments fresh)", s.init_from, step)


def run_pipeline(s: PipelineSettings, gguf, embed, stop_ids, fingerprint: dict,
                 out: Path | None = None) -> Path:
    """Everything after the data stage; returns the exported checkpoint directory."""
    t_start = time.time()
    train_seqs, val_groups, tap_index = load_data(s.work, s.taps, s.heldout)
    val_seqs = [seq for group in val_groups for seq in group]
    log.info("data: %d training sequences, %d held out", len(train_seqs), len(val_seqs))
    vocab_path = s.work / "vocab.npy"
    state = s.work / "train_state.pt"
    start = None
    if s.init_from is not None and not state.exists():
        start = load_checkpoint(s.init_from, fingerprint, embed)
        if vocab_path.exists() and not np.array_equal(np.load(vocab_path),
                                                      start.draft_ids.numpy()):
            raise UserError(f"{vocab_path} is not the draft vocabulary of {s.init_from}")
        np.save(vocab_path, start.draft_ids.numpy())
    if vocab_path.exists():
        draft_ids = np.load(vocab_path)
    else:
        counts = vocab_counts(s, train_seqs, fingerprint["vocab_size"])
        draft_ids = vocab.build_draft_vocab(counts, s.vocab_size, stop_ids)
        np.save(vocab_path, draft_ids)
    cov = vocab.coverage(val_seqs, draft_ids)
    log.info("draft vocabulary %d tokens, held-out reply coverage %.4f", len(draft_ids), cov)
    model = build_model(s, draft_ids, embed, gguf)
    if start is not None:
        seed_state(model, start, s, state)
    deadline = None if s.minutes is None else time.time() + 60 * s.minutes
    # a fixed slice, as much of each held-out shard, keeps the periodic check to seconds
    quick_val = [seq for group in val_groups for seq in group[: 32 // len(val_groups)]]

    weights = loss_weights(s.train)

    def held_out(m):  # judged by the loss it trains on
        return validation_loss(m, embed, quick_val, tap_index, weights=weights)["loss"]

    # a resumed run whose held-out set or loss changed forgets its best so far
    val_key = "heldout shards " + ",".join(map(str, s.heldout))
    if weights != WEIGHTS:
        val_key += " loss " + " ".join(f"{k} {v:g}" for k, v in weights.items())
    train(model, embed, train_seqs, tap_index, s.train, state_path=state, deadline=deadline,
          held_out=held_out, val_key=val_key)
    st = torch.load(state, weights_only=False) if state.exists() else {"step": 0}
    step = int(st["step"])
    best_step = (st.get("best") or {}).get("step", step)
    val = validation_loss(model, embed, val_seqs, tap_index)
    log.info("validation (weights of step %d): %s", best_step, val)
    z, correct, reached = calibrate.chain_rows(model, embed, val_seqs, tap_index)
    temps = calibrate.fit_temperatures(z, correct, reached)
    ece_before = calibrate.ece(z, correct, reached, np.ones_like(temps))
    ece_after = calibrate.ece(z, correct, reached, temps)
    with torch.no_grad():
        model.temperature.copy_(torch.from_numpy(temps).float())
    log.info("STS temperatures %s; held-out ECE %.4f -> %.4f", temps.round(3).tolist(),
             ece_before, ece_after)
    info = {
        "steps": step, "weights_from_step": best_step, "train_sequences": len(train_seqs),
        "heldout_sequences": len(val_seqs),
        "train_reply_tokens": int(sum(x.reply_len for x in train_seqs)),
        "settings": {k: v for k, v in s.train.__dict__.items()},
        "vocab_coverage_heldout": cov, "validation": val,
        "ece_heldout_before": ece_before, "ece_heldout_after": ece_after,
        "export_seconds": round(time.time() - t_start, 1),
    }
    out = out or s.work / "checkpoint"
    save_checkpoint(out, model, fingerprint, info)
    log.info("checkpoint written to %s", out)
    return out
