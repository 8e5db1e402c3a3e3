"""DSpark drafter: cache alignment across commits, the Markov head along the picks, batched
training path == runtime path. A tiny random drafter over synthetic target features."""

import numpy as np
import pytest
import torch

from adaspark.drafter.loss import Batch, forward_batch
from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.drafter.runtime import Drafter

DIM, V_TARGET, TAPS = 32, 100, [0, 2]


def tiny(seed=0, block=4, n_layers=1):
    torch.manual_seed(seed)
    c = DrafterConfig(
        target_layers=TAPS, draft_vocab_size=40, dim=DIM, block_size=block, n_layers=n_layers,
        n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, markov_rank=8, topk=5,
    )
    embed = torch.nn.Embedding(V_TARGET, DIM).requires_grad_(False)
    draft_ids = torch.arange(0, 80, 2)  # even target ids form the draft vocabulary
    model = DraftModel(c, draft_ids, embed(draft_ids))
    with torch.no_grad():  # a non-zero Markov head so that it matters
        model.markov_w2.weight.normal_(0, 1.0)
    return model, embed


def hiddens(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(n, DIM, generator=g) for layer in TAPS}


def test_cache_follows_commits_like_full_recompute():
    model, embed = tiny()
    full = Drafter(model, embed, capacity=4, dtype=torch.float32)
    h = hiddens(30)
    full.observe(h)
    inc = Drafter(model, embed, capacity=4, dtype=torch.float32)
    inc.observe({k: v[:10] for k, v in h.items()})  # prefill
    # rounds: a verify's rows = committed path rows mixed with rejected rows
    pos = 10
    for accepted in (3, 1, 5, 2, 9):
        rejected = hiddens(4, seed=pos)  # rows the target verified but did not accept
        rows = {k: torch.cat([h[k][pos : pos + accepted], rejected[k]]) for k in h}
        order = list(range(accepted))
        inc.draft(7)  # a draft writes scratch K/V past the prefix; commits must overwrite it
        inc.observe(rows, rows=order)
        pos += accepted
    assert inc.length == full.length == 30
    for a, b in zip(inc.cache.k + inc.cache.v, full.cache.k + full.cache.v, strict=True):
        torch.testing.assert_close(a[:, :30], b[:, :30])
    x, y = inc.draft(11), full.draft(11)
    np.testing.assert_array_equal(x.topk_ids, y.topk_ids)
    np.testing.assert_allclose(x.topk_logits, y.topk_logits, rtol=1e-5, atol=1e-5)


def test_truncate_then_observe_matches_fresh():
    model, embed = tiny()
    h = hiddens(20)
    d = Drafter(model, embed, dtype=torch.float32)
    d.observe(h)
    d.truncate(12)
    d.observe({k: v[12:] for k, v in h.items()})
    fresh = Drafter(model, embed, dtype=torch.float32)
    fresh.observe(h)
    np.testing.assert_allclose(d.draft(3).topk_logits, fresh.draft(3).topk_logits, rtol=1e-5)


def test_rounds_without_a_draft_are_appended_at_the_next_one():
    """Plain and gated rounds only observe; their features enter the cache in one batch at the
    next draft, a truncate may cut into them, and the result is the fresh recompute's."""
    model, embed = tiny()
    h = hiddens(30)
    d = Drafter(model, embed, dtype=torch.float32)
    d.observe({k: v[:10] for k, v in h.items()})
    d.draft(3)
    for a, b in ((10, 13), (13, 14), (14, 20)):  # three rounds without a draft
        d.observe({k: v[a:b] for k, v in h.items()})
    assert d.length == 20 and d._cache.length == 10  # observed, not yet computed
    d.truncate(16)  # cut inside the observed-only tokens
    d.observe({k: v[16:25] for k, v in h.items()}, rows=range(9))
    d.truncate(24)
    assert d.length == 24
    fresh = Drafter(model, embed, dtype=torch.float32)
    fresh.observe({k: v[:24] for k, v in h.items()})
    np.testing.assert_allclose(d.draft(5).topk_logits, fresh.draft(5).topk_logits, rtol=1e-5,
                               atol=1e-5)
    assert d._cache.length == 24
    d.truncate(8)  # below the computed prefix
    fresh.truncate(8)
    np.testing.assert_allclose(d.draft(5).topk_logits, fresh.draft(5).topk_logits, rtol=1e-5,
                               atol=1e-5)


def runtime_vs_batched(model, embed, h, anchor, prev_tokens):
    """Batched training path at the runtime's anchor with the given previous tokens."""
    n = h[TAPS[0]].shape[0]
    B = model.c.block_size
    batch = Batch(
        taps=torch.stack([h[t] for t in TAPS], -2),
        anchors=torch.tensor([n]),
        block_prev=torch.tensor([[anchor, *prev_tokens]]),
        labels=torch.zeros(1, B, dtype=torch.long),
        top_ids=torch.zeros(1, B, 1, dtype=torch.long),
        top_logits=torch.zeros(1, B, 1),
        valid=torch.ones(1, B, dtype=torch.bool),
    )
    with torch.no_grad():
        logits, conf = forward_batch(model, embed, batch)
    return logits[0], conf[0]


def test_markov_head_runs_along_the_picks():
    model, embed = tiny()
    h = hiddens(15)
    d = Drafter(model, embed, dtype=torch.float32)
    d.observe(h)
    block = d.draft(anchor=9)  # 9 is outside the draft vocabulary: W1's spare row
    # the training path, teacher-forced with the picks as previous tokens, must reproduce them
    logits, conf = runtime_vs_batched(model, embed, h, 9, block.picks[:-1].tolist())
    picks = model.draft_ids[logits.argmax(-1)].numpy()
    np.testing.assert_array_equal(picks, block.picks)
    np.testing.assert_array_equal(block.topk_ids[:, 0], block.picks)
    top = logits.topk(model.c.topk, -1).values.numpy()
    np.testing.assert_allclose(block.topk_logits, top, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(block.head, torch.sigmoid(conf).numpy(), rtol=1e-4, atol=1e-5)
    # and the picks really depend on the previous pick: without the head they differ
    with torch.no_grad():
        model.markov_w2.weight.zero_()
    plain = Drafter(model, embed, dtype=torch.float32)
    plain.observe(h)
    assert not np.array_equal(plain.draft(anchor=9).picks, block.picks)


def test_bf16_runtime_close_to_fp32():
    model, embed = tiny(n_layers=2)
    h = hiddens(40)
    fast, exact = Drafter(model, embed), Drafter(model, embed, dtype=torch.float32)
    fast.observe(h)
    exact.observe(h)
    a, b = fast.draft(4), exact.draft(4)
    assert a.topk_ids.shape == (4, 5) and a.head.shape == (4,)
    assert np.all((a.head > 0) & (a.head < 1))
    np.testing.assert_allclose(a.topk_logits[:, 0], b.topk_logits[:, 0], rtol=0.1, atol=0.3)


def test_observe_refuses_missing_tap():
    model, embed = tiny()
    d = Drafter(model, embed)
    with pytest.raises(ValueError, match="tap layers"):
        d.observe({0: torch.zeros(3, DIM)})


def test_every_anchor_of_a_training_batch_sees_what_the_runtime_sees():
    """Training/inference alignment: for each anchor a of a multi-anchor batch (blocks masked
    from each other, context cut at a), row 0 of the training forward equals the runtime
    draft after observing target positions 0..a-1 and drafting from token a, and its label is
    token a+1."""
    from adaspark.drafter.loss import make_batch
    from adaspark.drafter.shards import Sequence

    model, embed = tiny()
    T, P = 30, 6
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, V_TARGET, (T,), generator=g).numpy().astype(np.int32)
    h = hiddens(T - 1, seed=4)
    taps = torch.stack([h[t] for t in TAPS], -2).numpy().astype(np.float16)
    top = np.zeros((T - 1 - P, 1), np.int32)
    seq = Sequence(toks, P, taps, top, top.astype(np.float16))
    b = make_batch(seq, [0, 1], model.c.block_size, 8, np.random.default_rng(0))
    with torch.no_grad():
        logits, conf = forward_batch(model, embed, b)
    d = Drafter(model, embed, dtype=torch.float32)
    h16 = {t: torch.from_numpy(taps[:, i].astype(np.float32)) for i, t in enumerate(TAPS)}
    for n, a in enumerate(b.anchors.tolist()):
        assert b.block_prev[n, 0] == toks[a] and b.labels[n, 0] == toks[a + 1]
        d.reset()
        d.observe({t: x[:a] for t, x in h16.items()})
        block = d.draft(int(toks[a]))
        top_v, top_i = logits[n, 0].topk(model.c.topk)
        np.testing.assert_array_equal(block.topk_ids[0], model.draft_ids[top_i].numpy())
        np.testing.assert_allclose(block.topk_logits[0], top_v.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(block.head[0], torch.sigmoid(conf[n, 0]).item(), rtol=1e-4)
