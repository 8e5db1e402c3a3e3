"""The drafter data's prompt pool (drafter/pool.py): conversations read from pool or training-prompt
files, turn prompts with the target's earlier replies between the user turns, deduplication
against the evaluation pool, and the committed pool itself (data/drafter/pool.jsonl.gz)."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from adaspark.drafter.pool import (
    CALL_SUFFIX,
    Conversation,
    EvalGuard,
    ordered,
    read_pool,
    tool_calls,
)
from adaspark.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
POOL = ROOT / "data" / "drafter" / "pool.jsonl.gz"
EVAL = ROOT.parent / "shared" / "data" / "eval" / "conversations.jsonl"


def test_reads_pools_and_training_prompts_each_conversation_once(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"source": "s", "turns": ["Hi", "More"], "system": "Be brief."})
                 + "\n" + json.dumps({"source": "t", "prompt": "One\u2028line",
                                      "tools": [{"name": "f"}]}) + "\n")
    b = tmp_path / "b.jsonl.gz"
    with gzip.open(b, "wt") as f:
        f.write(json.dumps({"source": "s", "turns": ["Hi", "More"], "system": "Be brief."}))
    convs = read_pool([a, b])
    assert [c.turns for c in convs] == [("Hi", "More"), ("One\u2028line",)]
    assert convs[1].tools == ({"name": "f"},)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"source": "s", "turns": []}) + "\n")
    with pytest.raises(UserError, match="non-empty user turns"):
        read_pool([bad])
    with pytest.raises(UserError, match="cannot read"):
        read_pool([tmp_path / "missing.jsonl"])


def test_messages_put_earlier_replies_between_user_turns():
    c = Conversation("s", ("Q1", "Q2", "Q3"), system="S")
    assert c.messages(2, ["A1", "A2"]) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}]
    with pytest.raises(ValueError):
        c.messages(2, ["A1"])
    assert Conversation("s", ("Q1",)).key != Conversation("s", ("Q1", "Q2")).key


def test_tool_calls_answer_each_tool_conversations_first_turn_under_a_call_schema():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "dict", "properties": {"x": {"type": "float"}}}}}
    free = [Conversation("bfcl/simple", ("Call f with 2.", "And 3?"), (tool,), "Use tools."),
            Conversation("chat", ("Hi",))]
    calls = tool_calls(free)
    assert len(calls) == 1
    call = calls[0]
    assert (call.source, call.turns, call.tools, call.system) == (
        "bfcl/simple" + CALL_SUFFIX, ("Call f with 2.",), (tool,), "Use tools.")
    schema = call.response_format["json_schema"]["schema"]
    assert call.response_format["type"] == "json_schema"
    assert schema["properties"]["arguments"]["properties"]["x"] == {"type": "number"}
    assert call.messages(0, []) == free[0].messages(0, [])  # the same prompt, its own key
    assert call.key != Conversation("bfcl/simple" + CALL_SUFFIX, call.turns, (tool,),
                                    "Use tools.").key
    # a free conversation's key is what it was before structured replies existed
    body = json.dumps(["chat", ["Hi"], None, None], sort_keys=True)
    assert free[1].key == hashlib.sha256(body.encode()).hexdigest()[:16]


def test_order_is_seeded_and_filters_sources():
    pool = [Conversation(f"src{i % 2}/x", (f"q{i}",)) for i in range(20)]
    assert ordered(pool, 1) == ordered(pool, 1) != ordered(pool, 2)
    assert {c.source for c in ordered(pool, 1, ["src1"])} == {"src1/x"}


def test_eval_guard_matches_copies_heads_and_containment_not_short_phrases():
    text = "Compose an engaging travel blog post about a recent trip to Hawaii, please."
    long = "Read this report and answer. " * 10  # 290 characters
    guard = EvalGuard([text, "Thank you!", long])
    assert guard.hits(text.upper())
    assert guard.hits(long[:200] + "Question: what changed in 2008?")  # the same first 200
    assert guard.hits("Context first. " + text)  # contains an evaluation turn
    assert guard.hits(text[10:70])  # inside one
    assert guard.hits("thank  you!") and not guard.hits("Thank you! That was great.")
    assert not guard.hits("Write a poem about the sea, in the style of a limerick please.")


@pytest.mark.skipif(not POOL.exists(), reason="the committed pool is absent")
def test_committed_pool_is_wide_and_kept_apart_from_the_evaluation():
    pool = read_pool([POOL])
    sources = {c.source.split("/")[0] for c in pool}
    assert {"mt_bench_101", "toolace", "convfinqa", "longbench", "chain", "bfcl"} <= sources
    assert sum(len(c.turns) > 1 for c in pool) > len(pool) // 2  # mostly multi-turn
    assert any(c.tools for c in pool if c.source.startswith("toolace") and len(c.turns) > 1)
    assert max(len(c.turns[0]) for c in pool if c.source.startswith("longbench")) > 8000
    if EVAL.exists():
        guard = EvalGuard.from_conversations(EVAL)
        assert not [c for c in pool if guard.hits(c.turns[0])]
