"""benchmarks/soak.py without a server: the request mix, the malformed requests (each refused by
the server's own request model or its route rules), the stream reader, the verdicts."""

import importlib.util
import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from adaspark.bench.conversations import Conversation
from adaspark.server.app import MAX_BODY_BYTES
from adaspark.server.schemas import ChatRequest, RequestError

SPEC = importlib.util.spec_from_file_location(
    "soak", Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(SPEC)
sys.modules["soak"] = soak  # dataclasses look their module up
SPEC.loader.exec_module(soak)

TOOLS = ({"name": "weather", "description": "the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},)
CONVERSATIONS = [
    Conversation("spec_bench", "1", "writing", ("Write a poem.", "Shorter, please.")),
    Conversation("toolace", "2", "tools", ("Weather in Paris?", "And in Rome?"), tools=TOOLS,
                 system="You may call tools."),
    Conversation("longbench", "3", "long", ("lorem ipsum " * 3000,)),
]
BODY_REFUSED = {"over_context"}  # a valid body, refused for its length by the route
ROUTE_RULES = {"no_key", "wrong_key", "unknown_route", "wrong_method", "over_cap",
               "over_cap_chunked"}


def validate(body: bytes) -> ChatRequest:
    """What the route does with a body before it needs the engine."""
    request = ChatRequest.model_validate_json(body)
    request.check_supported()
    return request


@pytest.mark.parametrize("name", sorted(set(soak.MALFORMED) - BODY_REFUSED - ROUTE_RULES))
def test_a_malformed_body_is_refused_by_the_servers_request_model(name):
    planned = soak.malformed(name)
    assert (planned.kind, planned.expect, planned.method) == (f"malformed:{name}", "4xx", "POST")
    with pytest.raises((ValidationError, RequestError)):
        validate(planned.body)


def test_the_other_malformed_requests_break_the_rule_they_name():
    over = soak.malformed("over_context")
    text = validate(over.body).messages[0].text()
    assert len(text) / 8 > soak.CONTEXT  # past the context at any tokenizer's 8 chars a token
    assert soak.malformed("no_key").headers == {"authorization": None}
    assert soak.malformed("wrong_key").headers["authorization"] == "Bearer nope"
    assert soak.malformed("unknown_route").path == "/v1/nothing-here"
    assert soak.malformed("wrong_method").method == "GET"
    assert soak.MAX_BODY == MAX_BODY_BYTES
    for name in ("over_cap", "over_cap_chunked"):
        assert len(soak.malformed(name).body) > MAX_BODY_BYTES
    assert soak.malformed("over_cap_chunked").chunked
    assert not soak.malformed("over_cap").chunked
    assert all(soak.malformed(name).expect == "4xx" for name in soak.MALFORMED)


def test_tolerated_requests_are_valid_and_expect_a_reply():
    for name in soak.TOLERATED:
        planned = soak.tolerated(name, soak.user("hi"))
        assert planned.expect == "2xx"
        validate(planned.body)
    odd = json.loads(soak.tolerated("unknown_fields", soak.user("hi")).body)
    assert {"frobnicate", "metadata"} <= set(odd) and odd["messages"][0]["mood"]
    long = soak.tolerated("max_tokens_past_context", soak.user("hi"))
    assert json.loads(long.body)["max_tokens"] > soak.CONTEXT and long.cancel_after


def test_the_mix_holds_every_kind_and_chat_bodies_are_valid():
    rng = random.Random(3)
    dialogue = soak.Dialogue(CONVERSATIONS, rng)
    kinds, malformed, fields = Counter(), Counter(), Counter()
    for _ in range(3000):
        planned = soak.pick(rng, dialogue)
        kind = planned.kind.split(":")[0]
        kinds[kind] += 1
        if kind == "malformed":
            malformed[planned.kind] += 1
        if planned.messages is not None:
            body = json.loads(planned.body)
            validate(planned.body)
            fields.update(k for k in ("temperature", "top_p", "seed", "tools", "stream")
                          if k in body)
            assert body["max_tokens"] in soak.CAPS
            assert (planned.cancel_after is not None) == (kind == "cancelled")
            dialogue.answered(planned.messages, {"role": "assistant", "content": "ok"})
    assert set(kinds) == set(soak.WEIGHTS) | {"tolerated"}
    assert len(malformed) >= len(soak.MALFORMED) - 2  # the rare 32 MiB ones may be missed
    assert all(fields[k] > 50 for k in ("temperature", "top_p", "seed", "tools", "stream"))
    assert kinds["chat"] > kinds["cancelled"] > 0


def test_the_sweep_sends_every_malformed_and_tolerated_request_once():
    kinds = [p.kind for p in soak.sweep(soak.Dialogue(CONVERSATIONS, random.Random(0)))]
    assert sorted(kinds) == sorted([f"malformed:{n}" for n in soak.MALFORMED]
                                   + [f"tolerated:{n}" for n in soak.TOLERATED])


def test_a_dialogue_carries_tool_calls_on_as_tool_results():
    rng = random.Random(0)
    dialogue = soak.Dialogue(CONVERSATIONS[1:2], rng)
    sent = dialogue.next_messages()
    assert [m["role"] for m in sent] == ["system", "user"] and dialogue.tools
    call = {"id": "c7", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    dialogue.answered(sent, {"role": "assistant", "content": None, "tool_calls": [call]})
    after = dialogue.next_messages()
    assert [m["role"] for m in after] == ["system", "user", "assistant", "tool", "user"]
    assert after[3]["tool_call_id"] == "c7" and after[-1]["content"] == "And in Rome?"
    validate(json.dumps({"messages": after}).encode())
    dialogue.answered(after, None)  # a failed turn: dropped, the conversation moves on
    assert dialogue.next_messages()[-1]["content"] == "Weather in Paris?"


def test_the_long_prompt_is_about_the_asked_size():
    text = soak.long_prompt(CONVERSATIONS, 14_400)
    assert 14_400 <= len(text) < 14_600
    planned = soak.long_request(CONVERSATIONS, 14_400, stream=True)
    assert planned.kind == "long_prompt" and validate(planned.body).stream


def sse(*events):
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}" for e in events]


def chunk(text):
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_read_stream_outcomes():
    done = sse(chunk("a"), chunk("b"), {"choices": [], "usage": {"prompt_tokens": 9}}, "[DONE]")
    status, note, message = soak.read_stream(["", *done], None)
    assert (status, message["content"], soak.prompt_tokens(note)) == ("200", "ab", 9)
    assert soak.read_stream(done, 2)[0::2] == ("200_cancelled",
                                               {"role": "assistant", "content": "ab"})
    assert soak.read_stream(sse(chunk("a")), None)[0] == "stream_truncated"
    error = {"error": {"message": "internal error", "type": "server_error"}}
    assert soak.read_stream(sse(chunk("a"), error), None)[0] == "stream_server_error"
    refused = {"error": {"message": "cancelled", "type": "invalid_request_error"}}
    assert soak.read_stream(sse(refused), None)[0] == "stream_error"
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}
    calls = sse({"choices": [{"delta": {"tool_calls": [call]}}]}, "[DONE]")
    assert soak.read_stream(calls, None)[2]["tool_calls"][0]["id"] == "c1"


def test_verdicts():
    assert soak.expected("2xx", "200") and soak.expected("2xx", "200_cancelled")
    assert not soak.expected("2xx", "200_bad_body") and not soak.expected("2xx", "400")
    assert soak.expected("4xx", "413") and not soak.expected("4xx", "500")
    assert not soak.expected("4xx", "200")
    tally = soak.Tally()
    tally.record(soak.malformed("bad_json"), "500", 0.1)
    tally.record(soak.malformed("bad_json"), "400", 0.1)
    tally.record(soak.Planned("chat", "POST", "/"), "stream_server_error", 0.1)
    assert len(tally.server_errors) == 2 and len(tally.unexpected) == 2
    log = ('INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 200 OK\n'
           'INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 500 Internal\n'
           'ERROR: internal error abc in streaming\nTraceback (most recent call last):\n')
    assert len(soak.log_errors(log)) == 3
    assert soak.clean_exit(-15, "INFO:     Finished server process [1]")
    assert not soak.clean_exit(-9, "INFO:     Finished server process [1]")
    assert not soak.clean_exit(0, "")


def test_rss_summary():
    samples = [(t, 1024 * (1000 + t), t / 2) for t in range(0, 601, 10)]
    rss = soak.rss_summary(samples, minutes=10)
    assert (rss["start_mib"], rss["after_first_tenth_mib"], rss["peak_mib"], rss["end_mib"]) \
        == (1000, 1060, 1600, 1600)
    assert rss["server_cpu_cores_busy"] == 0.5 and rss["samples"] == 61
