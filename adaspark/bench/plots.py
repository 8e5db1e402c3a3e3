"""Figures like the paper's Figures 3 and 7-10, drawn from the engines' round logs.

Every function takes the round logs per arm label and a path, draws one PNG, and returns the
path, or None when the logs lack what the figure needs (the report then says which fields).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from adaspark.bench.rounds import has  # noqa: E402

MS = 1000.0
FIRST_ROUNDS = 160  # Figure 9 shows the first 160 rounds


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def verify_vs_rows(rounds: dict[str, list[dict]], path: Path) -> Path | None:
    """Figure 3: median verify time per row count, at a short and a long context."""
    pooled = [r for rs in rounds.values() for r in has(rs, "ctx", "rows", "verify")]
    if len(pooled) < 10:
        return None
    ctx = np.array([r["ctx"] for r in pooled], dtype=float)
    low_edge, high_edge = np.quantile(ctx, [1 / 3, 2 / 3])
    windows = [("short", [r for r in pooled if r["ctx"] <= low_edge]),
               ("long", [r for r in pooled if r["ctx"] >= high_edge])]
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = False
    for name, chosen in windows:
        by_rows: dict[int, list[float]] = {}
        for r in chosen:
            by_rows.setdefault(int(r["rows"]), []).append(r["verify"] * MS)
        xs = sorted(n for n, times in by_rows.items() if len(times) >= 3)
        if not xs:
            continue
        median_ctx = int(np.median([r["ctx"] for r in chosen]))
        ys = [float(np.median(by_rows[n])) for n in xs]
        ax.plot(xs, ys, marker="o", label=f"{name} context (median {median_ctx:,} tokens)")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("rows verified")
    ax.set_ylabel("verify time, median (ms)")
    ax.set_title("Verify time against rows (all arms' rounds)")
    ax.set_ylim(bottom=0)
    ax.legend()
    return _save(fig, path)


def round_anatomy(rounds: dict[str, list[dict]], path: Path) -> Path | None:
    """Figure 7: median draft (D), verify and commit at each arm's most frequent width."""
    rows = []
    for label, rs in rounds.items():
        timed = has(rs, "rows", "D", "verify", "commit", "accepted")
        if not timed:
            continue
        width, count = Counter(int(r["rows"]) for r in timed).most_common(1)[0]
        at = [r for r in timed if int(r["rows"]) == width]
        parts = [float(np.median([r[f] for r in at])) * MS for f in ("D", "verify", "commit")]
        tokens_at = float(np.mean([1 + r["accepted"] for r in at]))
        total_time = sum(r["D"] + r["verify"] + r["commit"] for r in timed)
        total_tokens = sum(1 + r["accepted"] for r in timed)
        note = (f"{width} rows ({count / len(timed):.0%} of rounds), {tokens_at:.2f} tok/round; "
                f"all rounds {total_tokens / len(timed):.2f} tok/round, "
                f"{total_time / total_tokens * MS:.2f} ms/tok")
        rows.append((label, parts, note))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.9 * len(rows) + 1.5))
    colors = ("tab:blue", "tab:orange", "tab:green")
    for i, (_, parts, note) in enumerate(rows):
        left = 0.0
        for part, name, color in zip(parts, ("draft D", "verify", "commit"), colors, strict=True):
            ax.barh(i, part, left=left, color=color, label=name if i == 0 else None)
            left += part
        ax.text(left, i, "  " + note, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms per round (medians at the most frequent width)")
    ax.set_xlim(right=ax.get_xlim()[1] * 2.2)  # room for the notes
    ax.set_title("Anatomy of a round", loc="left")
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, fontsize=8, frameon=False)
    return _save(fig, path)


def width_shares(rounds: dict[str, list[dict]], path: Path) -> Path | None:
    """Figure 8: share of rounds at each verified width, cold-start rounds left out."""
    series = []
    for label, rs in rounds.items():
        warm = [int(r["rows"]) for r in has(rs, "rows") if not r.get("cold")]
        if warm:
            series.append((label, Counter(warm), len(warm)))
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.0 * len(series) + 0.5), squeeze=False)
    for ax, (label, counts, total) in zip(axes[:, 0], series, strict=True):
        widths = sorted(counts)
        ax.bar([str(w) for w in widths], [counts[w] / total * 100 for w in widths])
        ax.set_ylabel("% of rounds")
        ax.set_title(f"{label} ({total:,} rounds)", fontsize=9)
    axes[-1, 0].set_xlabel("rows verified")
    return _save(fig, path)


def cost_model(rounds: dict[str, list[dict]], path: Path) -> Path | None:
    """Figure 9: measured verify time against the cost model's estimate, first 160 rounds.

    Cold-start rounds (a width chosen for measurement, often without an estimate) are hollow.
    """
    series = [(label, has(rs, "verify")) for label, rs in rounds.items()]
    series = [(label, rs) for label, rs in series if len(has(rs, "pred_T")) >= 2]
    if not series:
        return None
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.6 * len(series) + 0.5), squeeze=False)
    for ax, (label, rs) in zip(axes[:, 0], series, strict=True):
        first = rs[:FIRST_ROUNDS]
        x = np.arange(len(first))
        measured = np.array([r["verify"] for r in first]) * MS
        cold = np.array([bool(r.get("cold")) for r in first])
        estimate = np.array([np.nan if r.get("pred_T") is None else r["pred_T"] * MS
                             for r in first])
        ax.scatter(x[~cold], measured[~cold], s=8, label="measured verify")
        if cold.any():
            ax.scatter(x[cold], measured[cold], s=12, facecolors="none", edgecolors="tab:blue",
                       label="cold-start round")
        ax.plot(x, estimate, color="tab:red", label="estimate")
        priced = [r for r in has(rs, "pred_T") if not r.get("cold") and r["verify"] > 0]
        errors = [abs(r["pred_T"] - r["verify"]) / r["verify"] for r in priced[len(priced) // 2:]]
        error = f"{np.median(errors):.1%}" if errors else "n/a"
        ax.set_title(f"{label}: {len(rs):,} rounds ({int(sum(bool(r.get('cold')) for r in rs))} "
                     f"cold-start); median |error| over the second half: {error}", fontsize=9)
        ax.set_ylabel("verify (ms)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("round")
    return _save(fig, path)


def calibration(rounds: dict[str, list[dict]], path: Path, bins: int = 10) -> Path | None:
    """Figure 10: accepted nodes against the expected S, ten equal-count bins per arm."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = 0.0
    drawn = False
    for label, rs in rounds.items():
        priced = [r for r in has(rs, "pred_S", "accepted") if not r.get("cold")]
        if len(priced) < bins:
            continue
        priced.sort(key=lambda r: r["pred_S"])
        groups = np.array_split(np.arange(len(priced)), bins)
        xs = [float(np.mean([priced[i]["pred_S"] for i in g])) for g in groups]
        ys = [float(np.mean([priced[i]["accepted"] for i in g])) for g in groups]
        realised = sum(r["accepted"] for r in priced) / max(sum(r["pred_S"] for r in priced), 1e-9)
        ax.plot(xs, ys, marker="o", label=f"{label}: {realised:.3f} ({len(priced):,} rounds)")
        top = max(top, *xs, *ys)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.plot([0, top], [0, top], linestyle="--", color="grey")
    ax.set_xlabel("expected accepted nodes S")
    ax.set_ylabel("accepted nodes (bin mean)")
    ax.set_title("Calibration (realised / expected in the legend)", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


FIGURES = {
    "fig3_verify_vs_rows.png": (verify_vs_rows, "ctx, rows, verify"),
    "fig7_round_anatomy.png": (round_anatomy, "rows, D, verify, commit, accepted"),
    "fig8_width_shares.png": (width_shares, "rows (cold optional)"),
    "fig9_cost_model.png": (cost_model, "verify, pred_T"),
    "fig10_calibration.png": (calibration, "pred_S, accepted"),
}
