"""Drafter evaluation on held-out replies: the full-block chain, replayed round by round.

Each held-out sequence is the target's greedy reply with its tapped hidden states. A replay runs
the runtime `Drafter` exactly as the engine would: observe the prompt, draft from the anchor,
accept the leading picks that equal the target's tokens, commit those rows plus the anchor, and
take the target's next token (the bonus) as the next anchor. Greedy decoding makes the committed
stream the stored reply, so the replay needs no target forward.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from adaspark.drafter.calibrate import chain_rows, ece
from adaspark.drafter.model import DraftModel
from adaspark.drafter.runtime import Drafter
from adaspark.drafter.vocab import coverage


def replay_chain(drafter: Drafter, seq, tap_index) -> dict:
    """Rounds of the full-block chain over one sequence; per-position counts and draft times."""
    B = drafter.block_size
    toks = seq.tokens.tolist()
    T, P = len(toks), seq.prompt_len
    taps = torch.from_numpy(seq.hidden[:, tap_index].astype(np.float32))
    drafter.reset()
    drafter.cache.append(taps[:P])
    reached, accepted, topk_hit = np.zeros(B), np.zeros(B), np.zeros(B)
    rounds, committed, times = 0, 0, []
    a = P  # the anchor: the first reply token comes from the prefill
    while a < T - 1:
        t0 = time.perf_counter()
        block = drafter.draft(toks[a])
        times.append(time.perf_counter() - t0)
        n_acc = 0
        for k in range(B):
            if a + k + 1 > T - 1:
                break
            truth = toks[a + k + 1]
            reached[k] += 1
            topk_hit[k] += truth in block.topk_ids[k]
            if block.picks[k] != truth:
                break
            accepted[k] += 1
            n_acc += 1
        step = min(n_acc + 1, T - 1 - a)  # accepted picks + the bonus token
        drafter.cache.append(taps[a : a + n_acc + 1])  # anchor row + accepted rows
        a += step
        rounds += 1
        committed += step
    return dict(reached=reached, accepted=accepted, topk_hit=topk_hit, rounds=rounds,
                committed=committed, times=times)


def evaluate(model: DraftModel, embed, seqs, tap_index, temps_before=None, max_seqs=None,
             groups: list[str] | None = None, runtime: dict | None = None) -> dict:
    """Chain metrics over `seqs`; with `groups` (a label per sequence, e.g. its dataset) also the
    chain tokens per round of each group, to see where the drafter falls short. runtime: the
    replay Drafter's options (native=module, head_bits=...: the engine's quantised draft)."""
    seqs = seqs[:max_seqs] if max_seqs else seqs
    drafter = Drafter(model, embed, **(runtime or {}))
    B = model.c.block_size
    tot = {k: np.zeros(B) for k in ("reached", "accepted", "topk_hit")}
    rounds = committed = 0
    times: list[float] = []
    by_group: dict[str, list[tuple[int, int]]] = {}  # group -> (rounds, committed) per sequence
    for i, seq in enumerate(seqs):
        r = replay_chain(drafter, seq, tap_index)
        for k in tot:
            tot[k] += r[k]
        rounds += r["rounds"]
        committed += r["committed"]
        times += r["times"]
        if groups is not None:
            by_group.setdefault(groups[i], []).append((r["rounds"], r["committed"]))
    z, correct, reached = chain_rows(model, embed, seqs, tap_index)
    temps = model.temperature.float().numpy()
    ones = np.ones(B) if temps_before is None else temps_before
    times_ms = np.array(times) * 1e3
    reached_safe = np.maximum(tot["reached"], 1)
    result = {
        "prompts": len(seqs),
        "rounds": rounds,
        "chain_tokens_per_round": committed / max(rounds, 1),
        "accept_by_position": (tot["accepted"] / reached_safe).round(4).tolist(),
        "reach_by_position": (tot["reached"] / max(rounds, 1)).round(4).tolist(),
        "topk_hit_by_position": (tot["topk_hit"] / reached_safe).round(4).tolist(),
        "ece_before": ece(z, correct, reached, ones),
        "ece_after": ece(z, correct, reached, temps),
        "temperatures": temps.round(4).tolist(),
        "draft_ms": float(np.median(times_ms)) if len(times_ms) else None,
        "draft_ms_p90": float(np.percentile(times_ms, 90)) if len(times_ms) else None,
        "draft_vocab_coverage": coverage(seqs, model.draft_ids.numpy()),
    }
    if groups is not None:
        result["chain_by_group"] = {
            name: {"prompts": len(rc), "chain_tokens_per_round":
                   round(sum(c for _, c in rc) / max(sum(r for r, _ in rc), 1), 4)}
            for name, rc in sorted(by_group.items())}
    return result


def interleaved_timing(drafter: Drafter, target, context: int = 512, reps: int = 40) -> dict:
    """Median draft forward and one-row target forward (a 1-row verify, i.e. plain decode) at the
    same context, measured alternately so that both see the same machine load."""
    ids = list(range(1000, 1000 + context))
    target.reset()
    out = target.prefill(ids, tap_layers=drafter.tap_layers)
    drafter.reset()
    drafter.observe(out.hiddens)
    mask = np.ones((1, 1), dtype=bool)
    draft_t, target_t = [], []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        drafter.draft(2000 + i)
        t1 = time.perf_counter()
        target.verify([2000 + i], [0], mask)
        t2 = time.perf_counter()
        if i >= 3:  # warm-up
            draft_t.append(t1 - t0)
            target_t.append(t2 - t1)
    target.reset()
    drafter.reset()
    d, t = float(np.median(draft_t) * 1e3), float(np.median(target_t) * 1e3)
    return {"draft_ms": d, "target_1row_ms": t, "draft_over_target": d / t, "context": context}
