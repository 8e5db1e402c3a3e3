"""response_format over real HTTP, on the default arm (the shipped drafter) with 3 requests at
once: JSON Schema and JSON mode on both routes, streamed and whole, n > 1, beside unconstrained
requests in the batch; a schema the server cannot compile, or an oversized one, is a 400 that
says why."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
from test_server import _serving, _wait

from adaspark.drafter.loading import load_drafter
from adaspark.engine import Engine
from adaspark.grammar import MAX_SCHEMA_BYTES
from adaspark.model.tokenizer import Tokenizer
from adaspark.scheduler.round import Scheduler
from adaspark.server import create_app
from adaspark.speculative import DEFAULT_ARM, Speculator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CITY = {"type": "object", "properties": {"city": {"type": "string"},
                                         "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Return a JSON object with the keys city and country for "
        "Tokyo."}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY,
                                                         "strict": True}}


@pytest.fixture(scope="module")
def base(fast_model, model_path):
    tok = Tokenizer.from_gguf(model_path)
    spec = Speculator(fast_model, load_drafter(fast_model, model_path), Scheduler(DEFAULT_ARM),
                      tok.stop_ids)
    engine = Engine(fast_model, tok, model_path, spec)
    engine.reset()
    app = create_app(lambda: engine, model_id="m", parallel=3)
    with _serving(app) as url:
        _wait(lambda: httpx.get(url + "/health").status_code == 200, "the engine")
        yield url
    engine.batch.max_slots = 1
    engine.reset()


def chat(base: str, **body) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions",
                      json={"messages": ASK, "max_tokens": 48, **body}, timeout=300)


def test_json_schema_replies_validate_n_choices_seeded(base):
    response = chat(base, response_format=SCHEMA_FORMAT, n=2, temperature=0.9, seed=3)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), CITY)


def test_streamed_json_schema_reply_parses_and_ends_with_done(base):
    events = []
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=300,
                      json={"messages": ASK, "max_tokens": 48, "stream": True,
                            "response_format": SCHEMA_FORMAT}) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), CITY)
    whole = chat(base, response_format=SCHEMA_FORMAT).json()["choices"][0]["message"]
    assert text == whole["content"]  # streamed or not, the same reply


def test_json_mode_on_text_completions(base):
    response = httpx.post(base + "/v1/completions", timeout=300, json={
        "prompt": "Tokyo as a JSON object with its city and country:\n", "max_tokens": 48,
        "response_format": {"type": "json_object"}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["text"]), dict)


def test_constrained_beside_unconstrained_requests_equals_it_alone(base):
    alone = chat(base, response_format=SCHEMA_FORMAT).json()["choices"][0]["message"]["content"]
    bodies = [{"response_format": SCHEMA_FORMAT},
              {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
              {"messages": [{"role": "user", "content": "Name three colours."}],
               "temperature": 0.7, "seed": 1}]
    replies: list = [None] * len(bodies)

    def run(i: int) -> None:
        replies[i] = chat(base, **bodies[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(r is not None and r.status_code == 200 for r in replies)
    texts = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert texts[0] == alone
    assert not texts[1].startswith("{")  # the grammar stayed with its own request


@pytest.mark.parametrize(("response_format", "param", "says"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
     "response_format.json_schema.schema", "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"}
                                         for i in range(MAX_SCHEMA_BYTES // 16)}}}},
     "response_format.json_schema.schema", f"at most {MAX_SCHEMA_BYTES}"),
    ({"type": "yaml"}, "response_format.type", "json_schema"),
])
def test_a_schema_it_cannot_serve_is_a_400_naming_why(base, response_format, param, says):
    for route, body in [("/v1/chat/completions", {"messages": ASK}),
                        ("/v1/completions", {"prompt": "x"})]:
        response = httpx.post(base + route, timeout=60,
                              json={**body, "response_format": response_format, "stream": True})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and says in error["message"]
