"""The bench statistics on fixed numbers (stats.py), and the pure parts of the harness."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from adaspark.bench.conversations import Conversation, short_subset
from adaspark.bench.runner import text_tool_calls
from adaspark.bench.servers import file_stem, parse_external, plan_arms
from adaspark.bench.stats import (
    BANDS,
    Reply,
    arm_speed,
    bootstrap_interval,
    compare,
    geomean,
    identical_replies,
    in_band,
    mean_of_runs,
    replies_by_arm,
)
from adaspark.errors import UserError


def reply(arm, conv, turn, tok_s, *, tokens=100, looped=False, deltas=50, prompt=500, text="x",
          reply_index=0, source=None):
    decode = tokens / tok_s if tok_s else None
    return Reply(arm=arm, conversation=conv, source=source or conv.split("/")[0], turn=turn,
                 reply=reply_index, tokens=tokens, prompt_tokens=prompt, deltas=deltas,
                 decode_s=decode, looped=looped, text=text)


def arm(*replies):
    return {r.key: r for r in replies}


def test_geomean_on_fixed_numbers():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([2.0, 8.0, 4.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        geomean([])
    with pytest.raises(ValueError):
        geomean([1.0, 0.0])


def test_compare_is_the_geomean_of_per_reply_ratios():
    a = arm(reply("a", "s/1", 0, 20.0), reply("a", "s/1", 1, 10.0), reply("a", "s/2", 0, 90.0))
    b = arm(reply("b", "s/1", 0, 10.0), reply("b", "s/1", 1, 10.0), reply("b", "s/2", 0, 10.0))
    r = compare(a, b)
    # ratios 2, 1, 9 -> geomean (18)^(1/3)
    assert r.value == pytest.approx(18 ** (1 / 3))
    assert (r.n, r.looped, r.single_delta, r.conversations) == (3, 0, 0, 2)
    assert r.low <= r.value <= r.high


def test_bootstrap_interval_resamples_conversations_and_is_deterministic():
    logs = np.log(np.linspace(1.0, 3.0, 12))
    groups = [f"c{i // 2}" for i in range(12)]
    first = bootstrap_interval(logs, groups, n_boot=500, seed=7)
    assert first == bootstrap_interval(logs, groups, n_boot=500, seed=7)
    assert first != bootstrap_interval(logs, groups, n_boot=500, seed=8)
    assert first[0] < geomean(np.exp(logs)) < first[1]
    logs = np.log([2.0, 2.0, 1.0, 4.0])
    groups = ["c1", "c1", "c2", "c3"]
    # a resample can hold only c2 (ratio 1) or only c3 (ratio 4): the interval spans them
    low, high = bootstrap_interval(logs, groups, n_boot=4000, seed=0, level=1.0)
    assert low == pytest.approx(1.0) and high == pytest.approx(4.0)
    # one conversation: nothing to resample, the interval is the point
    assert bootstrap_interval(np.log([3.0, 3.0]), ["c", "c"]) == pytest.approx((3.0, 3.0))


def test_bootstrap_weights_a_conversation_by_its_replies():
    # c1 holds three replies at ratio 8, c2 one at ratio 1: with every draw holding both once the
    # mean is the reply-weighted (8*8*8*1)^(1/4), not the per-conversation (8*1)^(1/2)
    logs = np.log([8.0, 8.0, 8.0, 1.0])
    low, high = bootstrap_interval(logs, ["c1", "c1", "c1", "c2"], n_boot=4000, seed=0)
    assert low < 8 ** 0.75 < high


def test_looped_and_single_delta_replies_are_left_out_and_counted():
    a = arm(reply("a", "s/1", 0, 20.0), reply("a", "s/1", 1, 30.0, looped=True),
            reply("a", "s/2", 0, 50.0), reply("a", "s/3", 0, 40.0, deltas=1))
    b = arm(reply("b", "s/1", 0, 10.0), reply("b", "s/1", 1, 10.0),
            reply("b", "s/2", 0, 10.0, looped=True), reply("b", "s/3", 0, 10.0))
    r = compare(a, b)
    assert r.value == pytest.approx(2.0)
    assert (r.n, r.looped, r.single_delta) == (1, 2, 1)
    speed = arm_speed(a)
    assert (speed.n, speed.looped, speed.single_delta) == (2, 1, 1)  # only its own loops count
    assert speed.geomean == pytest.approx(math.sqrt(20.0 * 50.0))
    assert speed.pooled == pytest.approx(200 / (100 / 20 + 100 / 50))


def test_no_pairs_left_gives_no_ratio():
    a = arm(reply("a", "s/1", 0, 20.0, looped=True))
    b = arm(reply("b", "s/1", 0, 10.0))
    r = compare(a, b)
    assert r.value is None and r.looped == 1 and r.n == 0


def test_band_split_on_prompt_plus_half_the_reply():
    # contexts: 2000 + 40/2 = 2020 (under), 2000 + 100/2 = 2050 (over), 5000 (over)
    a = arm(reply("a", "s/1", 0, 20.0, prompt=2000, tokens=40),
            reply("a", "s/1", 1, 30.0, prompt=2000, tokens=100),
            reply("a", "s/2", 0, 40.0, prompt=5000))
    b = arm(reply("b", "s/1", 0, 10.0, prompt=2000, tokens=40),
            reply("b", "s/1", 1, 10.0, prompt=2000, tokens=100),
            reply("b", "s/2", 0, 10.0, prompt=5000))
    under = compare(a, b, in_band(BANDS[0]))
    over = compare(a, b, in_band(BANDS[1]))
    assert under.n == 1 and under.value == pytest.approx(2.0)
    assert over.n == 2 and over.value == pytest.approx(math.sqrt(3.0 * 4.0))


def test_mean_of_two_runs_and_loops_in_either_run():
    first = arm(reply("x", "s/1", 0, 10.0), reply("x", "s/2", 0, 10.0))
    second = arm(reply("x", "s/1", 0, 30.0), reply("x", "s/2", 0, 10.0, looped=True))
    both = mean_of_runs(first, second)
    assert both[("s/1", 0, 0)].tok_s == pytest.approx(20.0)
    assert both[("s/2", 0, 0)].looped
    assert arm_speed(both).pooled == pytest.approx(20.0)


def test_identical_replies_all_and_first_turns():
    a = arm(reply("a", "s/1", 0, 1.0, text="same"), reply("a", "s/1", 1, 1.0, text="p"),
            reply("a", "s/2", 0, 1.0, text="é"), reply("a", "s/3", 0, 1.0, text="b"))
    b = arm(reply("b", "s/1", 0, 1.0, text="same"), reply("b", "s/1", 1, 1.0, text="q"),
            reply("b", "s/2", 0, 1.0, text="é"), reply("b", "s/3", 0, 1.0, text="B"))
    same = identical_replies(a, b)
    assert (same.same, same.total, same.same_first, same.total_first) == (2, 4, 2, 3)


def test_replies_by_arm_reads_result_records():
    records = [
        {"kind": "reply", "arm": "ar", "conversation": "oasst/1", "source": "oasst", "turn": 0,
         "reply": 0, "completion_tokens": 50, "prompt_tokens": 10, "deltas": 50, "decode_s": 2.0,
         "reached_cap": False, "text": "hi", "reasoning": ""},
        {"kind": "conversation", "arm": "ar", "conversation": "oasst/1", "status": "done"},
    ]
    replies = replies_by_arm(records)
    assert list(replies) == ["ar"]
    assert replies["ar"][("oasst/1", 0, 0)].tok_s == pytest.approx(25.0)
    records[0]["reached_cap"] = True
    assert replies_by_arm(records)["ar"][("oasst/1", 0, 0)].looped
    assert not replies_by_arm(records, include_capped=True)["ar"][("oasst/1", 0, 0)].looped


def test_plan_arms_runs_adaspark_before_and_after_the_others():
    runs = plan_arms(["ar", "adaspark:8", "adaspark", "adaspark:16"], {"llamacpp": "http://h:1"})
    assert [r.label for r in runs] == ["adaspark", "ar", "adaspark:8", "adaspark:16",
                                       "llamacpp", "adaspark#2"]
    assert runs[-1].arm == "adaspark" and runs[4].arm is None and runs[4].url == "http://h:1"
    assert [r.label for r in plan_arms(["ar", "adaspark"], {}, repeat_adaspark=False)] == [
        "adaspark", "ar"]
    with pytest.raises(UserError, match="unknown arm"):
        plan_arms(["fast"], {})
    with pytest.raises(UserError, match="twice"):
        plan_arms(["ar", "ar"], {})
    with pytest.raises(UserError, match="NAME="):
        parse_external(["llamacpp=localhost:8080"])


def test_plan_arms_passes_plus_modifiers_to_the_server_as_commas():
    runs = plan_arms(["ar", "adaspark+plain", "adaspark:4+no-ngram"], {}, repeat_adaspark=False)
    assert [(r.label, r.arm) for r in runs] == [
        ("ar", "ar"), ("adaspark+plain", "adaspark,plain"),
        ("adaspark:4+no-ngram", "adaspark:4,no-ngram")]
    assert runs[1].file_stem == "adaspark_plain"


def test_an_external_server_cannot_take_an_arms_name():
    """--url names share the arms' namespace: one of our arms (modifiers joined by '+'
    included) or a name given twice is refused; any other name is the server's."""
    for taken in (["ar=http://h:1"], ["adaspark+gate=http://h:1"],
                  ["llamacpp=http://h:1", "llamacpp=http://h:2"]):
        with pytest.raises(UserError, match="is taken"):
            parse_external(taken)
    assert parse_external(["fast=http://h:1", "http://h:2"]) == {
        "fast": "http://h:1", "external": "http://h:2"}


def test_arm_file_stems_are_distinct():
    labels = ["adaspark", "adaspark:2", "adaspark#2", "tree:2", "adaspark+plain",
              "adaspark:2+plain"]
    assert len({file_stem(a) for a in labels}) == len(labels)
    with pytest.raises(UserError, match="unknown arm"):
        plan_arms(["adaspark+fast"], {})


def test_text_tool_calls_in_toolace_form():
    names = ["Market Trends API", "SEC Filings"]
    text = '[SEC Filings(identifier="aapl"), Market Trends API(trend_type="GAINERS")]'
    assert text_tool_calls(text, names) == ["SEC Filings", "Market Trends API"]
    assert text_tool_calls("SEC Filings(identifier='aapl') is what I would call", names) == []
    assert text_tool_calls("[nothing here]", names) == []


def test_short_subset_keeps_two_turns_of_each_sources_first_conversation():
    convs = [Conversation("a", "1", "", ("t1", "t2", "t3")), Conversation("a", "2", "", ("u",)),
             Conversation("b", "9", "", ("v1",))]
    short = short_subset(convs)
    assert [(c.key, c.turns) for c in short] == [("a/1", ("t1", "t2")), ("b/9", ("v1",))]


def _results_dir(tmp_path):
    """A bench directory written by hand: five arms, three conversations, one round log."""
    speeds = {"ar": 10.0, "chain3": 15.0, "adaspark": 20.0, "adaspark:8": 18.0,
              "adaspark:16": 19.0, "adaspark#2": 22.0}
    lines = []
    for arm_name, speed in speeds.items():
        for c, conv in enumerate(["oasst/1", "toolace/2", "longbench/3"]):
            prompt = 3000 if conv.startswith("longbench") else 200
            decode = 100 / (speed * (1 + 0.1 * c))
            lines.append({"kind": "reply", "arm": arm_name, "conversation": conv,
                          "source": conv.split("/")[0], "turn": 0, "reply": 0,
                          "completion_tokens": 100, "prompt_tokens": prompt, "deltas": 60,
                          "decode_s": decode, "reached_cap": c == 1 and arm_name == "ar",
                          "text": "same" if arm_name != "chain3" else "other",
                          "timings": {"draft_rounds": 5, "mean_width": 8.0},
                          "response_id": f"{arm_name}-{conv}"})
            lines.append({"kind": "conversation", "arm": arm_name, "conversation": conv,
                          "status": "done"})
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = {"settings": {"arms": list(speeds), "cap": 64, "conversations": "x.jsonl"},
           "invocations": []}
    (tmp_path / "run.json").write_text(json.dumps(run))
    rounds = tmp_path / "rounds" / "adaspark"
    rounds.mkdir(parents=True)
    with open(rounds / "part-0.jsonl", "w") as f:
        for i in range(60):
            rows = (4, 8, 16)[i % 3]
            f.write(json.dumps({"arm": "adaspark", "request": "adaspark-oasst/1",
                                "ctx": 100 + 50 * i, "width": rows, "rows": rows,
                                "accepted": i % 4, "accepted_drafter": i % 4, "accepted_ngram": 0,
                                "agreed": 0, "D": 0.004, "verify": 0.01 + 0.001 * rows,
                                "commit": 0.001, "pred_S": (i % 4) * 0.9,
                                "pred_T": 0.01 + 0.001 * rows}) + "\n")
        f.write('{"ctx": 5, "rows"')  # a torn last line
    return tmp_path


def test_report_tables_and_figures_from_a_written_directory(tmp_path):
    from adaspark.bench.report import write_report

    text = write_report(_results_dir(tmp_path), n_boot=200).read_text()
    # AdaSpark is the mean of its two runs (21 tok/s per reply against ar's 10)
    assert "| adaspark / ar | 2.100×" in text
    assert "| adaspark / chain3 | 1.400×" in text
    # Table 3: pinned over AdaSpark, 16 rows the best (19/21), in bold; again = 22/20
    assert f"**{19 / 21:.3f}**" in text and f"| {18 / 21:.3f} |" in text
    assert "| 1.100 |" in text
    # ar looped on toolace: left out of every ratio with ar and counted
    assert "| ar | 3 | 2 | 1 | 0 |" in text
    assert "| adaspark | chain3 | 0/3 | 0/3 |" in text
    assert "| rounds | 60 |" in text
    for figure in ("fig3_verify_vs_rows", "fig7_round_anatomy", "fig8_width_shares",
                   "fig9_cost_model", "fig10_calibration"):
        assert (tmp_path / "figures" / f"{figure}.png").stat().st_size > 1000


def test_report_table_2_table_7_widened_and_table_9(tmp_path):
    """Round logs carrying both log losses and the n-gram's widening fill Table 2 and Table 7's
    widened count; an `adaspark+classes` arm gives Table 9."""
    from adaspark.bench.report import write_report

    out = _results_dir(tmp_path)
    with open(out / "results.jsonl", "a") as f:
        for c, conv in enumerate(["oasst/1", "toolace/2", "longbench/3"]):
            f.write(json.dumps({"kind": "reply", "arm": "adaspark+classes", "conversation": conv,
                                "source": conv.split("/")[0], "turn": 0, "reply": 0,
                                "completion_tokens": 100, "deltas": 60,
                                "prompt_tokens": 3000 if c == 2 else 200,
                                "decode_s": 100 / (20.0 * (1 + 0.1 * c)), "text": "same",
                                "response_id": f"classes-{conv}"}) + "\n")
    with open(out / "rounds" / "adaspark" / "part-1.jsonl", "w") as f:
        for i in range(10):  # toolace: the fitted model wins and prices; half widened
            f.write(json.dumps({"request": "adaspark-toolace/2", "rows": 8, "accepted": 1,
                                "labels": 4, "logloss_head": 2.0, "logloss_fitted": 1.0,
                                "fitted_prices": True, "rows_ngram": 1, "rows_agreed": 0,
                                "ngram_widened": i % 2 == 0}) + "\n")
            f.write(json.dumps({"request": "adaspark-longbench/3", "rows": 4, "accepted": 1,
                                "labels": 2, "logloss_head": 1.0, "logloss_fitted": 1.5,
                                "fitted_prices": False, "rows_ngram": 0, "rows_agreed": 0,
                                "ngram_widened": False}) + "\n")
    text = write_report(out, n_boot=200).read_text()
    assert "## Acceptance prediction (Table 2)" in text
    # the log's first request (oasst, no labels) is left out
    assert "| adaspark | toolace | 1 | 40 | 0.5000 | 0.2500 | 50.0% | 100.0% |" in text
    assert "| adaspark | longbench | 1 | 20 | 0.5000 | 0.7500 | -50.0% | 0.0% |" in text
    assert "| adaspark | all | 2 | 60 | 0.5000 | 0.4167 | 16.7% | 50.0% |" in text
    assert "| rounds with n-gram candidates | 10 |" in text
    assert "| of those, rounds the n-gram widened | 50.0% |" in text
    assert "## Learned against kernel-class widths (Table 9)" in text
    assert "| all replies | 1.050×" in text
