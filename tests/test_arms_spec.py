"""benchmarks/arms.py: arm specs, including one drafter per arm for an interleaved drafter A/B."""

import importlib.util
from pathlib import Path

import pytest

from adaspark.errors import UserError

SPEC = importlib.util.spec_from_file_location(
    "arms_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "arms.py")
arms = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(arms)


def test_arm_specs_name_modifiers_and_drafters():
    got = arms.parse_arms("ar, adaspark+gate,chain3@/w/old,chain3@/w/new,", "/shipped")
    assert got == {"ar": ("ar", "/shipped"), "adaspark,gate": ("adaspark,gate", "/shipped"),
                   "chain3@old": ("chain3", "/w/old"), "chain3@new": ("chain3", "/w/new")}
    assert list(got) == ["ar", "adaspark,gate", "chain3@old", "chain3@new"]  # run order kept


def test_arm_specs_refuse_repeats_and_unknown_arms():
    with pytest.raises(SystemExit, match="named twice"):
        arms.parse_arms("chain3@/a/x,chain3@/b/x", None)
    with pytest.raises(UserError, match="unknown arm .nosuch."):
        arms.parse_arms("nosuch", None)


def test_rounds_group_by_rows_verified():
    records = [{"rows": 2, "accepted": 0, "D": 0.002, "verify": 0.006, "commit": 0.0},
               {"rows": 2, "accepted": 1, "D": 0.002, "verify": 0.008, "commit": 0.0},
               {"rows": 2, "accepted": 0, "D": 0.002, "verify": 0.007, "commit": 0.0},
               {"rows": 8, "accepted": 4, "D": 0.003, "verify": 0.011, "commit": 0.001}]
    two, eight = arms.by_width(records)  # the commonest width first
    assert two["rows"] == 2 and two["rounds"] == pytest.approx(0.75)
    assert two["time"] == pytest.approx(0.027 / 0.042)
    assert eight["time"] == pytest.approx(0.015 / 0.042)
    assert two["accepted"] == pytest.approx(1 / 3) and eight["accepted"] == 4
    assert two["D_ms"] == pytest.approx(2.0) and two["verify_ms"] == pytest.approx(7.0)


def test_rounds_group_by_kind_with_their_time_per_committed_token():
    records = [{"plain": True, "drafted": False, "accepted": 0, "D": 0.0, "verify": 0.003,
                "commit": 0.0},
               {"plain": True, "drafted": False, "accepted": 0, "D": 0.0, "verify": 0.004,
                "commit": 0.0},
               {"plain": False, "drafted": True, "accepted": 1, "D": 0.001, "verify": 0.004,
                "commit": 0.001},
               {"plain": False, "drafted": False, "accepted": 3, "D": 0.0, "verify": 0.006,
                "commit": 0.0}]
    plain, *rest = arms.by_kind(records)  # the commonest kind first
    kinds = {k["kind"]: k for k in rest}
    assert plain["kind"] == "plain" and plain["rounds"] == pytest.approx(0.5)
    assert plain["ms_per_token"] == pytest.approx(3.5) and plain["time"] == pytest.approx(7 / 19)
    assert kinds["drafted"]["tokens_per_round"] == 2 and kinds["drafted"]["ms_per_token"] == (
        pytest.approx(3.0))
    assert kinds["ngram"]["ms_per_token"] == pytest.approx(1.5)


def test_accepted_draft_tokens_split_by_the_source_of_their_node():
    records = [{"accepted": 3, "accepted_drafter": 2, "agreed": 1, "accepted_ngram": 0},
               {"accepted": 0, "accepted_drafter": 0, "agreed": 0, "accepted_ngram": 0},
               {"accepted": 5, "accepted_drafter": 0, "agreed": 0, "accepted_ngram": 5}]
    got = arms.by_node_source(records)
    assert got["accepted"] == 8
    assert (got["drafter"], got["agreed"], got["ngram"]) == pytest.approx((2 / 8, 1 / 8, 5 / 8))
    # plain rounds only (ar), or a record without the fields: nothing to split
    assert arms.by_node_source(records[1:2]) is None
    assert arms.by_node_source([{"accepted": 0}]) is None


def _reply(conv: str, tokens: int, seconds: float) -> dict:
    return {"conversation": conv, "decode_tokens": tokens, "decode_s": seconds,
            "draft_rounds": 0, "plain_rounds": tokens, "ngram_rounds": 0, "verified_rows": tokens}


def test_speeds_by_source_pool_runs_and_divide_by_the_base_arm():
    sources = {"a#1": "longbench", "b#1": "oasst", "c#1": "longbench"}
    results = {"ar": [[_reply("a#1", 100, 1.0), _reply("b#1", 50, 0.5), _reply("c#1", 100, 1.0)]],
               "ngram": [[_reply("a#1", 100, 0.5), _reply("b#1", 50, 1.0),
                          _reply("c#1", 100, 0.5)]]}
    header, _rule, ar, ngram = arms.by_source(results, sources, "ar")
    assert header == "| arm | longbench | oasst |"
    assert ar == "| ar | 100.0 | 100.0 |"
    assert ngram == "| ngram | 2.00x | 0.50x |"  # 200 tok/s on longbench, 50 on oasst


def test_a_run_interleaves_the_arms_per_conversation_rotating_the_first():
    calls = []

    def run_one(arm, conv):
        calls.append((arm, conv))
        return [{"arm": arm, "conv": conv}]

    got = arms.interleaved(["c0", "c1", "c2", "c3"], ["ar", "x", "y"], run_one)
    assert calls == [("ar", "c0"), ("x", "c0"), ("y", "c0"), ("x", "c1"), ("y", "c1"),
                     ("ar", "c1"), ("y", "c2"), ("ar", "c2"), ("x", "c2"), ("ar", "c3"),
                     ("x", "c3"), ("y", "c3")]
    assert {arm: [r["conv"] for r in rs] for arm, rs in got.items()} == {
        arm: ["c0", "c1", "c2", "c3"] for arm in ["ar", "x", "y"]}  # in conversation order
