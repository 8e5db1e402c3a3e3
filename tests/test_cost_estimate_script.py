"""benchmarks/cost_estimate.py: after one request from an empty store, the scheduler's price of
each width it measured beside a measured verify of that width, and their errors."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cost_estimate  # noqa: E402


@pytest.mark.usefixtures("one_thread")
def test_one_request_prices_the_widths_it_measured(tmp_path):
    out = tmp_path / "estimate.json"
    assert cost_estimate.main(["--max-tokens", "64", "--reps", "1", "--threads", "1",
                               "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    est, measured = got["estimate_ms"], got["measured_ms"]
    assert "1" in est and len(est) >= 2 and est.keys() == measured.keys()
    assert got["context"] == got["prompt_tokens"] + got["reply_tokens"]
    for width in est:
        assert est[width] > 0 and measured[width] > 0
        assert got["errors"][width] == pytest.approx(est[width] / measured[width] - 1)
    assert got["median_abs_error"] == pytest.approx(
        statistics.median(abs(e) for e in got["errors"].values()))


@pytest.mark.usefixtures("one_thread")
def test_requests_served_together_teach_the_width_of_their_rows(tmp_path):
    """Two requests at once: each step is one call of two rows, which prices width 2 even where
    the n-gram index proposed nothing."""
    out = tmp_path / "estimate.json"
    assert cost_estimate.main(["--max-tokens", "24", "--together", "2", "--reps", "1",
                               "--threads", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["together"] == [2] and {"1", "2"} <= got["estimate_ms"].keys()
