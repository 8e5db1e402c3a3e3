"""Speculative rounds under continuous batching (speculative.RoundDecode in batch.py's Batch) on the
embedded model, arm `ngram` and the drafting arms (`adaspark,gate`, `adaspark`, with the shipped
drafter): every running request plans its own tree on the one shared scheduler (drafting on its
own slot's drafter), all their rows go through one verify call per step (tapping the drafter's
layers), each accepts and commits its own path to its target and drafter caches. A request's
tokens equal its solo run's (Engine.generate: a batch of one) token for token, greedy and
seeded, joining and leaving at any step; cancellation and a failing request end alone; the
shared scheduler learns from every request's rounds; the server's worker batches the arms."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import numpy as np
import pytest
import torch
from test_speculative import make_engine
from test_worker import gated_worker

from adaspark import speculative
from adaspark.drafter.loading import load_drafter
from adaspark.model.tokenizer import Tokenizer
from adaspark.sampling import SamplingParams
from adaspark.scheduler.budget import StepPrice, allocate
from adaspark.scheduler.chooser import BandRate
from adaspark.server.worker import Job, QueueFull
from adaspark.speculative import RoundDecode, Speculator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."
PROMPTS = [
    [{"role": "user", "content": f"Repeat exactly: {SENTENCE} {SENTENCE}"}],
    [{"role": "user", "content": "List the days of the week, twice."}],
    [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=5, frequency_penalty=0.3,
                         logprobs=True)


def fresh_engine(fast_model, model_path, arm: str, drafter=None):
    """A fixture's engine (`yield from` it): `arm` on a fresh scheduler, so what it learns is
    the test's (test_speculative.make_engine); after the test, one slot and an empty cache."""
    engine = make_engine((fast_model, Tokenizer.from_gguf(model_path), drafter, model_path), arm)
    yield engine
    engine.batch.max_slots = 1
    engine.reset()


@pytest.fixture()
def engine(fast_model, model_path):
    """Arm `ngram` (no drafter) on a fresh scheduler, so what it learns is this test's."""
    yield from fresh_engine(fast_model, model_path, "ngram")


DRAFTING = ("adaspark,gate", "adaspark")


@pytest.fixture(scope="module")
def drafter(fast_model, model_path):
    """The shipped drafter on the target's build (the native draft where the target has one)."""
    return load_drafter(fast_model, model_path)


@pytest.fixture(params=DRAFTING)
def drafting(request, fast_model, model_path, drafter):
    """A drafting arm on a fresh scheduler and the shipped drafter."""
    yield from fresh_engine(fast_model, model_path, request.param, drafter)


def solo(engine, prompt, **kw):
    """The request alone, from an empty cache, through Engine.generate (a batch of one)."""
    engine.reset()
    return engine.generate(prompt, **kw)


def a_slot_each(engine):
    """An on_step check for together(): after each step, no two running requests share a slot,
    and each running request's slot holds its prompt and exactly its committed ids. (A request
    that ended may hand its slot to a later one: its prompt prefix is worth reusing.)"""
    def check(step: int) -> None:
        running = [seq for seq in engine.batch.running if not seq.prefilling]
        assert len({id(seq.slot) for seq in running}) == len(running)
        for seq in running:
            assert seq.slot.kv.length == len(seq.slot.ids)
            assert seq.slot.ids[:len(seq.prompt)] == seq.prompt
    return check


def together(engine, requests, joins=None, on_step=None):
    """The requests (new_decode kwargs, "messages" for the prompt) in one batch from empty
    slots; request i joins at step joins[i]. Returns their Decodes and each verify call's rows
    per sequence."""
    engine.reset()
    engine.batch.max_slots = len(requests)
    joins = joins or [0] * len(requests)
    seqs = [engine.new_decode(engine.tokenizer.encode_chat(r.pop("messages")), **r)
            for r in requests]
    assert all(isinstance(seq, RoundDecode) for seq in seqs)
    calls: list[list[int]] = []
    verify_many = engine.target.verify_many

    def spy(caches, rows, **kw):  # each call's rows per sequence; runs the real one
        calls.append([len(r[0]) for r in rows])
        return verify_many(caches, rows, **kw)

    engine.target.verify_many = spy
    step, ended = 0, []
    try:
        while step <= max(joins) or engine.batch.running:
            for seq, join in zip(seqs, joins, strict=True):
                if join == step:
                    assert engine.batch.add(seq)
            before = len(calls)
            ended += engine.batch.step()
            assert len(calls) - before <= 1  # every running request's rows in one call
            if on_step is not None:
                on_step(step)
            step += 1
    finally:
        del engine.target.verify_many
    assert sorted(map(id, ended)) == sorted(map(id, seqs))  # each step() reports who ended
    return seqs, calls


@contextlib.contextmanager
def planned_rows(sched):
    """Yields the list of the rows of every round sched plans meanwhile."""
    rows: list[int] = []
    plan_round = sched.plan_round

    def spy(*args, **kwargs):
        plan = plan_round(*args, **kwargs)
        rows.append(plan.rows)
        return plan

    sched.plan_round = spy
    try:
        yield rows
    finally:
        del sched.plan_round


def same(got, want):
    return (got.token_ids, got.text, got.finish_reason, got.stop_token_id) == (
        want.token_ids, want.text, want.finish_reason, want.stop_token_id)


def test_a_request_alone_runs_its_rounds_as_steps_of_a_batch_of_one(engine):
    """Engine.generate decodes a speculative arm as the server does: a RoundDecode in the
    engine's batch, one round a Batch.step and one verify_many call each, the first step after
    the prompt's prefill (a prompt shorter than a chunk prefills as it joins). Its timing counts
    every round the round hook saw."""
    assert not hasattr(Speculator, "decode")  # no second loop beside the batch's
    steps, calls, traces = [], [], []
    batch_step, verify_many = engine.batch.step, engine.target.verify_many
    engine.batch.step = lambda: steps.append(1) or batch_step()
    engine.target.verify_many = lambda caches, rows, **kw: (
        calls.append([len(r[0]) for r in rows]) or verify_many(caches, rows, **kw))
    engine.speculator.round_hook = traces.append
    try:
        gen = solo(engine, PROMPTS[0], max_tokens=24)
    finally:
        del engine.batch.step, engine.target.verify_many
    t = gen.timings
    rounds = t.draft_rounds + t.plain_rounds + t.ngram_rounds
    assert rounds == len(traces) == len(steps) == len(calls) > 0
    assert all(len(c) == 1 for c in calls)  # alone in every call
    assert t.verified_rows == sum(sum(c) for c in calls) == sum(tr.plan.rows for tr in traces)
    produced = len(gen.token_ids) + (gen.stop_token_id is not None)
    assert t.decode_tokens == produced - 1 == sum(len(tr.emitted) for tr in traces)
    assert not engine.batch.running and engine.speculator.running == 0
    assert engine.cache.ids == gen.prompt_token_ids + gen.token_ids  # the engine's own slot


def test_a_request_s_decode_time_starts_after_its_ngram_index(engine, monkeypatch):
    """The prompt's n-gram index is prompt work (docs/round.md): neither in the reply's decode
    time (decode tok/s) nor in its prefill's. A clock that jumps 1000 s while the index is
    built shows it, whatever the machine's speed."""
    real, jump = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + jump[0])
    sched = engine.speculator.scheduler
    begin = sched.begin_request
    monkeypatch.setattr(sched, "begin_request",
                        lambda *a, **kw: jump.__setitem__(0, jump[0] + 1000.0) or begin(*a, **kw))
    gen = solo(engine, PROMPTS[1], max_tokens=8)
    assert jump[0] == 1000.0 and gen.timings.decode_tokens > 0
    assert 0.0 < gen.timings.decode_s < 1000.0 and gen.timings.prefill_s < 1000.0


def test_greedy_rounds_beside_others_equal_their_solo_runs(engine):
    caps = (40, 32, 24, 16)
    want = [solo(engine, p, max_tokens=n) for p, n in zip(PROMPTS, caps, strict=True)]
    traces: list = []
    engine.speculator.round_hook = traces.append
    with planned_rows(engine.speculator.scheduler) as planned:
        seqs, calls = together(engine, [{"messages": p, "max_tokens": n}
                                        for p, n in zip(PROMPTS, caps, strict=True)],
                               joins=[0, 0, 3, 6], on_step=a_slot_each(engine))
    got = [engine.result(seq) for seq in seqs]
    assert all(same(g, w) for g, w in zip(got, want, strict=True))
    # they ran side by side: the two of step 0 share its call whatever they accept (a round
    # may take up to 33 tokens, so whether a later one finds them still running varies)
    assert max(len(c) for c in calls) >= 2
    # a round took >1 token where trees were verified (whether rounds plan them is the
    # chooser's call on the costs this CPU taught it: on Zen 5's AVX2 build, where a row is
    # dear, none did; and the shared row budget may cut a planned tree to its plain row)
    if max(planned) > 1 and any(n > 1 for call in calls for n in call):
        assert max(len(t.emitted) for t in traces) >= 3
        assert sum(g.timings.ngram_rounds for g in got) > 0
        assert sum(g.timings.accepted_tokens for g in got) > 0


def test_seeded_sampling_beside_others_equals_its_solo_run(engine):
    want = [solo(engine, PROMPTS[0], max_tokens=24, sampling=SAMPLED),
            solo(engine, PROMPTS[1], max_tokens=16),
            solo(engine, PROMPTS[3], max_tokens=16, sampling=SAMPLED)]
    seqs, _ = together(engine, [
        {"messages": PROMPTS[0], "max_tokens": 24, "sampling": SAMPLED},
        {"messages": PROMPTS[1], "max_tokens": 16},
        {"messages": PROMPTS[3], "max_tokens": 16, "sampling": SAMPLED}], joins=[0, 2, 4])
    got = [engine.result(seq) for seq in seqs]
    assert all(same(g, w) for g, w in zip(got, want, strict=True))
    assert got[0].logprobs == want[0].logprobs and got[0].seed == want[0].seed
    assert [e["id"] for e in got[2].logprobs] == got[2].token_ids


def test_a_cancelled_request_frees_its_slot_at_the_next_step(engine):
    want = [solo(engine, p, max_tokens=24) for p in PROMPTS[:2]]
    stop = threading.Event()
    running = []
    seqs, _ = together(engine, [{"messages": PROMPTS[0], "max_tokens": 24},
                                {"messages": PROMPTS[2], "max_tokens": 200,
                                 "should_stop": stop.is_set},
                                {"messages": PROMPTS[1], "max_tokens": 24}],
                       on_step=lambda step: (stop.set() if step == 4 else None,
                                             running.append(len(engine.batch.running))))
    cancelled = engine.result(seqs[1])
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < 200
    assert seqs[1] not in engine.batch.running and running[5] == 2  # gone at the next step
    assert seqs[1].request.anchor is None  # the scheduler ended its request
    assert same(engine.result(seqs[0]), want[0]) and same(engine.result(seqs[2]), want[1])


def test_a_failing_request_fails_alone(engine):
    want = solo(engine, PROMPTS[0], max_tokens=24)

    def broken(text):
        raise OSError("the client's stream broke")

    seqs, _ = together(engine, [{"messages": PROMPTS[0], "max_tokens": 24},
                                {"messages": PROMPTS[1], "max_tokens": 24, "on_text": broken}])
    assert isinstance(seqs[1].error, OSError) and seqs[1].request.anchor is None
    assert seqs[1].slot.ids == [] and seqs[1].slot.kv.length == 0  # its slot forgot the round
    assert seqs[0].error is None and same(engine.result(seqs[0]), want)


def test_the_shared_scheduler_learns_from_every_requests_rounds(engine):
    sched = engine.speculator.scheduler
    solo(engine, PROMPTS[0], max_tokens=24)  # measures the plain step the arm starts from
    rows4 = next(k for k in sched.cost.classes if k.top == 4).law.samples
    records: list[dict] = []
    engine.speculator.observers.append(lambda row, plan: records.append(row))
    rounds_before = sum(sched.width_rounds.values())
    seqs, calls = together(engine, [{"messages": p, "max_tokens": 24, "request_id": f"r{i}"}
                                    for i, p in enumerate(PROMPTS)])
    counted = [s.timing.plain_rounds + s.timing.ngram_rounds for s in seqs]
    assert [sum(r["request"] == f"r{i}" for r in records) for i in range(4)] == counted
    assert sum(sched.width_rounds.values()) - rounds_before == sum(counted)
    assert all(c > 0 for c in counted)
    # the calls of four plain rows taught the 4-row class's price (the call's total rows)
    four_plain = sum(c == [1, 1, 1, 1] for c in calls[1:])
    assert four_plain > 0
    assert next(k for k in sched.cost.classes if k.top == 4).law.samples > rows4
    assert all(seq.request.anchor is None for seq in seqs) and sched.request is None


def held_rate(tokens: float, time_ms: float) -> BandRate:
    """A long-run rate that the step's rounds leave as it is, so it holds for the test."""
    rate = BandRate()
    rate.tokens, rate.time, rate.rounds = tokens, time_ms, 10**6
    rate.observe = lambda tokens, round_ms: None
    return rate


def test_the_shared_row_budget_cuts_trees_under_a_high_rate_and_keeps_them_at_zero(
        engine, monkeypatch):
    caps = (40, 32, 24)
    want = [solo(engine, p, max_tokens=n) for p, n in zip(PROMPTS[:3], caps, strict=True)]
    sched, spec = engine.speculator.scheduler, engine.speculator
    cut, cuts = sched.cut, []
    sched.cut = lambda plan, keep, **kw: cuts.append((plan.rows, keep)) or cut(plan, keep, **kw)
    totals = []  # each shared call: (its step's price table, the rows it verified, its requests)
    allocations = []  # each shared call's allocate(): (candidates, step_ms, rate, shares)

    def spy_allocate(candidates, step_ms, rate, cap=None):
        shares = allocate(candidates, step_ms, rate, cap)
        allocations.append((candidates, step_ms, rate, shares))
        return shares

    monkeypatch.setattr(speculative, "allocate", spy_allocate)

    def share(seqs, rows):
        before = len(allocations)
        out = spec.share_rows(seqs, rows)
        if len(allocations) > before:  # each tree verifies the rows of its share
            candidates, _, _, shares = allocations[-1]
            assert all(len(o[0]) == 1 + k if k < len(q) else o is r
                       for o, r, q, k in zip(out, rows, candidates, shares, strict=True))
        if seqs[0].step is not None:
            totals.append((seqs[0].step.prices, sum(len(r[0]) for r in out), len(seqs)))
        return out

    engine.batch.before_verify = share

    def run(tokens: float, time_ms: float):
        spec.step_rate = held_rate(tokens, time_ms)
        cuts.clear()
        totals.clear()
        allocations.clear()
        seqs, calls = together(engine, [{"messages": p, "max_tokens": n}
                                        for p, n in zip(PROMPTS[:3], caps, strict=True)])
        assert all(same(engine.result(s), w) for s, w in zip(seqs, want, strict=True))
        # no call verified a total past the measured classes other than a class's top
        assert totals and all(np.isfinite(prices[t]) for prices, t, _ in totals)
        # whether some shared step priced a total past its plain rows (which totals have
        # prices depends on the wall-clock costs learned before: on a CPU whose extra rows
        # are dear, e.g. Zen 5 on the AVX2 build, none may be)
        return calls, any(np.isfinite(prices[n + 1:]).any() for prices, _, n in totals)

    def extra_rows(calls) -> float:  # rows past the plain ones, per shared call
        shared = [c for c in calls if len(c) > 1]
        return sum(sum(c) - len(c) for c in shared) / len(shared)

    high_rate = 1e12
    try:
        # tokens per ms that only a free row pays for (the price of the class that holds the
        # plain rows already): every planned tree is cut (beside others a round may also
        # decline to plan one at this rate, so whether a cut happens depends on what the
        # shared models learned before)
        run(high_rate, 1.0)
        assert all(keep < rows - 1 for rows, keep in cuts)
        # a rate of zero: every planned candidate pays, each request verifies its own plan
        # but for the candidates that would take the call to a total no price allows
        spec.plain_floor = False  # (else the rate is at least the plain step's)
        with planned_rows(sched) as planned:
            zero, priced = run(0.0, 1e12)
        # each step's allocation against the same step at the high rate (the two runs plan
        # different trees, as the shared models learn between them: compare on one step's
        # candidates and prices): the call takes the largest total a price allows, and no
        # request keeps fewer candidates than the high rate would leave it
        for candidates, step_ms, rate, shares in allocations:
            assert rate == 0.0
            q = np.sort(np.concatenate([np.asarray(c, dtype=np.float64) for c in candidates]))
            q = q[::-1][q[::-1] > 0.0]  # the useful candidates best-first, as allocate sums them
            S = np.concatenate([[0.0], np.cumsum(q)])
            n = len(candidates)
            largest = max(k for k in range(len(q) + 1) if np.isfinite(step_ms(n + k)))
            # (candidates past it that add nothing to the float sum may stay out: ties go to
            # fewer rows)
            assert sum(shares) <= largest and S[sum(shares)] == S[largest]
            high = allocate(candidates, step_ms, high_rate)
            assert all(z >= h for z, h in zip(shares, high, strict=True))
        # where a total past the plain rows had a price and a round planned a tree (the
        # chooser's call on this CPU's costs), some shared call verified tree rows
        if priced and max(planned) > 1:
            assert extra_rows(zero) > 0
    finally:
        spec.plain_floor = True
        del sched.cut
        engine.batch.before_verify = spec.share_rows


def test_the_worker_batches_the_ngram_arm(engine):
    want = [solo(engine, p, max_tokens=16).token_ids for p in PROMPTS[:3]]
    engine.reset()
    widths = []
    verify_many = engine.target.verify_many

    def spy(caches, rows, **kw):
        widths.append(len(rows))
        return verify_many(caches, rows, **kw)

    engine.target.verify_many = spy
    worker, gate = gated_worker(engine, parallel=3, queue_limit=0)
    try:
        jobs = [Job(engine.tokenizer.encode_chat(p), 16, []) for p in PROMPTS[:3]]
        futures = [worker.submit(job) for job in jobs]
        with pytest.raises(QueueFull):  # 3 running + 0 waiting: a fourth is refused
            worker.submit(Job([1, 2, 3], 4, []))
        gate.set()
        results = [f.result(timeout=300) for f in futures]
    finally:
        del engine.target.verify_many
        worker.close()
    assert [r.token_ids for r in results] == want
    assert max(widths) == 3  # the three ran side by side


# --- the drafting arms -------------------------------------------------------------------------
def drafted_beside_others(engine) -> list:
    """A round hook: the drafted rounds of a step that ran two or more requests, as (rows,
    tokens the reply took)."""
    rounds: list = []

    def hook(trace):
        if trace.plan.drafted and trace.plan.rows > 1 and len(engine.batch.running) > 1:
            rounds.append((trace.plan.rows, len(trace.emitted)))

    engine.speculator.round_hook = hook
    return rounds


def assert_slots_aligned(engine) -> None:
    """Every slot has its own drafter, as long as its target cache and its ids."""
    slots = engine.batch.slots
    assert len({id(slot.drafter) for slot in slots}) == len(slots)
    for slot in slots:
        assert slot.drafter.length == slot.kv.length == len(slot.ids)


def assert_verify_many_is_each_verify_alone(target, taps=(1, 14, 27)) -> None:
    caches = [target.new_cache() for _ in range(3)]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    rows = [([5, 6], [0, 1], [[True, False], [True, True]]), ([9], [0], [[True]]),
            ([17, 18, 19], [0, 1, 1], [[True, False, False], [True, True, False],
                                       [True, False, True]])]
    for cache, prompt in zip(caches, prompts, strict=True):
        with target.using(cache):
            target.prefill(prompt[:-1])
    out = target.verify_many(caches, rows, tap_layers=taps, return_logits=True)
    assert sorted(out.hiddens) == list(taps)
    at = 0
    for cache, (tokens, depths, mask) in zip(caches, rows, strict=True):
        with target.using(cache):
            alone = target.verify(tokens, depths, mask, taps, return_logits=True)
        n, at = len(tokens), at + len(tokens)
        for layer in taps:
            assert torch.equal(out.hiddens[layer][at - n:at], alone.hiddens[layer])
        assert torch.equal(out.argmax[at - n:at], alone.argmax)
        assert torch.equal(out.logits[at - n:at], alone.logits)


def test_verify_many_taps_each_sequences_rows_as_its_verify_alone(fast_model, monkeypatch):
    """The drafters' features come from verify_many's hiddens: every sequence's rows (taps,
    argmax, logits) bit-identical to its verify alone over its own cache; also where the
    kernel table runs a sequence's width on another kernel than the native forward."""
    if fast_model.native is None:
        pytest.skip("no native forward here")
    assert_verify_many_is_each_verify_alone(fast_model)
    native = fast_model.kernels.choose(1)
    monkeypatch.setattr(fast_model.kernels, "best", {2: native})  # 3 rows: bf16 alone
    monkeypatch.setattr(fast_model.kernels, "wide", "bf16")
    assert fast_model.kernels.choose(3) == "bf16"
    assert_verify_many_is_each_verify_alone(fast_model)


def test_a_forked_drafter_keeps_its_own_feature_cache(fast_model, drafter):
    drafter.reset()
    other = drafter.fork()
    assert other.native is drafter.native and other.model is drafter.model  # shared weights
    with fast_model.using(fast_model.new_cache()):
        out = fast_model.prefill([1, 2, 3, 4], tap_layers=drafter.tap_layers)
    other.observe(out.hiddens)
    block = other.draft(4)
    assert (other.length, drafter.length) == (4, 0)
    assert len(block.picks) == other.block_size
    other.reset()



def test_stacked_taps_feed_a_drafter_as_its_hiddens_do(fast_model, drafter):
    """Drafter.observe_taps (a batch stacks its step's taps once) queues exactly what observe()
    of the same rows' hiddens does: all rows, a run of rows, rows out of order; a tensor of
    the wrong shape is refused."""
    with fast_model.using(fast_model.new_cache()):
        out = fast_model.prefill([1, 2, 3, 4, 5, 6], tap_layers=drafter.tap_layers)
    stacked = torch.stack([out.hiddens[layer] for layer in drafter.tap_layers], -2)
    for rows in (None, [1, 2, 3], [0, 2, 5]):
        one, other = drafter.fork(), drafter.fork()
        one.observe(out.hiddens, rows=rows)
        other.observe_taps(stacked, rows=rows)
        assert one.length == other.length == (6 if rows is None else 3)
        assert torch.equal(torch.cat(one._pending), torch.cat(other._pending))
    with pytest.raises(ValueError, match="expected"):
        drafter.fork().observe_taps(stacked[:, :1])

def test_drafting_rounds_beside_others_equal_their_solo_runs(drafting):
    caps = (40, 32, 24, 16)
    want = [solo(drafting, p, max_tokens=n) for p, n in zip(PROMPTS, caps, strict=True)]
    rounds = drafted_beside_others(drafting)
    seqs, calls = together(drafting, [{"messages": p, "max_tokens": n}
                                      for p, n in zip(PROMPTS, caps, strict=True)],
                           joins=[0, 1, 3, 6], on_step=a_slot_each(drafting))
    got = [drafting.result(seq) for seq in seqs]
    assert all(same(g, w) for g, w in zip(got, want, strict=True))
    # side by side: the first (40 tokens, at most 34 a step) still runs when the second joins
    assert max(len(c) for c in calls) >= 2
    # drafted trees verified in shared calls, and one of them took more than one token
    assert rounds and max(taken for _, taken in rounds) >= 2
    assert sum(g.timings.draft_rounds for g in got) >= len(rounds)
    assert_slots_aligned(drafting)


def test_drafting_seeded_sampling_beside_others_equals_its_solo_run(drafting):
    want = [solo(drafting, PROMPTS[0], max_tokens=24, sampling=SAMPLED),
            solo(drafting, PROMPTS[1], max_tokens=16),
            solo(drafting, PROMPTS[3], max_tokens=16, sampling=SAMPLED)]
    rounds = drafted_beside_others(drafting)
    seqs, _ = together(drafting, [
        {"messages": PROMPTS[0], "max_tokens": 24, "sampling": SAMPLED},
        {"messages": PROMPTS[1], "max_tokens": 16},
        {"messages": PROMPTS[3], "max_tokens": 16, "sampling": SAMPLED}], joins=[0, 2, 4])
    got = [drafting.result(seq) for seq in seqs]
    assert all(same(g, w) for g, w in zip(got, want, strict=True))
    assert got[0].logprobs == want[0].logprobs and got[0].seed == want[0].seed
    assert got[2].logprobs == want[2].logprobs
    assert rounds  # drafted rounds in shared calls
    assert_slots_aligned(drafting)


def test_a_cancelled_drafting_request_frees_its_slot_at_the_next_step(drafting):
    want = [solo(drafting, p, max_tokens=40) for p in PROMPTS[:2]]
    stop = threading.Event()
    running: list[set] = []  # after each step, who runs

    def on_step(step):
        if step == 2:
            stop.set()
        running.append({id(seq) for seq in drafting.batch.running})

    seqs, _ = together(drafting, [{"messages": PROMPTS[0], "max_tokens": 40},
                                  {"messages": PROMPTS[2], "max_tokens": 200,
                                   "should_stop": stop.is_set},
                                  {"messages": PROMPTS[1], "max_tokens": 40}], on_step=on_step)
    cancelled = drafting.result(seqs[1])
    assert cancelled.finish_reason == "cancelled" and 0 < len(cancelled.token_ids) < 200
    assert id(seqs[1]) in running[2] and id(seqs[1]) not in running[3]  # gone at the next step
    assert seqs[1].request.anchor is None  # the scheduler ended its request
    assert same(drafting.result(seqs[0]), want[0]) and same(drafting.result(seqs[2]), want[1])
    assert_slots_aligned(drafting)


def test_a_failing_drafting_request_fails_alone(drafting):
    want = solo(drafting, PROMPTS[0], max_tokens=24)

    def broken(text):
        raise OSError("the client's stream broke")

    seqs, _ = together(drafting, [{"messages": PROMPTS[0], "max_tokens": 24},
                                  {"messages": PROMPTS[1], "max_tokens": 24, "on_text": broken}])
    assert isinstance(seqs[1].error, OSError) and seqs[1].request.anchor is None
    slot = seqs[1].slot  # it forgot the round: target, drafter and ids
    assert (slot.ids, slot.kv.length, slot.drafter.length) == ([], 0, 0)
    assert seqs[0].error is None and same(drafting.result(seqs[0]), want)


def test_the_worker_batches_a_drafting_arm(drafting):
    want = [solo(drafting, p, max_tokens=16).token_ids for p in PROMPTS[:3]]
    drafting.reset()
    widths = []
    verify_many = drafting.target.verify_many

    def spy(caches, rows, **kw):
        widths.append(len(rows))
        return verify_many(caches, rows, **kw)

    drafting.target.verify_many = spy
    worker, gate = gated_worker(drafting, parallel=3, queue_limit=0)
    try:
        futures = [worker.submit(Job(drafting.tokenizer.encode_chat(p), 16, []))
                   for p in PROMPTS[:3]]
        gate.set()
        results = [f.result(timeout=300) for f in futures]
    finally:
        del drafting.target.verify_many
        worker.close()
    assert [r.token_ids for r in results] == want
    assert max(widths) == 3  # the three ran side by side
    assert sum(r.timings.draft_rounds for r in results) > 0


def test_beside_others_a_round_drafts_only_where_the_step_price_pays(drafting, monkeypatch):
    """Where every row past the step's plain ones costs more than a token at the batch's rate,
    no tree pays: beside others no draft call runs past the requests' first rounds (a bucket
    with no drafted tree of its own yet is priced by the first rounds' trees); where rows are
    free at a rate near zero, drafts run beside others. The decision reads the step's prices
    once a step. Tokens equal the solo runs either way."""
    caps = (40, 32, 24)
    want = [solo(drafting, p, max_tokens=n) for p, n in zip(PROMPTS[:3], caps, strict=True)]
    sched, drafts, tables = drafting.speculator.scheduler, [], []
    draft = RoundDecode._draft

    def spied(self):  # (planned at a step price beside others, the request's first round)
        drafts.append((self.step is not None, self.request.rounds == 0))
        return draft(self)

    monkeypatch.setattr(RoundDecode, "_draft", spied)

    def run(step_ms, tokens: float, time_ms: float) -> list:
        def table(rows, most, context):
            tables.append(rows)
            return np.array([step_ms(total) for total in range(most + 1)])

        monkeypatch.setattr(sched, "step_prices", table)
        monkeypatch.setattr(sched, "step_price", lambda rows, context: step_ms(rows))
        drafting.speculator.step_rate = held_rate(tokens, time_ms)
        drafts.clear()
        tables.clear()
        seqs, calls = together(drafting, [{"messages": p, "max_tokens": n}
                                          for p, n in zip(PROMPTS[:3], caps, strict=True)])
        assert all(same(drafting.result(s), w) for s, w in zip(seqs, want, strict=True))
        assert 0 < len(tables) <= sum(len(c) > 1 for c in calls)  # at most once a shared step
        return [first for beside, first in drafts if beside]

    # 3 plain rows at 10 ms each, 0.1 tokens per ms: a row past them costs 10 tokens' time
    expensive = run(lambda rows: 10.0 * rows if rows <= 3 else 1e3 * rows, 3.0, 30.0)
    assert all(expensive)  # beside others only first rounds drafted
    cheap = run(lambda rows: 30.0, 1e-9, 1.0)
    assert not all(cheap)  # rows free: later rounds draft beside others too
    # the batch measured what a draft adds to a plan beside others (the next steps' draft_ms)
    undrafted_ms, drafted_ms = drafting.speculator.plan_ms
    assert undrafted_ms is not None and drafted_ms is not None and drafted_ms > undrafted_ms


def test_a_rounds_host_time_beside_others_counts_its_learn(drafting, monkeypatch):
    """What a draft adds to a step is its host time, the learn of its tree included (a tree's
    learn costs several times a plain round's): Speculator.plan_ms counts plan and learn.
    With every learn made 30 ms slower, each kind's host time measured is at least that."""
    sched = drafting.speculator.scheduler
    learn = sched.learn

    def slow(*args, **kwargs):
        time.sleep(0.03)
        return learn(*args, **kwargs)

    monkeypatch.setattr(sched, "learn", slow)
    monkeypatch.setattr(sched, "step_prices",  # every step priced, rows free
                        lambda rows, most, context: np.full(most + 1, 30.0))
    monkeypatch.setattr(sched, "step_price", lambda rows, context: 30.0)
    drafting.speculator.plan_ms = [None, None]
    drafting.speculator.step_rate = held_rate(1e-9, 1.0)  # rows free: drafts beside others
    together(drafting, [{"messages": p, "max_tokens": 12} for p in PROMPTS[:3]])
    measured = [ms for ms in drafting.speculator.plan_ms if ms is not None]
    assert measured and min(measured) >= 30.0


def test_a_step_prices_a_draft_at_what_drafting_adds(drafting, monkeypatch):
    """StepPrice.draft_ms is the drafted rounds' host time less the undrafted ones' (plan_ms
    is [undrafted, drafted]): a draft costs its time beside others, never a negative one
    (which made every draft look free once one had been measured)."""
    spec, sched = drafting.speculator, drafting.speculator.scheduler
    monkeypatch.setattr(sched, "step_price", lambda rows, context: 8.0 * rows)
    spec.step_rate = held_rate(1.0, 8.0)
    spec.plan_ms = [0.1, 2.5]

    class Seq:  # what step_price reads of a request: its slot's length
        slot = [0] * 100

    step = spec.step_price([Seq(), Seq()])
    assert step.draft_ms == pytest.approx(2.4)


def test_a_request_ending_beside_others_leaves_the_store_to_the_last_one(drafting, tmp_path,
                                                                         monkeypatch):
    """The learned store's save (an fsync) and the cost laws' refit stall every running
    stream: beside others a finished request's state waits for the last running one to end
    (or SAVE_EVERY_S)."""
    from adaspark import speculative
    from adaspark.scheduler.store import Store

    monkeypatch.setattr(speculative, "SAVE_EVERY_S", 1e9)
    store = Store(tmp_path, {"test": 1})
    drafting.speculator.store = store
    sched, refits = drafting.speculator.scheduler, []
    refit = sched.refit
    monkeypatch.setattr(sched, "refit", lambda: refits.append(1) or refit())
    saved = []  # the scheduler's state as each save found it
    update = store.update
    monkeypatch.setattr(store, "update", lambda *a, **k: saved.append(
        json.loads(json.dumps(sched.state_dict()))) or update(*a, **k))
    try:
        seqs, _ = together(drafting, [{"messages": p, "max_tokens": n}
                                      for p, n in zip(PROMPTS[:3], (24, 16, 8), strict=True)])
        assert all(seq.finished and seq.error is None for seq in seqs)
        # what the last request's end learned, saved (the step's shared verify, which may
        # teach after it, waits for the next save)
        assert store.saves == 1 and store.load() == saved[0]
        assert len(refits) == 1  # once, by the last request to end
        solo(drafting, PROMPTS[1], max_tokens=4)  # alone: refit and saved at its end
        assert store.saves == 2 and len(refits) == 2
    finally:
        drafting.speculator.store = None


def test_under_idle_saves_a_lone_requests_save_waits_for_idle(drafting, tmp_path, monkeypatch):
    """Under a server (idle_saves) a request that ends alone is refit at once, but its save (an
    fsync and a JSON write, a closed-loop client's next request would wait for it) waits for
    idle(), or SAVE_EVERY_S since the last save; idle() with nothing waiting writes nothing."""
    from adaspark import speculative
    from adaspark.scheduler.store import Store

    spec = drafting.speculator
    store = Store(tmp_path, {"test": 1})
    spec.store, spec.idle_saves = store, True
    sched, refits = spec.scheduler, []
    refit = sched.refit
    monkeypatch.setattr(sched, "refit", lambda: refits.append(1) or refit())
    try:
        spec._saved_at = speculative.time.monotonic()  # saved just now
        solo(drafting, PROMPTS[0], max_tokens=12)
        assert store.saves == 0 and spec.unsaved and len(refits) == 1  # refit, not saved
        solo(drafting, PROMPTS[1], max_tokens=8)
        assert store.saves == 0 and len(refits) == 2
        spec.idle()
        assert store.saves == 1 and not spec.unsaved
        assert store.load() == json.loads(json.dumps(sched.state_dict()))
        spec.idle()  # nothing waits: no second save
        assert store.saves == 1
        spec._saved_at -= speculative.SAVE_EVERY_S  # the last save is SAVE_EVERY_S old
        solo(drafting, PROMPTS[2], max_tokens=8)
        assert store.saves == 2 and not spec.unsaved
    finally:
        spec.store, spec.idle_saves = None, False


def test_the_servers_worker_saves_the_learned_state_once_it_is_idle(drafting, tmp_path):
    """The server's worker marks its speculator idle_saves and, once no request has run for
    IDLE_SAVE_S, runs the save that waited: the store holds the request's learning without a
    shutdown."""
    from adaspark.scheduler.store import Store
    from adaspark.server.worker import IDLE_SAVE_S

    spec = drafting.speculator
    store = Store(tmp_path, {"test": 1})
    spec.store = store
    drafting.reset()
    worker, gate = gated_worker(drafting, parallel=1)
    try:
        future = worker.submit(Job(drafting.tokenizer.encode_chat(PROMPTS[0]), 12, []))
        gate.set()
        assert len(future.result(timeout=120).token_ids) == 12
        assert spec.idle_saves
        deadline = time.monotonic() + IDLE_SAVE_S + 30
        while store.saves == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.saves == 1 and not spec.unsaved
        assert store.load()["rounds"] == spec.scheduler.state_dict()["rounds"] > 0
    finally:
        worker.close()
        spec.store, spec.idle_saves = None, False


def test_a_plain_round_beside_others_feeds_its_kept_row_to_its_own_drafter(drafting,
                                                                          monkeypatch):
    """Where no row past the step's plain ones pays, the rounds beside others are one-row
    rounds (most rounds under load), whose take() hands the slot's drafter its row's taps
    without an index: each adds exactly the kept row's taps to its own drafter (the features
    its next drafts read), and the tokens equal the solo runs."""
    caps = (24, 16, 20)
    want = [solo(drafting, p, max_tokens=n) for p, n in zip(PROMPTS[:3], caps, strict=True)]
    sched = drafting.speculator.scheduler
    def price(total):
        return 10.0 * total if total <= 3 else 1e3 * total

    monkeypatch.setattr(sched, "step_prices", lambda rows, most, context: np.array(
        [price(total) for total in range(most + 1)]))
    monkeypatch.setattr(sched, "step_price", lambda rows, context: price(rows))
    drafting.speculator.step_rate = held_rate(3.0, 30.0)  # a row past 3 costs 100 tokens' time
    take, plain, verified = RoundDecode.take, [], {}
    target_class = type(drafting.target)
    verify_many = target_class.verify_many

    def recorded(target, caches, rows, **kw):  # the call's taps, as the target made them
        out = verify_many(target, caches, rows, **kw)
        starts = np.cumsum([0, *(len(r[0]) for r in rows)])
        verified.update({id(c): (out.hiddens, int(at))
                         for c, at in zip(caches, starts[:-1], strict=True)})
        return out

    monkeypatch.setattr(target_class, "verify_many", recorded)  # together() spies on it

    def checked(self, argmax, logits=None, step=None, taps=None):
        drafter, before = self.slot.drafter, self.slot.drafter.length
        take(self, argmax, logits, step, taps=taps)
        if self._plan.rows == 1 and step.sequences > 1:
            hiddens, at = verified[id(self.slot.kv)]  # this request's row in the shared call
            kept = torch.stack([hiddens[layer][at:at + 1] for layer in drafter.tap_layers], -2)
            assert drafter.length == before + 1
            assert torch.equal(drafter._pending[-1], kept)  # queued for its next draft
            plain.append(id(self))

    monkeypatch.setattr(RoundDecode, "take", checked)
    seqs, _ = together(drafting, [{"messages": p, "max_tokens": n}
                                  for p, n in zip(PROMPTS[:3], caps, strict=True)])
    assert all(same(drafting.result(s), w) for s, w in zip(seqs, want, strict=True))
    assert len(plain) >= 30 and len(set(plain)) == 3
    assert_slots_aligned(drafting)


def test_a_step_prices_time_at_least_at_the_plain_steps_rate(drafting, monkeypatch):
    """The batch's rate is its own: where drafting lowered it, rows would look cheap and draw
    more drafting. A step's rate is at least its plain rows over their price."""
    sched, spec, rates = drafting.speculator.scheduler, drafting.speculator, []
    monkeypatch.setattr(sched, "step_prices",
                        lambda rows, most, context: np.array([8.0 * t for t in range(most + 1)]))
    monkeypatch.setattr(sched, "step_price", lambda rows, context: 8.0 * rows)
    lazy = StepPrice.lazy
    monkeypatch.setattr(StepPrice, "lazy", staticmethod(
        lambda rows, make, rate, draft_ms=None: rates.append((rows, rate))
        or lazy(rows, make, rate, draft_ms)))
    for floor in (True, False):
        spec.plain_floor, spec.step_rate = floor, held_rate(1e3, 1e9)  # 1e-6 tokens a ms
        rates.clear()
        seqs, _ = together(drafting, [{"messages": p, "max_tokens": 12} for p in PROMPTS[:3]])
        assert all(seq.finished and seq.error is None for seq in seqs)
        assert rates, "no shared step was priced"
        if floor:  # 3 plain rows at 24 ms: 1/8 token a ms, far above what the batch learned
            assert all(rate == pytest.approx(1.0 / 8.0) for _, rate in rates), rates
        else:  # the batch's own rate (it moves a little with every step's tokens)
            assert all(rate < 1e-5 for _, rate in rates), rates
    spec.plain_floor = True


def test_a_prompt_s_drafter_features_are_made_with_its_prefill(drafting):
    """Prompt work happens before the first token: each prefill chunk's features go into the
    slot's drafter in that chunk's own step (a long prompt's first draft used to append them
    all, in a step every running request waits for), so the first draft appends nothing but
    the rounds' rows (docs/round.md)."""
    engine = drafting
    prompt = engine.tokenizer.encode_chat(PROMPTS[0])
    engine.reset()
    engine.batch.prefill_chunk = 8
    seq = engine.new_decode(prompt, max_tokens=4)
    assert engine.batch.add(seq)  # its first chunk at once, the rest a chunk a step
    made = []
    while seq._unfilled:
        drafter = seq.slot.drafter
        assert drafter._pending_len == 0 and drafter._cache.length == seq.slot.kv.length
        made.append(drafter._cache.length)
        engine.batch.step()
    assert made == list(range(8, 8 * len(made) + 1, 8)) and len(made) >= 2
    while engine.batch.running:
        engine.batch.step()
