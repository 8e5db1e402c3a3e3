"""benchmarks/load_cost.py: a fresh process's load of a GGUF, its peak RSS above an imports-only
process's, and the file's size, as the issue's load table reports them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import load_cost  # noqa: E402

from adaspark.model.synthetic import SHAPES, Q, Recipe, write_model  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="reads /proc/self/status")


def test_a_load_is_measured_against_the_file(tmp_path):
    path = write_model(tmp_path / "tiny.gguf", Recipe("qwen3", SHAPES["tiny"], Q.Q4_0))
    out = tmp_path / "load.json"
    assert load_cost.main(["--model", str(path), "--runs", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["files"]
    assert row["file_mb"] == pytest.approx(path.stat().st_size / 2**20)
    assert row["forward"].startswith(("native-", "torch"))
    assert len(row["load_s"]) == 1 and 0 < row["load_s_median"] < 300
    # the model holds something beyond the imports, but a tiny file cannot cost gigabytes
    assert 0 < row["peak_over_file"] and row["peak_mb"][0] < 2048


def test_a_file_that_does_not_load_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(SystemExit, match="loading .*bad.gguf failed"):
        load_cost.main(["--model", str(bad), "--runs", "1"])
