"""The server batching concurrent requests, over real HTTP on the real model (`ar`, parallel 3,
a queue of 1): concurrent replies equal solo ones and did run side by side, a request's n
choices run side by side too (streamed interleaved, each equal to the same choice asked alone,
one that fails failing the request and ending the others), a client that leaves frees its slot
at the next step, and past the queue a request gets 429 with Retry-After."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import _error, _serving, _wait

from adaspark.errors import UserError
from adaspark.sampling import shifted_seed
from adaspark.server import create_app

pytestmark = pytest.mark.slow

PROMPTS = ["Name three colours.", "Write a haiku about the sea.", "Count to five."]
LONG = "Tell me a very long story about a dragon, a knight and a city by the sea."


@pytest.fixture(scope="module")
def served():
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path

    model_path = default_model_path(download=False)
    app = create_app(lambda: Engine.load(model_path, arm="ar"), model_id=model_path.stem,
                     parallel=3, queue_limit=1)
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        yield {"base": base, "worker": app.state.worker}


def body(prompt: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **kw}


def ask(base: str, payload: dict) -> str:
    """The reply's text, streamed or not."""
    url = base + "/v1/chat/completions"
    if not payload.get("stream"):
        response = httpx.post(url, json=payload, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", url, json=payload, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


@contextlib.contextmanager
def peak_running(worker):
    """The most requests the worker ran at once while the block ran: [peak]."""
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], worker.running)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield peak
    finally:
        stop.set()
        watcher.join()


def test_concurrent_replies_equal_solo_ones(served):
    base, worker = served["base"], served["worker"]
    payloads = [body(PROMPTS[0], max_tokens=32),
                body(PROMPTS[1], max_tokens=32, stream=True),
                body(PROMPTS[2], max_tokens=32, temperature=0.9, seed=3)]
    solo = [ask(base, p) for p in payloads]
    with peak_running(worker) as peak:
        with ThreadPoolExecutor(len(payloads)) as pool:
            together = list(pool.map(lambda p: ask(base, p), payloads))
    assert together == solo
    assert peak[0] >= 2  # they shared the batch, not took turns


def choices(base: str, payload: dict) -> tuple[list[str], list[int]]:
    """Each choice's text (by index), and the choice index of every content chunk in stream
    order (empty when not streamed)."""
    url = base + "/v1/chat/completions"
    if not payload.get("stream"):
        response = httpx.post(url, json=payload, timeout=300)
        assert response.status_code == 200, response.text
        return [c["message"]["content"] for c in response.json()["choices"]], []
    texts, order = [""] * payload["n"], []
    with httpx.stream("POST", url, json=payload, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if piece := choice["delta"].get("content"):
                        texts[choice["index"]] += piece
                        order.append(choice["index"])
    return texts, order


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11}])
def test_a_requests_choices_run_side_by_side_and_equal_each_alone(served, sampling):
    base, worker = served["base"], served["worker"]
    alone = [ask(base, body(PROMPTS[1], max_tokens=24, **(
        {**sampling, "seed": shifted_seed(sampling["seed"], i)} if sampling else {})))
        for i in range(3)]  # choice i of n is the request with seed + i
    payload = body(PROMPTS[1], max_tokens=24, n=3, **sampling)
    with peak_running(worker) as peak:
        whole, _ = choices(base, payload)
    assert peak[0] == 3  # one request's choices shared the batch, not took turns
    streamed, order = choices(base, {**payload, "stream": True})
    assert whole == streamed == alone
    assert sorted(set(order)) == [0, 1, 2]
    assert order != sorted(order)  # the choices' chunks came interleaved


def test_a_requests_choices_share_its_prompts_prefill(served, monkeypatch):
    base, engine = served["base"], served["worker"].engine
    chunks, prefill_many = [], engine.target.prefill_many

    def spy(caches, rows, **kw):
        chunks.extend(len(chunk) for chunk in rows)
        return prefill_many(caches, rows, **kw)

    monkeypatch.setattr(engine.target, "prefill_many", spy)
    prompt, sampling = "Describe a quiet harbour at dawn.", {"temperature": 0.9, "seed": 5}
    together, _ = choices(base, body(prompt, max_tokens=12, n=3, **sampling))
    # the first choice prefills the prompt; the others copy it and run its last token only
    assert sorted(chunks) == [1, 1, chunks[0]] and chunks[0] > 1
    monkeypatch.undo()
    alone = [ask(base, body(prompt, max_tokens=12, **{**sampling,
                                                       "seed": shifted_seed(5, i)}))
             for i in range(3)]
    assert together == alone


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_that_fails_fails_the_request_and_ends_the_others(served, monkeypatch,
                                                                   stream):
    base, worker = served["base"], served["worker"]
    engine, calls, ended = worker.engine, [], []
    new_decode = engine.new_decode

    def second_choice_refused(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise UserError("the second choice is refused")
        return new_decode(*args, **kw)

    monkeypatch.setattr(engine, "new_decode", second_choice_refused)
    observe = lambda job, result: ended.append(result)  # noqa: E731
    worker.observers.append(observe)
    try:
        payload = body(LONG, max_tokens=2000, n=2, stream=stream)
        if stream:
            with httpx.stream("POST", base + "/v1/chat/completions", json=payload,
                              timeout=300) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["message"] == "the second choice is refused"
        else:
            r = httpx.post(base + "/v1/chat/completions", json=payload, timeout=300)
            assert r.status_code == 400, r.text
            assert _error(r)["message"] == "the second choice is refused"
        _wait(lambda: len(ended) == 2 and worker.running == 0, "both choices to end",
              timeout=120)
    finally:
        worker.observers.remove(observe)
    first = next(result for result in ended if result is not None)
    assert first.finish_reason == "cancelled" and len(first.token_ids) < 2000


def test_a_client_that_leaves_frees_its_slot(served):
    base, worker = served["base"], served["worker"]
    previous = worker.last_result
    with httpx.stream("POST", base + "/v1/chat/completions",
                      json=body(LONG, max_tokens=2000, stream=True), timeout=300) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    _wait(lambda: worker.last_result is not previous and worker.running == 0,
          "the cancelled request to leave", timeout=60)
    assert worker.last_result.finish_reason == "cancelled"
    assert len(worker.last_result.token_ids) < 2000


def test_past_the_queue_a_request_gets_429_with_retry_after(served):
    base, worker = served["base"], served["worker"]
    url = base + "/v1/chat/completions"
    with ThreadPoolExecutor(1) as pool:
        with held_streams(url, 3):  # three long streams hold every slot
            _wait(lambda: worker.running == 3, "three running requests", timeout=60)
            queued = pool.submit(httpx.post, url, json=body(PROMPTS[0], max_tokens=4),
                                 timeout=300)
            _wait(lambda: worker.waiting == 1, "a queued request", timeout=60)
            assert "adaspark_requests_waiting 1.0" in httpx.get(base + "/metrics").text
            refused = httpx.post(url, json=body(PROMPTS[0], max_tokens=4))
            assert refused.status_code == 429
            assert refused.headers["retry-after"].isdigit()
            assert _error(refused)["code"] == "rate_limit_exceeded"
        # the three streams left: the queued request runs
        assert queued.result().status_code == 200
    assert worker.waiting == 0


@contextlib.contextmanager
def held_streams(url: str, n: int):
    """n streaming requests held open after their first chunk; closed (cancelled) on exit."""
    lines = []  # kept: a line iterator let go closes its connection (the client leaves)
    with httpx.Client(timeout=300) as client, contextlib.ExitStack() as stack:
        for i in range(n):
            response = stack.enter_context(client.stream(
                "POST", url, json=body(LONG, max_tokens=2000, stream=True, seed=i,
                                       temperature=1.0)))
            lines.append(response.iter_lines())
            next(lines[-1])
        yield
