"""Reply shards: the target's greedy replies as token ids only, compact enough to commit.

One shard is a compressed .npz of the replies finished together:
  tokens       prompt + reply ids of every record, concatenated (uint16 when the vocabulary
               fits, else uint32); a reply that ended on a stop token keeps it (the drafter
               learns to propose the end)
  offsets      [n+1] int64 record bounds in `tokens`; prompt_lens [n] int32
  turns        [n] int16: which user turn of its conversation the record answers
  keys, sources, finish   [n] str: the conversation's key (pool.Conversation.key), its source,
               "stop" or "length"
  target       the target's fingerprint (model file name and sha256): replies of another
               model are refused
Taps and logits are not stored (a few KB per token): taps.py recomputes them with the batched
prefill when training wants them. Shards are written whole (temp file + rename) and never
changed, so a directory resumes anywhere: the records present are done, the others are not.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaspark.errors import UserError

SHARD = re.compile(r"replies_(\d{5})\.npz$")


@dataclass
class Record:
    key: str  # the conversation's
    turn: int
    source: str
    tokens: np.ndarray  # prompt + reply ids
    prompt_len: int
    finish: str  # "stop": ended on a stop token (the last id); "length": hit max_new

    @property
    def reply(self) -> np.ndarray:
        return self.tokens[self.prompt_len:]

    @property
    def reply_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def shard_paths(directory: Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("replies_*.npz") if SHARD.fullmatch(p.name))


def next_shard_path(directory: Path) -> Path:
    last = max((int(SHARD.fullmatch(p.name).group(1)) for p in shard_paths(directory)), default=-1)
    return Path(directory) / f"replies_{last + 1:05d}.npz"


def write_shard(path: Path, records: list[Record], target: dict) -> None:
    if not records:
        raise ValueError("a reply shard needs at least one record")
    tokens = np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in records])
    if tokens.min() < 0:
        raise ValueError("negative token id in a reply record")
    dtype = np.uint16 if tokens.max() < 2**16 else np.uint32
    arrays = {
        "tokens": tokens.astype(dtype),
        "offsets": np.cumsum([0] + [len(r.tokens) for r in records]).astype(np.int64),
        "prompt_lens": np.array([r.prompt_len for r in records], dtype=np.int32),
        "turns": np.array([r.turn for r in records], dtype=np.int16),
        "keys": np.array([r.key for r in records]),
        "sources": np.array([r.source for r in records]),
        "finish": np.array([r.finish for r in records]),
        "target": np.array(json.dumps(target, sort_keys=True)),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def read_shard(path: Path, target: dict | None = None) -> list[Record]:
    """A shard's records; with `target`, refused unless they are that target's replies."""
    try:
        with np.load(path, allow_pickle=False) as a:
            arrays = {k: a[k] for k in a.files}
        made_by = json.loads(str(arrays["target"]))
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"reply shard {path} is unreadable ({err}); delete it") from err
    if target is not None and made_by != target:
        raise UserError(f"reply shard {path} holds replies of {made_by.get('model_file')} "
                        f"({str(made_by.get('sha256'))[:12]}), not of "
                        f"{target.get('model_file')} ({str(target.get('sha256'))[:12]})")
    off, tokens = arrays["offsets"], arrays["tokens"].astype(np.int32)
    return [Record(str(k), int(t), str(s), tokens[int(off[i]):int(off[i + 1])], int(p), str(f))
            for i, (k, t, s, p, f) in enumerate(zip(arrays["keys"], arrays["turns"],
                                                    arrays["sources"], arrays["prompt_lens"],
                                                    arrays["finish"], strict=True))]


def read_records(directory: Path, target: dict | None = None) -> list[Record]:
    return [r for p in shard_paths(directory) for r in read_shard(p, target)]


def target_fingerprint(model_path: Path) -> dict:
    """What a shard records of its target: replies of any other model file are refused."""
    from adaspark.drafter.loading import model_sha256

    return {"model_file": Path(model_path).name, "sha256": model_sha256(Path(model_path))}


def totals(records: Iterable[Record]) -> dict:
    records = list(records)
    return {"records": len(records), "reply_tokens": int(sum(r.reply_len for r in records)),
            "prompt_tokens": int(sum(r.prompt_len for r in records)),
            "conversations": len({r.key for r in records}),
            "later_turns": sum(1 for r in records if r.turn > 0)}
