"""Sampling on the real target: a seed gives the same tokens on every arm (reference precision),
each token is the position-keyed Gumbel-max pick of its own row written out from scratch,
logprobs are that row's log-softmax, and temperature 0 is greedy.

The drafter is random (as in test_speculative); accepted paths come from n-gram chains of a
prompt that asks for a copy, which a sampled reply mostly follows at these settings.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_speculative import COPY, engine_parts, make_engine, traced

from adaspark.sampling import SamplingParams, gumbel_noise

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ARMS = ("chain3", "tree:3", "cost", "adaspark", "adaspark:4", "adaspark,gate")
FULL = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11, frequency_penalty=0.4,
                      presence_penalty=0.2, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def parts():
    return engine_parts("reference")


def two_turns(engine, sampling):
    first = engine.generate(COPY, max_tokens=16, sampling=sampling)
    history = COPY + [{"role": "assistant", "content": first.text},
                      {"role": "user", "content": "Again, once."}]
    return first, engine.generate(history, max_tokens=8, sampling=sampling)


def test_same_seed_same_tokens_on_every_arm_in_reference_precision(parts):
    ar = two_turns(make_engine(parts, "ar"), FULL)
    accepted = 0
    for arm in ARMS:
        for shared in (True, False) if arm in ("adaspark:4", "adaspark,gate") else (True,):
            engine = make_engine(parts, arm)
            engine.speculator.shared_noise = shared
            got = two_turns(engine, FULL)
            for a, b in zip(got, ar, strict=True):
                assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), arm
                assert a.seed == b.seed == 11
                assert [e["id"] for e in a.logprobs] == a.token_ids
            accepted += sum(g.timings.accepted_tokens for g in got)
    assert accepted > 0  # some round took a drafted token, or the tree was never tested
    other = two_turns(make_engine(parts, "ar"), SamplingParams(temperature=0.8, seed=12))
    assert [g.token_ids for g in other] != [g.token_ids for g in ar]  # the seed matters


class Spy:
    """Keeps the logits of every prefill and verify the real target runs (in call order)."""

    def __init__(self, target, monkeypatch):
        self.logits: list[torch.Tensor] = []
        for name in ("prefill", "verify"):
            real = getattr(target, name)

            def call(*args, _real=real, **kw):
                kw["return_logits"] = True
                out = _real(*args, **kw)
                self.logits.append(out.logits.clone())
                return out

            monkeypatch.setattr(target, name, call)


def reference_pick(row: torch.Tensor, reply: list[int], position: int, p: SamplingParams):
    """Plain decoding's sample written out: OpenAI's penalties from the reply so far, then
    temperature, top-k, top-p (sorted, float64) and Gumbel-max with g(seed, position)."""
    pen = torch.zeros(row.numel())
    for t, c in Counter(reply).items():
        pen[t] = p.frequency_penalty * c + p.presence_penalty
    x = (row - pen) / p.temperature
    y = x + torch.from_numpy(gumbel_noise(p.seed, position, row.numel()))
    order = x.argsort(descending=True)[:p.top_k]
    probs = torch.softmax(x[order].double(), -1)
    inside = order[(torch.cumsum(probs, -1) - probs) < p.top_p]
    allowed = torch.full_like(y, -torch.inf)
    allowed[inside] = y[inside]
    return int(allowed.argmax()), torch.log_softmax(x.double(), -1)


@pytest.mark.parametrize("arm", ["ar", "adaspark:4"])
def test_each_token_is_its_rows_gumbel_max_pick_and_logprob(parts, arm, monkeypatch):
    engine = make_engine(parts, arm)
    traces = traced(engine) if arm != "ar" else None
    spy = Spy(engine.target, monkeypatch)
    gen = engine.generate(COPY, max_tokens=20, sampling=FULL)
    produced = gen.token_ids + ([gen.stop_token_id] if gen.stop_token_id is not None else [])
    # the row each produced token was picked on: the prefill's last, then verify rows
    rows = [spy.logits[0][-1]]
    if traces is None:
        rows += [logits[0] for logits in spy.logits[1:]]
    else:
        for tr, logits in zip(traces, spy.logits[1:], strict=True):
            rows += [logits[tr.outcome.rows[i]] for i in range(len(tr.emitted))]
    start = len(gen.prompt_token_ids)
    for k, token in enumerate(produced):
        want, logprobs = reference_pick(rows[k], produced[:k], start + k, FULL)
        assert token == want, k
        if k < len(gen.logprobs):
            entry = gen.logprobs[k]
            assert entry["logprob"] == pytest.approx(float(logprobs[token]), abs=1e-9)
            top = logprobs.topk(3)
            assert [i for i, _ in entry["top"]] == top.indices.tolist()
    assert len(gen.logprobs) == len(gen.token_ids)
    if traces is not None:
        assert any(len(tr.emitted) > 1 for tr in traces)  # a tree path was taken


@pytest.mark.parametrize("arm", ["ar", "adaspark:4"])
def test_temperature_zero_is_greedy(parts, arm):
    greedy = make_engine(parts, arm).generate(COPY, max_tokens=12)
    for params in (SamplingParams(temperature=0.0, seed=3),
                   SamplingParams(temperature=0.0, logprobs=True, top_p=0.5, top_k=2)):
        got = make_engine(parts, arm).generate(COPY, max_tokens=12, sampling=params)
        assert got.token_ids == greedy.token_ids
    assert greedy.seed is None and greedy.logprobs is None


def test_a_reply_without_seed_reports_one_that_reproduces_it(parts):
    params = SamplingParams(temperature=1.0)
    first = make_engine(parts, "adaspark:4").generate(COPY, max_tokens=10, sampling=params)
    assert isinstance(first.seed, int)
    again = make_engine(parts, "ar").generate(
        COPY, max_tokens=10, sampling=SamplingParams(temperature=1.0, seed=first.seed))
    assert again.token_ids == first.token_ids
