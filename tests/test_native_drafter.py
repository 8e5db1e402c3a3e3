"""The drafter on the native build (drafter/native.py, model/native/drafter.h), on every build
this CPU runs: near the float32 drafter, rows independent of how the context was appended, the
Markov head exactly as its definition, and the runtime's cache bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspark.drafter import native as native_module
from adaspark.drafter.checkpoint import load_checkpoint
from adaspark.drafter.loading import DEFAULT_DRAFTER, target_info
from adaspark.drafter.model import DrafterConfig, DraftModel
from adaspark.drafter.native import fc_weights, native_drafter
from adaspark.drafter.runtime import Drafter
from adaspark.model import native

pytestmark = pytest.mark.slow
POSITIONS = 512


@pytest.fixture(scope="module")
def shipped(fast_model, model_path):
    """The shipped drafter's float32 model, its taps of a prompt, and that prompt's tokens."""
    model = load_checkpoint(DEFAULT_DRAFTER, target_info(fast_model, model_path),
                            fast_model.embed)
    tokens = list(range(1000, 1100))
    fast_model.reset()
    out = fast_model.prefill(tokens, tap_layers=model.c.target_layers)
    fast_model.reset()
    taps = torch.stack([out.hiddens[i] for i in model.c.target_layers], -2)
    return model, taps, tokens


@pytest.fixture(scope="module", params=native.runnable_isas())
def module(request):
    module, why = native.load_isa(request.param)
    if module is None:
        pytest.skip(f"native {request.param} build not usable here: {why}")
    return module


def runtimes(module, model, embed):
    return (Drafter(model, embed, native=module, positions=POSITIONS),
            Drafter(model, embed, dtype=torch.float32))


def test_q8_0_keeps_each_weight_within_half_a_step():
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 96)
    bits, u, d, m = native.quantize_q8_0(w)
    blocks = w.numpy().reshape(48, 3, 32)
    assert bits == 8 and u.dtype == np.uint8 and int(u.min()) >= 1  # q in -127..127
    assert np.array_equal(d, d.astype(np.float16).astype(np.float32))  # GGUF's fp16 scales
    values = d[..., None] * u + m[..., None]
    assert np.all(np.abs(values - blocks) <= d[..., None] * (0.5 + 2**-10))


def test_q4_1_keeps_each_weight_within_half_a_step():
    """Half a step d/2, plus the fp16 rounding of the block's minimum and step (2^-11 of each,
    the step's over its 15 steps)."""
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 96)
    bits, u, d, m = native.quantize_q4_1(w)
    blocks = w.numpy().reshape(48, 3, 32)
    assert bits == 4 and u.dtype == np.uint8 and int(u.max()) <= 15
    for s in (d, m):  # GGUF's fp16 scales and minimums
        assert np.array_equal(s, s.astype(np.float16).astype(np.float32))
    values = d[..., None] * u + m[..., None]
    slack = d * (0.5 + 16 * 2**-11) + np.abs(m) * 2**-11
    assert np.all(np.abs(values - blocks) <= slack[..., None])


def test_a_q4_1_head_stays_near_the_float32_head(module, shipped, fast_model):
    """The head in Q4_1: each weight off by at most half a step of its block's range / 15, ~range
    / 52 rms, about 8% of a block's rms for trained rows (a block's range ~4 of its rms), so
    the logits move by about that (measured 9.5% on the shipped head; Q8_0: 0.8%); a wrong
    nibble order or scale gives ~100%.
    The picks then differ only where the float32 logits nearly tie."""
    model, taps, tokens = shipped
    anchor = fast_model.embed(torch.tensor([tokens[-1]]))[0]
    for bits, bound in ((8, 2**-5), (4, 2**-3)):
        d = Drafter(model, fast_model.embed, native=module, positions=POSITIONS, head_bits=bits)
        d.observe({i: taps[:, j] for j, i in enumerate(model.c.target_layers)})
        n = d.cache.length
        hidden, logits = d.native.backbone(d.cache.k, d.cache.v, anchor, n, torch.empty(0))
        want = model.logits(hidden).detach()  # the float32 head on the native rows
        error = (logits - want).norm(dim=-1) / want.norm(dim=-1)
        assert float(error.max()) < bound, (bits, float(error.max()))
    with pytest.raises(ValueError, match="head_bits"):
        Drafter(model, fast_model.embed, native=module, positions=POSITIONS, head_bits=5)


def test_the_native_backbone_stays_near_the_float32_drafter(module, shipped, fast_model):
    """Q8_0 weights and int8 activations, each rounded by at most half a step of 1/127 of a
    block's largest value, move the one-layer drafter's rows by about 1% (measured 0.99%; 1.8%
    before fc took the taps in float32); 2^-4 is far below a wrong mask, position or weight
    layout (~100%)."""
    model, taps, tokens = shipped
    nat, ref = runtimes(module, model, fast_model.embed)
    for d in (nat, ref):
        d.observe({i: taps[:, j] for j, i in enumerate(model.c.target_layers)})
    anchor = torch.tensor([tokens[-1]])
    n = nat.cache.length
    hidden, logits = nat.native.backbone(nat.cache.k, nat.cache.v,
                                         fast_model.embed(anchor)[0], n, torch.empty(0))
    with torch.inference_mode():
        ref.cache._grow(n + model.c.block_size)
        x = model.block_rows(fast_model.embed(anchor)[0])
        pos = torch.arange(n, n + model.c.block_size)
        for layer, k, v in zip(model.layers, ref.cache.k, ref.cache.v, strict=True):
            x = layer.forward_cached(x, pos, k, v, n)
        want = model.norm(x)
    error = (hidden - want).norm(dim=-1) / want.norm(dim=-1)
    assert float(error.max()) < 2**-4
    want_logits = model.logits(want)
    assert float(((logits - want_logits).norm(dim=-1) / want_logits.norm(dim=-1)).max()) < 2**-4


def test_appending_token_by_token_equals_one_batch(module, shipped, fast_model):
    model, taps, tokens = shipped
    one = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    many = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    one.cache.append(taps)
    for row in taps:
        many.cache.append(row[None])
    n = len(tokens)
    assert torch.equal(one.cache.k[:, :, :n], many.cache.k[:, :, :n])
    assert torch.equal(one.cache.v[:, :, :n], many.cache.v[:, :, :n])
    a, b = one.draft(tokens[-1]), many.draft(tokens[-1])
    assert np.array_equal(a.topk_ids, b.topk_ids) and np.array_equal(a.head, b.head)


def test_fc_reads_fp16_weights_only_where_each_weight_is_one(module):
    exact = torch.tensor([[1.0, -0.5, 2.0**-20, 65504.0]])
    assert fc_weights(module, exact).dtype == torch.float16
    assert fc_weights(module, exact + 1e-4).dtype == torch.float32  # 1.0001 is no fp16 number


def test_fp16_fc_weights_append_the_float32_ones_bits(module, shipped, fast_model, monkeypatch):
    """The shipped fc is fp16 in the checkpoint: stored as fp16 (half the bytes an append
    reads) it gives the float32 copy's features bit for bit, over 100 rows (a block of 64 and
    the rest) and one at a time."""
    model, taps, tokens = shipped
    assert fc_weights(module, model.fc.weight).dtype == torch.float16
    half = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    monkeypatch.setattr(native_module, "fc_weights",
                        lambda _module, w: w.detach().float().contiguous())
    full = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    half.cache.append(taps)
    full.cache.append(taps)
    for d in (half, full):
        d.cache.append(taps[:1])
    n = len(tokens) + 1
    assert torch.equal(half.cache.k[:, :, :n], full.cache.k[:, :, :n])
    assert torch.equal(half.cache.v[:, :, :n], full.cache.v[:, :, :n])


def test_fp16_markov_rows_give_the_float32_ones_bits(module, shipped, monkeypatch):
    """The shipped W2 is fp16 in the checkpoint: stored as fp16 (half the bytes the Markov
    pass gathers) the head's picks, candidates and values are the float32 copy's, bit for bit,
    on logits whose shortlists are rarely exact (many candidates reach the cap pass)."""
    model, _, _ = shipped
    assert native_module.half_if_exact(module, model.markov_w2.weight,
                                       "MARKOV_HALF").dtype == torch.float16
    half = native_drafter(module, model, POSITIONS)
    monkeypatch.setattr(native_module, "half_if_exact",
                        lambda _module, w, _takes: w.detach().float().contiguous())
    full = native_drafter(module, model, POSITIONS)
    torch.manual_seed(3)
    B, V = model.c.block_size, model.c.draft_vocab_size
    for _ in range(4):
        hidden, logits = torch.randn(B, model.c.dim), torch.randn(B, V) * 0.5
        got, want = half.markov(hidden, logits, 17, 64, 8), full.markov(hidden, logits, 17, 64, 8)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_appending_in_chunks_of_every_size_equals_one_batch(module, shipped, fast_model):
    """fc takes a call's rows 4 at a time and the rest 3, 2 or 1 together: each size gives
    every row the same bits."""
    model, taps, tokens = shipped
    one = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    chunks = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    one.cache.append(taps)
    at = 0
    for n in (3, 2, 1, 7, 5, 6, 4, 3, 2, 3):
        chunks.cache.append(taps[at:at + n])
        at += n
    assert torch.equal(one.cache.k[:, :, :at], chunks.cache.k[:, :, :at])
    assert torch.equal(one.cache.v[:, :, :at], chunks.cache.v[:, :, :at])


def test_observing_a_run_of_rows_equals_gathering_them(module, shipped, fast_model):
    """Consecutive accepted rows are sliced, others gathered: the same taps either way, and a
    run past the rows still fails as the gather does."""
    model, taps, tokens = shipped
    hiddens = {i: taps[:, j] for j, i in enumerate(model.c.target_layers)}
    run, gathered = (Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
                     for _ in range(2))
    for d in (run, gathered):
        d.observe({i: h[:50] for i, h in hiddens.items()})
    run.observe(hiddens, rows=range(50, 60))
    gathered.observe(hiddens, rows=[50, 51, 52, 53, 54, 55, 56, 57, 59, 58])
    gathered.truncate(58)
    gathered.observe(hiddens, rows=[58, 59])
    assert torch.equal(run.cache.k, gathered.cache.k)
    with pytest.raises(IndexError):
        run.observe(hiddens, rows=range(len(tokens) - 1, len(tokens) + 1))


def markov_reference(model, hidden, logits, prev, shortlist, topk):
    """The Markov and confidence heads by their definition, in float64 numpy: the bias on every
    candidate of the draft vocabulary (the peers' form; the native shortlist must give the
    same picks), best first with ties to the lower index; returns picks, top ids, top values,
    confidences and the largest error a float32 sum of the Markov and confidence dots can
    carry. `shortlist` is not read: a shortlist may only change the cost."""
    w1 = model.markov_w1.weight.detach().double().numpy()
    w2 = model.markov_w2.weight.detach().double().numpy()
    cw = model.confidence.weight.detach().double().numpy()[0]
    cb = float(model.confidence.bias.detach())
    temp = model.temperature.double().numpy()
    hidden, logits = hidden.double().numpy(), logits.double().numpy()
    picks, ids, vals, conf, slack = [], [], [], [], 0.0
    eps = np.finfo(np.float32).eps
    for i in range(len(logits)):
        short = np.lexsort((np.arange(logits.shape[1]), -logits[i]))
        e = w1[prev]
        terms = w2[short] * e
        sv = logits[i, short] + terms.sum(-1)
        slack = max(slack, float(np.abs(terms).sum(-1).max()) * len(e) * eps)
        order = np.lexsort((np.arange(len(sv)), -sv))[:topk]
        ids.append(short[order])
        vals.append(sv[order])
        c = cw[:len(hidden[i])] @ hidden[i] + cw[len(hidden[i]):] @ e + cb
        conf.append(1 / (1 + np.exp(-c / temp[i])))
        prev = int(short[order[0]])
        picks.append(prev)
    return np.array(picks), np.array(ids), np.array(vals), np.array(conf), slack


def test_the_markov_head_runs_along_the_picks(module, shipped, fast_model):
    model, _, _ = shipped
    torch.manual_seed(1)
    with torch.no_grad():  # a Markov bias large enough to reorder the shortlists
        model_w2 = model.markov_w2.weight.clone()
        model.markov_w2.weight.normal_(0, 0.5)
        drafter = native_drafter(module, model, POSITIONS)
        B, V = model.c.block_size, model.c.draft_vocab_size
        hidden, logits = torch.randn(B, model.c.dim), torch.randn(B, V) * 3
        picks, ids, vals, conf = drafter.markov(hidden, logits, 17, 64, 8)
        want = markov_reference(model, hidden, logits, 17, 64, 8)
        model.markov_w2.weight.copy_(model_w2)
    r_picks, r_ids, r_vals, r_conf, slack = want
    assert np.allclose(vals.numpy(), r_vals, rtol=0, atol=2 * slack + 1e-5)
    assert np.allclose(conf.numpy(), r_conf, rtol=1e-4, atol=1e-6)
    gaps = np.diff(-r_vals, axis=1)  # where no two candidates are within the float error
    clear = (gaps > 4 * slack + 1e-5).all(1)
    first = int(np.argmin(clear)) if not clear.all() else B  # rows after a tie may differ
    assert first >= 2
    assert np.array_equal(picks.numpy()[:first], r_picks[:first])
    assert np.array_equal(ids.numpy()[:first], r_ids[:first])
    assert np.array_equal(picks.numpy(), ids.numpy()[:, 0])


def test_the_runtime_drafts_the_same_after_truncate_and_reobserve(module, shipped, fast_model):
    model, taps, tokens = shipped
    hiddens = {i: taps[:, j] for j, i in enumerate(model.c.target_layers)}
    d = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    d.observe(hiddens)
    first = d.draft(tokens[-1])
    d.truncate(40)
    d.observe(hiddens, rows=range(40, len(tokens)))
    again = d.draft(tokens[-1])
    for field in ("picks", "topk_ids", "topk_logits", "head"):
        assert np.array_equal(getattr(first, field), getattr(again, field)), field
    assert np.array_equal(first.picks, first.topk_ids[:, 0])
    assert np.all((first.head > 0) & (first.head < 1))
    assert set(first.topk_ids.flatten()) <= set(model.draft_ids.tolist())


def test_the_cache_refuses_positions_past_its_rope_table(module, shipped, fast_model):
    model, taps, _ = shipped
    d = Drafter(model, fast_model.embed, native=module, positions=64)
    with pytest.raises(ValueError, match="positions end at 64"):
        d.cache.append(taps)
    with pytest.raises(RuntimeError, match="taps must be float32"):
        d.native.append(d.cache.k, d.cache.v, torch.zeros(2, 5), 0)


def test_a_checkpoint_the_native_draft_cannot_take_runs_on_torch(module, fast_model, caplog):
    ids = torch.arange(256)
    c = DrafterConfig(target_layers=[1, 14, 27], draft_vocab_size=256, n_heads=12,
                      n_kv_heads=4, head_dim=48)  # 48 floats: 3 AVX-512 vectors, not taken
    d = Drafter(DraftModel(c, ids, fast_model.embed(ids)), fast_model.embed, native=module,
                positions=POSITIONS)
    assert d.native is None and "torch path runs" in caplog.text
    assert d.draft(5).picks.shape == (c.block_size,)


def test_the_shortlist_breaks_ties_to_the_lower_index(module, shipped, fast_model):
    """Logits full of exact ties and no Markov bias: every row's shortlist, top-k and pick are
    the float64 reference's exactly (best first, the lower index first among equals), the
    selection's vector skip included (ties arrive in every lane position)."""
    model, _, _ = shipped
    with torch.no_grad():
        w2 = model.markov_w2.weight.clone()
        model.markov_w2.weight.zero_()
        drafter = native_drafter(module, model, POSITIONS)
        B, V = model.c.block_size, model.c.draft_vocab_size
        g = torch.Generator().manual_seed(3)
        logits = torch.randint(0, 6, (B, V), generator=g).float()  # ~V/6 ties at the top
        logits[1, V - 3:] = 9.0  # the best three at the very end, in the padded tail
        logits[2] = 0.0  # one value everywhere: the first indices win
        hidden = torch.randn(B, model.c.dim, generator=g)
        picks, ids, vals, _ = drafter.markov(hidden, logits, 5, 64, 8)
        r_picks, r_ids, r_vals, _, _ = markov_reference(model, hidden, logits, 5, 64, 8)
        model.markov_w2.weight.copy_(w2)
    assert np.array_equal(ids.numpy(), r_ids) and np.array_equal(picks.numpy(), r_picks)
    assert np.array_equal(vals.numpy(), r_vals)
    assert list(ids.numpy()[1, :3]) == [V - 3, V - 2, V - 1]
    assert list(ids.numpy()[2]) == list(range(8))


@pytest.mark.parametrize("vocab", [8192, 1000])
@pytest.mark.parametrize("layout", ["ascending", "descending", "one_set", "ties", "tail"])
def test_the_shortlist_is_the_full_ranking_whatever_the_layout(module, fast_model, layout, vocab):
    """The shortlist is cut by a bound from the maxima of sets of lanes, then ranked: the best
    values ascending, descending, all in one lane of the first vectors, tied, or at the end
    (past the whole groups where the vocabulary does not fill them) give the full ranking's
    first S exactly (no Markov bias, topk = S)."""
    ids = torch.arange(vocab)
    c = DrafterConfig(target_layers=[1, 14, 27], draft_vocab_size=vocab)
    model = DraftModel(c, ids, fast_model.embed(ids))
    B, V, S = c.block_size, vocab, 64
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(B, V, generator=g)
    if layout == "ascending":
        rows = torch.arange(V).float().expand(B, V).clone()
    elif layout == "descending":
        rows = torch.arange(V, 0, -1).float().expand(B, V).clone()
    elif layout == "one_set":  # every 16th value: one lane of 16 (or 8) lanes
        rows[:, 3:3 + 16 * 2 * S:16] += 100.0
    elif layout == "ties":
        rows = torch.randint(0, 3, (B, V), generator=g).float()
    else:
        rows[:, V - 5:] += 50.0
    with torch.no_grad():
        model.markov_w2.weight.zero_()
        drafter = native_drafter(module, model, POSITIONS)
        _, top, _, _ = drafter.markov(torch.zeros(B, c.dim), rows, 5, S, S)
    for i in range(B):
        want = np.lexsort((np.arange(V), -rows[i].double().numpy()))[:S]
        assert np.array_equal(top.numpy()[i], want), i


def test_drafting_from_the_anchor_id_equals_drafting_from_its_embedding(module, shipped,
                                                                        fast_model):
    """Given the target's embedding table the native draft looks the anchor up and maps its
    ids itself: the same blocks as the embed() path, for an anchor in the draft vocabulary,
    one outside it, and one past the id table, with and without noise."""
    model, taps, tokens = shipped
    table = native.pack_embeddings(module, fast_model._weights.raw("token_embd.weight"))
    hiddens = {i: taps[:, j] for j, i in enumerate(model.c.target_layers)}
    by_id = Drafter(model, fast_model.embed, native=module, positions=POSITIONS,
                    embedding=table)
    by_row = Drafter(model, fast_model.embed, native=module, positions=POSITIONS)
    outside = int(np.flatnonzero(model.to_draft_table.numpy() == model.c.draft_vocab_size)[0])
    past = len(model.to_draft_table)
    assert past < fast_model.config.vocab_size
    noise = torch.randn(model.c.block_size, model.c.draft_vocab_size,
                        generator=torch.Generator().manual_seed(2))
    for d in (by_id, by_row):
        d.observe(hiddens)
    for anchor in (tokens[-1], outside, past):
        for n in (None, noise):
            a, b = by_id.draft(anchor, noise=n), by_row.draft(anchor, noise=n)
            for field in ("picks", "topk_ids", "topk_logits", "head"):
                assert np.array_equal(getattr(a, field), getattr(b, field)), (anchor, field)
    with pytest.raises(RuntimeError, match="anchor id out of the vocabulary"):
        by_id.draft(fast_model.config.vocab_size)
