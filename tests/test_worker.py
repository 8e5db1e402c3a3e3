"""The server's engine thread (server/worker.py) on the real model: queued requests join the
running batch a prefill budget at a time, a full queue refuses, a request cancelled while queued
never reaches the engine, and close() ends the running ones and drops the queued ones."""

from __future__ import annotations

import threading

import pytest

from adaspark.engine import Engine
from adaspark.model.tokenizer import Tokenizer
from adaspark.server.worker import PREFILL_PER_STEP, Cancelled, EngineWorker, Job, QueueFull

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

LONG = [(37 * i) % 9000 + 100 for i in range(300)]  # 300 in-vocabulary ids


@pytest.fixture()
def engine(fast_model, model_path):
    engine = Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)
    engine.reset()
    yield engine
    engine.reset()


def gated_worker(engine, **kw):
    """A worker whose engine loads when the gate opens, so jobs can queue up first (the wait
    only bounds a test that never opens it). Returns (worker, gate)."""
    gate = threading.Event()

    def load():
        gate.wait(timeout=300)
        return engine

    return EngineWorker(load, **kw), gate


def test_queued_requests_join_a_prefill_budget_at_a_time(engine):
    assert 2 * len(LONG) > PREFILL_PER_STEP > len(LONG)
    widths = []
    verify_many = engine.target.verify_many

    def spy(caches, rows, **kw):  # the rows of each step's one forward
        widths.append(len(rows))
        return verify_many(caches, rows, **kw)

    engine.target.verify_many = spy
    try:
        worker, gate = gated_worker(engine, parallel=3)
        jobs = [Job([*LONG[i:], *LONG[:i]], 4, []) for i in range(3)]
        futures = [worker.submit(job) for job in jobs]
        assert worker.waiting == 3
        gate.set()
        results = [f.result(timeout=120) for f in futures]
    finally:
        del engine.target.verify_many
        worker.close()
    # two prompts spend the step's budget, the third joins at the next step
    assert widths[:2] == [2, 3]
    assert all(len(r.token_ids) == 4 for r in results)
    assert worker.waiting == 0 and worker.running == 0


def test_a_full_queue_refuses_and_a_cancelled_job_never_runs(engine):
    worker, gate = gated_worker(engine, parallel=1, queue_limit=1)
    seen = []
    worker.observers.append(lambda job, result: seen.append((job, result)))
    try:
        kept, dropped = Job(LONG[:20], 2, []), Job(LONG[:30], 2, [])
        first, second = worker.submit(kept), worker.submit(dropped)
        with pytest.raises(QueueFull):
            worker.submit(Job(LONG[:10], 2, []))
        dropped.cancel.set()
        gate.set()
        assert len(first.result(timeout=120).token_ids) == 2
        with pytest.raises(Cancelled):
            second.result(timeout=120)
    finally:
        worker.close()
    assert (dropped, None) in seen and any(job is kept and r is not None for job, r in seen)
    assert engine.cache.ids[:20] == LONG[:20]  # the dropped one never reached the engine


def test_close_ends_the_running_and_drops_the_queued(engine):
    worker, gate = gated_worker(engine, parallel=1)
    running = worker.submit(Job(LONG[:20], 400, []))
    queued = worker.submit(Job(LONG[:30], 200, []))
    gate.set()
    while worker.running == 0:
        threading.Event().wait(0.01)
    worker.close()
    assert running.result(timeout=120).finish_reason == "cancelled"
    with pytest.raises(Cancelled):
        queued.result(timeout=120)


def test_serve_refuses_a_parallel_or_queue_below_one(capsys):
    from adaspark.cli import main

    for flag in ("--parallel", "--queue"):
        assert main(["serve", flag, "0", "--port", "1"]) == 2
        assert f"{flag} must be at least 1" in capsys.readouterr().err


def test_a_future_given_up_while_queued_is_dropped_and_the_worker_serves_on(engine):
    worker, gate = gated_worker(engine, parallel=1)
    seen = []
    worker.observers.append(lambda job, result: seen.append((job, result)))
    try:
        first, given_up = Job(LONG[:20], 2, []), Job(LONG[:30], 2, [])
        futures = [worker.submit(first), worker.submit(given_up)]
        assert futures[1].cancel()  # what asyncio.wrap_future does when its awaiter goes
        gate.set()
        assert len(futures[0].result(timeout=120).token_ids) == 2
        later = worker.submit(Job(LONG[:40], 2, []))
        assert len(later.result(timeout=120).token_ids) == 2
    finally:
        worker.close()
    assert [result for job, result in seen if job is given_up] == [None]  # it never ran


def test_a_requests_choices_fill_only_slots_no_other_request_waits_for(engine):
    """A request's n choices are n jobs under one place: they never run past the batch's
    slots, and a later request gets a slot before the request's second choice does."""
    worker, gate = gated_worker(engine, parallel=2)
    order, peak = [], [0]
    new_decode, step = engine.new_decode, engine.batch.step

    def spy_decode(prompt, **kw):
        order.append(kw["request_id"])
        return new_decode(prompt, **kw)

    def spy_step():
        peak[0] = max(peak[0], len(engine.batch.running))
        return step()

    engine.new_decode, engine.batch.step = spy_decode, spy_step
    try:
        many = worker.reserve()
        futures = [many.submit(Job(LONG[:20], 3, [], request_id="many", cancel=many.cancel))
                   for _ in range(4)]
        futures.append(worker.submit(Job(LONG[:30], 3, [], request_id="later")))
        gate.set()
        results = [f.result(timeout=120) for f in futures]
        many.release()
    finally:
        del engine.new_decode, engine.batch.step
        worker.close()
    assert order == ["many", "later", "many", "many", "many"]
    assert peak[0] == 2  # two choices ran side by side, never more than the slots
    assert all(len(r.token_ids) == 3 for r in results)
