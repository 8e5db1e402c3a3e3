"""benchmarks/peer_greedy.py: greedy replies of ours and llama.cpp's compared to the first
difference, and vs_llamacpp's raw prompts.

The counting and the margins at a parting are checked on made-up replies and logits; the whole
comparison on Gemma 3 270M against llama.cpp itself, which needs llama.cpp's venv and the
fetched Gemma file (both skip with that reason where absent, as in CI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from test_peer_logits import _llamacpp_missing

from adaspark.errors import UserError
from adaspark.model import sources
from adaspark.model.tokenizer import Tokenizer

SPEC = importlib.util.spec_from_file_location(
    "peer_greedy", Path(__file__).resolve().parents[1] / "benchmarks" / "peer_greedy.py")
pg = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(pg)

pytestmark = pytest.mark.usefixtures("one_thread")


def item(ours: list[int], theirs: list[int], near_tie: bool | None = None) -> dict:
    same = pg.pl.common_prefix(ours, theirs)
    parted = near_tie is not None
    diff = {"near_tie": near_tie, "argmaxes_picked": True} if parted else None
    return {"ours": ours, "llamacpp": theirs, "same_tokens": same, "first_difference": diff}


def test_the_verdict_counts_each_kind_of_parting():
    items = [item([1, 2, 3], [1, 2, 3]), item([1, 2], [1, 5], near_tie=True),
             item([4], [4, 9]), item([7, 8], [7, 6], near_tie=False)]
    v = pg.verdict(items)
    assert (v["identical"], v["parted_at_near_tie"], v["parted_not_near_tie"],
            v["parted_by_length"]) == (1, 1, 1, 1)
    assert not v["equal_to_first_near_tie"]
    assert pg.verdict(items[:2])["equal_to_first_near_tie"]
    assert not pg.verdict(items[:3])["equal_to_first_near_tie"]  # one reply cut short


def test_a_parting_reports_both_margins_and_whether_the_argmaxes_were_picked():
    ours = np.array([0.0, 3.0, 2.5, 1.0], np.float32)  # ours: 1, then 2 by 0.5
    theirs = np.array([0.0, 2.0, 2.1, 2.2], np.float32)  # llama.cpp: 3, then 2 by 0.1
    bound = np.full(4, 0.5, np.float32)
    p = pg.pl.parting(ours, theirs, bound, 1, 3)
    assert p["ours_margin"] == pytest.approx(2.0) and p["llamacpp_margin"] == pytest.approx(0.2)
    assert p["ours_top2_margin"] == pytest.approx(0.5)
    assert p["llamacpp_top2_margin"] == pytest.approx(0.1, abs=1e-6)
    assert p["argmaxes_picked"] and not p["near_tie"]  # 2.2 > 0.5 + 0.5
    assert pg.pl.parting(ours, theirs, np.full(4, 1.2, np.float32), 1, 3)["near_tie"]
    assert not pg.pl.parting(ours, theirs, bound, 2, 3)["argmaxes_picked"]


def test_raw_prompts_are_the_text_as_it_is(model_path):
    tok = Tokenizer.from_gguf(model_path)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert pg.vs.encode(tok, turns, raw=True) == tok.encode_prompt("Be brief.\n\nHi there")
    assert pg.vs.encode(tok, turns, raw=False) == tok.encode_chat(turns)
    assert pg.vs.parse_args(["--raw"]).raw and not pg.vs.parse_args([]).raw


def gemma_path() -> Path:
    try:
        return sources.optional_model_path("gemma3-270m", download=False)
    except UserError:
        pytest.skip("Gemma 3 270M is not fetched (run `adaspark fetch-model gemma3-270m`, "
                    "~250 MB): the tests do not download it")


@pytest.mark.skipif(bool(_llamacpp_missing()), reason=_llamacpp_missing() or "")
def test_gemma_greedy_equals_llamacpps_to_the_first_near_tie():
    """Gemma 3 270M, a base model, from raw text: every reply equal to llama.cpp's or parting
    at a near tie, and the parting priced where the replies part (the tokens each side picked,
    from their common context)."""
    args = pg.parse_args(["--model", str(gemma_path()), "--raw", "--prompts", "2",
                          "--max-tokens", "12", "--threads", "1", "--n-ctx", "256",
                          "--conversations", "/nonexistent"])
    result = pg.run(args)
    assert result["forward"].startswith("native-") and result["raw"]
    assert result["summary"]["prompts"] == 2 and result["summary"]["equal_to_first_near_tie"]
    for g in result["prompts"]:
        same, d = g["same_tokens"], g["first_difference"]
        assert g["ours"][:same] == g["llamacpp"][:same]
        if d is not None:
            assert d["position"] == g["prompt_tokens"] + same
            assert (d["ours_token"], d["llamacpp_token"]) == (g["ours"][same],
                                                              g["llamacpp"][same])
            assert d["ours_top2_margin"] >= 0 and d["llamacpp_top2_margin"] >= 0
