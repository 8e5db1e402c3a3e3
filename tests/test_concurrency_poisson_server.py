"""benchmarks/concurrency.py's Poisson mode end to end through main(): `adaspark serve --arm ar`
(a real server, the embedded model), one client over three short first turns, then the same
requests at seeded Poisson times on a fresh server. Every request answered, each reply equal to
its solo reply, and the rows, the comparison and the JSON consistent with the schedule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import arrivals  # noqa: E402
import concurrency  # noqa: E402

pytestmark = pytest.mark.slow

TURNS = ("Count from 1 to 10, separated by commas.", "Name three colours.",
         "Write one sentence about the sea.")


def write_data(tmp_path: Path) -> Path:
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"source": "t", "id": str(i), "category": "chat",
                                        "turns": [turn]}) + "\n" for i, turn in enumerate(TURNS)))
    return data


def test_the_poisson_pass_answers_every_request_as_the_solo_pass_did(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # main sets it for the servers: restored after
    data = write_data(tmp_path)
    out = tmp_path / "out.json"
    assert concurrency.main(["--arms", "ar", "--arrivals", "poisson", "--concurrency", "2",
                             "--requests", "3", "--cap", "8", "--seed", "5", "--threads", "1",
                             "--prompts", "mixed", "--data", str(data), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    solo, poisson = result["rows"]
    assert solo["clients"] == 1 and solo["failed"] == 0 and "arrivals" not in solo
    rate = poisson["rate_per_s"]
    # Little's law: the completion rate of 2 closed-loop clients keeps 2 in flight
    calibration = poisson["rate_from"]
    assert calibration["clients"] == 2 and calibration["requests"] == 3
    assert rate == pytest.approx(3 / calibration["wall_s"])
    assert poisson["arrivals"] == "poisson" and poisson["clients"] == 2 and poisson["seed"] == 5
    assert poisson["failed"] == 0 and poisson["same_as_solo"] == 3
    assert poisson["tokens"] == solo["tokens"]
    assert poisson["arrival_span_s"] == arrivals.poisson_arrivals(3, rate, 5)[-1]
    assert poisson["wall_s"] >= poisson["arrival_span_s"]  # the last was sent, then answered
    assert poisson["in_flight_mean"] > 0
    (comparison,) = result["comparison"]
    assert comparison["aggregate_tok_s_over_solo"] == pytest.approx(
        poisson["aggregate_tok_s"] / solo["aggregate_tok_s"])
    assert comparison["aggregate_over_llama_server"] is None
    assert result["settings"]["arrivals"] == "poisson"
    printed = capsys.readouterr().out
    assert "ar: Poisson ~2" in printed and "mixed by seed 5" in printed


def test_the_closed_loop_mode_runs_as_before(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out.json"
    assert concurrency.main(["--arms", "ar", "--clients", "1,2", "--requests", "3", "--cap", "8",
                             "--threads", "1", "--data", str(write_data(tmp_path)),
                             "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["clients"] for r in result["rows"]] == [1, 2] and "comparison" not in result
    assert all("arrivals" not in r for r in result["rows"])
    assert result["rows"][1]["same_as_solo"] == 3
    assert result["rows"][1]["ttft_p95_waves_s"] is not None  # waves: closed loop only


def test_the_interleaved_pass_runs_every_arms_server_at_once(tmp_path, monkeypatch, capsys):
    """--interleave: `ar` and `ngram` up together, each request to both in turn: every reply
    answered and equal (every arm emits the target's greedy tokens)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out.json"
    assert concurrency.main(["--arms", "ar,ngram", "--clients", "1", "--requests", "3",
                             "--cap", "8", "--threads", "1", "--interleave",
                             "--data", str(write_data(tmp_path)), "--json", str(out)]) == 0
    ar, ngram = json.loads(out.read_text())["rows"]
    assert ar["interleaved"] and ngram["interleaved"]
    assert ar["failed"] == ngram["failed"] == 0 and ngram["same_as_first"] == 3
    assert ar["tokens"] == ngram["tokens"] and ngram["paired_over_first"] > 0
    assert "ngram over ar, interleaved" in capsys.readouterr().out
