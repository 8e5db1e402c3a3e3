"""The drafter on the real target: its feature cache follows the target's commits (verify + commit
rounds) exactly as a full recompute over the committed tokens would, and the data path writes
shards the trainer reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspark.drafter.data import generate_shards, select_prompts
from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.drafter.runtime import Drafter
from adaspark.drafter.shards import read_shards, shard_path, shard_prompts
from adaspark.model.sources import default_model_path
from adaspark.model.tokenizer import Tokenizer
from adaspark.model.transformer import Transformer

pytestmark = pytest.mark.slow
TAPS = [1, 14, 27]


@pytest.fixture(scope="module")
def target():
    # reference precision: verify rows and prefill rows then agree to rounding, so the cache
    # comparison below can be tight (fast kernels differ by row count, see paper §3.5)
    return Transformer.from_gguf(default_model_path(), precision="reference", max_context=512)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_model_path())


def random_drafter(target, block=4):
    torch.manual_seed(0)
    ids = torch.arange(0, 4096)
    c = DrafterConfig(target_layers=TAPS, draft_vocab_size=len(ids), block_size=block)
    return DraftModel(c, ids, target.embed(ids))


def test_cache_follows_verify_and_commit(target, tok):
    model = random_drafter(target)
    d = Drafter(model, target.embed, dtype=torch.float32)
    prompt = tok.encode_chat([{"role": "user", "content": "Count from one to ten."}])
    target.reset()
    out = target.prefill(prompt, tap_layers=d.tap_layers)
    d.observe(out.hiddens)
    anchor = int(out.argmax[-1])
    committed = list(prompt)
    for _ in range(4):
        block = d.draft(anchor)
        rows = [anchor, *block.picks.tolist()]
        n = len(rows)
        mask = np.tril(np.ones((n, n), dtype=bool))  # a chain: each row's ancestors are above it
        v = target.verify(rows, list(range(n)), mask, tap_layers=d.tap_layers)
        acc = 0
        while acc < n - 1 and rows[acc + 1] == int(v.argmax[acc]):
            acc += 1
        path = list(range(acc + 1))
        target.commit(path)
        d.observe(v.hiddens, rows=path)
        committed += rows[: acc + 1]
        anchor = int(v.argmax[acc])
        assert d.length == target.cache.length == len(committed)
    fresh = Drafter(model, target.embed, dtype=torch.float32)
    target.reset()
    fresh.observe(target.prefill(committed, tap_layers=fresh.tap_layers).hiddens)
    for a, b in zip(d.cache.k + d.cache.v, fresh.cache.k + fresh.cache.v, strict=True):
        torch.testing.assert_close(a[:, : d.length], b[:, : d.length], rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(d.draft(anchor).picks, fresh.draft(anchor).picks)


def test_data_shards_from_target(target, tok, tmp_path):
    prompts = select_prompts([{"prompt": "What is 2+2?"}, {"prompt": "Name a colour."}], tok, 2,
                             0, 512, shuffle=False)
    generate_shards(target, tok, prompts, tmp_path, TAPS, 6, per_shard=2, batch=2)
    seqs, taps = read_shards(tmp_path)
    assert taps == TAPS and len(seqs) == 2
    for s in seqs:
        assert s.hidden.shape[0] == len(s.tokens) - 1 and s.hidden.shape[1:] == (3, 576)
        assert s.top_ids.shape == (len(s.tokens) - 1 - s.prompt_len, 32)
    target.reset()
    s = seqs[0]
    out = target.prefill(s.tokens.tolist(), tap_layers=TAPS, return_logits=False)
    got = torch.from_numpy(s.hidden[:, 1].astype(np.float32))
    torch.testing.assert_close(got, out.hiddens[14][: len(got)], rtol=2e-2, atol=2e-2)


def test_shard_labels_are_the_targets_greedy_tokens(target, tok, tmp_path):
    """The trainer's labels (the stored reply) and its TV target (the stored top-k) must be the
    engine's own greedy choices over the engine's chat template, position by position: the
    first drafter's bootstrap data (bf16 logits, its own template for tools) was not."""
    item = {"prompt": "List three fruits.", "tools": [{"name": "get_time", "parameters": {}}]}
    prompts = select_prompts([item], tok, 1, 0, 512, shuffle=False)
    msgs = [{"role": "user", "content": item["prompt"]}]
    assert prompts[0] == tok.encode_chat(msgs, item["tools"])
    generate_shards(target, tok, prompts, tmp_path, TAPS, 8, per_shard=1, batch=1)
    s = read_shards(tmp_path)[0][0]
    P = s.prompt_len
    np.testing.assert_array_equal(s.top_ids[:, 0], s.tokens[P + 1 :])
    target.reset()
    out = target.prefill(s.tokens[:-1].tolist())
    assert int(out.argmax[-1]) == s.tokens[-1]
    target.reset()
    assert int(target.prefill(s.tokens[:P].tolist()).argmax[-1]) == s.tokens[P]


def test_a_later_data_run_adds_new_prompts_from_chosen_sources(target, tok, tmp_path):
    """A second data run (other sources, first_shard) numbers its shards after the first run's,
    draws only from its sources and never repeats a prompt an earlier shard holds."""
    items = [{"source": "code/a", "prompt": "Write a loop."},
             {"source": "chat/b", "prompt": "Say hello."},
             {"source": "chat/c", "prompt": "Name a colour."},
             {"source": "chat/b", "prompt": "Count to three."}]
    first = select_prompts(items[1:2], tok, 1, 0, 512, shuffle=False)
    generate_shards(target, tok, first, tmp_path, TAPS, 4, per_shard=1, batch=1)
    held = shard_prompts(tmp_path, below=1)
    assert held == {tuple(first[0])}
    later = select_prompts(items, tok, 10, 0, 512, sources=["chat/"], skip=held)
    expected = {tuple(select_prompts([it], tok, 1, 0, 512)[0]) for it in (items[2], items[3])}
    assert {tuple(p) for p in later} == expected  # no code prompt, no repeat of shard 0's
    generate_shards(target, tok, later, tmp_path, TAPS, 4, per_shard=1, batch=1,
                    first_shard=1)
    assert all(shard_path(tmp_path, i).exists() for i in (0, 1, 2))
    assert shard_prompts(tmp_path, below=3) == held | expected
