"""One failure ends one request, never the batch or the engine thread (batch.py, server/worker.py),
on the embedded model with the default arm (`adaspark,gate`, the shipped drafter), faults
injected into the real code paths: the step's price, the shared row budget and the shared
verify's learning raising (the speculator's hooks around the one verify call), one request's
own price raising, and a request whose failing raises again. Every request that did not fail
ends with the tokens of plain decoding (`ar`). A bug that escapes even the engine step's
catch-all stops the engine thread out loud: every admitted and queued request gets an error,
and /health answers 503 with a generic message."""

from __future__ import annotations

import httpx
import pytest
from test_batch_speculative import fresh_engine
from test_worker import gated_worker

from adaspark.engine import Engine
from adaspark.model.tokenizer import Tokenizer
from adaspark.server.worker import EngineStopped, Job
from adaspark.speculative import RoundDecode

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPTS = [
    [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
    [{"role": "user", "content": "List the days of the week, twice."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
CAPS = (24, 20, 16)


@pytest.fixture(scope="module")
def plain(fast_model, model_path):
    """`ar`: plain decoding on the same target, the reference every arm must equal."""
    return Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)


@pytest.fixture(scope="module")
def reference(plain):
    out = []
    for prompt, cap in zip(PROMPTS, CAPS, strict=True):
        plain.reset()
        out.append(plain.generate(prompt, max_tokens=cap).token_ids)
    plain.reset()
    return out


@pytest.fixture(scope="module")
def drafter(fast_model, model_path):
    from adaspark.drafter.loading import load_drafter

    return load_drafter(fast_model, model_path)


@pytest.fixture()
def engine(fast_model, model_path, drafter):
    """The default arm on a fresh scheduler and the shipped drafter."""
    yield from fresh_engine(fast_model, model_path, "adaspark,gate", drafter)


def run_together(engine, n: int = 3, **first):
    """The first n prompts in one batch (the first request with `first`'s extra kwargs), step
    by step until every one has ended; returns their Decodes."""
    engine.reset()
    engine.batch.max_slots = n
    seqs = [engine.new_decode(engine.tokenizer.encode_chat(p), max_tokens=cap,
                              **(first if i == 0 else {}))
            for i, (p, cap) in enumerate(zip(PROMPTS[:n], CAPS, strict=False))]
    assert all(isinstance(seq, RoundDecode) for seq in seqs)
    for seq in seqs:
        assert engine.batch.add(seq)
    ended = []
    for _ in range(10 * sum(CAPS) + 100):  # each step ends or advances every request
        if not engine.batch.running:
            break
        ended += engine.batch.step()
    assert not engine.batch.running
    assert sorted(map(id, ended)) == sorted(map(id, seqs))
    return seqs


def assert_plain(engine, seqs, reference, skip=()):
    for i, seq in enumerate(seqs):
        if i in skip:
            continue
        assert seq.error is None, seq.error
        assert engine.result(seq).token_ids == reference[i]


def broken(what: str):
    """A stand-in that raises; .calls counts its calls (a fault never hit tests nothing)."""
    def fail(*args, **kwargs):
        fail.calls += 1
        raise RuntimeError(f"injected: {what}")
    fail.calls = 0
    return fail


def test_a_step_price_that_raises_leaves_each_request_to_plan_alone(engine, reference,
                                                                    monkeypatch):
    spec, calls = engine.speculator, []
    step_price = spec.step_price

    def shared_fails(seqs):  # the price over several requests raises; alone it stands
        calls.append(len(seqs))
        if len(seqs) > 1:
            raise RuntimeError("injected: the step's price")
        return step_price(seqs)

    monkeypatch.setattr(spec, "step_price", shared_fails)
    seqs = run_together(engine)
    assert max(calls) == 3 and 1 in calls  # it raised beside others, then priced each alone
    assert_plain(engine, seqs, reference)


def test_one_requests_own_price_failing_fails_that_request_alone(engine, reference,
                                                                 monkeypatch):
    spec = engine.speculator
    step_price = spec.step_price
    bad = engine.tokenizer.encode_chat(PROMPTS[0])

    def fails_with_the_first(seqs):  # raises wherever the first request is priced
        if any(seq.prompt == bad for seq in seqs):
            raise RuntimeError("injected: the first request's price")
        return step_price(seqs)

    monkeypatch.setattr(spec, "step_price", fails_with_the_first)
    seqs = run_together(engine)
    assert "first request's price" in str(seqs[0].error)
    assert_plain(engine, seqs, reference, skip={0})


def test_a_row_budget_that_raises_verifies_every_plan_whole(engine, reference, monkeypatch):
    calls = []

    def share_fails(seqs, rows):
        calls.append(len(seqs))
        raise RuntimeError("injected: the shared row budget")

    monkeypatch.setattr(engine.batch, "before_verify", share_fails)
    seqs = run_together(engine)
    assert max(calls) == 3
    assert_plain(engine, seqs, reference)


def assert_fails_no_request(engine, reference, monkeypatch, owner, name: str) -> None:
    """owner.name raises wherever it is called: it was called, and every request still ends
    with plain decoding's tokens."""
    fault = broken(name)
    monkeypatch.setattr(owner, name, fault)
    seqs = run_together(engine)
    assert fault.calls > 0
    assert_plain(engine, seqs, reference)


def test_shared_learning_that_raises_fails_no_request(engine, reference, monkeypatch):
    assert_fails_no_request(engine, reference, monkeypatch, engine.speculator.scheduler,
                            "learn_shared_verify")


def test_a_request_whose_failing_raises_again_fails_alone_and_its_slot_is_retired(
        engine, reference, monkeypatch):
    engine.batch.max_slots = 3

    def on_text(text):  # the client's stream breaks...
        raise OSError("injected: the client's stream broke")

    first = engine.new_decode(engine.tokenizer.encode_chat(PROMPTS[0]), max_tokens=CAPS[0],
                              on_text=on_text)
    assert engine.batch.add(first)
    slot = first.slot
    reset = broken("forgetting the slot")
    monkeypatch.setattr(slot, "reset", reset)  # ...and failing it raises
    others = [engine.new_decode(engine.tokenizer.encode_chat(p), max_tokens=cap)
              for p, cap in zip(PROMPTS[1:], CAPS[1:], strict=True)]
    for seq in others:
        assert engine.batch.add(seq)
    while engine.batch.running:
        engine.batch.step()
    assert isinstance(first.error, OSError) and reset.calls > 0
    assert all(s is not slot for s in engine.batch.slots)  # never handed out again
    assert engine.speculator.running == 0  # its request ended on the scheduler too
    assert_plain(engine, [first, *others], reference, skip={0})


def test_the_default_arm_learns_on_after_a_refit_that_raises(engine, reference, monkeypatch):
    """The end of a request (its refit) raising is logged; the reply stands."""
    assert_fails_no_request(engine, reference, monkeypatch, engine.speculator.scheduler,
                            "refit")


def test_a_bug_past_the_step_catch_all_stops_the_engine_out_loud(engine, reference,
                                                                 monkeypatch):
    """Before: the engine thread died silently and every request waited forever."""
    worker, gate = gated_worker(engine, parallel=1, queue_limit=4)
    try:
        ids = engine.tokenizer.encode_chat(PROMPTS[0])
        running = worker.submit(Job(ids, 400, []))
        queued = worker.submit(Job(ids, 4, []))
        # the step raises, and so does its recovery (failing the running request)
        monkeypatch.setattr(engine.batch, "step", broken("a step"))
        monkeypatch.setattr(engine.batch, "drop", broken("the catch-all's recovery"))
        gate.set()
        for future in (running, queued):
            with pytest.raises(EngineStopped):
                future.result(timeout=300)
        assert worker.fault and "restart" in worker.fault
        with pytest.raises(EngineStopped):
            worker.submit(Job(ids, 4, [])).result(timeout=10)
    finally:
        worker.close()


def test_health_answers_503_once_the_engine_stopped(engine, monkeypatch):
    from test_server import _error, _serving, _wait

    from adaspark.server import create_app

    app = create_app(lambda: engine, model_id="m")
    with _serving(app) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        monkeypatch.setattr(engine.batch, "step", broken("a step with a secret /path"))
        monkeypatch.setattr(engine.batch, "drop", broken("the catch-all's recovery"))
        reply = httpx.post(base + "/v1/chat/completions",
                           json={"messages": PROMPTS[2], "max_tokens": 4}, timeout=300)
        # the request that was running when the engine stopped: the same 503 as a later one
        assert reply.status_code == 503 and "secret" not in reply.text
        assert "restart" in _error(reply)["message"]
        health = httpx.get(base + "/health")
        assert health.status_code == 503
        assert "restart" in _error(health)["message"] and "secret" not in health.text
        later = httpx.post(base + "/v1/chat/completions",
                           json={"messages": PROMPTS[2], "max_tokens": 4}, timeout=60)
        assert later.status_code == 503
