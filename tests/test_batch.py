"""Continuous batching of plain decoding (batch.py, sequence.py) on the real model: a request's
tokens are the same alone or beside others (greedy and seeded sampling), requests join and leave
at any step, every step verifies all running rows in one forward, a failing or cancelled request
leaves the others untouched; and the server's default --parallel."""

from __future__ import annotations

import pytest
import torch

from adaspark.engine import Engine
from adaspark.errors import UserError
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import PREFILL_CHUNK
from adaspark.sampling import SamplingParams
from adaspark.server.worker import default_parallel

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPTS = [
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Count from one to ten in words."}],
]
LONG = [(37 * i) % 9000 + 100 for i in range(300)]  # 300 in-vocabulary ids
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=5, frequency_penalty=0.3,
                         logprobs=True)


@pytest.fixture(scope="module", params=["fast", "reference"])
def engine(request, fast_model, reference_model, model_path):
    """`ar` on the native forward (one call per step) and on the torch path (one verify per
    sequence): both must batch exactly."""
    target = fast_model if request.param == "fast" else reference_model
    engine = Engine(target, Tokenizer.from_gguf(model_path), model_path)
    engine.batch.max_slots = 1
    engine.reset()
    return engine


def alone(engine, prompt, **kw):
    engine.batch.max_slots = 1
    return engine.generate(prompt, **kw)


def together(engine, requests, joins=None, prefilling=None, prefills=None):
    """Run the requests (kwargs of new_decode, "messages" for the prompt's) in one batch;
    request i joins at step joins[i]. Returns their Decodes and the rows each step verified;
    `prefilling` (a list) gets how many requests were still prefilling after each step, and
    `prefills` (a list) the chunks of each prefill forward, with the index of its step."""
    engine.batch.max_slots = len(requests)
    joins = joins or [0] * len(requests)
    seqs = [engine.new_decode(engine.tokenizer.encode_chat(r.pop("messages"))
                              if "messages" in r else r.pop("prompt"), **r) for r in requests]
    widths, step = [], 0
    calls, fills = [], []
    verify_many, prefill_many = engine.target.verify_many, engine.target.prefill_many

    def spy(caches, rows, **kw):  # counts the forwards a step makes, runs the real one
        calls.append(len(rows))
        return verify_many(caches, rows, **kw)

    def spy_prefill(caches, chunks, **kw):
        fills.append((step, [len(c) for c in chunks]))
        return prefill_many(caches, chunks, **kw)

    engine.target.verify_many, engine.target.prefill_many = spy, spy_prefill
    try:
        while step <= max(joins) or engine.batch.running:
            for seq, join in zip(seqs, joins, strict=True):
                if join == step:
                    assert engine.batch.join(seq)  # prefilled in this step's prefill forward
            before = len(calls)
            engine.batch.step()
            assert len(calls) - before <= 1  # every running row in one forward
            widths.append(sum(calls[before:]))
            if prefilling is not None:
                prefilling.append(sum(seq.prefilling for seq in engine.batch.running))
            step += 1
    finally:
        del engine.target.verify_many, engine.target.prefill_many
    if prefills is not None:
        prefills += fills
    return seqs, widths


def test_greedy_tokens_alone_equal_beside_others_joining_and_leaving(engine):
    solo = [alone(engine, p, max_tokens=n) for p, n in zip(PROMPTS, (24, 8, 16), strict=True)]
    seqs, widths = together(engine, [{"messages": p, "max_tokens": n} for p, n
                                     in zip(PROMPTS, (24, 8, 16), strict=True)], joins=[0, 3, 5])
    for s, seq in zip(solo, seqs, strict=True):
        got = engine.result(seq)
        assert (got.token_ids, got.text, got.finish_reason) == (s.token_ids, s.text,
                                                                 s.finish_reason)
    assert max(widths) == 3  # they did run side by side
    assert widths[3] == 2 and widths[5] == 3  # each joined at its step
    assert widths[-2] == 1  # ...and left when done


def test_wide_steps_keep_every_row_as_alone(engine):
    """Six rows a step: past the row counts where the native matmuls change their blocking
    (AMX tiles from 5 rows where the CPU has them), each row still comes out as alone."""
    prompts = PROMPTS + [[{"role": "user", "content": text}] for text in
                         ("Say hello.", "List two fruits.", "What is two plus two?")]
    solo = [alone(engine, p, max_tokens=8).token_ids for p in prompts]
    seqs, widths = together(engine, [{"messages": p, "max_tokens": 8} for p in prompts])
    assert [engine.result(seq).token_ids for seq in seqs] == solo
    assert max(widths) == 6


def test_seeded_sampling_alone_equals_beside_others(engine):
    solo = [alone(engine, p, max_tokens=12, sampling=SAMPLED) for p in PROMPTS[:2]]
    greedy = alone(engine, PROMPTS[2], max_tokens=12)
    seqs, _ = together(engine, [{"messages": PROMPTS[0], "max_tokens": 12, "sampling": SAMPLED},
                                {"messages": PROMPTS[2], "max_tokens": 12},
                                {"messages": PROMPTS[1], "max_tokens": 12, "sampling": SAMPLED}])
    got = [engine.result(seq) for seq in seqs]
    assert [g.token_ids for g in got] == [solo[0].token_ids, greedy.token_ids,
                                          solo[1].token_ids]
    assert got[0].logprobs == solo[0].logprobs and got[0].seed == solo[0].seed


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_the_others_stream(engine):
    engine.batch.prefill_chunk = 64  # 300 prompt tokens: chunks of 64 x 4 and 44
    try:
        solo = [alone(engine, PROMPTS[0], max_tokens=12), alone(engine, LONG, max_tokens=6)]
        engine.reset()  # no slot holds the long prompt: it is prefilled from its start
        prefilling, prefills = [], []
        seqs, widths = together(engine, [{"messages": PROMPTS[0], "max_tokens": 12},
                                         {"prompt": LONG, "max_tokens": 6},
                                         {"prompt": LONG[1:], "max_tokens": 6,
                                          "should_stop": lambda: len(prefilling) >= 3}],
                                joins=[0, 2, 2], prefilling=prefilling, prefills=prefills)
    finally:
        engine.batch.prefill_chunk = PREFILL_CHUNK
    assert [engine.result(s).token_ids for s in seqs[:2]] == [g.token_ids for g in solo]
    # the two long ones joined together: their first chunks in one forward (neither prompt
    # ends there); steps 3-5 ran the long one's chunks 2-4 beside the short request's rows,
    # step 6 its last chunk, and it decodes in that step already
    assert [chunks for _, chunks in prefills[1:]] == [[64, 64], [64], [64], [64], [44]]
    assert widths[2:7] == [1, 1, 1, 1, 2] and prefilling[2:7] == [2, 1, 1, 1, 0]
    cancelled = engine.result(seqs[2])  # cancelled between two chunks: no token
    assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == []


def test_prompts_ending_together_prefill_shortest_first_each_streaming_at_once(engine):
    """Three arrivals at once, whose prompts end in the same step: a forward each, shortest
    prompt first, and each request's first token streams as soon as its own forward ends,
    before the next prompt's forward (a compute-bound prefill of three prompts in one forward
    made each wait for all three). Each reply is the one it gets alone, and all three decode
    in the step of their prefill."""
    prompts = [[{"role": "user", "content": text}] for text in (  # longest first
        "Write one sentence about the sea, then one about the mountains, then stop.",
        "Say hello.", "Name two colours of the rainbow.")]
    solo = [alone(engine, p, max_tokens=6).token_ids for p in prompts]
    engine.reset()
    forwards = []
    prefill_many = engine.target.prefill_many

    def spy(caches, chunks, **kw):  # each forward's prompt, and the first tokens taken so far
        taken = sum(1 for seq in engine.batch.running if seq.reply.token_ids or seq.reply.done)
        forwards.append(([len(c) for c in chunks], taken))
        return prefill_many(caches, chunks, **kw)

    lengths = [len(engine.tokenizer.encode_chat(p)) for p in prompts]
    assert lengths[0] > lengths[2] > lengths[1]
    engine.target.prefill_many = spy
    try:
        seqs, widths = together(engine, [{"messages": p, "max_tokens": 6} for p in prompts])
    finally:
        engine.target.__dict__.pop("prefill_many", None)  # together() removes its own spy
    assert [engine.result(seq).token_ids for seq in seqs] == solo
    # one forward each, shortest first; before each, every shorter prompt's first token taken
    assert forwards == [([n], k) for k, n in enumerate(sorted(lengths))]
    assert widths[0] == 3


def test_prefill_many_is_each_prefill_alone(fast_model):
    """Chunks of 40, 3 and 64 rows (the 3 alone takes the few-row kernels), one after a
    committed prefix: the same argmax, logits, taps and K/V as each prefill alone; a chunk
    that fails leaves every cache as it was."""
    if fast_model.native is None:
        pytest.skip("no native build: prefill_many runs each prefill alone")
    chunks, taps = [LONG[:40], LONG[50:53], LONG[100:164]], (3, 11)
    alone_caches, alone_outs = [], []
    for i, chunk in enumerate(chunks):
        cache = fast_model.new_cache()
        with fast_model.using(cache):
            if i == 1:
                fast_model.prefill(LONG[200:230])
            alone_outs.append(fast_model.prefill(chunk, taps, return_logits=True))
        alone_caches.append(cache)
    caches = [fast_model.new_cache() for _ in chunks]
    with fast_model.using(caches[1]):
        fast_model.prefill(LONG[200:230])
    outs = fast_model.prefill_many(caches, chunks, tap_layers=taps, return_logits=True)
    for a, b, ca, cb in zip(alone_outs, outs, alone_caches, caches, strict=True):
        assert torch.equal(a.argmax, b.argmax) and torch.equal(a.logits, b.logits)
        assert all(torch.equal(a.hiddens[t], b.hiddens[t]) for t in taps)
        n = ca.length
        assert cb.length == n and torch.equal(ca.k[..., :n, :], cb.k[..., :n, :])
        assert torch.equal(ca.v[..., :n, :], cb.v[..., :n, :])
    lengths = [c.length for c in caches]
    with pytest.raises(UserError, match="out of range"):
        fast_model.prefill_many(caches[:2], [LONG[:5], [10**7]], tap_layers=taps)
    assert [c.length for c in caches] == lengths


def test_a_failing_or_cancelled_request_leaves_the_others_untouched(engine):
    solo = alone(engine, PROMPTS[1], max_tokens=16)
    streamed = []

    def broken(text):  # a client callback that fails on its second piece of text
        streamed.append(text)
        if len(streamed) > 1:
            raise ConnectionError("client gone")

    steps = 0

    def cancel_soon():
        return steps >= 4

    engine.batch.max_slots = 3
    seqs = [engine.new_decode(engine.tokenizer.encode_chat(p), max_tokens=16, **kw)
            for p, kw in ((PROMPTS[0], {"on_text": broken}), (PROMPTS[1], {}),
                          (PROMPTS[2], {"should_stop": cancel_soon}))]
    for seq in seqs:
        assert engine.batch.add(seq)
    while engine.batch.running:
        running = len(engine.batch.running)
        finished = engine.batch.step()
        steps += 1
        assert len(engine.batch.running) == running - len(finished)  # their slots are free
    assert isinstance(seqs[0].error, ConnectionError) and seqs[0].slot.ids == []
    assert engine.result(seqs[1]).token_ids == solo.token_ids
    cancelled = engine.result(seqs[2])
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 16


def test_an_interrupted_request_leaves_the_batch_clean(engine):
    solo = alone(engine, PROMPTS[1], max_tokens=8)

    def interrupt(text):  # Ctrl-C while the reply streams
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        alone(engine, PROMPTS[0], max_tokens=8, on_text=interrupt)
    assert not engine.batch.running and engine.cache.ids == []
    assert alone(engine, PROMPTS[1], max_tokens=8).token_ids == solo.token_ids


def test_a_refused_prompt_fails_alone(engine):
    seq = engine.new_decode([1] * 10, max_tokens=4)
    seq.prompt = [10**7]  # past the vocabulary: the prefill refuses it
    engine.batch.max_slots = 2
    assert not engine.batch.add(seq)
    assert seq.error is not None and not engine.batch.running


def test_default_parallel_from_cores_and_memory():
    slot = 200 << 20
    assert default_parallel(slot, cores=2, memory=64 << 30) == 4
    assert default_parallel(slot, cores=16, memory=64 << 30) == 8  # a step's rows stay few
    assert default_parallel(slot, cores=2, memory=600 << 20) == 1  # a quarter holds 0.75 slots
    assert default_parallel(slot, cores=2, memory=None) == 4


def test_a_slot_takes_another_slots_prefix_exactly_and_never_with_a_drafter():
    from adaspark.cached import CachedTokens
    from adaspark.model.cache import KVCache

    def cache():
        return KVCache(2, 1, 4, 8, torch.float32, conv_layers=1, conv_dim=3)

    source, target = cache(), cache()
    for t in (source.k, source.v, source.conv):
        t.copy_(torch.randn(t.shape))
    source.length = 6
    target.copy_prefix(source, 4)
    assert target.length == 4
    assert torch.equal(target.k[:, :, :, :4], source.k[:, :, :, :4])
    assert torch.equal(target.v[:, :, :, :4], source.v[:, :, :, :4])
    assert torch.equal(target.conv[:, :, :4], source.conv[:, :, :4])
    assert not target.k[:, :, :, 4:].any()  # nothing past the prefix
    with pytest.raises(ValueError):
        target.copy_prefix(source, 7)  # more than the source holds
    held = CachedTokens(None, kv=source)
    held.ids = list(range(6))
    slot = CachedTokens(None, kv=cache())
    slot.copy_prefix(held, 5)
    assert slot.ids == [0, 1, 2, 3, 4] and slot.kv.length == 5
    with pytest.raises(ValueError, match="drafter"):
        CachedTokens(None, drafter=object(), kv=cache()).copy_prefix(held, 2)


@pytest.mark.parametrize("order", [(1, 14, 27), (27, 1, 14)])
def test_a_step_hands_each_request_its_rows_taps_in_the_batchs_tap_order(fast_model,
                                                                       model_path, order,
                                                                       monkeypatch):
    """A step's taps reach take() as [rows, taps, dim] in Batch.tap_layers' order: the
    forward's own tensor (a view, no copy) where its ascending order is the batch's, else the
    hiddens stacked in the batch's order."""
    from adaspark.sequence import Decode

    engine = Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)
    engine.batch.tap_layers = order
    outs, got = [], []
    verify_many, take = fast_model.verify_many, Decode.take

    def spy(caches, rows, **kw):
        outs.append(verify_many(caches, rows, **kw))
        return outs[-1]

    def taken(self, argmax, logits=None, step=None, taps=None):
        got.append(taps)
        return take(self, argmax, logits, step, taps)

    monkeypatch.setattr(fast_model, "verify_many", spy)
    monkeypatch.setattr(Decode, "take", taken)
    engine.generate(PROMPTS[0], max_tokens=4)
    assert len(outs) == len(got) == 3  # the prefill's pick, then three one-row steps
    for out, taps in zip(outs, got, strict=True):
        assert torch.equal(taps, torch.stack([out.hiddens[layer] for layer in order], -2))
        # a view of the forward's own tensor only in its order
        assert (taps._base is out.tap_rows._base) == (order == tuple(sorted(order)))
