"""Text completions (`/v1/completions`) over real HTTP with the real embedded model; a model
without a chat template (a copy of the embedded GGUF with tokenizer.chat_template removed) on the
server and the CLI; `adaspark generate --raw` and the forward its --json names.

The module's server runs the plain `ar` arm one request at a time with no queue (parallel 1,
queue 0), so a held stream makes the next request a 429. Greedy replies compared for equality
start from the same cache state on both sides (see test_server._settle).
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import openai
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from test_server import _error, _serving, _wait

from adaspark import cli
from adaspark.errors import UserError
from adaspark.model.tokenizer import Tokenizer, _read_tokenizer_metadata
from adaspark.server import create_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CONTEXT = 512
PROMPT = "The three primary colours are"
STORY = "Once upon a time, in a small village by the sea, there lived"


def without_chat_template(source, target) -> None:
    """A copy of the GGUF `source` at `target`, every key and tensor but the chat template."""
    reader = GGUFReader(source)
    writer = GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name in ("general.architecture", "tokenizer.chat_template") or \
                field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()


@pytest.fixture(scope="module")
def bare_gguf(tmp_path_factory, model_path):
    path = tmp_path_factory.mktemp("bare") / "no-template.gguf"
    without_chat_template(model_path, path)
    return path


@pytest.fixture(scope="module")
def served(model_path):
    from adaspark.engine import Engine

    app = create_app(lambda: Engine.load(model_path, arm="ar", max_context=CONTEXT),
                     model_id="m", parallel=1, queue_limit=0)
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code != 503, "the model to load")
        assert httpx.get(base + "/health").status_code == 200, httpx.get(base + "/health").text
        yield {"base": base, "app": app, "worker": app.state.worker}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def reference(model_path):
    """An engine built as the server's is, driven directly (generate_ids)."""
    from adaspark.engine import Engine

    return Engine.load(model_path, arm="ar", max_context=CONTEXT)


def _settled(engine, ids: list[int], max_tokens: int):
    """generate_ids after the same one-token request the server's side settles with."""
    engine.generate_ids(ids, max_tokens=1)
    return engine.generate_ids(ids, max_tokens=max_tokens)


def _post(served, **body) -> httpx.Response:
    return httpx.post(served["base"] + "/v1/completions", json=body, timeout=300)


def _complete(served, **body) -> dict:
    response = _post(served, **body)
    assert response.status_code == 200, response.text
    return response.json()


def _sse(served, **body) -> list[str]:
    """The raw `data:` payloads of a streamed completion."""
    with httpx.stream("POST", served["base"] + "/v1/completions", timeout=300,
                      json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# --- the tokenizer without a template (no model run) ---------------------------------------------
def test_a_tokenizer_without_a_template_refuses_chat_and_encodes_raw_text(model_path):
    metadata = dict(_read_tokenizer_metadata(model_path))
    del metadata["tokenizer.chat_template"]
    bare = Tokenizer.from_gguf(metadata)
    assert bare.chat_template is None
    with pytest.raises(UserError, match="no chat template"):
        bare.encode_chat([{"role": "user", "content": "hi"}])
    assert bare.encode_prompt(PROMPT) == bare.encode(PROMPT)  # SmolLM2 asks for no BOS
    with_bos = Tokenizer.from_gguf(dict(metadata, **{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode_prompt(PROMPT) == [with_bos.bos_id, *bare.encode(PROMPT)]
    assert with_bos.encode_prompt("") == [with_bos.bos_id]


# --- /v1/completions ------------------------------------------------------------------------
def test_greedy_completion_is_generate_ids_on_the_same_tokens(client, served, reference):
    ids = reference.tokenizer.encode_prompt(PROMPT)
    client.completions.create(model="m", prompt=PROMPT, max_tokens=1)
    whole = client.completions.create(model="any", prompt=PROMPT, max_tokens=12)
    want = _settled(reference, ids, 12)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and whole.model == "m"
    assert whole.id.startswith("cmpl-")
    assert choice.text == want.text and want.token_ids
    assert choice.finish_reason == want.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == \
        (len(ids), len(want.token_ids))
    assert whole.model_extra["timings"]["prompt_tokens"] == len(ids)
    # the same prompt as token ids, and as a list of one prompt of either kind
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=12)
    assert by_ids.choices[0].text == want.text
    for prompt in ([PROMPT], [ids]):
        assert _complete(served, prompt=prompt, max_tokens=12)["choices"][0]["text"] == want.text


def test_max_tokens_defaults_to_16(served):
    body = _complete(served, prompt=STORY)
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"


def test_streamed_text_concatenates_to_the_whole_text(client, served):
    _complete(served, prompt=PROMPT, max_tokens=1)
    whole = _complete(served, prompt=PROMPT, max_tokens=10)
    events = _sse(served, prompt=PROMPT, max_tokens=10, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    with_choices = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in with_choices) == \
        whole["choices"][0]["text"]
    finishes = [c["choices"][0]["finish_reason"] for c in with_choices]
    assert finishes[-1] == whole["choices"][0]["finish_reason"]
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # the openai client reads the same stream
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == \
        whole["choices"][0]["text"]


def test_stop_strings_cut_the_text(served):
    _complete(served, prompt=STORY, max_tokens=1)
    text = _complete(served, prompt=STORY, max_tokens=12)["choices"][0]["text"]
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    for body in (_complete(served, prompt=STORY, max_tokens=12, stop=stop),
                 _complete(served, prompt=STORY, max_tokens=12, stop=["zzqx", stop])):
        assert body["choices"][0] == {"index": 0, "text": text[:text.index(stop)],
                                      "finish_reason": "stop", "logprobs": None}
    streamed = [json.loads(e) for e in _sse(served, prompt=STORY, max_tokens=12, stop=[stop])
                if e != "[DONE]"]
    assert "".join(c["choices"][0]["text"] for c in streamed) == text[:text.index(stop)]


def test_echo_puts_the_prompt_before_the_reply(served):
    _complete(served, prompt=PROMPT, max_tokens=1)
    plain = _complete(served, prompt=PROMPT, max_tokens=6)["choices"][0]["text"]
    echoed = _complete(served, prompt=PROMPT, max_tokens=6, echo=True)
    assert echoed["choices"][0]["text"] == PROMPT + plain
    events = _sse(served, prompt=PROMPT, max_tokens=6, echo=True)
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert texts[0].startswith(PROMPT) and "".join(texts) == PROMPT + plain


def test_logprobs_in_the_legacy_shape(served):
    _complete(served, prompt=PROMPT, max_tokens=1)
    body = _complete(served, prompt=PROMPT, max_tokens=6, logprobs=3)
    choice, greedy = body["choices"][0], _complete(served, prompt=PROMPT, max_tokens=6)
    assert choice["text"] == greedy["choices"][0]["text"]  # temperature 0: still the argmax
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                   strict=True):
        assert len(top) == 3 and max(top.values()) == logprob <= 0
        assert top[token] == logprob
    events = _sse(served, prompt=PROMPT, max_tokens=6, logprobs=3)
    last = json.loads(events[-2])["choices"][0]
    assert last["logprobs"]["tokens"] == lp["tokens"]
    assert last["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"])
    assert _complete(served, prompt=PROMPT, max_tokens=2, logprobs=0)["choices"][0][
        "logprobs"]["top_logprobs"] == [{}, {}]


def test_sampled_choices_report_their_seed_and_reproduce(served):
    _complete(served, prompt=STORY, max_tokens=1)
    many = _complete(served, prompt=STORY, max_tokens=6, temperature=1.1, seed=9, n=2)
    assert many["adaspark"] == {"seed": 9} and [c["index"] for c in many["choices"]] == [0, 1]
    for i, choice in enumerate(many["choices"]):
        alone = _complete(served, prompt=STORY, max_tokens=6, temperature=1.1, seed=9 + i)
        assert alone["choices"][0]["text"] == choice["text"]
    assert many["usage"]["completion_tokens"] >= 2


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [""]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [10 ** 6]}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "logprobs": 1, "echo": True}, "logprobs"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "best_of": 2}, "best_of"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "n": 17}, "n"),
])
def test_bad_prompts_and_fields_get_400(served, body, param):
    response = _post(served, **body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_a_prompt_that_fills_the_context_gets_400(served, reference):
    for prompt in ([1] * CONTEXT, "hello " * (CONTEXT + 10)):
        response = _post(served, prompt=prompt, max_tokens=4)
        assert response.status_code == 400
        error = _error(response)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    ids = [reference.tokenizer.encode(" hello")[0]] * (CONTEXT - 1)
    last = _complete(served, prompt=ids, max_tokens=8)  # room for one token, whatever the cap
    assert last["usage"]["completion_tokens"] <= 1
    # max_tokens null: the reply may run to the end of the context, not to the default 16
    near = _complete(served, prompt=ids[:CONTEXT - 24], max_tokens=None)
    assert near["usage"]["completion_tokens"] == 24, near["choices"][0]
    assert near["choices"][0]["finish_reason"] == "length"


def test_a_body_over_the_cap_gets_413(served):
    from adaspark.server.app import MAX_BODY_BYTES

    port = int(served["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        assert conn.recv(4096).startswith(b"HTTP/1.1 413")


def test_a_held_stream_makes_the_next_request_429_and_leaving_cancels_it(served):
    worker = served["worker"]
    previous = worker.last_result
    with httpx.stream("POST", served["base"] + "/v1/completions", timeout=300,
                      json={"prompt": STORY, "max_tokens": 400, "stream": True}) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        refused = _post(served, prompt=PROMPT, max_tokens=2)
        assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
        assert _error(refused)["code"] == "rate_limit_exceeded"
    _wait(lambda: worker.last_result is not previous and worker.running == 0,
          "the cancelled request to end", timeout=60)
    assert worker.last_result.finish_reason == "cancelled"
    assert len(worker.last_result.token_ids) < 400
    assert _post(served, prompt=PROMPT, max_tokens=2).status_code == 200


# --- a model without a chat template ----------------------------------------------------------
def test_a_model_without_a_template_completes_but_refuses_chat(bare_gguf, reference):
    from adaspark.engine import Engine

    app = create_app(lambda: Engine.load(bare_gguf, arm="ar", max_context=CONTEXT),
                     model_id="bare")
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code != 503, "the model to load")
        assert httpx.get(base + "/health").status_code == 200, httpx.get(base + "/health").text
        chat = httpx.post(base + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400
        error = _error(chat)
        assert (error["param"], error["code"]) == ("messages", "no_chat_template")
        assert "/v1/completions" in error["message"]
        body = {"prompt": PROMPT, "max_tokens": 8}
        httpx.post(base + "/v1/completions", json={**body, "max_tokens": 1}, timeout=300)
        got = httpx.post(base + "/v1/completions", json=body, timeout=300).json()
    want = _settled(reference, reference.tokenizer.encode_prompt(PROMPT), 8)
    assert got["choices"][0]["text"] == want.text


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_cli_without_raw_refuses_a_model_without_a_template(bare_gguf, command, capsys):
    argv = [command, "--model", str(bare_gguf), "--arm", "ar"]
    assert cli.main([*argv, "--prompt", "hi"] if command == "generate" else argv) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "--raw" in err and "Traceback" not in err


# --- generate --raw and --json's forward ------------------------------------------------------
def _generate_json(capsys, *args: str) -> dict:
    assert cli.main(["generate", "--arm", "ar", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_raw_continues_the_text_untemplated(capsys, bare_gguf, reference):
    tok = reference.tokenizer
    out = _generate_json(capsys, "--raw", "--prompt", PROMPT, "--max-tokens", "6")
    assert out["prompt_token_ids"] == tok.encode_prompt(PROMPT) and out["raw"] is True
    assert out["text"] == tok.decode(out["token_ids"]) and 1 <= len(out["token_ids"]) <= 6
    chat = _generate_json(capsys, "--prompt", PROMPT, "--max-tokens", "1")
    assert chat["prompt_token_ids"] == tok.encode_chat([{"role": "user", "content": PROMPT}])
    bare = _generate_json(capsys, "--model", str(bare_gguf), "--raw", "--prompt", PROMPT,
                          "--max-tokens", "6")
    assert bare["token_ids"] == out["token_ids"]  # the same weights, the same raw prompt
    assert cli.main(["generate", "--raw", "--system", "x", "--prompt", "hi"]) == 2
    assert "--system" in capsys.readouterr().err


def test_generate_json_names_the_forward_that_ran(capsys, reference):
    fast = _generate_json(capsys, "--raw", "--prompt", "Hi", "--max-tokens", "1")
    assert fast["forward"] == reference.forward  # native-<ISA> where the build loads
    exact = _generate_json(capsys, "--raw", "--prompt", "Hi", "--max-tokens", "1",
                           "--precision", "reference")
    assert exact["forward"] == "torch-cpu"  # float32 reference never runs the native forward


# --- the OpenAPI document and the API key ---------------------------------------------------
def test_the_route_is_declared_and_guarded():
    gate = threading.Event()

    def load():
        gate.wait(300)
        raise RuntimeError("this test's model never loads")

    app = create_app(load, model_id="m", api_key="k")
    with _serving(app) as base:
        try:
            refused = httpx.post(base + "/v1/completions", json={"prompt": "hi"})
            assert refused.status_code == 401 and _error(refused)["code"] == "invalid_api_key"
            loading = httpx.post(base + "/v1/completions", json={"prompt": "hi"},
                                 headers={"authorization": "Bearer k"})
            assert loading.status_code == 503
            doc = httpx.get(base + "/openapi.json", headers={"authorization": "Bearer k"}).json()
        finally:
            gate.set()
    route = doc["paths"]["/v1/completions"]["post"]
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for status in ("400", "401", "413", "429", "500", "503"):
        assert route["responses"][status]["content"]["application/json"]["schema"] == error_ref
    body = route["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["prompt"] and "$ref" not in json.dumps(body)
    shapes = body["properties"]["prompt"]["anyOf"]
    assert shapes[0] == {"type": "string", "minLength": 1}
    assert all(s.get("maxItems") == 1 for s in shapes[2:])  # one prompt a request
