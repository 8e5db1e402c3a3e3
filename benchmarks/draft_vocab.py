"""How much of the target's replies a draft vocabulary of each size covers (issue 44's bar: at
least 0.97 of reply tokens), from the reply shards of `adaspark gen-data`.

    .venv/bin/python benchmarks/draft_vocab.py [--replies data/drafter/replies]
        [--sizes 8192,16384,...] [--heldout 0.1] [--json OUT]

The records are split by conversation (a hash of its key, so every turn of a conversation falls
on one side): the vocabulary is the `size` most frequent reply tokens of the training side
(drafter.vocab.build_draft_vocab, stop tokens always in) and its coverage is measured on the
held-out side's reply tokens, the first reply token excepted (the prefill makes it), overall and
per source family (the key's prefix). The shipped drafter's own vocabulary is measured the same
way beside them. A token outside the vocabulary can never be drafted, so coverage caps the
acceptance a drafter of that vocabulary can reach; what a larger vocabulary costs a draft is
benchmarks/draft_shape.py's to say.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np

from adaspark.drafter.loading import DEFAULT_DRAFTER
from adaspark.drafter.replies import read_records
from adaspark.drafter.vocab import build_draft_vocab

REPLIES = Path(__file__).resolve().parents[1] / "data/drafter/replies"
SHIPPED = DEFAULT_DRAFTER / "model.safetensors"
SIZES = (4096, 8192, 12288, 16384, 24576, 32768)


def held_out(key: str, share: float) -> bool:
    """Whether a conversation is on the held-out side (crc32 of its key: stable everywhere)."""
    return zlib.crc32(key.encode()) % 1000 < share * 1000


def family(source: str) -> str:
    return source.split("/", 1)[0]


def shipped_vocab() -> np.ndarray | None:
    """The shipped drafter's draft vocabulary (target ids), or None where it is not there."""
    if not SHIPPED.is_file():
        return None
    from safetensors.numpy import load_file

    tensors = load_file(str(SHIPPED))
    return next((np.asarray(v, dtype=np.int64) for k, v in tensors.items()
                 if k == "draft_vocab"), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", type=Path, default=REPLIES)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--heldout", type=float, default=0.1, help="share of conversations held out")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    records = read_records(args.replies)
    if not records:
        raise SystemExit(f"no reply shards in {args.replies}")
    vocab_size = 1 + max(int(r.tokens.max()) for r in records)
    stops = {int(r.tokens[-1]) for r in records if r.finish == "stop"}
    counts = np.zeros(vocab_size, dtype=np.int64)
    test: dict[str, list[np.ndarray]] = defaultdict(list)
    n_train = 0
    for r in records:
        if held_out(r.key, args.heldout):
            test[family(r.source)].append(r.tokens[r.prompt_len + 1:].astype(np.int64))
        else:
            np.add.at(counts, r.tokens[r.prompt_len:].astype(np.int64), 1)
            n_train += 1
    test_all = np.concatenate([t for ts in test.values() for t in ts])
    by_family = {f: np.concatenate(ts) for f, ts in sorted(test.items())}
    vocabs = {str(s): build_draft_vocab(counts, s, stops) for s in map(int, args.sizes.split(","))}
    if (shipped := shipped_vocab()) is not None:
        vocabs[f"shipped ({shipped.size})"] = shipped

    def cover(tokens: np.ndarray, vocab: np.ndarray) -> float:
        return float(np.isin(tokens, vocab).mean()) if tokens.size else float("nan")

    rows = {name: {"all": cover(test_all, v), **{f: cover(t, v) for f, t in by_family.items()}}
            for name, v in vocabs.items()}
    print(f"{len(records)} replies in {args.replies}: {n_train} train ("
          f"{int(counts.sum()):,} reply tokens), {len(records) - n_train} held out "
          f"({test_all.size:,} reply tokens after the first); distinct reply tokens "
          f"{int((counts > 0).sum()):,} of {vocab_size:,}\n")
    families = list(by_family)
    print("| vocabulary | held-out coverage | " + " | ".join(
        f"{f} ({by_family[f].size:,})" for f in families) + " |")
    print("|---|---|" + "---|" * len(families))
    for name, row in rows.items():
        print(f"| {name} | {row['all']:.4f} | " + " | ".join(f"{row[f]:.3f}" for f in families)
              + " |")
    if args.json:
        args.json.write_text(json.dumps({"replies": len(records), "train_replies": n_train,
                                         "heldout_tokens": int(test_all.size),
                                         "coverage": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
