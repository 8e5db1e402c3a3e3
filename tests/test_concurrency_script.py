"""benchmarks/concurrency.py's requests: first turns in file order, `--short` keeps short ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import concurrency  # noqa: E402

from adaspark.bench.conversations import load_conversations  # noqa: E402


def test_short_keeps_only_first_turns_within_the_characters():
    conversations = load_conversations(concurrency.CONVERSATIONS)
    every = concurrency.first_turns(conversations)
    short = concurrency.first_turns(conversations, short=500)
    assert len(every) == len(conversations)
    assert 0 < len(short) < len(every)
    assert all(concurrency.prompt_chars(r) <= 500 for r in short)
    assert short == [r for r in every if concurrency.prompt_chars(r) <= 500]  # file order kept
    assert any(concurrency.prompt_chars(r) > 500 for r in every)


def test_prompt_chars_counts_the_messages_and_the_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "de"}]
    assert concurrency.prompt_chars((messages, None)) == 5
    assert concurrency.prompt_chars((messages, tools)) == 5 + len(json.dumps(tools))
