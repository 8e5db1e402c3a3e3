"""/metrics and /v1/adaspark/state over real HTTP, on the embedded model with the default arm
(adaspark,gate) from an empty learned store, behind an API key: the metrics move as requests
run, and the state is the scheduler's own snapshot."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import _serving, _wait

from adaspark.server import create_app
from adaspark.server.metrics import KINDS, SOURCES

pytestmark = pytest.mark.slow

KEY = "watch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COPY = [{"role": "user", "content": "Repeat exactly: The quick brown fox jumps over the lazy "
         "dog. The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """The embedded model served behind KEY, from an empty store (also the browser test's)."""
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path

    model_path = default_model_path(download=False)
    stores = tmp_path_factory.mktemp("stores")
    # one slot: a second request waits (the queue gauge test), whatever the machine's default
    app = create_app(lambda: Engine.load(model_path, arm="adaspark,gate", store=stores,
                                         fresh=True), model_id=model_path.stem, api_key=KEY,
                     parallel=1)
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
        yield {"base": base, "app": app, "client": client}


@pytest.fixture(scope="module")
def served(keyed_server):
    return keyed_server


def scrape(base: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    response = httpx.get(base + "/metrics", headers=AUTH)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def total(samples, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == x for k, x in match.items()))


def delta(before, after, name: str, **match: str) -> float:
    return total(after, name, **match) - total(before, name, **match)


def test_metrics_move_as_requests_run(served):
    base, client = served["base"], served["client"]
    before = scrape(base)
    reply = client.chat.completions.create(model="m", messages=COPY, max_tokens=24)
    after = scrape(base)
    t = reply.model_extra["timings"]
    rounds = t["draft_rounds"] + t["plain_rounds"] + t["ngram_rounds"]
    assert rounds > 0
    finish = reply.choices[0].finish_reason
    assert delta(before, after, "adaspark_requests_total", finish_reason=finish) == 1
    assert delta(before, after, "adaspark_prompt_tokens_total") == reply.usage.prompt_tokens
    assert delta(before, after, "adaspark_completion_tokens_total") == \
        reply.usage.completion_tokens
    assert delta(before, after, "adaspark_decode_tokens_total") == t["decode_tokens"]
    assert delta(before, after, "adaspark_decode_seconds_total") == pytest.approx(t["decode_s"])
    assert delta(before, after, "adaspark_rounds_total") == rounds
    # histograms: one observation per round, summing to the request's own counts
    assert delta(before, after, "adaspark_round_verified_rows_count") == rounds
    assert delta(before, after, "adaspark_round_verified_rows_sum") == t["verified_rows"]
    assert delta(before, after, "adaspark_round_accepted_tokens_count") == rounds
    assert delta(before, after, "adaspark_round_accepted_tokens_sum") >= t["accepted_tokens"]
    assert delta(before, after, "adaspark_round_verified_rows_bucket", le="+Inf") == rounds
    assert delta(before, after, "adaspark_verify_seconds_count") == rounds
    assert delta(before, after, "adaspark_draft_seconds_count") == rounds
    assert delta(before, after, "adaspark_verify_seconds_sum") > 0
    assert delta(before, after, "adaspark_accepted_tokens_total") == \
        delta(before, after, "adaspark_round_accepted_tokens_sum")
    # the request's save waits for the server's first idle moment (IDLE_SAVE_S), then runs once
    _wait(lambda: delta(before, scrape(base), "adaspark_store_saves_total") == 1,
          "the idle save")
    # acceptance by block position: a round that accepted k tokens reached positions 1..k
    assert delta(before, after, "adaspark_block_position_accepted_total") == \
        delta(before, after, "adaspark_round_accepted_tokens_sum")
    assert delta(before, after, "adaspark_block_position_verified_total", position="1") >= \
        delta(before, after, "adaspark_block_position_accepted_total", position="1")
    for kind in KINDS:  # a label per kind, from the start
        assert ("adaspark_rounds_total", (("kind", kind),)) in after
    for source in SOURCES:
        assert ("adaspark_accepted_tokens_total", (("source", source),)) in after
    assert after[("adaspark_requests_running", ())] == 0
    assert after[("adaspark_requests_waiting", ())] == 0


def test_probe_rounds_and_widths_by_label(served):
    base, client = served["base"], served["client"]
    for _ in range(2):
        client.chat.completions.create(model="m", messages=COPY, max_tokens=24)
    samples = scrape(base)
    # from an empty store the cost model first measures its ladder: probe rounds, at its widths
    # (kinds and gate decisions on a scheduler past its probes: test_metrics.py)
    assert total(samples, "adaspark_rounds_total", kind="probe") >= 3
    widths = {dict(labels)["width"] for (name, labels) in samples
              if name == "adaspark_verify_seconds_count"}
    assert {"2", "4"} <= widths
    assert total(samples, "adaspark_verify_seconds_count", width="2") >= 3
    assert total(samples, "adaspark_predicted_accepted_tokens_total") > 0


def test_streamed_requests_count_and_the_queue_gauges_move(served):
    base, client = served["base"], served["client"]
    before = scrape(base)
    # a reply that runs to its cap (seconds), so it is still running when the client leaves
    count = [{"role": "user", "content": "Write the numbers from 1 to 3000, separated by commas."}]
    stream = client.chat.completions.create(model="m", messages=count, max_tokens=2000,
                                            stream=True)
    next(iter(stream))  # the engine is running it now
    assert scrape(base)[("adaspark_requests_running", ())] == 1
    queued = threading.Thread(target=client.chat.completions.create,
                              kwargs={"model": "m", "messages": COPY, "max_tokens": 2})
    queued.start()
    _wait(lambda: scrape(base)[("adaspark_requests_waiting", ())] == 1, "a queued request",
          timeout=60)
    stream.close()  # cancels the streamed request; the queued one then runs
    queued.join(timeout=300)
    _wait(lambda: scrape(base)[("adaspark_requests_running", ())] == 0, "the engine to idle")
    after = scrape(base)
    assert after[("adaspark_requests_waiting", ())] == 0
    assert delta(before, after, "adaspark_requests_total", finish_reason="cancelled") == 1
    assert delta(before, after, "adaspark_requests_total") == 2


def test_state_is_the_schedulers_own_snapshot(served):
    base, client, app = served["base"], served["client"], served["app"]
    client.chat.completions.create(model="m", messages=COPY, max_tokens=16)
    state = httpx.get(base + "/v1/adaspark/state", headers=AUTH).json()
    scheduler = app.state.worker.engine.speculator.scheduler
    # the engine is idle: the snapshot published after the request is the scheduler now
    assert state["scheduler"] == json.loads(json.dumps(scheduler.snapshot()))
    assert state["arm"] == "adaspark,gate" and state["ready"]
    snap = state["scheduler"]
    assert snap["rounds"] == sum(scheduler.width_rounds.values()) > 0
    assert [k["top"] for k in snap["cost"]["classes"]] == scheduler.cost.widths
    assert sum(b["count"] for b in snap["acceptance"]["calibration"]) == \
        int(scheduler.acceptance.calibration[0].sum()) > 0
    samples = scrape(base)
    served_totals = state["served"]
    assert served_totals["requests"] == total(samples, "adaspark_requests_total")
    assert served_totals["rounds"] == {k: total(samples, "adaspark_rounds_total", kind=k)
                                       for k in KINDS}
    assert len(state["history"]) == total(samples, "adaspark_requests_total",
                                          finish_reason="stop") + \
        total(samples, "adaspark_requests_total", finish_reason="length") + \
        total(samples, "adaspark_requests_total", finish_reason="cancelled")
    # the dashboard reads the same document; without the key, neither answers
    data = httpx.get(base + "/dashboard/data", headers=AUTH).json()
    assert data["scheduler"] == state["scheduler"]
    assert httpx.get(base + "/v1/adaspark/state").status_code == 401
    assert httpx.get(base + "/dashboard/data").status_code == 401
