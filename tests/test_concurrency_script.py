"""benchmarks/concurrency.py's requests: first turns in file order, `--short` keeps short ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import concurrency  # noqa: E402

from adaspark.bench.conversations import Conversation  # noqa: E402

CONVERSATIONS = [
    Conversation("chat", "0", "c", ("hello there",)),
    Conversation("long", "1", "c", ("x" * 600,)),
    Conversation("sys", "2", "c", ("short",), system="y" * 495),  # 500 with the system prompt
    Conversation("chat", "3", "c", ("bye",)),
]


def test_short_keeps_only_first_turns_within_the_characters():
    every = concurrency.first_turns(CONVERSATIONS)
    short = concurrency.first_turns(CONVERSATIONS, short=500)
    assert len(every) == len(CONVERSATIONS)
    assert [messages[-1]["content"] for messages, _ in short] == ["hello there", "short", "bye"]
    assert all(concurrency.prompt_chars(r) <= 500 for r in short)
    assert concurrency.first_turns(CONVERSATIONS, short=499)[1][0][-1]["content"] == "bye"


def test_prompt_chars_counts_the_messages_and_the_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}]
    assert concurrency.prompt_chars((messages, None)) == 5
    assert concurrency.prompt_chars((messages, tools)) == 5 + len(json.dumps(tools))


def test_summary_keeps_each_requests_time_to_first_token_in_order():
    def reply(ttft, text):
        return SimpleNamespace(ttft_s=ttft, tok_s=10.0, completion_tokens=4, text=text)

    replies = [reply(0.3, "a"), None, reply(0.1, "c"), reply(0.2, "d")]
    row = concurrency.summarise(4, replies, 2.0, [reply(0.1, "a"), None, reply(0.1, "x"),
                                                  reply(0.1, "d")])
    assert row["ttft_s"] == [0.3, None, 0.1, 0.2]  # the failed one kept its place
    assert row["ttft_median_s"] == 0.2 and row["failed"] == 1 and row["same_as_solo"] == 2
    assert row["aggregate_tok_s"] == 6.0


def test_waves_of_prompts_wait_for_the_shorter_ones_before_them():
    # fixed part 0.1 (the fastest solo first token); waves of two in queue order, shortest first
    predicted = concurrency.wave_ttft([0.1, 0.3, 0.2, 0.1, 0.5], 2)
    assert predicted == pytest.approx([0.1, 0.3, 0.1, 0.2, 0.5])
    assert concurrency.wave_ttft([0.2, None, 0.4], 1) == pytest.approx([0.2, 0.4])
    assert concurrency.wave_ttft([None], 4) == []


def test_summary_predicts_the_waves_tail_from_the_solo_first_tokens():
    def reply(ttft):
        return SimpleNamespace(ttft_s=ttft, tok_s=10.0, completion_tokens=4, text="t")

    solo = [reply(t) for t in (0.1, 0.2, 0.3, 0.4)]
    row = concurrency.summarise(4, [reply(0.5)] * 4, 1.0, solo)
    # one wave of four: 0.1, 0.2, 0.4, 0.7; its p95 by linear interpolation
    assert row["ttft_p95_waves_s"] == pytest.approx(0.4 + 0.85 * 0.3)
    assert concurrency.summarise(1, solo, 1.0, None)["ttft_p95_waves_s"] is None
