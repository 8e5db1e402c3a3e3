"""`adaspark bench` end to end against the real server and model, killed and resumed, then reported.

Two short conversations of the evaluation subset (two turns of Spec-Bench, one turn of ToolACE
with its tools), a small cap, two arms. The two records are committed in tests/data (a clean
clone has no ../shared/data beside it, and the test must run there too); where the shared
subset is present, the copy is checked against it. The first run is killed with SIGKILL once a
conversation is finished; the second run must keep that conversation's replies, redo only what
was cut off, and finish the rest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import adaspark.server  # noqa: F401  the server the benchmark starts: an import error fails here
from adaspark.bench.report import write_report
from adaspark.bench.runner import check_forward
from adaspark.bench.stats import identical_replies, replies_by_arm
from adaspark.errors import UserError

pytestmark = pytest.mark.slow

# The two records, byte for byte as in the evaluation subset (tests/data/README.md: sources).
BENCH_DATA = Path(__file__).resolve().parent / "data" / "bench_conversations.jsonl"
SHARED_EVAL = Path(__file__).resolve().parents[2] / "shared/data/eval/conversations.jsonl"
PICK = {"spec_bench/81": 2, "toolace/1": 1}  # conversation -> turns kept (keeps the test short)
# Plain decode twice: needs no drafter, and greedy decoding must give the same text both times.
ARMS = "ar,ar#2"
CAP = 16


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "two.jsonl"
    with open(BENCH_DATA) as f, open(path, "w") as out:
        for line in f:
            record = json.loads(line)
            key = f"{record['source']}/{record['id']}"
            if key in PICK:
                record["turns"] = record["turns"][: PICK[key]]
                out.write(json.dumps(record) + "\n")
    return path


def test_the_committed_conversations_are_the_evaluation_subsets():
    """Both picked conversations are there, and where the shared subset is beside the checkout
    (the project's machines; not a clean clone), they are its lines unchanged."""
    lines = BENCH_DATA.read_text().splitlines()
    keys = [f"{r['source']}/{r['id']}" for r in map(json.loads, lines)]
    assert sorted(keys) == sorted(PICK)
    if SHARED_EVAL.exists():
        assert set(lines) <= set(SHARED_EVAL.read_text().splitlines())


def _bench(conversations: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "adaspark.cli", "bench", "--conversations", str(conversations),
            "--arms", ARMS, "--cap", str(CAP), "--out", str(out), "--no-progress"]


def _records(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def _kill_after_first_conversation(command: list[str], out: Path, timeout: float = 300) -> None:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while not any(r.get("kind") == "conversation" for r in _records(out)):
            if process.poll() is not None:
                raise AssertionError(f"bench exited early: {process.stdout.read().decode()}")
            if time.monotonic() > deadline:
                raise AssertionError("no conversation finished in time")
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def bench_dir(conversations, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = _bench(conversations, out)
    _kill_after_first_conversation(command, out)
    before = _records(out)
    done = [r for r in before if r.get("kind") == "conversation"]
    kept = {r["response_id"] for r in before if r.get("kind") == "reply"
            and (r["arm"], r["conversation"]) == (done[0]["arm"], done[0]["conversation"])}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    return {"out": out, "first_done": done[0], "kept_ids": kept}


def test_every_arm_answered_every_turn_once(bench_dir):
    records = _records(bench_dir["out"])
    replies = [r for r in records if r["kind"] == "reply"]
    assert {r["arm"] for r in replies} == set(ARMS.split(","))
    per_key = Counter((r["arm"], r["conversation"], r["turn"], r["reply"]) for r in replies)
    assert max(per_key.values()) == 1, "a reply was recorded twice"
    for arm in ARMS.split(","):
        turns = {(r["conversation"], r["turn"]) for r in replies if r["arm"] == arm}
        assert turns == {(c, t) for c, n in PICK.items() for t in range(n)}
        done = {r["conversation"] for r in records
                if r["kind"] == "conversation" and r["arm"] == arm and r["status"] == "done"}
        assert done == set(PICK)


def test_replies_carry_client_clock_speed_and_server_numbers(bench_dir):
    for r in (r for r in _records(bench_dir["out"]) if r["kind"] == "reply"):
        assert 0 <= r["completion_tokens"] <= CAP
        assert r["tokens_source"] == "usage" and r["prompt_tokens"] > 0
        assert r["reached_cap"] == (r["completion_tokens"] >= CAP or r["finish_reason"] == "length")
        assert r["timings"], "the server's timings object is missing"
        assert r["response_id"]
        if r["deltas"] >= 2:
            assert r["decode_s"] > 0 and r["tok_s"] == pytest.approx(
                r["completion_tokens"] / r["decode_s"])
        else:
            assert r["tok_s"] is None


def test_a_killed_run_resumes_without_redoing_finished_conversations(bench_dir):
    out, first = bench_dir["out"], bench_dir["first_done"]
    ids = {r["response_id"] for r in _records(out) if r["kind"] == "reply"
           and (r["arm"], r["conversation"]) == (first["arm"], first["conversation"])}
    assert ids == bench_dir["kept_ids"]
    log = (out / "logs" / f"{first['arm']}.log").read_text()
    starts = [line for line in log.splitlines() if line.startswith("$ ")]
    assert len(starts) == 2 and "--fresh" in starts[0] and "--fresh" not in starts[1]
    run = json.loads((out / "run.json").read_text())
    assert len(run["invocations"]) == 2


def test_two_greedy_runs_give_byte_identical_replies(bench_dir):
    replies = replies_by_arm(_records(bench_dir["out"]))
    same = identical_replies(replies["ar"], replies["ar#2"])
    assert same.total == len(replies["ar"]) and same.same == same.total


def test_report_names_every_arm(bench_dir):
    path = write_report(bench_dir["out"], n_boot=200)
    text = path.read_text()
    for arm in ARMS.split(","):
        assert f"| {arm} |" in text
    assert "## End to end (Table 4)" in text and "| ar (tok/s) |" in text
    assert "| ar | ar#2 |" in text  # the identical-replies row
    # a reply cut off by the small cap counts as a loop by default: no pair is left when all were
    if all(r["reached_cap"] for r in _records(bench_dir["out"]) if r["kind"] == "reply"):
        assert "| ar#2 | – | – |" in text  # the by-band row
    # ... and kept, every timed reply enters the ratio
    text = write_report(bench_dir["out"], n_boot=200, include_capped=True).read_text()
    assert re.search(r"\| ar#2 \| \d\.\d{3}× \[", text)  # the by-band row, now with a ratio


def test_sampled_bench_sends_each_turn_its_own_seed_on_every_arm(conversations, tmp_path):
    """--temperature: both runs of `ar` get the same derived seed per request, so their
    sampled replies match; the report says so; a resume at another temperature is refused."""
    out = tmp_path / "sampled"
    command = [*_bench(conversations, out), "--temperature", "0.9", "--seed", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    replies = replies_by_arm(_records(out))
    same = identical_replies(replies["ar"], replies["ar#2"])
    assert same.total == len(replies["ar"]) and same.same == same.total
    assert json.loads((out / "run.json").read_text())["settings"]["temperature"] == 0.9
    text = write_report(out, n_boot=200).read_text()
    assert "## Sampling (temperature 0.9)" in text and "| ar#2 |" in text
    other = subprocess.run([*_bench(conversations, out), "--temperature", "0.5"],
                           capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "temperature" in other.stderr


def test_request_seeds_differ_by_turn_and_reply_only():
    from adaspark.bench.conversations import Conversation
    from adaspark.bench.runner import request_sampling

    conv = Conversation(source="spec_bench", id="81", category="c", turns=("a", "b"))
    seeds = {(t, i): request_sampling(0.7, 4, conv, t, i)["seed"] for t in (0, 1) for i in (0, 1)}
    assert len(set(seeds.values())) == 4
    assert request_sampling(0.7, 4, conv, 0, 0)["seed"] == seeds[(0, 0)]
    assert request_sampling(0.7, 5, conv, 0, 0)["seed"] != seeds[(0, 0)]
    assert request_sampling(0.0, 4, conv, 0, 0) is None


def test_every_local_arm_recorded_the_forward_its_server_ran(bench_dir):
    forwards = json.loads((bench_dir["out"] / "forwards.json").read_text())
    assert len(forwards) >= 2 and len(set(forwards.values())) == 1
    assert next(iter(forwards.values())).startswith(("native-", "torch-"))


def test_an_arm_on_another_forward_is_refused(tmp_path):
    log = tmp_path / "x.log"
    check_forward(tmp_path, "ar", "native-avx512vnni", log)
    check_forward(tmp_path, "ar", "native-avx512vnni", log)  # a resumed arm
    check_forward(tmp_path, "chain3", "native-avx512vnni", log)
    check_forward(tmp_path, "llamacpp", None, log)  # external or unknown: nothing to compare
    with pytest.raises(UserError, match="torch-cpu forward but ar ran on native-avx512vnni"):
        check_forward(tmp_path, "adaspark", "torch-cpu", log)
    assert "adaspark" not in json.loads((tmp_path / "forwards.json").read_text())
    (tmp_path / "forwards.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        check_forward(tmp_path, "ar", "native-avx512vnni", log)


def test_first_turns_subset_keeps_every_conversation_and_only_its_first_turn():
    from adaspark.bench.conversations import SUBSETS, Conversation
    convs = [Conversation(source=src, id=str(i), category="c", turns=[f"q{i}", f"r{i}", "x"])
             for i, src in enumerate(["oasst", "oasst", "longbench"])]
    first = SUBSETS["first-turns"](convs)
    assert [c.key for c in first] == [c.key for c in convs]
    assert [f.turns for f in first] == [["q0"], ["q1"], ["q2"]]
    assert [c.turns for c in SUBSETS["short"](convs)] == [["q0", "r0"], ["q2", "r2"]]
