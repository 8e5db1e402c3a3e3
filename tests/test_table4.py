"""benchmarks/table4.py and table4_report.py: the paper's Table 4 against llama-server.

The pure parts (pairing, ratios, capped replies apart, draft counts, settings on resume) run on
hand-made replies whose ratios are worked out below; the end-to-end smoke run (our `ar` and
llama-server plain on one short conversation, then resumed) needs the built llama-server.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llama_server  # noqa: E402
import table4  # noqa: E402
import table4_report as t4  # noqa: E402
from vs_llamacpp import cmake_args  # noqa: E402

from adaspark.cpuinfo import flags  # noqa: E402
from adaspark.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_DATA = ROOT / "tests" / "data" / "bench_conversations.jsonl"
CAP = 64


def reply(arm, conv, turn, tokens, seconds, text="same", capped=False, timings=None):
    return {"kind": "reply", "arm": arm, "conversation": conv, "source": conv.split("/")[0],
            "turn": turn, "reply": 0, "completion_tokens": tokens, "prompt_tokens": 100,
            "deltas": tokens, "decode_s": seconds, "reached_cap": capped, "text": text,
            "reasoning": "", "timings": timings, "response_id": f"{arm}-{conv}-{turn}"}


def records() -> list[dict]:
    """ar and the default arm on two conversations of two turns; s/c2 turn 0 reached the cap in
    the default arm. Per-reply speed ratios default/ar: 2, 1.25, (4, capped), 2. llama-server
    plain and DSpark n=3 gave one reply each (s/c1 turn 0): 50 and 25 tok/s."""
    d = t4.DEFAULT
    return [
        reply("ar", "s/c1", 0, 100, 1.0), reply(d, "s/c1", 0, 100, 0.5),      # 100 vs 200
        reply("ar", "s/c1", 1, 50, 0.5), reply(d, "s/c1", 1, 50, 0.4),        # 100 vs 125
        reply("ar", "s/c2", 0, 64, 0.8), reply(d, "s/c2", 0, 64, 0.2, capped=True),  # 80 vs 320
        reply("ar", "s/c2", 1, 40, 0.5), reply(d, "s/c2", 1, 40, 0.25),       # 80 vs 160
        reply(t4.LLAMA_PLAIN, "s/c1", 0, 100, 2.0, text="theirs"),
        reply(t4.DSPARK3, "s/c1", 0, 100, 4.0, text="theirs",
              timings={"draft_n": 30, "draft_n_accepted": 10}),
    ]


def arm(summary, label):
    return next(a for a in summary["arms"] if a["label"] == label)


def test_ratios_are_geometric_means_of_reply_ratios_and_capped_pairs_count_apart():
    s = t4.summarise(records(), [*t4.OUR_ARMS, *t4.LLAMA_ARMS], n_boot=200)
    default = arm(s, t4.DEFAULT)
    ended = default["over_ar"]["ended"]
    assert ended["value"] == pytest.approx((2 * 1.25 * 2) ** (1 / 3))
    assert (ended["n"], ended["capped"], ended["conversations"]) == (3, 1, 2)
    assert ended["low"] <= ended["value"] <= ended["high"]
    capped = default["over_ar"]["capped"]
    assert (capped["value"], capped["n"]) == (pytest.approx(4.0), 1)
    assert default["capped"] == 1 and arm(s, "ar")["capped"] == 0
    assert default["tok_s_geomean"] == pytest.approx((200 * 125 * 160) ** (1 / 3))
    assert default["tok_s_geomean_all"] == pytest.approx((200 * 125 * 160 * 320) ** (1 / 4))
    # ours: its own plain decoding is our ar, so (b) is (a)
    assert default["over_plain"]["ended"]["value"] == pytest.approx(ended["value"])
    assert [a["label"] for a in s["arms"]] == ["ar", t4.DEFAULT, t4.LLAMA_PLAIN, t4.DSPARK3]


def test_each_engine_is_compared_with_its_own_plain_decoding_and_head_to_head():
    s = t4.summarise(records(), list(t4.ALL_ARMS), n_boot=200)
    dspark = arm(s, t4.DSPARK3)
    assert dspark["over_plain"]["ended"]["value"] == pytest.approx(0.5)   # 25 / 50
    assert dspark["over_ar"]["ended"]["value"] == pytest.approx(0.25)     # 25 / 100
    assert arm(s, t4.LLAMA_PLAIN)["over_plain"] is None  # itself
    assert arm(s, "ar")["over_ar"] is None
    pairs = {(p["numerator"], p["denominator"]): p["ended"] for p in s["head_to_head"]}
    assert set(pairs) == {(t4.DEFAULT, t4.DSPARK3), ("ar", t4.LLAMA_PLAIN)}  # arms that ran
    assert pairs[(t4.DEFAULT, t4.DSPARK3)]["value"] == pytest.approx(8.0)  # 200 / 25
    assert pairs[("ar", t4.LLAMA_PLAIN)]["value"] == pytest.approx(2.0)
    assert dspark["drafts"] == {"accepted": 10, "drafted": 30, "source": "stream"}
    text = t4.markdown(s, ["header line"])
    assert "1.71x" in text and "8.00x" in text and "0.50x" in text and "10 of 30" in text


def test_our_greedy_replies_must_equal_ar_and_llama_servers_are_informational():
    rows = records()
    assert t4.differing_greedy(t4.summarise(rows, list(t4.ALL_ARMS), n_boot=50)) == []
    rows[3] = {**rows[3], "text": "another reply"}
    s = t4.summarise(rows, list(t4.ALL_ARMS), n_boot=50)
    assert t4.differing_greedy(s) == [t4.DEFAULT]
    assert arm(s, t4.DEFAULT)["same_as_ar"] == {"same": 3, "total": 4, "same_first": 2,
                                                 "total_first": 2}
    assert arm(s, t4.LLAMA_PLAIN)["same_as_ar"]["same"] == 0  # not flagged: another engine
    assert "Not greedy-exact" in t4.markdown(s, [])


def test_draft_counts_from_llama_servers_log_and_our_round_log():
    log = ("slot print_timing: id  0 | task 5 | draft acceptance = 0.13790 ( 1025 accepted /  "
           "7433 generated), mean len =  1.27\nsrv  update_slots: all slots are idle\n"
           "slot print_timing: id  0 | task 9 | draft acceptance = 0.50000 (    3 accepted /     "
           "6 generated), mean len =  2.00\n")
    assert t4.llama_log_counts(log) == t4.DraftCounts(1028, 7439, "log")
    assert t4.llama_log_counts("no drafting here") is None
    rows = [r for r in records() if r["arm"] == t4.LLAMA_PLAIN]
    assert t4.llama_stream_counts(rows, t4.LLAMA_PLAIN) is None  # plain: nothing drafted
    s = t4.summarise([{**r, "timings": None} if r["arm"] == t4.DSPARK3 else r
                      for r in records()], list(t4.ALL_ARMS), logs={t4.DSPARK3: log}, n_boot=50)
    assert arm(s, t4.DSPARK3)["drafts"]["source"] == "log"
    rounds = [{"rows": 1, "accepted": 0}, {"rows": 4, "accepted": 2}, {"rows": 3, "accepted": 1}]
    assert t4.our_round_counts(rounds) == t4.DraftCounts(3, 5, "rounds")
    assert t4.our_round_counts([{"rows": 1, "accepted": 0}]) is None  # ar drafts nothing


def test_llama_server_arms_take_the_drafter_gguf_and_their_draft_length():
    assert t4.llama_args(t4.LLAMA_PLAIN, None, 2) == []
    assert t4.llama_args(t4.NGRAM_MOD, None, 2) == ["--spec-type", "ngram-mod"]
    for label, n in ((t4.DSPARK3, "3"), (t4.DSPARK7, "7")):
        args = t4.llama_args(label, "d.gguf", 2)
        value = dict(zip(args[::2], args[1::2], strict=True))
        assert value == {"--spec-draft-model": "d.gguf", "--spec-type": "draft-dspark",
                         "--spec-draft-n-max": n, "--spec-draft-threads": "2",
                         "--spec-draft-threads-batch": "2"}
    with pytest.raises(ValueError, match="drafter GGUF"):
        t4.llama_args(t4.DSPARK7, None, 2)
    assert t4.needs_draft_gguf(["ar", t4.DSPARK7]) and not t4.needs_draft_gguf(["ar", "ngram"])


def test_arms_are_checked_and_a_resume_with_other_settings_is_refused(tmp_path):
    assert table4.parse_arms("ar, adaspark+gate,llama-server") == ["ar", "adaspark+gate",
                                                                   "llama-server"]
    with pytest.raises(UserError, match="neither llama.cpp's"):
        table4.parse_arms("ar,llama-server-dspark5")
    with pytest.raises(UserError, match="twice"):
        table4.parse_arms("ar,ar")
    assert table4.subset_name("short", 2) == "short[:2]" and table4.subset_name(None, None) is None
    settings = {"model": "m.gguf", "threads": 2, "avx2": False, "drafter": None, "cap": 64}
    table4.check_settings(tmp_path, settings)
    table4.check_settings(tmp_path, {**settings, "draft_gguf": "/d.gguf"})  # added later: kept
    with pytest.raises(UserError, match="threads=2"):
        table4.check_settings(tmp_path, {**settings, "threads": 4})
    with pytest.raises(UserError, match="draft_gguf"):
        table4.check_settings(tmp_path, {**settings, "draft_gguf": "/other.gguf"})


def test_avx2_for_ours_means_llama_server_without_avx512_too():
    assert table4.avx2_wanted(True, {})
    assert table4.avx2_wanted(False, {"ADASPARK_NATIVE": "avx2"})
    assert not table4.avx2_wanted(False, {"ADASPARK_NATIVE": "avx512"})
    assert not table4.avx2_wanted(False, {})


def test_without_the_exporter_the_dspark_arms_say_what_to_do(tmp_path, monkeypatch):
    import adaspark.cli

    monkeypatch.delitem(adaspark.cli.COMMANDS, table4.EXPORT_COMMAND, raising=False)
    with pytest.raises(UserError, match="--draft-gguf PATH"):
        table4.export_drafter(tmp_path, None, None)
    made = tmp_path / "drafter.gguf"  # a previous run's export is used as it is
    made.write_bytes(b"")
    assert table4.export_drafter(tmp_path, None, None) == made


@pytest.mark.slow
def test_a_target_gguf_is_refused_as_the_drafter(model_path, tmp_path):
    with pytest.raises(UserError, match="architecture 'llama'"):
        table4.check_draft_gguf(model_path)
    with pytest.raises(UserError, match="no such file"):
        table4.check_draft_gguf(tmp_path / "missing.gguf")


def test_the_build_without_avx512_has_its_own_folder_and_arms_add_options():
    assert llama_server.server_dir(avx512=False) != llama_server.server_dir()
    cmd = llama_server.command(Path("m.gguf"), 8123, parallel=1, threads=2, slot_context=8192,
                               avx512=False, extra=["--spec-type", "ngram-mod"])
    assert cmd[0] == str(llama_server.binary(avx512=False))
    assert cmd[-2:] == ["--spec-type", "ngram-mod"]
    assert cmd[cmd.index("--ctx-size") + 1] == "8192"


@pytest.mark.slow
@pytest.mark.skipif(not llama_server.built(cmake_args(flags())),
                    reason="llama-server not built (benchmarks/llama_server.py --build-only)")
def test_ar_and_llama_server_end_to_end_then_resumed(tmp_path, model_path):
    out = tmp_path / "t4"
    command = [sys.executable, str(ROOT / "benchmarks" / "table4.py"), "--out", str(out),
               "--arms", "ar,llama-server", "--conversations", str(BENCH_DATA), "--limit", "1",
               "--cap", "8", "--threads", "1", "--n-boot", "100", "--no-progress"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert first.returncode == 0, first.stdout + first.stderr
    result = json.loads((out / "table4.json").read_text())
    replies = result["replies"]
    assert sorted((r["arm"], r["turn"]) for r in replies) == [
        ("ar", 0), ("ar", 1), ("llama-server", 0), ("llama-server", 1)]
    assert all(r["completion_tokens"] > 0 and r["decode_s"] for r in replies)
    assert all(r["reached_cap"] for r in replies)  # 8 tokens: every reply is cut off
    head = result["summary"]["head_to_head"]
    assert [(p["numerator"], p["denominator"]) for p in head] == [("ar", "llama-server")]
    assert head[0]["ended"]["capped"] == 2 and head[0]["capped"]["n"] == 2
    assert math.isfinite(head[0]["capped"]["value"])
    text = (out / "table4.md").read_text()
    assert "| llama.cpp | `llama-server` |" in text
    assert re.search(r"ours: (native|torch)-\S+ forward", text)  # what our server ran
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stderr.count("every conversation done, not run again") == 2
    assert len(json.loads((out / "table4.json").read_text())["replies"]) == 4
