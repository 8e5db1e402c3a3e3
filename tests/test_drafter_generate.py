"""The batched reply generator for drafter data (drafter/generate.py) on the embedded target: every
reply is exactly `ar`'s reply to that prompt alone, beside neighbours; later turns are built from
the target's own earlier replies; a stopped run writes what finished and a resumed run completes
the same data, each reply once; shards of another target are refused."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from adaspark.drafter.generate import GenSettings, ReplyGenerator, reply_text
from adaspark.drafter.pool import Conversation, tool_calls
from adaspark.drafter.replies import read_records, shard_paths
from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TARGET = {"model_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": "test"}
POOL = [
    Conversation("a", ("Name three colours.", "Now name three more, different ones.")),
    Conversation("b", ("Write a haiku about the sea.",)),
    Conversation("c", ("Count from one to ten in words.", "Backwards, please.",
                       "Why did you stop there?")),
    Conversation("d", ("What is 2 + 2?",)),
    Conversation("e", ("Say hi.",)),
    Conversation("x", ("Say hi.", "Say it again, louder.")),  # e's opening: its reply reused
]
SETTINGS = GenSettings(max_new=10, max_prompt_tokens=200, concurrency=3, shard_size=2)


@pytest.fixture(scope="module")
def engine(fast_model, model_path):
    return Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)


def alone(engine, prompt, max_new):
    """`ar` on one prompt, by itself: its reply ids, with the stop token it ended on."""
    engine.batch.max_slots = 1
    engine.reset()
    gen = engine.generate_ids(prompt, max_tokens=max_new)
    return gen.token_ids + ([gen.stop_token_id] if gen.stop_token_id is not None else [])


@pytest.fixture(scope="module")
def full_run(engine, tmp_path_factory):
    """One run over the pool; `widths`: the sequences of each shared verify call."""
    out = tmp_path_factory.mktemp("replies")
    widths, real = [], engine.target.verify_many

    def spy(caches, rows, **kw):
        widths.append(len(rows))
        return real(caches, rows, **kw)

    engine.target.verify_many = spy
    try:
        report = ReplyGenerator(engine, POOL, out, TARGET, SETTINGS).run()
    finally:
        del engine.target.verify_many
    return out, report, widths


def test_every_reply_is_ar_alone_and_later_turns_follow_own_replies(engine, full_run):
    out, report, widths = full_run
    assert max(widths) == SETTINGS.concurrency  # replies decode together, refilled
    records = read_records(out, TARGET)
    # every turn once: "Say hi." opens two conversations and runs once
    assert report.stopped == "done" and report.records == len(records) == 9
    assert report.reply_tokens == sum(r.reply_len for r in records)
    assert len(shard_paths(out)) == 5  # shards of 2, the last of 1
    by = {tuple(r.tokens[:r.prompt_len].tolist()): r for r in records}
    assert len(by) == len(records)
    for conv in POOL:
        replies = []
        for turn in range(len(conv.turns)):
            prompt = engine.tokenizer.encode_chat(conv.messages(turn, replies))
            r = by[tuple(prompt)]
            assert r.reply.tolist() == alone(engine, prompt, SETTINGS.max_new)
            assert r.reply_len >= 2
            assert r.finish == ("stop" if r.reply[-1] in engine.tokenizer.stop_ids else "length")
            own = alone(engine, prompt, SETTINGS.max_new)
            if own[-1] in engine.tokenizer.stop_ids:
                own = own[:-1]
            replies.append(engine.tokenizer.decode(own))  # what a client sends back
            assert reply_text(engine.tokenizer, r) == replies[-1]
        assert len(replies) == len(conv.turns)


def test_stopped_run_writes_what_finished_and_resume_completes_it(engine, full_run,
                                                                   tmp_path):
    out, *_ = full_run
    steps = iter(range(1000))
    first = ReplyGenerator(engine, POOL, tmp_path, TARGET, SETTINGS).run(
        stop_now=lambda: next(steps) >= 14)  # a time budget that ends mid-reply
    assert first.stopped == "budget" and 0 < first.records < 9
    assert first.dropped_tokens > 0  # replies were running: dropped, not written
    assert len(read_records(tmp_path, TARGET)) == first.records
    second = ReplyGenerator(engine, POOL, tmp_path, TARGET, SETTINGS).run()
    assert second.stopped == "done" and first.records + second.records == 9

    def content(d):
        return sorted((r.key, r.turn, r.tokens.tolist(), r.prompt_len, r.finish)
                      for r in read_records(d, TARGET))

    assert content(tmp_path) == content(out)  # the same data, each reply once
    assert ReplyGenerator(engine, POOL, tmp_path, TARGET, SETTINGS).run().records == 0


def test_long_prompts_end_their_conversation(engine, tmp_path):
    long = Conversation("long", ("word " * 300,))
    tight = GenSettings(max_new=4, max_prompt_tokens=60, concurrency=2, shard_size=8)
    report = ReplyGenerator(engine, [long, POOL[3]], tmp_path, TARGET, tight).run()
    assert (report.records, report.skipped) == (1, 1)
    assert [r.key for r in read_records(tmp_path)] == [POOL[3].key]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "dict", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


def test_a_tool_call_reply_follows_its_schema_beside_the_free_reply(engine, tmp_path):
    """A tool conversation's call (tool_calls) and its free twin share a prompt but are two
    replies: the call is `ar`'s reply alone under the same response_format, JSON valid under
    the call schema; the free one is `ar`'s free reply. A schema the grammar library refuses
    fails that reply alone."""
    free = Conversation("tools", ("What is the weather in Paris right now?",), (WEATHER,))
    broken = Conversation("broken", ("Hi",), ({"name": "h", "parameters": {"$ref": "#/no"}},))
    call, refused = tool_calls([free, broken])
    settings = GenSettings(max_new=48, max_prompt_tokens=400, concurrency=3, shard_size=8)
    report = ReplyGenerator(engine, [free, call, refused], tmp_path, TARGET, settings).run()
    assert (report.records, report.failed) == (2, 1)
    by = {r.key: r for r in read_records(tmp_path, TARGET)}
    prompt = free.prompt_ids(engine.tokenizer, 0, [])
    for conv in (free, call):
        assert by[conv.key].tokens[:by[conv.key].prompt_len].tolist() == prompt
    assert by[free.key].reply.tolist() == alone(engine, prompt, settings.max_new)
    engine.batch.max_slots = 1
    engine.reset()
    gen = engine.generate_ids(prompt, max_tokens=settings.max_new,
                              response_format=call.response_format)
    assert by[call.key].finish == "stop" and gen.stop_token_id is not None
    assert by[call.key].reply.tolist() == gen.token_ids + [gen.stop_token_id]
    jsonschema.validate(json.loads(reply_text(engine.tokenizer, by[call.key])),
                        call.response_format["json_schema"]["schema"])
    assert by[call.key].reply.tolist() != by[free.key].reply.tolist()
    again = ReplyGenerator(engine, [free, call], tmp_path, TARGET, settings).run()
    assert again.records == 0  # both found again by their prompt and structure


def test_refuses_other_targets_shards_and_too_small_a_context(engine, full_run):
    out, *_ = full_run
    with pytest.raises(UserError, match="not of"):
        ReplyGenerator(engine, POOL, out, {**TARGET, "sha256": "other"}, SETTINGS)
    with pytest.raises(UserError, match="context"):
        ReplyGenerator(engine, POOL, out, TARGET, GenSettings(max_prompt_tokens=500))


def test_ids_are_stored_compactly(full_run):
    out, *_ = full_run
    with np.load(shard_paths(out)[0]) as a:
        assert a["tokens"].dtype == np.uint16  # a 49,152-token vocabulary fits


def test_gen_data_command_stops_at_its_budget_resumes_and_reports(tmp_path, capsys):
    import json

    from adaspark import cli

    pool = tmp_path / "pool.jsonl"
    pool.write_text("\n".join(json.dumps({"source": c.source, "turns": list(c.turns)})
                              for c in POOL[:3]) + "\n")
    out = tmp_path / "replies"
    argv = ["gen-data", "--out", str(out), "--pool", str(pool), "--max-new", "6",
            "--max-prompt-tokens", "120", "--concurrency", "2", "--shard-size", "2",
            "--threads", "1", "--json"]
    assert cli.main([*argv, "--time-budget", "0"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["stopped"], first["replies"], first["directory"]["records"]) == ("budget", 0, 0)
    assert cli.main(argv) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["stopped"] == "done" and done["replies"] == 6  # 2 + 1 + 3 turns
    assert done["tok_s"] > 0 and done["reply_tokens"] == done["directory"]["reply_tokens"]
    assert done["directory"]["later_turns"] == 3
    assert cli.main(["gen-data", "--out", str(out), "--pool", str(tmp_path / "none")]) == 2
