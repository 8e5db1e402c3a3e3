"""The Markov head over the backbone's top-S candidates only (no exactness bound) against the
exact chain: the evaluation replay's chain tokens a round and the share of rows whose pick
differs, for a drafter on the evaluation's first turns (torch path, float32). Counts only.

    .venv/bin/python docs/results/zen5-s32/scripts/markov_shortlist.py DRAFTER_DIR [N_SEQS]
"""
import sys

import torch
from markov_reach import load

from adaspark.drafter import runtime
from adaspark.drafter.evaluate import evaluate

model, embed, seqs = load(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 45
exact_chain = runtime.markov_chain
stats = {"rows": 0, "differ": 0}


def shortlist_chain(S):
    def chain(logits, w1, w2, w2_max, first_key, key_of_pick, shortlist, topk, bound=None):
        exact = exact_chain(logits, w1, w2, w2_max, first_key, key_of_pick, shortlist, topk,
                            bound)
        B, V = logits.shape
        short_v, short_i = logits.topk(min(S, V), -1)
        prev, picks = first_key, torch.empty(B, dtype=torch.long)
        K = min(topk, S)
        top_i, top_v = torch.empty(B, K, dtype=torch.long), torch.empty(B, K)
        prev_emb = torch.empty(B, w1.shape[1])
        for i in range(B):
            e = w1[prev]
            prev_emb[i] = e
            vals = short_v[i] + w2[short_i[i]] @ e
            order = torch.sort(vals, descending=True, stable=True).indices[:K]
            top_i[i], top_v[i] = short_i[i][order], vals[order]
            picks[i] = int(top_i[i, 0])
            # rows compared while both chains still share their previous pick
            if i == 0 or picks[i - 1] == exact.picks[i - 1]:
                stats["rows"] += 1
                stats["differ"] += int(picks[i] != exact.picks[i])
            prev = int(picks[i]) if key_of_pick is None else int(key_of_pick[picks[i]])
        return runtime.Chain(picks, top_i, top_v, prev_emb)
    return chain


idx = list(range(len(model.c.target_layers)))
base = evaluate(model, embed, seqs, idx, max_seqs=n, runtime={"dtype": torch.float32})
print(f"exact: chain {base['chain_tokens_per_round']:.4f} acc {base['accept_by_position'][:3]}")
for S in (64, 256, 1024):
    stats.update(rows=0, differ=0)
    runtime.markov_chain = shortlist_chain(S)
    r = evaluate(model, embed, seqs, idx, max_seqs=n, runtime={"dtype": torch.float32})
    runtime.markov_chain = exact_chain
    print(f"top-{S}: chain {r['chain_tokens_per_round']:.4f} acc {r['accept_by_position'][:3]}"
          f"; picks differing from the exact chain's: {stats['differ']} of {stats['rows']} rows")
