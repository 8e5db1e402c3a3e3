"""Arm `ngram`: trees from the request's own text alone, no drafter loaded anywhere.

The scheduler tests run it on synthetic text and verify times (a drafter that would fail the
test if it were ever asked for a block); the engine tests run it on the embedded model with no
drafter at all and hold every reply to `ar`'s, greedy and seeded; the loading tests cover the
default arm of a model without a drafter (a tiny GGUF written here), the drafter fingerprint
check and the arm's own learned store.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter

import pytest
from test_architectures import random_weights, write_gguf
from test_round import argmax_following
from test_sampling_engine import FULL
from test_speculative import COPY

from adaspark.drafter.loading import DEFAULT_DRAFTER, target_info
from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.learned_store import drafter_sha256, fingerprint
from adaspark.model.sources import default_model_path
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer
from adaspark.options import ModelOptions
from adaspark.scheduler.arm import Arm
from adaspark.scheduler.record import ChosenBy, RoundTimes
from adaspark.scheduler.round import Scheduler
from adaspark.speculative import DEFAULT_ARM, NO_DRAFTER_ARM, Speculator, load_speculator

LIST = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]


# --- the arm ----------------------------------------------------------------------------------
def test_arm_parse_ngram():
    arm = Arm.parse("ngram")
    assert arm.ngram_only and arm.ngram and arm.paced and not arm.needs_drafter
    assert Arm.parse("adaspark,gate").needs_drafter and not Arm.parse("ar").needs_drafter
    mods = Arm.parse("ngram+head+ratio+no-hysteresis+classes")
    assert mods.name == "ngram,head,ratio,no-hysteresis,classes" and mods.ngram_only
    assert not mods.fitted and mods.ratio_rule and not mods.hysteresis and mods.classes
    assert Arm.parse("ngram:4").pinned == 4 and Arm.parse("ngram,head").at_width(8).name == \
        "ngram:8,head"
    for bad in ("ngram,gate", "ngram,plain", "ngram,no-ngram", "ngram,ladder", "ngram:0",
                "ngram,bogus"):
        with pytest.raises(UserError):
            Arm.parse(bad)


def never_draft():
    raise AssertionError("the ngram arm asked for a drafter block")


def ngram_rounds(text_period: int, row_ms: float, rounds: int = 240, arm: str = "ngram"):
    """Rounds of `arm` on a text that repeats with `text_period` (0: never), verify time
    10 ms + row_ms per row beyond the first; -> (kinds by round, tokens per 10 ms, sched)."""
    sched = Scheduler(arm)
    period = text_period or 10**9
    truth = [3 + i % period for i in range(20_000)]
    sched.begin_request(truth[:300])
    context, kinds, ms = 300, [], 0.0
    for _ in range(rounds):
        plan = sched.plan_round(context, never_draft)
        verify_ms = 10.0 + row_ms * (plan.rows - 1)
        outcome = sched.accept(plan, argmax_following(plan, truth[context:]))
        sched.learn(outcome, RoundTimes(0.0003, verify_ms / 1000.0, 0.0002))
        assert not plan.drafted
        ms += verify_ms + 0.5
        context += len(outcome.committed)
        kinds.append(plan.chosen_by)
    return kinds, (context - 300) / ms * 10.0, sched


def test_ngram_arm_verifies_text_trees_where_the_text_repeats():
    kinds, rate, sched = ngram_rounds(text_period=40, row_ms=1.0)
    late = Counter(kinds[60:])
    assert late[ChosenBy.CHOOSER] >= 0.9 * sum(late.values()), late
    assert rate > 3.0  # tokens per plain step's time: long copied chains accepted
    assert sched.acceptance.request_stats["nodes"] > 0  # fitted to the verify outcomes
    assert sched.gate.fixed_ms is not None  # D of its rounds, for the chooser's price


def test_ngram_arm_declines_to_plain_rounds_where_trees_cannot_pay():
    """A text that never repeats proposes nothing; on repeating text rows as dear as a whole
    step make every tree lose: after at most the budgeted probes, plain rounds."""
    kinds, rate, _ = ngram_rounds(text_period=0, row_ms=1.0)
    assert set(kinds) == {ChosenBy.PLAIN} and rate == pytest.approx(10 / 10.5)
    kinds, _, sched = ngram_rounds(text_period=40, row_ms=30.0)
    assert kinds.count(ChosenBy.PROBE) <= 3 and kinds.count(ChosenBy.CHOOSER) == 0
    assert kinds[-100:] == [ChosenBy.PLAIN] * 100
    assert sched.chooser.rates  # plain rounds teach the band's long-run rate


def test_ngram_arm_state_round_trips():
    _, _, sched = ngram_rounds(text_period=40, row_ms=1.0, rounds=80)
    sched.end_request()
    state = json.loads(json.dumps(sched.state_dict()))
    restored = Scheduler("ngram")
    restored.load_state_dict(state)
    assert json.dumps(restored.state_dict(), sort_keys=True) == json.dumps(state, sort_keys=True)


# --- on the embedded model, no drafter --------------------------------------------------------
def no_drafter_parts(precision: str):
    path = default_model_path()
    target = Transformer.from_gguf(path, precision=precision, max_context=1024, calibrate=False)
    return target, Tokenizer.from_gguf(path), path


def ngram_engine(parts, arm: str = "ngram") -> Engine:
    target, tok, path = parts
    spec = None if arm == "ar" else Speculator(target, None, Scheduler(arm), tok.stop_ids)
    engine = Engine(target, tok, path, spec)
    engine.reset()
    return engine


def replies(engine: Engine, sampling=None) -> list:
    """Two turns of the copy prompt, a count and a haiku (each from an empty cache)."""
    first = engine.generate(COPY, max_tokens=24, sampling=sampling)
    history = COPY + [{"role": "assistant", "content": first.text},
                      {"role": "user", "content": "Again, once."}]
    out = [first, engine.generate(history, max_tokens=16, sampling=sampling)]
    for messages, cap in ((LIST, 40), (HAIKU, 24)):
        engine.reset()
        out.append(engine.generate(messages, max_tokens=cap, sampling=sampling))
    return out


@pytest.fixture(scope="module")
def reference_parts():
    return no_drafter_parts("reference")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_ngram_arm_emits_the_ar_tokens_without_a_drafter(reference_parts):
    want = replies(ngram_engine(reference_parts, "ar"))
    engine = ngram_engine(reference_parts)
    assert engine.speculator.drafter is None and engine.speculator.tap_layers == ()
    traces: list = []
    engine.speculator.round_hook = traces.append
    got = replies(engine)
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.finish_reason, a.stop_token_id) == \
            (b.token_ids, b.finish_reason, b.stop_token_id)
    assert engine.target.cache.length == len(engine.cache.ids)
    assert sum(g.timings.ngram_rounds for g in got) > 0 and sum(
        g.timings.draft_rounds for g in got) == 0
    # n-gram trees were verified and took more than one token a round
    taken = [len(tr.emitted) for tr in traces if tr.plan.tree is not None]
    assert taken and max(taken) >= 3 and all(not tr.plan.drafted for tr in traces)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_ngram_arm_samples_the_ar_tokens_from_a_seed(reference_parts):
    want = replies(ngram_engine(reference_parts, "ar"), FULL)
    got = replies(ngram_engine(reference_parts), FULL)
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.finish_reason, a.seed) == (b.token_ids, b.finish_reason, b.seed)
        assert [e["id"] for e in a.logprobs] == a.token_ids
    assert sum(g.timings.accepted_tokens for g in got) > 0


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_ngram_arm_emits_the_ar_tokens_on_the_native_forward():
    parts = no_drafter_parts("fast")
    if parts[0].native is None:
        pytest.skip(f"no native forward here: {parts[0].native_note}")
    want = replies(ngram_engine(parts, "ar"))
    got = replies(ngram_engine(parts))
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    assert sum(g.timings.accepted_tokens for g in got) > 0


# --- loading: the default arm, the drafter's fingerprint, the store ---------------------------
@pytest.fixture
def tiny(tmp_path):
    """A model no drafter was ever trained for."""
    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", random_weights("llama"))
    return Transformer.from_gguf(path, precision="reference"), path


def test_default_arm_without_a_drafter_is_ngram(tiny, tmp_path, caplog):
    target, path = tiny
    with caplog.at_level(logging.WARNING, logger="adaspark.speculative"):
        spec = load_speculator(target, path, (), ModelOptions(store=tmp_path / "stores"))
    assert spec.arm == NO_DRAFTER_ARM == "ngram" and spec.drafter is None
    assert "no shipped drafter for tiny-llama.gguf" in caplog.text
    assert spec.store.fingerprint["arm"] == "ngram"
    assert spec.store.fingerprint["drafter_sha256"] is None
    with pytest.raises(UserError, match="no shipped drafter"):  # a drafting arm, named
        load_speculator(target, path, (), ModelOptions(arm="adaspark,gate",
                                                       store=tmp_path / "stores"))


def shipped_copy(tmp_path, **target_changes):
    """The shipped drafter with its recorded target changed (None: the key removed)."""
    out = tmp_path / "drafter"
    shutil.copytree(DEFAULT_DRAFTER, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in target_changes.items():
        if value is None:
            config["target"].pop(key)
        else:
            config["target"][key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
def test_a_drafter_for_another_model_is_refused_naming_both(tiny, fast_model, model_path,
                                                            tmp_path):
    target, path = tiny
    shipped = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(UserError, match=f"n_layers=30 \\(model file {shipped}\\).*n_layers=2 "
                                        "\\(model file tiny-llama.gguf\\)"):
        load_speculator(target, path, (), ModelOptions(drafter=DEFAULT_DRAFTER,
                                                       store=tmp_path / "stores"))
    other = shipped_copy(tmp_path, sha256="00" * 32, model_file="other-model.gguf")
    for arm in (None, "adaspark"):  # a --drafter given is never dropped for the default
        with pytest.raises(UserError, match=f"other-model.gguf.*model file {model_path.name}"):
            load_speculator(fast_model, model_path, (), ModelOptions(
                arm=arm, drafter=other, store=tmp_path / "stores"))


@pytest.mark.slow
def test_a_drafter_is_taken_by_its_hash_or_on_its_shape_when_it_has_none(
        fast_model, model_path, tmp_path, caplog):
    renamed = shipped_copy(tmp_path / "a", model_file="renamed.gguf")
    spec = load_speculator(fast_model, model_path, (), ModelOptions(
        drafter=renamed, store=tmp_path / "stores"))
    assert spec.arm == DEFAULT_ARM and spec.drafter is not None
    old = shipped_copy(tmp_path / "b", sha256=None, model_file=None)
    with caplog.at_level(logging.WARNING, logger="adaspark.drafter.checkpoint"):
        spec = load_speculator(fast_model, model_path, (), ModelOptions(
            arm="adaspark", drafter=old, store=tmp_path / "stores"))
    assert spec.drafter is not None and "records no model hash" in caplog.text


@pytest.mark.slow
def test_ngram_store_is_its_own_with_or_without_a_drafter(fast_model, model_path, tmp_path):
    stores = tmp_path / "stores"
    spec = load_speculator(fast_model, model_path, (), ModelOptions(arm="ngram", store=stores))
    assert spec.drafter is None  # a drafter exists for this model; the arm loads none
    beside = load_speculator(fast_model, model_path, (), ModelOptions(
        arm="ngram", drafter=tmp_path / "nowhere", store=stores))
    assert beside.store.path == spec.store.path
    sha = target_info(fast_model, model_path)["sha256"]
    assert spec.store.fingerprint == fingerprint(sha, None, fast_model, "ngram")
    drafted = load_speculator(fast_model, model_path, (), ModelOptions(store=stores))
    assert drafted.arm == DEFAULT_ARM
    assert drafted.store.fingerprint == fingerprint(sha, drafter_sha256(DEFAULT_DRAFTER),
                                                    fast_model, DEFAULT_ARM)
    assert drafted.store.path != spec.store.path
    _, _, sched = ngram_rounds(text_period=40, row_ms=1.0, rounds=40)
    spec.store.save(sched.state_dict())
    again = load_speculator(fast_model, model_path, (), ModelOptions(arm="ngram+ratio",
                                                                     store=stores))
    assert again.store.path != spec.store.path  # a modifier is another family
    again = load_speculator(fast_model, model_path, (), ModelOptions(arm="ngram", store=stores))
    assert json.dumps(again.scheduler.state_dict(), sort_keys=True) == \
        json.dumps(json.loads(json.dumps(sched.state_dict())), sort_keys=True)
