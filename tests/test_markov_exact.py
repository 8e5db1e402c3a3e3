"""The Markov head's shortlist is exact (drafter/runtime.py markov_chain, drafter.h markov()):
the pick of every row is the argmax over the whole draft vocabulary, as the peers compute it,
while the bias is computed for a shortlist and the few candidates a cap cannot exclude; with
the Markov table (a previous pick's high-bias set and a bound on every other bias), the whole
top K is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspark.drafter.runtime import markov_bound, markov_caps, markov_chain, markov_table

V, R, B = 2000, 32, 7


def low_rank_w2(seed: int, scale: float = 1.0) -> torch.Tensor:
    """A W2 like a trained one: a few strong directions and a weaker rest."""
    g = torch.Generator().manual_seed(seed)
    strong = torch.randn(V, 3, generator=g) @ torch.randn(3, R, generator=g) * 2
    return (strong + 0.3 * torch.randn(V, R, generator=g)) * scale


def test_the_caps_bound_every_candidates_biased_logit():
    for seed in range(5):
        w2 = low_rank_w2(seed)
        bound = markov_bound(w2, k=4)
        g = torch.Generator().manual_seed(100 + seed)
        logits, e = torch.randn(V, generator=g) * 5, torch.randn(R, generator=g) * 2
        exact = logits + w2 @ e  # float32, as the chain computes a candidate
        caps = markov_caps(logits, e, bound)
        assert bool((caps >= exact).all())
        assert float((caps - exact).max()) < float((w2.norm(dim=1) * e.norm()).max())


def test_the_tables_tau_bounds_every_bias_outside_the_high_set():
    g = torch.Generator().manual_seed(4)
    w2, w1 = low_rank_w2(2), torch.randn(300, R, generator=g)
    table = markov_table(w1, w2, m=16, chunk=128)  # chunks with a short last one
    keyed = markov_table(w1, w2, torch.tensor([5, 299, 5, 17]), m=16)  # a target-keyed head's
    assert keyed.row_of[[5, 17, 299]].tolist() == [0, 1, 2] and int(keyed.row_of[6]) == -1
    bias = w1.double() @ w2.double().T
    for t, p in [(table, p) for p in range(len(w1))] + [(keyed, p) for p in (5, 17, 299)]:
        row = int(t.row_of[p])
        outside = torch.ones(V, dtype=torch.bool)
        outside[t.high[row].long()] = False
        assert float(bias[p, outside].max()) <= float(t.tau[row])
        assert float(bias[p, ~outside].min()) >= float(bias[p, outside].max()) - 1e-3
    assert markov_table(w1, w2[:16], m=16) is None  # no fewer candidates than the set


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_the_chain_is_the_full_vocabularys_chain(scale):
    """Shortlist 64 with the bound, and with neither (every candidate): the same picks and
    pick values (the chain; the siblings after a pick come from the candidates computed, which
    only shapes a tree); the old top-64-only shortlist picked otherwise somewhere here."""
    w2 = low_rank_w2(7, scale)
    bound = markov_bound(w2, k=4)
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(V + 1, R, generator=g)
    table = markov_table(w1, w2)
    old_differs = False
    for _trial in range(12):
        logits = torch.randn(B, V, generator=g) * 4
        first = int(torch.randint(0, V, (1,), generator=g))
        full = markov_chain(logits, w1, w2, 0.0, first, None, V, 8)
        w2_max = float(w2.norm(dim=1).max())
        tabled = markov_chain(logits, w1, w2, w2_max, first, None, 64, 8, table=table)
        for kept in (markov_chain(logits, w1, w2, w2_max, first, None, 64, 8, bound), tabled):
            assert np.array_equal(kept.picks, full.picks)
            assert np.array_equal(kept.top_i[:, 0], full.picks)
            assert torch.allclose(kept.top_v[:, 0], full.top_v[:, 0], rtol=0, atol=1e-4)
        # the table's candidates hold the whole top K, siblings included
        assert torch.allclose(tabled.top_v, full.top_v, rtol=0, atol=1e-4)
        # the old shortlist: the best of the 64 best backbone logits, biased
        prev = first
        for i in range(B):
            short = logits[i].topk(64).indices
            pick = int(short[int((logits[i, short] + w2[short] @ w1[prev]).argmax())])
            old_differs |= pick != int(full.picks[i])
            prev = int(full.picks[i])
    assert old_differs or scale < 1.0


@pytest.fixture(scope="module", params=["avx512", "avx2"])
def module(request):
    from adaspark.model import native

    if request.param not in native.runnable_isas():
        pytest.skip(f"this CPU does not run {request.param}")
    module, why = native.load_isa(request.param)
    if module is None:
        pytest.skip(f"native {request.param} build not usable here: {why}")
    return module


@pytest.mark.parametrize("markov", ["table", "bound"])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_the_native_chain_is_the_full_vocabularys_chain(module, scale, markov, monkeypatch):
    """drafter.h's markov(): the same exact picks as every candidate's argmax, with its own
    float32 pass of the table's threshold or of the caps (vectors and the tail past whole
    vectors: V = 2000). Without the table where its vocabulary is too large for one."""
    if markov == "bound":
        monkeypatch.setattr("adaspark.drafter.runtime.TABLE_LIMIT", 0)
    from adaspark.drafter.model import DrafterConfig, DraftModel
    from adaspark.drafter.native import native_drafter

    c = DrafterConfig(target_layers=[0], draft_vocab_size=V, dim=64, block_size=B, n_heads=1,
                      n_kv_heads=1, head_dim=64, ffn_dim=64, markov_rank=R)
    g = torch.Generator().manual_seed(3)
    model = DraftModel(c, torch.arange(V), torch.randn(V, 64, generator=g))
    with torch.no_grad():
        model.markov_w2.weight.copy_(low_rank_w2(5, scale))
        model.markov_w1.weight.normal_(0, 1, generator=g)
    drafter = native_drafter(module, model, 64)
    w1, w2 = model.markov_w1.weight.detach(), model.markov_w2.weight.detach()
    for _trial in range(8):
        logits = torch.randn(B, V, generator=g) * 4
        first = int(torch.randint(0, V, (1,), generator=g))
        picks, ids, vals, _ = drafter.markov(torch.zeros(B, 64), logits, first, 64, 8)
        full = markov_chain(logits, w1, w2, 0.0, first, None, V, 8)
        assert np.array_equal(picks.numpy(), full.picks.numpy())
        assert torch.allclose(vals[:, 0], full.top_v[:, 0], rtol=0, atol=1e-4)
        if markov == "table":  # the whole top K, siblings included
            assert torch.allclose(vals, full.top_v, rtol=0, atol=1e-4)


def test_the_native_table_decides_the_candidates(module):
    """A table that claims no bias anywhere (tau far below every bias, one high candidate) makes
    the native chain the shortlist's alone, which picks otherwise than the full chain here: the
    table, when set, is what the native markov() follows."""
    from adaspark.drafter.model import DrafterConfig, DraftModel
    from adaspark.drafter.native import native_drafter

    c = DrafterConfig(target_layers=[0], draft_vocab_size=V, dim=64, block_size=B, n_heads=1,
                      n_kv_heads=1, head_dim=64, ffn_dim=64, markov_rank=R)
    g = torch.Generator().manual_seed(3)
    model = DraftModel(c, torch.arange(V), torch.randn(V, 64, generator=g))
    with torch.no_grad():
        model.markov_w2.weight.copy_(low_rank_w2(5, 3.0))
        model.markov_w1.weight.normal_(0, 1, generator=g)
    drafter = native_drafter(module, model, 64)
    keys = model.markov_w1.weight.shape[0]
    rows = torch.arange(keys, dtype=torch.int32)
    drafter.set_markov_table(torch.zeros(keys, 1, dtype=torch.int32), torch.full((keys,), -1e6),
                             rows)
    w1, w2 = model.markov_w1.weight.detach(), model.markov_w2.weight.detach()
    differs = False
    for _trial in range(8):
        logits = torch.randn(B, V, generator=g) * 4
        first = int(torch.randint(0, V, (1,), generator=g))
        picks, _, _, _ = drafter.markov(torch.zeros(B, 64), logits, first, 64, 8)
        full = markov_chain(logits, w1, w2, 0.0, first, None, V, 8)
        differs |= not np.array_equal(picks.numpy(), full.picks.numpy())
    assert differs
    with pytest.raises(RuntimeError, match="high must be int32"):
        drafter.set_markov_table(torch.zeros(keys, 1, dtype=torch.long), torch.zeros(keys), rows)
    with pytest.raises(RuntimeError, match="out of the draft vocabulary"):
        drafter.set_markov_table(torch.full((keys, 1), V, dtype=torch.int32), torch.zeros(keys),
                                 rows)
    with pytest.raises(RuntimeError, match="table row is out of range"):
        drafter.set_markov_table(torch.zeros(keys, 1, dtype=torch.int32), torch.zeros(keys),
                                 rows + 1)


def test_a_target_keyed_chain_with_the_table_is_the_full_chain():
    """W1 keyed by target id (the peers' form): the table holds the rows the picks key; the
    first row, keyed by an anchor outside them, takes every candidate. The whole top K equals
    the full vocabulary's either way."""
    g = torch.Generator().manual_seed(21)
    w2, w1 = low_rank_w2(9, 3.0), torch.randn(3 * V, R, generator=g)
    key_of_pick = torch.randperm(3 * V, generator=g)[:V]
    table = markov_table(w1, w2, key_of_pick)
    outside = int(torch.nonzero(table.row_of < 0)[0])
    w2_max = float(w2.norm(dim=1).max())
    for first in (outside, int(key_of_pick[3])):
        logits = torch.randn(B, V, generator=g) * 4
        full = markov_chain(logits, w1, w2, 0.0, first, key_of_pick, V, 8)
        tabled = markov_chain(logits, w1, w2, w2_max, first, key_of_pick, 64, 8, table=table)
        assert np.array_equal(tabled.picks, full.picks)
        assert torch.allclose(tabled.top_v, full.top_v, rtol=0, atol=1e-4)
