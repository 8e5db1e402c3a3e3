"""The reduced draft vocabulary: the target's most frequent reply tokens, as target ids.

On this CPU a 49k-wide drafter head costs about a one-row target forward; a few thousand of the
target's own most frequent reply tokens cover almost all of what it writes (FR-Spec, EAGLE-3).
A token outside the vocabulary can never be drafted, which costs acceptance at exactly those
positions: `coverage` on held-out replies is that cost's upper bound.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from adaspark.drafter.shards import Sequence
from adaspark.errors import UserError


def reply_token_counts(seqs: Iterable[Sequence], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in seqs:
        np.add.at(counts, s.tokens[s.prompt_len :].astype(np.int64), 1)
    return counts


def build_draft_vocab(counts: np.ndarray, size: int, always: Iterable[int]) -> np.ndarray:
    """The `size` most frequent ids (stop tokens always in), sorted ascending; ties by lower id."""
    always = sorted(set(int(t) for t in always))
    if size < len(always) + 1 or size > len(counts):
        lo, hi = len(always) + 1, len(counts)
        raise UserError(f"draft vocabulary size {size} must be in [{lo}, {hi}]")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id
    chosen = list(always)
    seen = set(always)
    for t in order:
        if len(chosen) == size:
            break
        if int(t) not in seen:
            chosen.append(int(t))
            seen.add(int(t))
    return np.array(sorted(chosen), dtype=np.int64)


def coverage(seqs: Iterable[Sequence], draft_vocab: np.ndarray) -> float:
    """Fraction of reply tokens (the tokens a drafter must predict) inside the draft vocabulary."""
    inside = total = 0
    for s in seqs:
        reply = s.tokens[s.prompt_len + 1 :]  # the first reply token comes from prefill
        inside += int(np.isin(reply, draft_vocab).sum())
        total += len(reply)
    return inside / max(total, 1)
