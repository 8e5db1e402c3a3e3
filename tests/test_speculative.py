"""The speculative round loop on the real target: exactness against plain decoding, stops inside
an accepted path, cache alignment for prefix reuse, the learned store and the round log.

The drafter is randomly initialised (correctness must not depend on its quality); accepted paths
come from the n-gram chains of a prompt that asks for a copy. Pinned-width arms keep the rounds
deterministic, so a stop can be placed inside a path the loop is known to accept.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adaspark.drafter.checkpoint import save_checkpoint, target_fingerprint
from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.drafter.runtime import Drafter
from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.learned_store import drafter_sha256, fingerprint, open_store, restore
from adaspark.model.sources import default_model_path
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.scheduler.round import Scheduler
from adaspark.speculative import DEFAULT_ARM, Speculator, load_speculator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SENTENCE = "The quick brown fox jumps over the lazy dog."
COPY = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Repeat exactly: {SENTENCE} {SENTENCE}"}]
ARMS = ("chain3", "chain", "tree:3", "cost", "adaspark", "adaspark:4")


def random_model(target) -> DraftModel:
    torch.manual_seed(0)
    ids = torch.arange(4096)
    c = DrafterConfig(target_layers=[1, 14, 27], draft_vocab_size=len(ids))
    return DraftModel(c, ids, target.embed(ids))


def engine_parts(precision: str):
    """(target, tokenizer, random drafter, model path) on the embedded model."""
    path = default_model_path()
    target = Transformer.from_gguf(path, precision=precision, max_context=1024, calibrate=False)
    # the drafter runs where the target does: on the native build when the target has one
    drafter = Drafter(random_model(target), target.embed, dtype=torch.float32,
                      native=target.native_module, positions=1024 + 16)
    return target, Tokenizer.from_gguf(path), drafter, path


@pytest.fixture(scope="module")
def parts():
    return engine_parts("reference")


def make_engine(parts, arm: str) -> Engine:
    """A fresh engine (and fresh learned state) on the shared target and drafter."""
    target, tok, drafter, path = parts
    spec = None if arm == "ar" else Speculator(target, drafter, Scheduler(arm), tok.stop_ids)
    engine = Engine(target, tok, path, spec)
    engine.reset()
    return engine


def traced(engine: Engine) -> list:
    traces: list = []
    engine.speculator.round_hook = traces.append
    return traces


def assert_aligned(engine: Engine) -> None:
    target = engine.target
    assert target.cache.length == len(engine.cache.ids)
    if engine.speculator is not None:
        assert engine.speculator.drafter.length == target.cache.length


def assert_path_is_argmax(traces, first: int, produced: list[int]) -> None:
    """Every emitted token is the target's argmax on its verify row, along the accepted path."""
    emitted = [first]
    for tr in traces:
        rows = tr.outcome.rows
        for i, token in enumerate(tr.emitted):
            assert token == tr.argmax[rows[i]]
            if i + 1 < len(rows):  # an accepted candidate: a child of the row before it
                assert tr.plan.parents[rows[i + 1]] == rows[i]
                assert tr.plan.tokens[rows[i + 1]] == token
        assert tr.committed_rows == rows[:len(tr.emitted)]
        emitted += tr.emitted
    assert emitted == produced


def produced(gen) -> list[int]:
    return gen.token_ids + ([gen.stop_token_id] if gen.stop_token_id is not None else [])


def two_turns(engine: Engine):
    first = engine.generate(COPY, max_tokens=10)
    assert_aligned(engine)
    history = COPY + [{"role": "assistant", "content": first.text},
                      {"role": "user", "content": "Again, once."}]
    second = engine.generate(history, max_tokens=6)
    assert_aligned(engine)
    return first, second


# --- exactness --------------------------------------------------------------------------------
def test_every_arm_emits_the_ar_tokens_in_reference_precision(parts):
    ar1, ar2 = two_turns(make_engine(parts, "ar"))
    assert ar2.timings.reused_tokens > len(ar1.prompt_token_ids)  # turn 2 reuses the cache
    accepted = 0
    for arm in ARMS:
        engine = make_engine(parts, arm)
        one, two = two_turns(engine)
        assert (one.token_ids, two.token_ids) == (ar1.token_ids, ar2.token_ids), arm
        assert (one.finish_reason, two.finish_reason) == (ar1.finish_reason, ar2.finish_reason)
        assert two.timings.reused_tokens == ar2.timings.reused_tokens, arm
        assert one.timings.decode_tokens == ar1.timings.decode_tokens
        t = one.timings
        assert t.draft_rounds + t.plain_rounds >= 1 and t.verified_rows >= t.draft_rounds
        accepted += t.accepted_tokens + two.timings.accepted_tokens
    assert accepted > 0  # some round took more than one token, or nothing was tested


@pytest.fixture(scope="module")
def native_parts():
    parts = engine_parts("fast")
    if parts[0].native is None:
        pytest.skip(f"no native forward here: {parts[0].native_note}")
    return parts


def test_every_arm_emits_the_ar_tokens_on_the_native_forward(native_parts):
    """Fast precision: the native forward's rows do not depend on the width of the call."""
    ar1, ar2 = two_turns(make_engine(native_parts, "ar"))
    accepted = 0
    for arm in (*ARMS, "adaspark,gate", "adaspark,plain"):
        one, two = two_turns(make_engine(native_parts, arm))
        assert (one.token_ids, two.token_ids) == (ar1.token_ids, ar2.token_ids), arm
        assert (one.finish_reason, two.finish_reason) == (ar1.finish_reason, ar2.finish_reason)
        accepted += one.timings.accepted_tokens + two.timings.accepted_tokens
    assert accepted > 0


def test_fast_kernels_emit_the_argmax_of_each_verify_row(parts):
    _, tok, _, path = parts
    target = Transformer.from_gguf(path, precision="fast", max_context=1024)
    drafter = Drafter(random_model(target), target.embed)
    engine = Engine(target, tok, path,
                    Speculator(target, drafter, Scheduler("adaspark"), tok.stop_ids))
    accepted = 0
    for messages, cap in ((COPY, 24), (COPY + [{"role": "assistant", "content": SENTENCE},
                                              {"role": "user", "content": "Thanks."}], 8)):
        traces = traced(engine)
        gen = engine.generate(messages, max_tokens=cap)
        assert_path_is_argmax(traces, produced(gen)[0], produced(gen))
        assert_aligned(engine)
        accepted += sum(len(tr.outcome.tokens) for tr in traces)
    assert accepted > 0  # some path went past the anchor, or the walk was not tested


def test_gated_rounds_emit_the_ar_tokens_in_reference_precision(parts):
    """The draft gate's undrafted rounds (n-gram trees, plain rows) next to drafted ones: a
    scheduler warmed on a useless drafter and a repeating text prefers undrafted rounds."""
    from test_round import gate_rounds

    _, sched = gate_rounds("adaspark,gate", drafter_right=False, rounds=120, text_period=40)
    sched.end_request()
    ar = make_engine(parts, "ar")
    ar0 = ar.generate(COPY, max_tokens=48)
    ar1, ar2 = two_turns(ar)
    target, tok, drafter, path = parts
    engine = Engine(target, tok, path, Speculator(target, drafter, sched, tok.stop_ids))
    engine.reset()
    traces = traced(engine)
    assert engine.generate(COPY, max_tokens=48).token_ids == ar0.token_ids
    one, two = two_turns(engine)
    assert (one.token_ids, two.token_ids) == (ar1.token_ids, ar2.token_ids)
    assert (one.finish_reason, two.finish_reason) == (ar1.finish_reason, ar2.finish_reason)
    kinds = {tr.plan.chosen_by for tr in traces}
    assert "undrafted" in kinds, kinds
    assert any(len(tr.outcome.tokens) > 0 for tr in traces if tr.plan.chosen_by == "undrafted")


# --- stops inside an accepted path ------------------------------------------------------------
def long_chunks(traces, reply_ids: list[int]):
    """Index in the reply of the first token of every round that took at least 3 tokens."""
    at = 1  # reply token 0 came from the prefill
    found = []
    for tr in traces:
        if len(tr.emitted) >= 3 and at + 3 <= len(reply_ids):
            found.append(at)
        at += len(tr.emitted)
    assert found, "no round accepted a path of 3 tokens: the stops were not tested"
    return found


@pytest.fixture(scope="module")
def copy_run(parts):
    engine = make_engine(parts, "adaspark:6")
    traces = traced(engine)
    gen = engine.generate(COPY, max_tokens=30)
    return gen, traces


def stopped_mid_path(traces) -> bool:
    last = traces[-1]
    return len(last.emitted) < len(last.outcome.tokens) + 1


def compare_with_ar(parts, **kw):
    """The pinned arm and ar under the same stop; the caches must hold the same tokens."""
    ar = make_engine(parts, "ar")
    want = ar.generate(COPY, **kw)
    ar_cache = list(ar.cache.ids)
    spec = make_engine(parts, "adaspark:6")
    streamed: list[str] = []
    traces = traced(spec)
    got = spec.generate(COPY, on_text=streamed.append, **kw)
    assert (got.text, got.token_ids, got.finish_reason, got.stop_token_id) == \
        (want.text, want.token_ids, want.finish_reason, want.stop_token_id)
    assert "".join(streamed) == got.text
    assert spec.cache.ids == ar_cache
    assert_aligned(spec)
    assert stopped_mid_path(traces)
    return got, spec


def test_max_tokens_inside_an_accepted_path(parts, copy_run):
    gen, traces = copy_run
    at = long_chunks(traces, gen.token_ids)[0]
    got, spec = compare_with_ar(parts, max_tokens=at + 2)
    assert got.finish_reason == "length" and len(got.token_ids) == at + 2
    # the last emitted token is not in the cache: the next turn recomputes it like ar would
    assert spec.cache.ids == got.prompt_token_ids + got.token_ids[:-1]


def test_stop_string_split_across_an_accepted_chunk(parts, copy_run):
    gen, traces = copy_run
    tok, ids = parts[1], gen.token_ids
    for at in long_chunks(traces, ids):
        # the text of the round's first two tokens, found nowhere earlier in the reply
        start = len(tok.decode(ids[:at]))
        stop = tok.decode(ids[:at + 2])[start:]
        if stop.strip() and tok.decode(ids).find(stop) == start:
            break
    else:
        raise AssertionError("no accepted chunk holds a stop string seen first there")
    assert len(tok.encode(stop)) >= 1
    got, spec = compare_with_ar(parts, max_tokens=30, stop=[stop])
    assert got.finish_reason == "stop" and got.stop_token_id is None
    assert not got.text.endswith(stop) and stop not in got.text
    assert spec.cache.ids == got.prompt_token_ids + got.token_ids[:-1]


def end_token_drafter(target, tok) -> Drafter:
    """A drafter that always drafts the end-of-turn token: its final norm zeroed, every backbone
    logit is 0, and the Markov head adds 1 per rank to the first id of its vocabulary (eot)."""
    ids = torch.cat([torch.tensor([tok.eot_id]), torch.arange(3, 4096)])
    model = DraftModel(DrafterConfig(target_layers=[1, 14, 27], draft_vocab_size=len(ids)),
                       ids, target.embed(ids))
    with torch.no_grad():
        model.norm.weight.zero_()
        model.markov_w1.weight.fill_(1.0)
        model.markov_w2.weight.zero_()
        model.markov_w2.weight[0] = 1.0
    drafter = Drafter(model, target.embed, dtype=torch.float32)
    drafter.shortlist = len(ids)  # the Markov bias must reach eot, which no backbone logit ranks
    return drafter


def test_stop_token_inside_an_accepted_path(parts, copy_run):
    target, tok, _, path = parts
    want = copy_run[0]  # the same tokens as ar (the exactness test's claim)
    assert want.stop_token_id == tok.eot_id, "the copy did not end: no stop token to test"
    engine = Engine(target, tok, path, Speculator(target, end_token_drafter(target, tok),
                                                  Scheduler("chain3"), tok.stop_ids))
    engine.reset()
    traces = traced(engine)
    got = engine.generate(COPY, max_tokens=30)
    last = traces[-1]
    # the chain verified the drafted end token, the target agreed, and its bonus was dropped
    assert last.outcome.tokens == [tok.eot_id] and last.emitted == [tok.eot_id]
    assert stopped_mid_path(traces)
    assert (got.text, got.token_ids, got.stop_token_id) == \
        (want.text, want.token_ids, want.stop_token_id)
    assert engine.cache.ids == got.prompt_token_ids + got.token_ids
    assert_aligned(engine)


def test_context_full_falls_back_to_plain_rounds(parts):
    target = parts[0]
    prompt = parts[1].encode_chat(COPY)
    capacity = target.cache.capacity
    target.cache.capacity = len(prompt) + 12  # a tree no longer fits near the end
    try:
        want = make_engine(parts, "ar").generate(COPY, max_tokens=40)
        engine = make_engine(parts, "adaspark:6")
        traces = traced(engine)
        got = engine.generate(COPY, max_tokens=40)
    finally:
        target.cache.capacity = capacity
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert got.finish_reason == "length"
    assert any(tr.plan.chosen_by == "plain" for tr in traces)
    assert got.timings.plain_rounds >= 1
    assert_aligned(engine)


def test_cancel_between_rounds(parts):
    engine = make_engine(parts, "adaspark")
    calls = []
    gen = engine.generate(COPY, max_tokens=30, should_stop=lambda: calls.append(1) or
                          len(calls) > 2)
    assert gen.finish_reason == "cancelled" and len(calls) == 3
    assert_aligned(engine)


# --- loading, the learned store and the round log --------------------------------------------
def as_json(state: dict) -> str:
    return json.dumps(state, sort_keys=True, default=lambda v: v.tolist())


def test_load_speculator_store_and_round_log(parts, tmp_path):
    target, tok, drafter, path = parts
    checkpoint = tmp_path / "drafter"
    save_checkpoint(checkpoint, drafter.model.float(), target_fingerprint(target.config, path))
    stores, log = tmp_path / "stores", tmp_path / "rounds.jsonl"
    def load(**options):
        return load_speculator(target, path, tok.stop_ids, ModelOptions(**options))

    assert load(arm="ar") is None
    with pytest.raises(UserError, match="no drafter checkpoint"):
        load(arm="adaspark", drafter=tmp_path / "none")

    spec = load(arm="adaspark", drafter=checkpoint, store=stores, round_log=log)
    engine = Engine(target, tok, path, spec)
    engine.reset()
    gen = engine.generate(COPY, max_tokens=12, request_id="chatcmpl-1")
    spec.close()
    state = spec.scheduler.state_dict()

    # a restart: a new speculator on the same fingerprint reads back what the request learned
    again = load(arm="adaspark", drafter=checkpoint, store=stores)
    assert again.store.path == spec.store.path and again.store.path.is_file()
    assert as_json(again.scheduler.state_dict()) == as_json(state)
    fresh = load(arm="adaspark", drafter=checkpoint, store=stores, fresh=True)
    assert as_json(fresh.scheduler.state_dict()) == as_json(Scheduler("adaspark").state_dict())
    default = load(drafter=checkpoint, store=stores)
    assert default.arm == DEFAULT_ARM == "adaspark,gate" and default.scheduler.arm.gate
    expected = fingerprint(json.loads((checkpoint / "config.json").read_text())["target"]
                           ["sha256"], drafter_sha256(checkpoint), target, "adaspark")
    assert open_store(stores, expected).path == spec.store.path

    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    t = gen.timings
    assert len(rounds) == t.draft_rounds + t.plain_rounds + t.ngram_rounds
    assert sum(r["rows"] for r in rounds) == t.verified_rows
    for r in rounds:
        assert r["arm"] == "adaspark" and r["request"] == "chatcmpl-1"
        for name in ("ctx", "width_offered", "width", "rows", "accepted", "accepted_drafter",
                     "accepted_ngram", "agreed", "D", "verify", "commit", "pred_S", "pred_T"):
            assert name in r
        assert r["accepted"] == r["accepted_drafter"] + r["accepted_ngram"] + r["agreed"]
        assert r["verify"] > 0 and r["D"] > 0 and r["commit"] > 0
    assert [r["ctx"] for r in rounds] == sorted(r["ctx"] for r in rounds)
    assert np.all(np.diff([r["ctx"] for r in rounds]) >= 1)
    assert restore(Scheduler("adaspark"), again.store) is None
