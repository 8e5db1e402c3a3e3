"""benchmarks/draft_vocab.py (a draft vocabulary's coverage of held-out replies) and
benchmarks/draft_shape.py (a draft's cost by shape against a one-row target step)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import draft_shape  # noqa: E402
import draft_vocab  # noqa: E402

from adaspark.drafter.replies import Record, write_shard  # noqa: E402

STOP = 2


def conversation(key: str, replies: list[list[int]]) -> list[Record]:
    """One record per turn: a 3-token prompt, then the reply."""
    return [Record(key, turn, f"{key.split('-')[0]}/x", np.array([7, 8, 9, *reply]), 3,
                   "stop" if reply[-1] == STOP else "length")
            for turn, reply in enumerate(replies)]


def test_coverage_is_measured_on_held_out_conversations(tmp_path):
    """Training conversations write 10 (often) and 11; the held-out ones 10, 12, 13 after their
    first token: a 2-token vocabulary (the stop and 10) covers 10 and the stop there, a larger
    one 11 as well; every turn of a conversation falls on one side."""
    keys = [f"chat-{i}" for i in range(400)]
    held = [k for k in keys if draft_vocab.held_out(k, 0.1)]
    assert 10 < len(held) < 80  # crc32 spreads the keys
    records = []
    for k in keys:
        if k in held:
            records += conversation(k, [[5, 10, 12, 13, STOP], [5, 10, STOP]])
        else:
            records += conversation(k, [[5, 10, 10, 10, 11, STOP]])
    write_shard(tmp_path / "replies" / "replies_00000.npz", records, {"name": "t"})
    out = tmp_path / "cov.json"
    assert draft_vocab.main(["--replies", str(tmp_path / "replies"), "--sizes", "2,4",
                             "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["replies"] == 400 + len(held) and got["train_replies"] == 400 - len(held)
    # held-out reply tokens after the first: 10 12 13 STOP, 10 STOP -> 6 a conversation
    assert got["heldout_tokens"] == 6 * len(held)
    assert got["coverage"]["2"]["all"] == pytest.approx(4 / 6)  # {STOP, 10}
    assert got["coverage"]["4"]["all"] == pytest.approx(4 / 6)  # + 11, 5: none held out
    assert got["coverage"]["2"]["chat"] == pytest.approx(4 / 6)


def test_a_draft_of_each_shape_is_timed_against_a_one_row_step(tmp_path):
    threads = torch.get_num_threads()  # main() sets the process's
    out = tmp_path / "shape.json"
    try:
        assert draft_shape.main(["--context", "64", "--reps", "2", "--threads", "1",
                                 "--shapes", "shipped,4096x1,4096x2qk", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    got = json.loads(out.read_text())
    assert set(got["ratio"]) == {"shipped", "4096x1", "4096x2qk"}
    assert all(v > 0 for v in got["median_ms"].values())
    # a second decoder layer adds a layer's work to the same head: never cheaper than none
    assert got["median_ms"]["4096x2qk"] > 0.5 * got["median_ms"]["4096x1"]
    with pytest.raises(SystemExit, match="VOCABxLAYERS"):
        draft_shape.main(["--context", "64", "--reps", "1", "--shapes", "4096"])
