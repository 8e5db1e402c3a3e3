"""Training data for the drafter: the target's own greedy replies and its hidden states.

Prompts come from a JSONL file ({"prompt", "system"?, "tools"?}), shuffled with a seed and
rendered with the target's chat template; prompts longer than `max_prompt_tokens` are skipped
(a long prompt costs a whole padded batched prefill). Shard i holds prompts
[i*per_shard, (i+1)*per_shard) of that order, so a run resumes at its first missing shard and
a larger run extends a smaller one. A later data run can draw from other sources or longer
prompts into shards numbered after the existing ones (`first_shard`); it skips every prompt that
an existing shard already holds, so no reply is trained on twice.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from adaspark.drafter.shards import Sequence, shard_path, write_shard
from adaspark.errors import UserError

log = logging.getLogger("adaspark.drafter")


def load_prompt_items(path: Path) -> list[dict]:
    try:
        lines = Path(path).read_text().split("\n")  # not splitlines(): U+2028 inside JSON
        return [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read prompts from {path}: {err}") from err


def first_turns(conversations_path: Path) -> list[dict]:
    """The evaluation conversations' first user turns, as prompt items."""
    return [
        {"prompt": c["turns"][0], "system": c.get("system"), "tools": c.get("tools"),
         "source": c.get("source")}
        for c in load_prompt_items(conversations_path)
    ]


def encode_item(tokenizer, item: dict) -> list[int]:
    msgs = [{"role": "system", "content": item["system"]}] if item.get("system") else []
    msgs.append({"role": "user", "content": item["prompt"]})
    return tokenizer.encode_chat(msgs, item.get("tools"))


def select_prompts(items, tokenizer, n: int, seed: int, max_prompt_tokens: int, shuffle=True,
                   sources: list[str] | None = None, skip: set[tuple] | frozenset = frozenset()):
    """The first n prompts (token ids) of the seeded order that fit max_prompt_tokens, come from
    a source starting with one of `sources` (all when None) and are not in `skip`."""
    items = list(items)
    if sources:
        items = [it for it in items if str(it.get("source", "")).startswith(tuple(sources))]
    if shuffle:
        random.Random(seed).shuffle(items)
    out = []
    for item in items:
        ids = encode_item(tokenizer, item)
        if len(ids) <= max_prompt_tokens and tuple(ids) not in skip:
            out.append(ids)
        if len(out) == n:
            break
    return out


def target_embedding(gguf) -> torch.nn.Embedding:
    """The target's input embedding as a frozen lookup (training needs no engine for it)."""
    w = torch.from_numpy(gguf.tensors["token_embd.weight"].dequantize())
    return torch.nn.Embedding.from_pretrained(w, freeze=True)


def sequences_from_target(target, prompts, replies, tap_layers, topk: int) -> list[Sequence]:
    """Tapped hidden states and top-k logits of prompt+reply through the target (causal)."""
    seqs = []
    full = [p + r for p, r in zip(prompts, replies, strict=True)]
    outs = target.hidden_states_batch(full, tap_layers, return_logits=True)
    for p, toks, out in zip(prompts, full, outs, strict=True):
        T, P = len(toks), len(p)
        if T - P < 2:
            continue
        hidden = torch.stack([out[t][: T - 1] for t in tap_layers], 1)
        vals, ids = out["logits"][P : T - 1].float().topk(topk, -1)
        seqs.append(Sequence(
            np.asarray(toks, np.int32), P, hidden.to(torch.float16).numpy(),
            ids.to(torch.int32).numpy(), vals.to(torch.float16).numpy(),
        ))
    return seqs


def generate_shards(target, tokenizer, prompts, out_dir: Path, tap_layers, max_new: int,
                    per_shard: int = 128, batch: int = 32, topk: int = 32,
                    first_shard: int = 0) -> None:
    """Write every missing shard of `prompts` to out_dir (batched greedy on the target), the
    first as shard number `first_shard`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_shards = (len(prompts) + per_shard - 1) // per_shard
    stops = set(tokenizer.stop_ids)
    for i in tqdm(range(n_shards), desc="data shards", dynamic_ncols=True):
        path = shard_path(out_dir, first_shard + i)
        if path.exists():
            continue
        chunk = prompts[i * per_shard : (i + 1) * per_shard]
        order = sorted(range(len(chunk)), key=lambda j: len(chunk[j]))  # less padding
        seqs: list[Sequence] = []
        for s in range(0, len(order), batch):
            ps = [chunk[j] for j in order[s : s + batch]]
            replies = target.generate_greedy_batch(ps, max_new, stops)
            seqs += sequences_from_target(target, ps, replies, tap_layers, topk)
        write_shard(path, seqs, list(tap_layers))
        log.info("shard %d: %d sequences, %d reply tokens", first_shard + i, len(seqs),
                 sum(s.reply_len for s in seqs))
