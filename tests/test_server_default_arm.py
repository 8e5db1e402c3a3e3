"""The default arm (`adaspark,gate`, the shipped drafter) served to several clients at once over
real HTTP: each request drafts on its own slot's drafter, their rows share one verify call and
the row budget, their learned state is saved when the last running one ends (the saves of the
others wait). Every reply, streamed or not, equals the same request's reply from a server
running plain decoding (`ar`), token for token (text, token count, finish reason), and the
store on disk then holds every round the requests ran."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import _serving, _wait
from test_server_batching import peak_running

from adaspark.engine import Engine
from adaspark.model.sources import default_model_path
from adaspark.server import create_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
REQUESTS = [
    ({"content": f"Repeat exactly: {SENTENCE} {SENTENCE}"}, 48, False),
    ({"content": "Count from 1 to 30, separated by commas."}, 64, True),
    ({"content": "List the days of the week, twice."}, 40, False),
    ({"content": "Write a haiku about the sea."}, 32, True),
]


def payload(message: dict, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", **message}], "max_tokens": max_tokens,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


def ask(base: str, body: dict) -> tuple[str, int, str, dict]:
    """(text, completion tokens, finish reason, timings) of one reply, streamed or not."""
    url = base + "/v1/chat/completions"
    if not body["stream"]:
        response = httpx.post(url, json=body, timeout=600)
        assert response.status_code == 200, response.text
        reply = response.json()
        choice = reply["choices"][0]
        return (choice["message"]["content"], reply["usage"]["completion_tokens"],
                choice["finish_reason"], reply["timings"])
    text, finish, usage, timings, done = "", None, None, None, False
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
    assert done
    return text, usage["completion_tokens"], finish, timings


@pytest.fixture(scope="module")
def plain_replies():
    model_path = default_model_path(download=False)
    app = create_app(lambda: Engine.load(model_path, arm="ar"), model_id="m", parallel=1)
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        return [ask(base, payload(*r))[:3] for r in REQUESTS]


def rounds(timings: dict) -> int:
    return timings["draft_rounds"] + timings["plain_rounds"] + timings["ngram_rounds"]


def test_the_default_arm_under_concurrency_equals_ar_token_for_token(plain_replies, tmp_path):
    model_path = default_model_path(download=False)
    engine = Engine.load(model_path, store=tmp_path, fresh=True)  # the default arm
    assert engine.speculator is not None and engine.speculator.arm == "adaspark,gate"
    app = create_app(lambda: engine, model_id="m", parallel=len(REQUESTS))
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        replies = []
        with peak_running(app.state.worker) as peak:
            for _ in range(2):  # the second wave plans on what the first one learned
                with ThreadPoolExecutor(len(REQUESTS)) as pool:
                    replies += list(pool.map(lambda r: ask(base, payload(*r)), REQUESTS))
        assert [r[:3] for r in replies] == plain_replies * 2
        assert peak[0] >= 2  # they shared the batch, not took turns
        drafters = {id(slot.drafter) for slot in engine.batch.slots}
        assert len(engine.batch.slots) >= 2 and len(drafters) == len(engine.batch.slots)
        assert sum(r[3]["draft_rounds"] for r in replies) > 0  # the drafter drafted
        # once the server is idle (IDLE_SAVE_S), the save that waited runs: every round on disk
        sched, store = engine.speculator.scheduler, engine.speculator.store
        assert sched.rounds_learned == sum(rounds(r[3]) for r in replies)
        _wait(lambda: (store.load() or {}).get("rounds") == sched.rounds_learned,
              "the idle save")
        # a request's choices draft side by side, each on its own slot's drafter: greedy, each
        # equals the plain reply
        both = httpx.post(base + "/v1/chat/completions",
                          json={**payload(*REQUESTS[2]), "n": 2}, timeout=600)
        assert both.status_code == 200, both.text
        assert [c["message"]["content"] for c in both.json()["choices"]] == \
            [plain_replies[2][0]] * 2
