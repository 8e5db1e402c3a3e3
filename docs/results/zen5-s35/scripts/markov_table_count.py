"""Counts per Markov row, on eval-drafter's replay (torch path): candidates outside the
shortlist that markov_bound's caps let through (for the pick), against those outside the
shortlist and the previous pick's M-candidate high set whose backbone logit comes within tau of
the best (REF=best) or of the 8th best (REF=kth, the committed rule: the whole top 8).

    REF=kth .venv/bin/python markov_table_count.py 64 eval-drafter --work W --drafter D --json
"""
import os, sys, statistics as st, torch
import adaspark.drafter.runtime as r
r.TABLE_LIMIT = 0  # the runtime's own chain on the caps, as before the table
M = int(sys.argv[1])
cache = {}
stats = {"cur": [], "new": [], "pick_diff": 0, "rows": 0}
orig = r.markov_chain
def patched(logits, w1, w2, w2_max, first_key, key_of_pick, shortlist, topk, bound=None, table=None):
    out = orig(logits, w1, w2, w2_max, first_key, key_of_pick, shortlist, topk, bound, table)
    if id(w2) not in cache:
        full = w1 @ w2.T  # [keys, V]
        tv, ti = full.topk(M + 1, -1)
        cache[id(w2)] = (full, ti[:, :M], tv[:, M])
    full, hi, tau = cache[id(w2)]
    B, V = logits.shape
    S = min(shortlist, V)
    short_v, short_i = logits.topk(S, -1)
    prev = first_key
    for i in range(B):
        e = w1[prev]
        exact = logits[i] + w2 @ e
        # current method's count
        vals = short_v[i] + w2[short_i[i]] @ e
        reach = r._reaching(logits[i], e, bound, float(vals.max())) if bound is not None else torch.arange(V)
        cur = int((~torch.isin(reach, short_i[i])).sum())
        # new: exact over short ∪ hi[prev]; outside: lr_j + tau >= best
        cand = torch.unique(torch.cat([short_i[i], hi[prev]]))
        best = float(exact[cand].max() if os.environ.get("REF") == "best"
                     else exact[cand].topk(8).values[-1])
        slack = 1e-3 * (abs(best) + 1)
        outside = torch.ones(V, dtype=torch.bool); outside[cand] = False
        new = int(((logits[i] + float(tau[prev]) + slack >= best) & outside).sum())
        stats["cur"].append(cur); stats["new"].append(new)
        pick = int(out.picks[i]); stats["rows"] += 1
        if int(exact.argmax()) != pick: stats["pick_diff"] += 1
        prev = pick if key_of_pick is None else int(key_of_pick[pick])
    return out
r.markov_chain = patched
from adaspark.cli import main
try:
    main(sys.argv[2:])
finally:
    c, n = stats["cur"], stats["new"]
    q = lambda v, p: sorted(v)[int(p * (len(v) - 1))]
    print(f"M={M} rows={stats['rows']} current: mean {st.mean(c):.0f} median {q(c,.5)} p90 {q(c,.9)}; "
          f"new: mean {st.mean(n):.1f} median {q(n,.5)} p90 {q(n,.9)} max {max(n)}; pick!=exact argmax {stats['pick_diff']}",
          file=sys.stderr)
