"""Candidates a row's Markov bound lets through, by threshold and level, for a drafter on the
evaluation's first turns (torch path replay). The first level scans the whole vocabulary with
W2's top 8 directions; a second level re-caps only its survivors with the top K2 directions.
Threshold "best": the shortlist's best biased value (enough for the pick); "kth": its 8th best
(enough for the whole top 8 to be exact). Counts only, no timing; gathered bytes per row in
fp16 rows (r = 128: 256 bytes exact, 2*K2 bytes a second-level row).

    .venv/bin/python docs/results/zen5-s33/scripts/markov_levels.py DRAFTER_DIR [N_SEQS]
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "zen5-s32" / "scripts"))
from markov_reach import load  # noqa: E402

from adaspark.drafter import runtime  # noqa: E402
from adaspark.drafter.evaluate import replay_chain  # noqa: E402


def main() -> None:
    model, embed, seqs = load(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    w2 = model.markov_w2.weight.detach().float()
    r = w2.shape[1]
    bounds = {k: runtime.markov_bound(w2, k) for k in (8, 32, 64)}
    counts: dict[str, list[int]] = {}
    real_reaching = runtime._reaching

    def spy(logits_row, e, bound, best):
        short = logits_row.topk(64).indices
        sv = logits_row[short] + w2[short] @ e
        thr = {"best": best, "kth": float(sv.topk(8).values[-1])}
        caps = {k: runtime.markov_caps(logits_row, e, b) for k, b in bounds.items()}
        for name, t in thr.items():
            first = caps[8] >= t
            counts.setdefault(f"{name} L1(8)", []).append(int(first.sum()))
            for k2 in (32, 64):
                counts.setdefault(f"{name} L1(8)+L2({k2})", []).append(
                    int((first & (caps[k2] >= t)).sum()))
        return real_reaching(logits_row, e, bound, best)

    runtime._reaching = spy
    drafter = runtime.Drafter(model, embed, dtype=torch.float32)
    for seq in seqs[:n]:
        replay_chain(drafter, seq, list(range(len(model.c.target_layers))))
    base = np.array(counts["best L1(8)"]).mean() * 2 * r
    print(f"rows {len(counts['best L1(8)'])} not provably exact; V {w2.shape[0]}, r {r}")
    for name, v in counts.items():
        v = np.array(v)
        line = (f"  {name:22s} median {np.median(v):5.0f}  mean {v.mean():6.0f}  "
                f"p90 {np.percentile(v, 90):5.0f}")
        if "L2" in name:
            k2 = int(name.split("L2(")[1].rstrip(")"))
            first = np.array(counts[name.split(" ")[0] + " L1(8)"]).mean()
            gathered = first * 2 * k2 + v.mean() * 2 * r
            line += f"  bytes/row {gathered:8.0f} ({gathered / base:.2f}x today's)"
        elif name.startswith("kth"):
            line += f"  bytes/row {v.mean() * 2 * r:8.0f} ({v.mean() * 2 * r / base:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
