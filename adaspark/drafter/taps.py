"""Training sequences from reply shards: the target's taps and top-k logits recomputed from the
stored token ids with the batched prefill (Transformer.prefill_rows_many: one native call for
many sequences' chunks), then written as the trainer's tap shards (shards.py).

Reply shards keep ids only (two bytes a token, committed); a tap shard costs a few KB a token
(every tap for every token), so a training stage materialises the tap shards it trains on
(`write_tap_shards(..., shards=range(a, b))`) and may delete them after. Tap shard i holds
records [i*per_shard, (i+1)*per_shard) of the reply shards in order, so the numbering stays put
as later sessions add reply shards. The taps are the native prefill's, the very rows a drafter
reads at inference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from adaspark.drafter.replies import Record, read_records
from adaspark.drafter.shards import Sequence as TapSequence
from adaspark.drafter.shards import shard_path, write_shard
from adaspark.model.transformer import PREFILL_CHUNK

log = logging.getLogger("adaspark.drafter")


def _groups(records: Sequence[Record], max_rows: int) -> list[list[int]]:
    """Indices of records whose first chunks fit max_rows together (at least one a group),
    similar lengths side by side (their later chunks then run together too)."""
    order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))
    groups, group, rows = [], [], 0
    for i in order:
        n = min(len(records[i].tokens) - 1, PREFILL_CHUNK)
        if group and rows + n > max_rows:
            groups.append(group)
            group, rows = [], 0
        group.append(i)
        rows += n
    if group:
        groups.append(group)
    return groups


@torch.no_grad()
def sequences_from_records(target, records: Sequence[Record], tap_layers: Iterable[int],
                           topk: int = 32, max_rows: int = 1024) -> list[TapSequence]:
    """Each record (with at least two reply tokens) as a training sequence: the residual after
    each tap layer at positions 0..T-2 (fp16, in tap_layers' order) and the target's top-k
    logits at the reply's positions P..T-2, in the records' order."""
    taps = list(tap_layers)
    usable = [r for r in records if r.reply_len >= 2]
    out: dict[int, TapSequence] = {}
    caches = []
    for group in _groups(usable, max_rows):
        while len(caches) < len(group):
            caches.append(target.new_cache())
        for cache in caches:
            cache.reset()
        hidden = {i: [] for i in group}
        tops = {i: [] for i in group}
        for at in range(0, max(len(usable[i].tokens) - 1 for i in group), PREFILL_CHUNK):
            live = [(k, i) for k, i in enumerate(group) if len(usable[i].tokens) - 1 > at]
            chunks = [usable[i].tokens[at:min(at + PREFILL_CHUNK, len(usable[i].tokens) - 1)]
                      for _, i in live]
            first = [min(max(usable[i].prompt_len - at, 0), len(c))
                     for (_, i), c in zip(live, chunks, strict=True)]
            outs = target.prefill_rows_many([caches[k] for k, _ in live],
                                            [c.tolist() for c in chunks],
                                            logits_from=first, tap_layers=taps)
            for (_, i), o in zip(live, outs, strict=True):
                hidden[i].append(torch.stack([o.hiddens[t] for t in taps], 1)
                                 .to(torch.float16).numpy())
                if o.logits is not None and len(o.logits):
                    vals, ids = o.logits.float().topk(topk, -1)
                    tops[i].append((ids.to(torch.int32).numpy(),
                                    vals.to(torch.float16).numpy()))
        for i in group:
            r = usable[i]
            out[i] = TapSequence(np.asarray(r.tokens, np.int32), r.prompt_len,
                                 np.concatenate(hidden[i]),
                                 np.concatenate([t[0] for t in tops[i]]),
                                 np.concatenate([t[1] for t in tops[i]]))
    return [out[i] for i in range(len(usable))]


def write_tap_shards(target, replies_dir: Path, out_dir: Path, tap_layers: Sequence[int],
                     fingerprint: dict, per_shard: int = 128, topk: int = 32,
                     shards: Iterable[int] | None = None, max_rows: int = 1024) -> list[Path]:
    """The tap shards (shards.py) of the reply shards in replies_dir that are not written yet:
    all, or the indices in `shards`. Returns the paths written."""
    records = read_records(replies_dir, fingerprint)
    n_shards = (len(records) + per_shard - 1) // per_shard
    wanted = range(n_shards) if shards is None else [i for i in shards if i < n_shards]
    written = []
    for i in tqdm(wanted, desc="tap shards", dynamic_ncols=True):
        path = shard_path(out_dir, i)
        if path.exists():
            continue
        seqs = sequences_from_records(target, records[i * per_shard:(i + 1) * per_shard],
                                      tap_layers, topk, max_rows)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_shard(path, seqs, list(tap_layers))
        written.append(path)
        log.info("tap shard %d: %d sequences, %d reply tokens", i, len(seqs),
                 sum(s.reply_len for s in seqs))
    return written
