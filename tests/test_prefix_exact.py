"""A prompt over a cached prefix equals its whole prefill bit for bit on the native forward,
whatever computed the prefix (a prefill, one-row decode steps, verified chains and trees) and
however its rows fall into calls and PREFILL_CHUNK chunks: every row count runs the native
forward, none goes to the torch path's bf16 kernels (docs/batching.md, "Exactness"). So a
request's reply does not depend on what its slot held before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_model_forward import ancestors, depths
from test_native_forward import native_model
from test_native_gemma3 import VOCAB, random_weights, write_quantised

from adaspark.engine import Engine
from adaspark.model import native
from adaspark.model.kernels import KernelTable
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import PREFILL_CHUNK, Transformer
from adaspark.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

_RNG = np.random.default_rng(23)
# in-vocabulary ids; 65 and 68 rows are just past the kernel ladder's top (64), where a whole
# prefill used to leave the native forward
PROMPTS = [_RNG.integers(100, 9000, n).tolist() for n in (65, 68, 100, 200)]
LONG = _RNG.integers(100, 9000, PREFILL_CHUNK + 88).tolist()  # two chunks when whole
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, logprobs=True)


@pytest.fixture(scope="module", params=native.runnable_isas())
def model(request, model_path):
    return native_model(request.param, model_path, max_context=1024)


def whole(model, ids):
    model.reset()
    return model.prefill(ids, return_logits=True)


def over(model, ids, cached):
    """ids prefilled over a cache already holding ids[:cached] (by a prefill)."""
    model.reset()
    model.prefill(ids[:cached])
    return model.prefill(ids[cached:], return_logits=True)


def assert_same_last_row(a, b):
    assert torch.equal(a.logits[-1], b.logits[-1]), \
        f"last-row logits differ by up to {float((a.logits[-1] - b.logits[-1]).abs().max())}"
    assert int(a.argmax[-1]) == int(b.argmax[-1])


def test_every_row_count_runs_the_native_forward(model):
    native_kernel = model.kernels.choose(1)
    assert native_kernel.startswith("native")
    assert {model.kernels.choose(n) for n in (64, 65, PREFILL_CHUNK, 1024)} == {native_kernel}
    assert KernelTable.only("int4").choose(10_000) == "int4"
    assert KernelTable.default().choose(10_000) == "bf16"  # the torch path's wide rows


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_a_prompt_over_a_prefilled_prefix_equals_its_whole_prefill(model, prompt):
    ids = PROMPTS[prompt]
    ref = whole(model, ids)
    for cached in (1, 17, len(ids) // 2, len(ids) - 1):
        assert_same_last_row(over(model, ids, cached), ref)


def test_a_prefix_of_decode_steps_and_verified_rounds_equals_a_whole_prefill(model):
    """A previous turn's reply was computed one row (plain decoding) or a few (verified chains
    and trees, the accepted path committed) at a time: the next turn over it equals a whole
    prefill of the same ids."""
    ids = PROMPTS[1]
    ref = whole(model, ids)
    model.reset()
    model.prefill(ids[:6])
    at = 6
    for _ in range(8):  # one-row decode steps
        model.verify(ids[at:at + 1], [0], [[True]])
        model.commit([0])
        at += 1
    chain = [-1, 0, 1, 2]
    model.verify(ids[at:at + 4], depths(chain), ancestors(chain))  # a chain, 3 of 4 accepted
    model.commit([0, 1, 2])
    at += 3
    tree = [-1, 0, 0, 2]  # rows 1 and 2 siblings: the accepted path 0, 2, 3 moves its K/V
    tokens = [ids[at], 5, ids[at + 1], ids[at + 2]]
    model.verify(tokens, depths(tree), ancestors(tree))
    model.commit([0, 2, 3])
    at += 3
    assert model.cache.length == at
    assert_same_last_row(model.prefill(ids[at:], return_logits=True), ref)


def test_chunk_boundaries_do_not_change_a_row(model):
    """Whole, LONG runs as chunks of 512 + 88 rows; over a cached prefix the chunks fall
    elsewhere (100 + 500, 520 + 68)."""
    ref = whole(model, LONG)
    for cached in (100, PREFILL_CHUNK + 8):
        assert_same_last_row(over(model, LONG, cached), ref)


def test_a_windowed_model_over_a_cached_prefix_equals_its_whole_prefill(tmp_path, monkeypatch):
    """Gemma 3's sliding window (the synthetic model of test_native_gemma3: window 5) masks by
    position: a committed slot and an in-call ancestor fall out of it alike."""
    path = write_quantised(tmp_path / "gemma3.gguf", random_weights())
    monkeypatch.setenv("ADASPARK_NATIVE", native.runnable_isas()[0])
    model = Transformer.from_gguf(path, precision="fast", max_context=160, calibrate=False)
    assert model.native is not None, model.native_note
    ids = [(7 * i * i + 3 * i + 2) % VOCAB for i in range(120)]
    ref = whole(model, ids)
    for cached in (1, 5, 17, 100):
        assert_same_last_row(over(model, ids, cached), ref)
    model.reset()
    model.prefill(ids[:2])
    for t in ids[2:40]:  # one-row decode steps
        model.verify([t], [0], [[True]])
        model.commit([0])
    assert_same_last_row(model.prefill(ids[40:], return_logits=True), ref)


def test_a_reply_is_the_same_whatever_its_slot_held_before(fast_model, model_path):
    """The engine reuses the prefix its slot shares with the prompt: a reply (seeded sampling,
    logprobs) after another request, and a second turn over the first turn's prompt and reply,
    equal the same request from an empty slot."""
    if fast_model.native is None:
        pytest.skip("no native forward here")
    engine = Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)
    system = {"role": "system", "content": "You are a careful assistant for a small museum of "
              "clocks. Answer in plain sentences, mention opening hours (ten to five, closed "
              "on Mondays) when asked about visits, and keep every reply short."}
    first = [system, {"role": "user", "content": "Can I visit on a Monday with two children?"}]
    other = [system, {"role": "user", "content": "Which clock is the oldest one you have?"}]

    def fresh(messages):
        engine.reset()
        return engine.generate(messages, max_tokens=12, sampling=SAMPLED)

    solo = fresh(first)
    assert len(solo.prompt_token_ids) > 64
    engine.generate(other, max_tokens=12, sampling=SAMPLED)
    after_other = engine.generate(first, max_tokens=12, sampling=SAMPLED)
    assert after_other.timings.reused_tokens > 0
    assert (after_other.token_ids, after_other.logprobs) == (solo.token_ids, solo.logprobs)

    second = [*first, {"role": "assistant", "content": solo.text},
              {"role": "user", "content": "And on a Tuesday?"}]
    over_first = engine.generate(second, max_tokens=12, sampling=SAMPLED)
    assert over_first.timings.reused_tokens > len(solo.prompt_token_ids)
    alone = fresh(second)
    assert (over_first.token_ids, over_first.logprobs) == (alone.token_ids, alone.logprobs)
