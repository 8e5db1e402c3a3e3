"""Sequential Temperature Scaling of the confidence head, and its calibration error.

The head predicts P(pick k accepted | picks 0..k-1 accepted). Under greedy verification a pick
is accepted when it equals the target's token. Rows whose earlier picks all matched are the only
ones the scheduler ever prices at that position, so position k's temperature is fitted on those
rows alone (the "sequential" part), on sequences held out from training. On those rows the
teacher-forced previous token equals the previous pick, so one batched forward gives exactly
the runtime's values.
"""

from __future__ import annotations

import numpy as np
import torch

from adaspark.drafter.loss import forward_batch, make_batch
from adaspark.drafter.model import DraftModel


@torch.no_grad()
def chain_rows(model: DraftModel, embed, seqs, tap_index, anchors=48, seed=0):
    """-> confidence logits z, correct, reached: each [rows, B] over sampled anchors."""
    rng = np.random.default_rng(seed)
    zs, corrects, reached = [], [], []
    for seq in seqs:
        b = make_batch(seq, tap_index, model.c.block_size, anchors, rng)
        if b is None:
            continue
        logits, conf = forward_batch(model, embed, b)
        picks = model.draft_ids[logits.argmax(-1)]
        ok = (picks == b.labels) & b.valid
        before = torch.cumprod(torch.cat([torch.ones_like(ok[:, :1]), ok[:, :-1]], 1).int(), 1)
        zs.append(conf.float().numpy())
        corrects.append(ok.numpy())
        reached.append((before.bool() & b.valid).numpy())
    return np.concatenate(zs), np.concatenate(corrects), np.concatenate(reached)


def _nll(z, y, t):
    p = 1.0 / (1.0 + np.exp(-z / t))
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))


def fit_temperatures(z, correct, reached) -> np.ndarray:
    """One temperature per position, minimising log loss on that position's reached rows."""
    grid = np.exp(np.linspace(np.log(0.05), np.log(20.0), 400))
    temps = np.ones(z.shape[1])
    for k in range(z.shape[1]):
        m = reached[:, k]
        if m.sum() >= 20:
            losses = [_nll(z[m, k], correct[m, k], t) for t in grid]
            temps[k] = grid[int(np.argmin(losses))]
    return temps


def ece(z, correct, reached, temps, bins=10) -> float:
    """Expected calibration error over all reached rows, equal-width probability bins."""
    p = 1.0 / (1.0 + np.exp(-z / temps[None]))
    p, y = p[reached], correct[reached].astype(np.float64)
    if len(p) == 0:
        return float("nan")
    idx = np.minimum((p * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            err += m.sum() * abs(p[m].mean() - y[m].mean())
    return float(err / len(p))
