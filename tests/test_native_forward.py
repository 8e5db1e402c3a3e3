"""The embedded model on the native forward, on every build this CPU runs: a row's logits, hidden
states and K/V are bit-identical whatever else shares its call (tree, chain, one-row step,
prefill chunk), so speculation emits exactly plain decoding's tokens in fast precision too."""

from __future__ import annotations

import pytest
import torch
from test_model_forward import CHAIN, PARENTS, PROMPT, TAPS, TREE_TOKENS, ancestors, depths

from adaspark.model import native, transformer
from adaspark.model.cache import KVCache
from adaspark.model.transformer import Transformer

pytestmark = pytest.mark.slow


def native_model(isa: str, path, max_context: int = 512) -> Transformer:
    """The model at `path` on the native build `isa` (the test skips where it cannot run)."""
    module, why = native.load_isa(isa)
    if module is None:
        pytest.skip(f"native {isa} build not usable here: {why}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPARK_NATIVE", isa)
        m = Transformer.from_gguf(path, precision="fast", max_context=max_context,
                                  calibrate=False)
    assert m.native is not None and m.kernels.choose(1) == f"native-{module.ISA}"
    return m


@pytest.fixture(scope="module", params=native.runnable_isas())
def model(request, model_path):
    return native_model(request.param, model_path)


def verify_rows(model, rows, context=PROMPT):
    index = {r: i for i, r in enumerate(rows)}
    parents = [index[PARENTS[r]] if PARENTS[r] >= 0 else -1 for r in rows]
    model.reset()
    model.prefill(context)
    return model.verify([TREE_TOKENS[r] for r in rows], depths(parents), ancestors(parents),
                        TAPS, return_logits=True)


def assert_same_rows(a, b, rows_a, rows_b=None):
    rows_b = list(range(len(rows_a))) if rows_b is None else rows_b
    assert torch.equal(a.logits[rows_a], b.logits[rows_b])
    assert torch.equal(a.argmax[rows_a], b.argmax[rows_b])
    for layer in TAPS:
        assert torch.equal(a.hiddens[layer][rows_a], b.hiddens[layer][rows_b])


def test_rows_are_bit_identical_at_every_width(model):
    tree = verify_rows(model, range(len(PARENTS)))
    for rows in (CHAIN, [0, 1, 4], [0, 2], [0, 1], [0]):
        assert_same_rows(tree, verify_rows(model, rows), rows)


def test_a_one_row_step_equals_its_prefill_row(model):
    model.reset()
    whole = model.prefill(PROMPT, TAPS, return_logits=True)
    model.reset()
    model.prefill(PROMPT[:-1])
    step = model.verify(PROMPT[-1:], [0], [[True]], TAPS, return_logits=True)
    assert torch.equal(step.logits, whole.logits) and torch.equal(step.argmax, whole.argmax)
    for layer in TAPS:
        assert torch.equal(step.hiddens[layer], whole.hiddens[layer][-1:])


def test_commit_leaves_the_cache_of_a_fresh_prefill_bit_for_bit(model):
    path = [0, 1, 4]
    verify_rows(model, range(len(PARENTS)))
    model.commit(path)
    n = model.cache.length
    committed = model.cache.k[:, :, :, :n].clone(), model.cache.v[:, :, :, :n].clone()
    model.reset()
    model.prefill(PROMPT + [TREE_TOKENS[r] for r in path])
    assert torch.equal(committed[0], model.cache.k[:, :, :, :n])
    assert torch.equal(committed[1], model.cache.v[:, :, :, :n])


def test_prefill_in_chunks_equals_one_chunk(model, monkeypatch):
    model.reset()
    whole = model.prefill(PROMPT, TAPS, return_logits=True)
    k = model.cache.k[:, :, :, :len(PROMPT)].clone()
    monkeypatch.setattr(transformer, "PREFILL_CHUNK", 3)
    model.reset()
    chunked = model.prefill(PROMPT, TAPS, return_logits=True)
    assert torch.equal(chunked.logits, whole.logits)
    assert torch.equal(k, model.cache.k[:, :, :, :len(PROMPT)])
    for layer in TAPS:
        assert torch.equal(chunked.hiddens[layer], whole.hiddens[layer])


@pytest.mark.parametrize("context", [PROMPT[:1], PROMPT])
def test_a_long_chain_equals_its_rows_in_a_tree(model, context):
    """A chain of 17 rows or more (a prefill chunk) attends over the cache with key tiles shared
    by many queries and no mask (attention.h, attend_chain); a side branch makes the same rows
    a tree, which takes the masked path: each row comes out the same bit for bit."""
    ids = [(37 * i + 11) % 9000 + 100 for i in range(40)]
    chain = list(range(-1, len(ids) - 1))
    tree = chain + [0]  # one more row beside row 1: not a chain
    depth = list(range(len(ids)))  # depths() recurses exponentially on a chain this long
    model.reset()
    model.prefill(context)
    a = model.verify(ids, depth, ancestors(chain), TAPS, return_logits=True)
    model.reset()
    model.prefill(context)
    b = model.verify(ids + [5], depth + [1], ancestors(tree), TAPS, return_logits=True)
    assert_same_rows(a, b, list(range(len(ids))))


def test_native_stays_near_float32_reference(model, reference_model):
    """Activations rounded to int8 per block of 32 (as ggml does for these weights) move the
    last layer's rows by a few percent of the float32 reference (measured ~4%); 2^-3 leaves
    room for other CPUs' float rounding and is far below a wrong mask or weight layout (~100%).
    The head's argmax is the float32 head's own (target.h refines every near-top logit)."""
    tree = verify_rows(model, range(len(PARENTS)))
    exact = verify_rows(reference_model, range(len(PARENTS)))
    for layer in TAPS:
        error = (tree.hiddens[layer] - exact.hiddens[layer]).norm(dim=-1)
        assert float((error / exact.hiddens[layer].norm(dim=-1)).max()) < 2**-3, layer
    assert torch.equal(tree.argmax, exact.argmax)


def test_the_argmax_is_the_float32_heads(model):
    model.reset()
    rows, _ = model.native.forward(model.cache.k, model.cache.v, torch.tensor(PROMPT),
                                   torch.arange(len(PROMPT)), 0,
                                   torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril(),
                                   [])
    logits, argmax = model.native.head(rows)
    assert torch.equal(argmax, (rows @ model.tok_embeddings.T).argmax(-1))
    assert torch.equal(argmax, logits.argmax(-1))


def test_a_row_of_nans_stays_in_its_row(model):
    """A non-finite row (a corrupt model, an overflow) gives some id in range for itself and
    leaves the other rows' argmax alone; the vector argmax never reads past the vocabulary."""
    model.reset()
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    rows, _ = model.native.forward(model.cache.k, model.cache.v, torch.tensor(PROMPT[:4]),
                                   torch.arange(4), 0, causal, [])
    _, clean = model.native.head(rows)
    rows[1] = float("nan")
    _, argmax = model.native.head(rows)
    assert 0 <= int(argmax[1]) < model.tok_embeddings.shape[0]
    assert torch.equal(argmax[[0, 2, 3]], clean[[0, 2, 3]])


def test_bad_rows_are_refused(model):
    model.reset()
    model.prefill(PROMPT)
    with pytest.raises(RuntimeError, match="anc must be bool"):
        model.native.forward(model.cache.k, model.cache.v, torch.tensor([5]), torch.tensor([10]),
                             10, torch.ones(2, 2, dtype=torch.bool), [])
    with pytest.raises(RuntimeError, match="token id out of range"):
        model.native.forward(model.cache.k, model.cache.v, torch.tensor([10**6]),
                             torch.tensor([10]), 10, torch.ones(1, 1, dtype=torch.bool), [])


def test_sequences_batched_in_one_call_equal_each_alone(model):
    """Rows of two sequences, each over its own cache, share one forward (the matmuls see them
    all, attention keeps each row to its sequence): every row's output and K/V are those of its
    sequence's call alone."""
    f = model.native
    c = model.config
    caches = [KVCache(c.n_layers, c.n_kv_heads, c.head_dim, 64, torch.float16) for _ in range(2)]
    contexts = [PROMPT, PROMPT[3:] + PROMPT[:2]]
    rows = [TREE_TOKENS[:3], CHAIN[:2]]
    trees = [torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
             torch.ones(2, 2, dtype=torch.bool).tril()]
    alone = []
    for cache, context, tokens, anc in zip(caches, contexts, rows, trees, strict=True):
        n = len(context)
        f.forward(cache.k, cache.v, torch.tensor(context), torch.arange(n), 0,
                  torch.ones(n, n, dtype=torch.bool).tril(), [])
        depth = anc.sum(1) - 1
        out = f.forward(cache.k, cache.v, torch.tensor(tokens), n + depth, n, anc, [TAPS[0]])
        alone.append((out, cache.k[:, :, :, n:n + len(tokens)].clone()))
    anc = torch.block_diag(*trees)
    positions = torch.cat([len(c) + a.sum(1) - 1 for c, a in zip(contexts, trees, strict=True)])
    out, hiddens = f.forward_batch([c.k for c in caches], [c.v for c in caches],
                                   [len(c) for c in contexts], [len(r) for r in rows],
                                   torch.tensor(rows[0] + rows[1]), positions, anc, [TAPS[0]])
    split = [0, len(rows[0]), len(rows[0]) + len(rows[1])]
    for s, ((rows_alone, hid_alone), k_alone) in enumerate(alone):
        assert torch.equal(out[split[s]:split[s + 1]], rows_alone)
        assert torch.equal(hiddens[:, split[s]:split[s + 1]], hid_alone)
        n = len(contexts[s])
        assert torch.equal(caches[s].k[:, :, :, n:n + len(rows[s])], k_alone)
    with pytest.raises(RuntimeError, match="anc joins rows of two sequences"):
        f.forward_batch([c.k for c in caches], [c.v for c in caches], [10, 10], [1, 1],
                        torch.tensor([5, 6]), torch.tensor([10, 10]),
                        torch.ones(2, 2, dtype=torch.bool), [])
    with pytest.raises(RuntimeError, match="a cache of its own"):
        f.forward_batch([caches[0].k] * 2, [caches[0].v] * 2, [10, 12], [1, 1],
                        torch.tensor([5, 6]), torch.tensor([10, 12]),
                        torch.eye(2, dtype=torch.bool), [])


LONG = [(37 * i) % 9000 + 100 for i in range(300)]  # 300 in-vocabulary ids


def test_long_contexts_keep_the_same_bits_and_accuracy(model, reference_model):
    """At a context of 300 (prefilled through the torch path, as prompts past 64 rows are) a
    row's bits still do not depend on the width or on the call (a step after a commit equals
    the row in a tree), and it stays as near the float32 reference as at a short context."""
    tree = verify_rows(model, range(len(PARENTS)), LONG)
    for rows in (CHAIN, [0, 2], [0]):
        assert_same_rows(tree, verify_rows(model, rows, LONG), rows)
    # row 1 of the tree seen through the call (an ancestor in the call) and after a commit
    verify_rows(model, [0], LONG)
    model.commit([0])
    step = model.verify([TREE_TOKENS[1]], [0], [[True]], TAPS, return_logits=True)
    assert torch.equal(step.logits, tree.logits[1:2])
    exact = verify_rows(reference_model, range(len(PARENTS)), LONG)
    for layer in TAPS:
        error = (tree.hiddens[layer] - exact.hiddens[layer]).norm(dim=-1)
        assert float((error / exact.hiddens[layer].norm(dim=-1)).max()) < 2**-3, layer
