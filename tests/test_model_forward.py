"""Tree verify, commit and the batched paths on the embedded model.

Tree used throughout (depth-first rows; the chain 0-1-3-5 is one root-to-leaf path):
    0 ─ 1 ─ 3 ─ 5
    │    └─ 4
    └─ 2
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adaspark.errors import UserError

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 2657, 30, 216]  # any in-vocabulary ids
PARENTS = [-1, 0, 0, 1, 1, 3]
TREE_TOKENS = [1073, 2114, 384, 260, 2351, 28]
CHAIN = [0, 1, 3, 5]
TAPS = (0, 14, 29)


def ancestors(parents):
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def depths(parents):
    return [0 if p < 0 else depths(parents[:p + 1])[p] + 1 for p in parents]


def assert_rows_close(a, b, rel):
    """Each row's difference is small next to the row itself (fast kernels round to bf16)."""
    error = (a - b).norm(dim=-1) / b.norm(dim=-1)
    assert float(error.max()) <= rel, f"rows differ by up to {float(error.max()):.2e} relative"


def verify_tree(model, rows, kernel=None):
    """Verify the sub-tree of TREE made of `rows` (closed under parents), after PROMPT."""
    index = {r: i for i, r in enumerate(rows)}
    parents = [index[PARENTS[r]] if PARENTS[r] >= 0 else -1 for r in rows]
    model.reset()
    model.prefill(PROMPT)
    return model.verify([TREE_TOKENS[r] for r in rows], depths(parents), ancestors(parents),
                        TAPS, return_logits=True, kernel=kernel)


def test_chain_inside_a_tree_is_bit_exact_in_reference(reference_model):
    tree = verify_tree(reference_model, range(len(PARENTS)))
    chain = verify_tree(reference_model, CHAIN)
    assert torch.equal(tree.logits[CHAIN], chain.logits)
    assert torch.equal(tree.argmax[CHAIN], chain.argmax)
    for layer in TAPS:
        assert torch.equal(tree.hiddens[layer][CHAIN], chain.hiddens[layer])


@pytest.mark.parametrize("kernel", ["int4", "bf16"])
def test_torch_kernel_rows_barely_depend_on_width(torch_model, kernel):
    """The torch path (no native build, CUDA): rows round activations to bf16 (8 bits), and
    attention sums a row's ancestors in other lanes within a tree, so a float32 difference in
    the last bits can flip a bf16 rounding at any of the ~120 casts on the way; rows then
    differ by a few bf16 steps. 2^-4 is far above that and far below a wrong mask (~100%).
    The native path is bit-exact instead (test_native_forward.py)."""
    tree = verify_tree(torch_model, range(len(PARENTS)), kernel)
    chain = verify_tree(torch_model, CHAIN, kernel)
    assert torch.equal(tree.argmax[CHAIN], chain.argmax)
    assert_rows_close(tree.logits[CHAIN], chain.logits, 2**-4)
    assert_rows_close(tree.hiddens[29][CHAIN], chain.hiddens[29], 2**-4)


def test_commit_leaves_the_cache_of_a_fresh_prefill(reference_model):
    """Reference precision: prefill and tree verify sum attention in different orders (a
    matmul against a term-by-term sum), so K/V agree to float32 rounding grown over the
    layers; 2^-12 of each cached row is thousands of float32 steps and far below a wrong slot
    or position (~100%). The native path is compared bit for bit (test_native_forward.py)."""
    model = reference_model
    path = [0, 1, 4]
    verify_tree(model, range(len(PARENTS)))
    model.commit(path)
    assert model.cache.length == len(PROMPT) + len(path)
    n = model.cache.length
    committed_k = model.cache.k[:, :, :, :n].clone()
    committed_v = model.cache.v[:, :, :, :n].clone()
    model.reset()
    model.prefill(PROMPT + [TREE_TOKENS[r] for r in path])
    assert_rows_close(committed_k, model.cache.k[:, :, :, :n], 2**-12)
    assert_rows_close(committed_v, model.cache.v[:, :, :, :n], 2**-12)


@pytest.mark.parametrize("precision", ["reference", "fast"])
def test_one_row_verify_gives_the_prefill_next_token(request, precision):
    model = request.getfixturevalue(f"{precision}_model")
    model.reset()
    whole = model.prefill(PROMPT, TAPS, return_logits=True)
    model.reset()
    model.prefill(PROMPT[:-1])
    row = model.verify(PROMPT[-1:], [0], [[True]], TAPS, return_logits=True)
    assert row.argmax.tolist() == whole.argmax.tolist()
    assert_rows_close(row.logits, whole.logits, 2e-2)
    assert set(whole.hiddens) == set(TAPS) and whole.hiddens[0].shape == (len(PROMPT), 576)
    assert_rows_close(row.hiddens[29], whole.hiddens[29][-1:], 2e-2)


def test_truncate_then_prefill_matches_a_fresh_prefill(fast_model):
    model = fast_model
    model.reset()
    model.prefill(PROMPT + [TREE_TOKENS[0]])
    model.truncate(len(PROMPT) - 2)
    again = model.prefill(PROMPT[-2:], return_logits=True)
    model.reset()
    fresh = model.prefill(PROMPT, return_logits=True)
    assert again.argmax.tolist() == fresh.argmax.tolist()


def greedy_alone(model, prompt, max_new, stop_ids, kernel=None):
    model.reset()
    token, alone = int(model.prefill(prompt, kernel=kernel).argmax[-1]), []
    while len(alone) < max_new:
        alone.append(token)
        if token in stop_ids:
            break
        token = int(model.verify([token], [0], [[True]], kernel=kernel).argmax[0])
        model.commit([0])
    return alone


def test_batched_greedy_matches_one_at_a_time(fast_model):
    model = fast_model
    prompts = [PROMPT, PROMPT[3:]]
    batch = model.generate_greedy_batch(prompts, max_new_tokens=5, stop_ids={2})
    for prompt, got in zip(prompts, batch, strict=True):  # batches run the torch kernels
        assert got == greedy_alone(model, prompt, 5, {2}, kernel="int4")


def test_batched_greedy_a_sequence_that_stops_early_leaves_the_others_intact(reference_model):
    """One sequence meets a stop token mid-way: it ends there, the others go on intact
    (reference precision: the fast kernels' bf16 rounding differs with the batch's width)."""
    model = reference_model
    prompts = [PROMPT, PROMPT[3:], PROMPT[5:]]
    free = [greedy_alone(model, p, 6, set()) for p in prompts]
    stop = free[1][2]  # the middle sequence stops at its third token
    batch = model.generate_greedy_batch(prompts, max_new_tokens=6, stop_ids={stop})
    assert batch[1] == free[1][:3]
    for prompt, got in zip(prompts, batch, strict=True):
        assert got == greedy_alone(model, prompt, 6, {stop})


def test_batched_hidden_states_match_prefill_taps(fast_model):
    model = fast_model
    seqs = [PROMPT, PROMPT[:4]]
    batch = model.hidden_states_batch(seqs, TAPS, return_logits=True)
    for seq, got in zip(seqs, batch, strict=True):
        model.reset()
        out = model.prefill(seq, TAPS, return_logits=True, kernel="int4")  # batches: torch
        for layer in TAPS:
            assert_rows_close(got[layer], out.hiddens[layer], 5e-2)  # may differ in kernel
        assert int(got["argmax"][-1]) == int(out.argmax[-1])
        assert got["logits"].shape == (len(seq), model.config.vocab_size)


@pytest.mark.parametrize("bad", [-1, 49152, 10**7])
def test_verify_refuses_a_token_outside_the_vocabulary_as_list_or_tensor(fast_model, bad):
    length = fast_model.cache.length
    for tokens in ([5, bad], (bad,), torch.tensor([bad, 7])):
        n = len(tokens)
        mask = np.tril(np.ones((n, n), dtype=bool))
        with pytest.raises(UserError, match="token id out of range for a vocabulary of 49152"):
            fast_model.verify(tokens, list(range(n)), mask)
    assert fast_model.cache.length == length
    assert int(fast_model.verify([49151], [0], [[True]]).argmax[0]) >= 0  # the last id is in
