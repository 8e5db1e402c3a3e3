"""On-disk training data for the drafter: the target's replies, tapped hidden states, top-k logits.

One shard is one safetensors file holding a few hundred sequences concatenated, with offsets.
Per sequence of T tokens (prompt of P tokens, then the target's greedy reply):
  tokens  [T]                   int32
  hidden  [T-1, n_taps, dim]    fp16   residual stream after each tap layer, positions 0..T-2
  top_ids / top_logits [T-1-P, k]      the target's k largest logits at positions P..T-2
The target's logits are kept as a top-k only (full 49k-wide rows would be ~100 KB per token);
the total-variation loss renormalises them over the draft vocabulary (see train.py).
Shards are written atomically (temp file + rename), so an interrupted run resumes at the first
missing shard.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from adaspark.errors import UserError


@dataclass
class Sequence:
    tokens: np.ndarray  # [T] int32
    prompt_len: int
    hidden: np.ndarray  # [T-1, n_taps, dim] fp16
    top_ids: np.ndarray  # [T-1-P, k] int32
    top_logits: np.ndarray  # [T-1-P, k] fp16

    @property
    def reply_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def shard_path(work_dir: Path, index: int) -> Path:
    return Path(work_dir) / f"shard_{index:05d}.safetensors"


def write_shard(path: Path, seqs: list[Sequence], tap_layers: list[int]) -> None:
    offsets = np.cumsum([0] + [len(s.tokens) for s in seqs]).astype(np.int64)
    reply_offsets = np.cumsum([0] + [len(s.top_ids) for s in seqs]).astype(np.int64)
    arrays = {
        "tokens": np.concatenate([s.tokens for s in seqs]).astype(np.int32),
        "offsets": offsets,
        "prompt_lens": np.array([s.prompt_len for s in seqs], dtype=np.int64),
        "hidden": np.concatenate([s.hidden for s in seqs]).astype(np.float16),
        "reply_offsets": reply_offsets,
        "top_ids": np.concatenate([s.top_ids for s in seqs]).astype(np.int32),
        "top_logits": np.concatenate([s.top_logits for s in seqs]).astype(np.float16),
    }
    meta = {"tap_layers": json.dumps(list(tap_layers))}
    tmp = Path(str(path) + ".tmp")
    save_file(arrays, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_shard(path: Path) -> tuple[list[Sequence], list[int]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            tap_layers = json.loads(f.metadata()["tap_layers"])
        a = load_file(str(path))
    except Exception as err:  # safetensors raises several types for a damaged file
        raise UserError(f"drafter data shard {path} is unreadable ({err}); delete it") from err
    seqs = []
    for i in range(len(a["prompt_lens"])):
        t0, t1 = int(a["offsets"][i]), int(a["offsets"][i + 1])
        r0, r1 = int(a["reply_offsets"][i]), int(a["reply_offsets"][i + 1])
        h0 = t0 - i  # hidden rows are T-1 per sequence
        seqs.append(
            Sequence(
                tokens=a["tokens"][t0:t1],
                prompt_len=int(a["prompt_lens"][i]),
                hidden=a["hidden"][h0 : h0 + (t1 - t0 - 1)],
                top_ids=a["top_ids"][r0:r1],
                top_logits=a["top_logits"][r0:r1],
            )
        )
    return seqs, tap_layers


def shard_tokens(path: Path) -> list[tuple[np.ndarray, int]]:
    """(tokens, prompt length) of every sequence of a shard; reads only the token arrays, not
    the hidden states."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as f:
            tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
            prompt_lens = f.get_tensor("prompt_lens")
    except Exception as err:
        raise UserError(f"drafter data shard {path} is unreadable ({err}); delete it") from err
    return [(tokens[int(a) : int(b)], int(p))
            for a, b, p in zip(offsets[:-1], offsets[1:], prompt_lens, strict=True)]


def shard_prompts(work_dir: Path, below: int) -> set[tuple]:
    """The prompts (token-id tuples) that shards 0..below-1 of a directory hold."""
    paths = (shard_path(work_dir, i) for i in range(below))
    return {tuple(int(t) for t in tokens[:plen])
            for p in paths if p.exists() for tokens, plen in shard_tokens(p)}


def read_shards(work_dir: Path, taps: list[int] | None = None) -> tuple[list[Sequence], list[int]]:
    """All shards of a directory; with `taps`, each shard's hidden states cut to those layers in
    that order (shards written with different tap sets then read as one)."""
    paths = sorted(Path(work_dir).glob("shard_*.safetensors"))
    if not paths:
        raise UserError(f"no drafter data shards in {work_dir}; run the data stage first")
    seqs: list[Sequence] = []
    common: list[int] | None = None
    for p in paths:
        s, stored = read_shard(p)
        if taps is not None:
            missing = [t for t in taps if t not in stored]
            if missing:
                raise UserError(f"shard {p} lacks target layers {missing}; regenerate it")
            idx = [stored.index(t) for t in taps]
            if idx != list(range(len(stored))):
                for x in s:
                    x.hidden = x.hidden[:, idx]
            stored = list(taps)
        if common is not None and stored != common:
            raise UserError(f"shard {p} taps layers {stored}, others {common}; regenerate the data")
        common = stored
        seqs.extend(s)
    return seqs, common or []
