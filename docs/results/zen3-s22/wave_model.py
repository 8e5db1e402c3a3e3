"""Session 22, ad hoc: benchmarks/concurrency.py's wave_ttft applied to every committed
concurrency JSON of this Zen 3 class (sessions 20-22): per arm-run, the measured p95 time to
first token at 4 clients over the solo p95, beside the p95 the solo first tokens predict if
every 4 prompts arrived together and prefilled one after another at their solo cost.

    .venv/bin/python docs/results/zen3-s22/wave_model.py
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
from concurrency import percentile, wave_ttft  # noqa: E402

files = sorted(REPO.glob("docs/results/zen3-s2[0-2]/concurrency-short-*.json")) + sorted(
    REPO.glob("docs/results/zen3-s20/prefill-order-ab-*.json"))
print(f"{'file':<44} {'arm':<14} {'solo p95':>8} {'4 p95':>6} {'x solo':>6} {'waves':>6}")
for path in files:
    rows = json.loads(path.read_text())["rows"]
    for arm in dict.fromkeys(r["arm"] for r in rows if "ttft_s" in r):
        by = {r["clients"]: r for r in rows if r["arm"] == arm and "ttft_s" in r}
        if 1 not in by or 4 not in by:
            continue
        p1, p4 = by[1]["ttft_p95_s"], by[4]["ttft_p95_s"]
        waves = percentile(wave_ttft(by[1]["ttft_s"], 4), 0.95)
        print(f"{path.parent.name + '/' + path.name:<44} {arm:<14} {p1:8.3f} {p4:6.3f} "
              f"{p4 / p1:6.2f} {waves / p1:6.2f}")
