"""Plot the multi-request runs: aggregate tok/s and rows per request per step against N.

    .venv/bin/python docs/results/multi-request-sim/plot.py   (reads the *.json beside it)
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
CURVES = ("cpu-avx2", "cpu-smollm2", "int4-dense")


def main() -> None:
    fig, axes = plt.subplots(2, len(CURVES), figsize=(4.2 * len(CURVES), 6.5), sharex=True)
    for col, curve in enumerate(CURVES):
        rows = json.loads((HERE / f"{curve}.json").read_text())
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            n = [r["streams"] for r in mine]
            style = {"linewidth": 2.5} if policy == "shared" else {"linewidth": 1.2}
            axes[0, col].plot(n, [r["tokens_per_s"] for r in mine], "o-", label=policy, **style)
            axes[1, col].plot(n, [r["rows_per_step"] / r["streams"] for r in mine], "o-",
                              label=policy, **style)
        axes[0, col].set_title(curve)
        axes[1, col].set_xlabel("requests running (N)")
        axes[1, col].set_xscale("log", base=2)
        axes[1, col].set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    axes[0, 0].set_ylabel("aggregate tok/s")
    axes[1, 0].set_ylabel("rows per request per step")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "multi-request.png", dpi=90)


if __name__ == "__main__":
    main()
