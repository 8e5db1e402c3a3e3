"""The HTTP server over real HTTP, with the `openai` client and the real embedded model.

One uvicorn server runs in a thread on a free loopback port for the whole module. Its loader
waits for a gate before building the engine, so the test can see the server answer 503 while the
model loads, then 200 once it is ready. The engine runs the plain `ar` arm: the server is the same
for every arm, and plain decoding keeps replies repeatable (no learned state between requests)
and leaves no learned store behind.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections import Counter

import httpx
import numpy as np
import openai
import pytest
import uvicorn

from adaspark.server import create_app
from adaspark.server.toolcalls import parse_tool_calls

pytestmark = pytest.mark.slow

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
HELLO = [{"role": "user", "content": "Name three colours."}]


def _settle(client, messages) -> None:
    """Cache `messages`' prompt, so the requests that follow all reuse the same prefix.

    The fast kernels are chosen by row count, so a prompt prefilled whole and one prefilled as
    its last token over a cached prefix can differ in the last bits of the logits, and greedy
    replies compared for equality must start from the same cache.
    """
    client.chat.completions.create(model="m", messages=messages, max_tokens=1)


def _wait(predicate, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def _serving(app):
    """Run `app` with uvicorn in a thread on a free loopback port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started, "uvicorn to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def served():
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path

    model_path = default_model_path(download=False)
    gate = threading.Event()

    def load():
        gate.wait(timeout=300)
        return Engine.load(model_path, arm="ar")

    app = create_app(load, model_id=model_path.stem)
    with _serving(app) as base:
        yield {"base": base, "gate": gate, "app": app, "model_id": model_path.stem}
        gate.set()


@pytest.fixture(scope="module")
def client(served):
    """A client that can only be used once the model has loaded (after test_loading_then_ready)."""
    served["gate"].set()
    _wait(lambda: httpx.get(served["base"] + "/health").status_code == 200, "the model to load")
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_loading_then_ready(served):
    base = served["base"]
    loading = httpx.get(base + "/health")
    assert loading.status_code == 503
    assert _error(loading)["type"] == "service_unavailable"
    chat = httpx.post(base + "/v1/chat/completions", json={"messages": HELLO})
    assert chat.status_code == 503
    served["gate"].set()
    _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok"
    assert health["forward"].startswith(("native-", "torch-"))  # what benchmarks record
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [served["model_id"]]


def test_non_streaming_reply_with_usage_and_timings(client, served):
    reply = client.chat.completions.create(model="any-name", messages=HELLO, max_tokens=8)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert reply.model == served["model_id"]
    assert reply.usage.completion_tokens <= 8
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    timings = reply.model_extra["timings"]
    assert {"decode_s", "draft_rounds", "plain_rounds", "verified_rows", "accepted_tokens",
            "mean_width"} <= set(timings)
    # the plain arm: one 1-row round per token after the first (which the prefill gives)
    assert timings["draft_rounds"] == 0 and timings["accepted_tokens"] == 0
    assert timings["plain_rounds"] == timings["verified_rows"] == timings["decode_tokens"]
    assert timings["mean_width"] == (1.0 if timings["plain_rounds"] else 0.0)


def test_streaming_matches_non_streaming_and_includes_usage(client):
    _settle(client, HELLO)
    whole = client.chat.completions.create(model="m", messages=HELLO, max_tokens=6)
    stream = client.chat.completions.create(model="m", messages=HELLO, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same reply either way
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert "timings" in last.model_extra


def test_stop_string_cuts_the_reply(client):
    _settle(client, HELLO)
    free = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8)
    text = free.choices[0].message.content
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    cut = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_multi_turn(client):
    first = client.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
    history = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": [{"type": "text", "text": "And one more?"}]}]
    second = client.chat.completions.create(model="m", messages=history, max_tokens=4)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def _streamed(stream) -> tuple[str, list, str | None]:
    """Text, tool-call deltas and finish_reason of a streamed reply."""
    text, calls, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    return text, calls, finish


def test_tools_render_and_return(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=1)
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                           max_tokens=12)
    text, calls, finish = _streamed(client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=12, stream=True))
    assert finish == whole.choices[0].finish_reason
    if finish == "tool_calls":
        wanted = whole.choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in wanted]
    else:
        assert text == whole.choices[0].message.content
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert whole.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools were rendered
    # a call and its result carried back as history
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    after = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4)
    assert after.usage.prompt_tokens > whole.usage.prompt_tokens
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ("[]", None),
    ('{"model": "m"}', "messages"),
    ('{"messages": []}', "messages"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages.0.role"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
    ('{"messages": [{"role": "user"}]}', "messages.0"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', "max_tokens"),
    ('{"messages": [{"role": "user", "content": "hi"}], "stop": 3}', "stop"),
    *[(f'{{"messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}', field)
      for field, value in [("temperature", -0.1), ("temperature", 2.5), ("top_p", 0),
                           ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("top_logprobs", 21),
                           ("top_logprobs", -1), ("frequency_penalty", 2.5),
                           ("presence_penalty", -3), ("seed", 1.5), ("seed", '"3"'),
                           ("seed", "true"), ("n", 0), ("n", 17), ("top_logprobs", 2),
                           ("logprobs", '"yes"')]],
    ('{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}',
     "tool_choice"),
])
def test_bad_requests_get_400_with_an_error_object(client, served, body, param):
    response = httpx.post(served["base"] + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def _chat(served, **body) -> dict:
    response = httpx.post(served["base"] + "/v1/chat/completions", timeout=300,
                          json={"model": "m", "messages": HELLO, "max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_sampled_reply_reports_its_seed_and_reproduces(client, served):
    _settle(client, HELLO)  # every request below then prefills the same last token
    drawn = _chat(served, temperature=1.0, top_p=0.95, top_k=50)
    seed = drawn["adaspark"]["seed"]
    assert isinstance(seed, int)
    again = _chat(served, temperature=1.0, top_p=0.95, top_k=50, seed=seed)
    assert again["choices"][0]["message"] == drawn["choices"][0]["message"]
    assert again["adaspark"] == {"seed": seed}
    assert "adaspark" not in _chat(served)  # greedy: nothing to reproduce
    assert _chat(served, temperature=0)["choices"] == _chat(served)["choices"]


def test_n_choices_are_seeded_samples_one_after_another(client, served):
    _settle(client, HELLO)
    many = _chat(served, temperature=1.2, seed=40, n=3, max_tokens=6)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    for i, choice in enumerate(many["choices"]):
        alone = _chat(served, temperature=1.2, seed=40 + i, max_tokens=6)
        assert alone["choices"][0]["message"] == choice["message"]
    assert many["usage"]["completion_tokens"] == sum(
        len(client.chat.completions.create(model="m", messages=HELLO, max_tokens=6,
                                           temperature=1.2, seed=40 + i, logprobs=True)
            .choices[0].logprobs.content) for i in range(3))


def test_logprobs_and_top_logprobs(client, served):
    _settle(client, HELLO)
    reply = client.chat.completions.create(model="m", messages=HELLO, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    text = b"".join(bytes(item.bytes) for item in content).decode()
    assert text == reply.choices[0].message.content
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert item.top_logprobs[0].token == item.token  # temperature 0: the argmax
        assert item.logprob == tops[0]
    stream = client.chat.completions.create(model="m", messages=HELLO, max_tokens=6,
                                            temperature=0.8, seed=5, logprobs=True,
                                            stream=True)
    chunks = [c for c in stream if c.choices]
    whole = client.chat.completions.create(model="m", messages=HELLO, max_tokens=6,
                                           temperature=0.8, seed=5, logprobs=True)
    streamed = [i for c in chunks if c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == \
        [(i.token, i.logprob) for i in whole.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert whole.choices[0].logprobs.content[0].top_logprobs == []


COUNT = [{"role": "user", "content": "Count from 1 to 20."}]


def penalised_greedy(model, prompt: list[int], steps: int, stops, frequency: float,
                     presence: float):
    """Plain greedy decoding written out on a model of our own (not the server's): each step's
    logits minus OpenAI's penalties (frequency * count + presence where the reply has the token
    already), in float64, up to a stop token. -> ids, each pick's log-softmax, whether it
    stopped, the smallest top-2 margin, and at how many steps the unpenalised argmax differs."""
    ids, logprobs, margin, changed = [], [], np.inf, 0
    model.reset()
    logits = model.prefill(prompt, return_logits=True).logits[-1]
    for _ in range(steps):
        row = logits.double().numpy()
        penalty = np.zeros_like(row)
        for token, count in Counter(ids).items():
            penalty[token] = frequency * count + presence
        x = row - penalty
        top2 = np.sort(x)[-2:]
        margin, pick = min(margin, top2[1] - top2[0]), int(np.argmax(x))
        changed += int(np.argmax(row)) != pick
        if pick in stops:
            return ids, logprobs, True, margin, changed
        ids.append(pick)
        logprobs.append(float(x[pick] - x.max() - np.log(np.exp(x - x.max()).sum())))
        logits = model.verify([pick], [0], np.ones((1, 1), bool), return_logits=True).logits[0]
        model.commit([0])
    return ids, logprobs, False, margin, changed


@pytest.mark.parametrize("frequency,presence", [(2.0, 1.0), (-1.0, -0.5)])
def test_penalties_shift_the_greedy_reply_as_openai_defines_them(client, served, fast_model,
                                                                 frequency, presence):
    """Temperature 0 with penalties: the server's reply is the argmax of the penalised logits
    at every step, and each token's logprob is that row's log-softmax (penalties included), both
    against plain decoding with the penalties written out on another instance of the model.
    Both settings change the greedy reply (one stops early, one repeats); the logprobs tell
    frequency from presence (the reply repeats tokens)."""
    body = _chat(served, messages=COUNT, temperature=0, max_tokens=12, logprobs=True,
                 frequency_penalty=frequency, presence_penalty=presence)
    tokenizer = served["app"].state.worker.engine.tokenizer
    ids, logprobs, stopped, margin, changed = penalised_greedy(
        fast_model, tokenizer.encode_chat(COUNT), 12, tokenizer.stop_ids, frequency, presence)
    assert margin > 0.1 and changed >= 2, (margin, changed)  # no near-ties; penalties bite
    choice = body["choices"][0]
    assert choice["finish_reason"] == ("stop" if stopped else "length")
    assert choice["message"]["content"] == tokenizer.decode(ids)
    got = [item["logprob"] for item in choice["logprobs"]["content"]]
    assert got == pytest.approx(logprobs, abs=0.02)


def test_prompt_over_the_context(client, served):
    engine = served["app"].state.worker.engine
    words = " ".join(["hello"] * (engine.context_length + 10))
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", max_tokens=4,
                                       messages=[{"role": "user", "content": words}])
    assert caught.value.status_code == 400
    assert caught.value.code == "context_length_exceeded"


def test_body_over_the_limit_gets_413(client, served):
    from adaspark.server.app import MAX_BODY_BYTES

    port = int(served["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        answer = b""  # answered from the headers alone, before any body is sent
        for _ in range(20):
            piece = conn.recv(4096)
            answer += piece
            if not piece or b"invalid_request_error" in answer:
                break
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"invalid_request_error" in answer


def test_unknown_route_and_method(client, served):
    missing = httpx.get(served["base"] + "/v1/nothing")
    assert missing.status_code == 404 and _error(missing)["type"] == "not_found_error"
    wrong = httpx.get(served["base"] + "/v1/chat/completions")
    assert wrong.status_code == 405 and _error(wrong)


def test_disconnect_cancels_and_frees_the_engine(client, served):
    worker = served["app"].state.worker
    _settle(client, HELLO)
    before = client.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
    previous = worker.last_result
    stream = client.chat.completions.create(model="m", messages=HELLO, max_tokens=400,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    _wait(lambda: worker.last_result is not previous, "the cancelled request to end")
    assert len(worker.last_result.token_ids) < 400  # it stopped early, not at its cap
    after = client.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
    assert after.choices[0].message.content == before.choices[0].message.content


@pytest.mark.parametrize("text, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', [("f", {"x": 1})]),
    ('<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": "z"}}]'
     "</tool_call>", [("f", {}), ("g", {"y": "z"})]),
    ('  <tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}', [("f", {"x": 2})]),
    ('Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call>', None),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call> done', None),
    ("<tool_call>{not json}</tool_call>", None),
    ('<tool_call>{"arguments": {}}</tool_call>', None),
    ("just text", None),
])
def test_parse_tool_calls(text, calls):
    parsed = parse_tool_calls(text)
    if calls is None:
        assert parsed is None
    else:
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed]
        assert got == calls
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed)


def test_a_model_that_fails_to_load_is_reported(tmp_path, caplog):
    from adaspark.engine import Engine

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a model")
    app = create_app(lambda: Engine.load(broken), model_id="broken")
    with caplog.at_level("ERROR", logger="adaspark.server"), _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code != 503, "the load to fail")
        health = httpx.get(base + "/health")
        chat = httpx.post(base + "/v1/chat/completions", json={"messages": HELLO})
        for response in (health, chat):  # why is the server's to log, not the client's to see
            assert response.status_code == 500 and "failed to load" in _error(response)["message"]
            assert "GGUF" not in response.text and str(tmp_path) not in response.text
    assert any("not a GGUF file" in record.getMessage() for record in caplog.records)


def test_serve_command_refuses_bad_options_before_listening(capsys, tmp_path):
    from adaspark.cli import main

    assert main(["serve", "--model", str(tmp_path / "absent.gguf"), "--port", "1"]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert main(["serve", "--arm", "fastest", "--port", "1"]) == 2
    assert "unknown arm" in capsys.readouterr().err


def test_serve_command_refuses_a_busy_port():
    from adaspark.commands.serve import listen
    from adaspark.errors import UserError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(UserError, match="cannot listen on 127.0.0.1"):
            listen("127.0.0.1", busy.getsockname()[1]).close()


def test_the_served_engine_loads_then_freezes_the_heap(monkeypatch):
    import gc

    from adaspark.commands import serve
    from adaspark.engine import Engine

    loaded = object()
    monkeypatch.setattr(Engine, "load", staticmethod(lambda path, options: loaded))
    gc.unfreeze()
    try:
        assert serve.load_engine("model.gguf", None) is loaded
        assert gc.get_freeze_count() > 0  # what the load left alive is out of reach
    finally:
        gc.unfreeze()
