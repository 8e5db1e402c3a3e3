"""How many candidates the Markov head's exactness bound lets through per row (each then costs an
r-term dot), by basis size K, for a drafter on the evaluation's first turns (torch path replay,
the bound of runtime.markov_bound). Counts only, no timing. load() serves markov_shortlist.py.

    .venv/bin/python docs/results/zen5-s32/scripts/markov_reach.py DRAFTER_DIR [N_SEQS]
"""
import sys
from pathlib import Path

import numpy as np
import torch

from adaspark.drafter import runtime
from adaspark.drafter.checkpoint import load_checkpoint
from adaspark.drafter.data import target_embedding
from adaspark.drafter.evaluate import replay_chain
from adaspark.drafter.loading import model_sha256
from adaspark.drafter.shards import read_shards
from adaspark.model.config import ModelConfig
from adaspark.model.gguf import read_gguf
from adaspark.model.sources import resolve_model


def load(drafter_dir: str):
    """The drafter (float32, on the embedded target's embedding), that embedding, and the
    cached evaluation replies with their taps."""
    path = resolve_model(None)
    gguf = read_gguf(path)
    c = ModelConfig.from_metadata(gguf.metadata)
    info = {"arch": c.arch, "n_layers": c.n_layers, "dim": c.dim, "vocab_size": c.vocab_size,
            "model_file": path.name, "sha256": model_sha256(path)}
    embed = target_embedding(gguf)
    model = load_checkpoint(Path(drafter_dir), info, embed)
    seqs, _ = read_shards(Path("/root/eval-s31/data/eval"), list(model.c.target_layers))
    return model, embed, seqs


def main() -> None:
    model, embed, seqs = load(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    w2 = model.markov_w2.weight.detach().float()
    s = torch.linalg.svdvals(w2.double())
    print("W2", tuple(w2.shape), "singular values (top 12):", [round(float(x), 1) for x in s[:12]],
          "... median", round(float(s.median()), 2))
    bounds = {k: runtime.markov_bound(w2, k) for k in (8, 16, 32, 64)}
    counts = {k: [] for k in bounds}
    exact_rows = [0]
    rows = [0]
    real_reaching = runtime._reaching

    def spy(logits_row, e, bound, best):
        for k, b in bounds.items():
            counts[k].append(len(real_reaching(logits_row, e, b, best)))
        return real_reaching(logits_row, e, bound, best)

    runtime._reaching = spy
    real_exact = runtime.shortlist_is_exact

    def spy_exact(*a):
        r = real_exact(*a)
        rows[0] += 1
        exact_rows[0] += r
        return r

    runtime.shortlist_is_exact = spy_exact
    drafter = runtime.Drafter(model, embed, dtype=torch.float32)
    for seq in seqs[:n]:
        replay_chain(drafter, seq, list(range(len(model.c.target_layers))))
    print(f"rows {rows[0]}, shortlist provably exact in {exact_rows[0]} "
          f"({exact_rows[0] / max(rows[0], 1):.3f}); the rest, candidates reaching by basis size:")
    for k, v in counts.items():
        v = np.array(v)
        print(f"  K={k:3d}: median {np.median(v):.0f}, mean {v.mean():.0f}, p90 "
              f"{np.percentile(v, 90):.0f}, max {v.max()} of {w2.shape[0]}")


if __name__ == "__main__":
    main()
