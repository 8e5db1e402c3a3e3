"""The Markov head's shortlist is exact (drafter/runtime.py markov_chain, drafter.h markov()):
the pick of every row is the argmax over the whole draft vocabulary, as the peers compute it,
while the bias is computed for a shortlist and the few candidates a cap cannot exclude."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspark.drafter.runtime import markov_bound, markov_caps, markov_chain

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


@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0])
def test_the_chain_is_the_full_vocabularys_chain(scale):
    """Shortlist 64 with the bound, and with neither (every candidate): the same picks and
    pick values (the chain; the siblings after a pick come from the candidates computed, which
    only shapes a tree); the old top-64-only shortlist picked otherwise somewhere here."""
    w2 = low_rank_w2(7, scale)
    bound = markov_bound(w2, k=4)
    g = torch.Generator().manual_seed(11)
    w1 = torch.randn(V + 1, R, generator=g)
    old_differs = False
    for _trial in range(12):
        logits = torch.randn(B, V, generator=g) * 4
        first = int(torch.randint(0, V, (1,), generator=g))
        full = markov_chain(logits, w1, w2, 0.0, first, None, V, 8)
        kept = markov_chain(logits, w1, w2, float(w2.norm(dim=1).max()), first, None, 64, 8,
                            bound)
        assert np.array_equal(kept.picks, full.picks)
        assert np.array_equal(kept.top_i[:, 0], full.picks)
        assert torch.allclose(kept.top_v[:, 0], full.top_v[:, 0], rtol=0, atol=1e-4)
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


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_the_native_chain_is_the_full_vocabularys_chain(module, scale):
    """drafter.h's markov(): the same exact picks as every candidate's argmax, with its own
    float32 pass of the caps (vectors and the tail past whole vectors: V = 2000)."""
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
