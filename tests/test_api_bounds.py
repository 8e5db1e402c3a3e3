"""The API's bounds and admission, over real HTTP (issue 40): the stop list's caps, a full
server refusing before it reads a body, places that clients left no longer counted, the n
choices of a request never refused midway, every stream ending in `[DONE]`, tiny temperatures,
seeds a JavaScript client can replay, and server faults never reported with their details.

Two uvicorn servers run in threads on loopback ports: `idle`, whose model never loads (what is
answered before a request needs the engine), and `served`, the real embedded model on the `ar`
arm with one slot, a queue of one and one request at a time through tokenising.
"""

from __future__ import annotations

import json
import math
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import _error, _serving, _wait

from adaspark.errors import UserError
from adaspark.sampling import DRAWN_SEED_BITS, MAX_SEED, MIN_SEED, SamplingParams
from adaspark.server import create_app
from adaspark.server.schemas import MAX_CHOICES, MAX_STOP_CHARS, MAX_STOPS
from adaspark.server.worker import Cancelled, EngineWorker, Job, QueueFull

HI = [{"role": "user", "content": "Name three colours."}]
LONG = "Tell me a very long story about a dragon, a knight and a city by the sea."
JS_SAFE = 2**53 - 1  # Number.MAX_SAFE_INTEGER


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise AssertionError(f"{constant} in a JSON body")
    return json.loads(text, parse_constant=refuse)


def never_loading():
    gate = threading.Event()

    def load():
        gate.wait(300)
        raise RuntimeError("this test's model never loads")
    return load, gate


@pytest.fixture(scope="module")
def idle():
    load, gate = never_loading()
    app = create_app(load, model_id="m", parallel=1, queue_limit=1)
    with _serving(app) as base:
        yield {"base": base, "worker": app.state.worker}
        gate.set()


def post(base: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + "/v1/chat/completions", content=content, timeout=300,
                      headers={"content-type": "application/json"}, **kw)


# ----- answered before the engine ----------------------------------------------------------
def test_the_stop_list_is_capped_in_count_and_length(idle):
    base = idle["base"]
    at_bound = ["x" * MAX_STOP_CHARS] * MAX_STOPS
    # within the caps, the request passes validation (and waits for the model: 503)
    assert post(base, {"messages": HI, "stop": at_bound}).status_code == 503
    for stop, cap in ((["x"] * (MAX_STOPS + 1), MAX_STOPS),
                      (["x", "x" * (MAX_STOP_CHARS + 1)], MAX_STOP_CHARS),
                      ("x" * (MAX_STOP_CHARS + 1), MAX_STOP_CHARS)):
        refused = post(base, {"messages": HI, "stop": stop})
        assert refused.status_code == 400 and _error(refused)["param"] == "stop"
        assert f"at most {cap}" in _error(refused)["message"]
    doc = httpx.get(base + "/openapi.json").json()
    schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    stop = schema["application/json"]["schema"]["properties"]["stop"]["anyOf"]
    assert stop[0]["maxLength"] == MAX_STOP_CHARS and stop[1]["maxItems"] == MAX_STOPS


def test_seeds_are_int64_which_replay_exactly(idle):
    base = idle["base"]
    for seed in (MIN_SEED, MAX_SEED, 0):
        assert post(base, {"messages": HI, "seed": seed}).status_code == 503  # accepted
    for seed in (MAX_SEED + 1, MIN_SEED - 1, 2**64):
        refused = post(base, {"messages": HI, "seed": seed})
        assert refused.status_code == 400 and _error(refused)["param"] == "seed"


def test_drawn_seeds_and_their_choices_stay_javascript_safe():
    seeds = [SamplingParams(temperature=1.0).with_seed().seed for _ in range(4000)]
    assert max(seeds) + MAX_CHOICES - 1 <= JS_SAFE
    assert max(seeds) >= 2 ** (DRAWN_SEED_BITS - 2)  # still drawn from the whole range


def test_a_full_server_refuses_before_reading_the_body(idle):
    base, worker = idle["base"], idle["worker"]
    places = [worker.reserve(threading.Event()) for _ in range(2)]  # parallel 1 + queue 1
    try:
        with pytest.raises(QueueFull):
            worker.reserve(threading.Event())
        refused = post(base, b"{not json")  # never parsed: the refusal comes first
        assert refused.status_code == 429 and refused.headers["retry-after"].isdigit()
        assert _error(refused)["code"] == "rate_limit_exceeded"
    finally:
        for place in places:
            place.release()
    assert post(base, b"{not json").status_code == 400


def test_a_place_or_job_whose_client_left_no_longer_counts():
    load, gate = never_loading()
    worker = EngineWorker(load, parallel=1, queue_limit=1)
    try:
        kept, left = Job([1, 2], 1, []), Job([1, 3], 1, [])
        futures = [worker.submit(kept), worker.submit(left)]
        assert worker.full and worker.waiting == 2
        left.cancel.set()  # its client went away while it waited
        assert not worker.full and worker.waiting == 1
        futures.append(worker.submit(Job([1, 4], 1, [])))  # a live client is not refused
        with pytest.raises(QueueFull):
            worker.submit(Job([1, 5], 1, []))
        # a request's place is held across its choices: one submitted after the queue filled
        # is not refused
        futures[-1].cancel()
        place = worker.reserve(threading.Event())
        assert worker.full
        futures.append(place.submit(Job([1, 6], 1, [])))
        futures.append(place.submit(Job([1, 7], 1, [])))
        place.release()
        with pytest.raises(ValueError, match="given back"):
            place.submit(Job([1, 8], 1, []))
    finally:
        gate.set()  # the load fails: every queued job is dropped
    for future in futures:
        if not future.cancelled():
            with pytest.raises(Cancelled):
                future.result(timeout=60)
    assert worker.waiting == 0 and worker.held == 0


def test_health_says_the_load_failed_without_its_details(caplog):
    def load():
        raise RuntimeError("cannot open /srv/secret/model.gguf")

    app = create_app(load, model_id="m")
    with caplog.at_level("ERROR", logger="adaspark.server"), _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code != 503, "the load to fail")
        for response in (httpx.get(base + "/health"), post(base, {"messages": HI})):
            assert response.status_code == 500
            assert "failed to load" in _error(response)["message"]
            assert "secret" not in response.text and "RuntimeError" not in response.text
    assert any("/srv/secret/model.gguf" in r.getMessage() for r in caplog.records)


def test_an_unwritable_round_log_fails_the_serve_command_before_it_listens(capsys, tmp_path):
    from adaspark.cli import main

    (tmp_path / "a-file").write_text("")
    log = tmp_path / "a-file" / "rounds.jsonl"  # under a file: no one can create it
    with socket.socket() as busy:  # were the log not checked first, this port would fail
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--round-log", str(log), "--port", str(port)]) == 2
    assert "cannot write the round log" in capsys.readouterr().err


def test_an_unwritable_round_log_fails_the_speculator_at_load(tmp_path):
    from adaspark.scheduler.round import Scheduler
    from adaspark.speculative import Speculator

    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match="cannot write the round log"):
        Speculator(None, None, Scheduler("ngram"), round_log=tmp_path / "a-file" / "r.jsonl")
    spec = Speculator(None, None, Scheduler("ngram"), round_log=tmp_path / "ok" / "r.jsonl")
    assert (tmp_path / "ok" / "r.jsonl").exists()  # opened at load, before any request
    spec.close()


def test_an_event_refuses_nan_and_logprobs_floor_at_minus_9999():
    from adaspark.server.app import LOGPROB_FLOOR, _event, floored

    assert floored(-math.inf) == LOGPROB_FLOOR == -9999.0 == floored(-1e33)
    assert floored(-1.5) == -1.5
    assert math.isnan(floored(math.nan))  # a bug, left to fail loudly
    with pytest.raises(ValueError):
        _event({"logprob": math.nan})


# ----- on the real model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path

    model_path = default_model_path(download=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("adaspark.server.app.work_slots", lambda: 1)
        app = create_app(lambda: Engine.load(model_path, arm="ar"), model_id="m",
                         parallel=1, queue_limit=1)
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        worker = app.state.worker
        yield {"base": base, "worker": worker, "app": app}


def events(response: httpx.Response) -> list:
    """A stream's events: parsed JSON objects (strictly), and "[DONE]"."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else strict_json(line[6:]))
    return out


def stream(base: str, body: dict) -> list:
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as response:
        assert response.status_code == 200
        return events(response)


def content(evs: list) -> str:
    return "".join(c["delta"].get("content") or "" for e in evs if e != "[DONE]"
                   for c in e.get("choices", ()))


def filler(worker) -> Job:
    return Job(worker.engine.tokenizer.encode("Hi"), 1, [])


def fill_places(worker, submit) -> list:
    """Jobs submitted until the worker refuses one: the queue is full."""
    futures = []
    while True:
        try:
            futures.append(submit(filler(worker)))
        except QueueFull:
            return futures


@pytest.mark.slow
def test_a_stop_list_at_the_bound_cuts_the_reply(served):
    base = served["base"]
    post(base, {"messages": HI, "max_tokens": 1})  # the prompt cached: the same forwards
    plain = post(base, {"messages": HI, "max_tokens": 24}).json()
    text = plain["choices"][0]["message"]["content"]
    word = text[len(text) // 2:len(text) // 2 + 3]
    stops = [word] + [f"{i:02d}" + "z" * (MAX_STOP_CHARS - 2) for i in range(MAX_STOPS - 1)]
    cut = post(base, {"messages": HI, "max_tokens": 24, "stop": stops})
    assert cut.status_code == 200, cut.text
    choice = cut.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[:text.index(word)]
    evs = stream(base, {"messages": HI, "max_tokens": 24, "stop": stops})
    assert evs[-1] == "[DONE]" and content(evs) == text[:text.index(word)]
    assert post(base, {"messages": HI, "stop": [*stops, "y"]}).status_code == 400


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1e-40, 1e-46])
def test_a_tiny_temperature_is_the_argmax_with_finite_logprobs(served, temperature):
    base = served["base"]
    post(base, {"messages": HI, "max_tokens": 1})  # the prompt cached: the same forwards
    greedy = post(base, {"messages": HI, "max_tokens": 8}).json()
    body = {"messages": HI, "max_tokens": 8, "temperature": temperature, "seed": 5,
            "logprobs": True, "top_logprobs": 3}
    tiny = post(base, body)
    assert tiny.status_code == 200, tiny.text
    reply = strict_json(tiny.text)
    text = greedy["choices"][0]["message"]["content"]
    assert text and reply["choices"][0]["message"]["content"] == text
    entries = reply["choices"][0]["logprobs"]["content"]
    assert len(entries) == 8 and all(e["logprob"] == 0.0 for e in entries)  # certain picks
    assert all(-9999.0 <= top["logprob"] <= 0.0 for e in entries for top in e["top_logprobs"])
    evs = stream(base, body)  # strict_json: no NaN or Infinity in any chunk
    assert evs[-1] == "[DONE]" and content(evs) == text


@pytest.mark.slow
def test_a_drawn_seed_is_javascript_safe_and_replays(served):
    base = served["base"]
    body = {"messages": HI, "max_tokens": 6, "temperature": 1.0}
    first = post(base, body).json()
    seed = first["adaspark"]["seed"]
    assert 0 <= seed <= JS_SAFE
    again = post(base, {**body, "seed": seed}).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert again["adaspark"]["seed"] == seed


@pytest.mark.slow
def test_the_choices_of_the_largest_seed_wrap_and_replay(served):
    base = served["base"]
    body = {"messages": HI, "max_tokens": 3, "temperature": 1.0}
    both = post(base, {**body, "seed": MAX_SEED, "n": 2})
    assert both.status_code == 200, both.text
    second = post(base, {**body, "seed": MIN_SEED}).json()  # choice 1 used MAX_SEED + 1
    assert both.json()["choices"][1]["message"] == second["choices"][0]["message"]


@pytest.mark.slow
def test_a_full_queue_between_choices_keeps_the_choices_decoded(served):
    worker, fillers = served["worker"], []

    def fill_after_the_first_choice(job, result):  # the engine thread, before the client hears
        if job.request_id and result is not None and not fillers:
            fillers.extend(fill_places(worker, worker.submit))

    worker.observers.append(fill_after_the_first_choice)
    try:
        reply = post(served["base"], {"messages": HI, "max_tokens": 3, "n": 2,
                                      "temperature": 0.8, "seed": 9})
    finally:
        worker.observers.remove(fill_after_the_first_choice)
    assert fillers  # the queue was full when the second choice was submitted
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1]
    assert all(len(f.result(timeout=120).token_ids) == 1 for f in fillers)


@pytest.mark.slow
def test_a_stream_never_meets_a_full_queue_after_its_200(served, monkeypatch):
    worker, fillers = served["worker"], []
    submit = worker.submit

    def others_fill_the_queue_first(job, *args, **kw):
        if job.request_id and not fillers:  # the stream's first choice
            fillers.extend(fill_places(worker, submit))
        return submit(job, *args, **kw)

    monkeypatch.setattr(worker, "submit", others_fill_the_queue_first)
    evs = stream(served["base"], {"messages": HI, "max_tokens": 4})
    assert fillers and evs[-1] == "[DONE]"
    assert not any("error" in e for e in evs[:-1]) and content(evs)
    assert all(len(f.result(timeout=120).token_ids) == 1 for f in fillers)


@pytest.mark.slow
@pytest.mark.parametrize("fault, kind", [(RuntimeError("secret /srv/x"), "server_error"),
                                          (UserError("refused"), "invalid_request_error")])
def test_a_stream_that_fails_ends_with_an_error_object_then_done(served, monkeypatch, fault,
                                                                 kind):
    engine, calls = served["worker"].engine, []
    new_decode = engine.new_decode

    def second_choice_fails(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise fault
        return new_decode(*args, **kw)

    monkeypatch.setattr(engine, "new_decode", second_choice_fails)
    evs = stream(served["base"], {"messages": HI, "max_tokens": 3, "n": 2,
                                  "temperature": 0.8, "seed": 4})
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["type"] == kind
    assert "secret" not in json.dumps(evs)
    assert [c["index"] for e in evs[:-2] for c in e["choices"]][-1] == 0  # choice 0 came whole


@pytest.mark.slow
def test_requests_take_turns_through_tokenising(served, monkeypatch):
    base, worker, turns = served["base"], served["worker"], served["app"].state.turns
    tokenizer, gate, lock = worker.engine.tokenizer, threading.Event(), threading.Lock()
    inside, peak = [0], [0]
    encode_chat = tokenizer.encode_chat

    def held_encode(*args, **kw):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        try:
            gate.wait(120)
            return encode_chat(*args, **kw)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(tokenizer, "encode_chat", held_encode)
    with ThreadPoolExecutor(2) as pool:
        replies = [pool.submit(post, base, {"messages": HI, "max_tokens": 2}) for _ in range(2)]
        _wait(lambda: inside[0] == 1 and turns.waiting == 1, "one tokenising, one waiting")
        gate.set()
        assert [r.result().status_code for r in replies] == [200, 200]
    assert peak[0] == 1


@pytest.mark.slow
def test_a_request_that_waited_its_turn_is_refused_unparsed_if_the_queue_filled(served,
                                                                                monkeypatch):
    base, worker, turns = served["base"], served["worker"], served["app"].state.turns
    tokenizer, gate = worker.engine.tokenizer, threading.Event()
    encode_chat = tokenizer.encode_chat

    def held_encode(*args, **kw):
        gate.wait(120)
        return encode_chat(*args, **kw)

    monkeypatch.setattr(tokenizer, "encode_chat", held_encode)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, base, {"messages": HI, "max_tokens": 2})
        _wait(lambda: turns.working == 1 and worker.held == 1, "the first one tokenising")
        second = pool.submit(post, base, b"{not json")
        _wait(lambda: turns.waiting == 1, "the second one waiting its turn")
        place = worker.reserve(threading.Event())  # the last place goes meanwhile
        try:
            gate.set()
            refused = second.result()
            assert refused.status_code == 429, refused.text  # never parsed: not a 400
            assert first.result().status_code == 200
        finally:
            place.release()


@pytest.mark.slow
def test_a_queued_client_that_left_frees_its_place_for_a_live_one(served, monkeypatch):
    base, worker = served["base"], served["worker"]
    url, batch, go = base + "/v1/chat/completions", worker.engine.batch, threading.Event()
    step = batch.step

    def held_step():  # the engine thread waits here: the one slot stays taken
        go.wait(120)
        return step()

    monkeypatch.setattr(batch, "step", held_step)
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(1) as pool, \
            client.stream("POST", url, json={"messages": HI, "max_tokens": 2000,
                                             "stream": True}) as running:
        assert running.status_code == 200
        _wait(lambda: worker.running == 1, "the first stream to take the slot")
        with client.stream("POST", url, json={"messages": HI, "max_tokens": 4,
                                              "stream": True}) as queued:
            assert queued.status_code == 200
            _wait(lambda: worker.waiting == 1 and worker.full, "the second stream to queue")
        # its client left: neither its place nor its job counts now
        _wait(lambda: worker.waiting == 0 and not worker.full, "the queued stream to leave",
              timeout=60)
        assert "adaspark_requests_waiting 0.0" in httpx.get(base + "/metrics").text
        live = pool.submit(post, base, {"messages": HI, "max_tokens": 2})
        _wait(lambda: worker.waiting == 1, "the live request to queue", timeout=60)
        running.close()  # the first stream leaves too: the live request runs
        _wait(lambda: worker.held == 1, "the first stream to leave")  # the live one's place
        go.set()
        assert live.result().status_code == 200
