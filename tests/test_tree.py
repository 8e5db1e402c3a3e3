import itertools

import numpy as np
import pytest

from adaspark.scheduler.acceptance import AcceptanceModel
from adaspark.scheduler.tree import (
    NGRAM,
    PICK,
    SIBLING,
    Block,
    CandidateTree,
    accept,
    layout,
    rank,
)


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    return CandidateTree.from_parents(parents, rng.integers(0, 50, size=n))


def closed_subsets(parents, size):
    for subset in itertools.combinations(range(len(parents)), size):
        chosen = set(subset)
        if all(parents[j] < 0 or parents[j] in chosen for j in subset):
            yield subset


def path_products(tree, q):
    Q = np.zeros(tree.n_nodes)
    for j in range(tree.n_nodes):
        p = tree.parent[j]
        Q[j] = q[j] * (1.0 if p < 0 else Q[p])
    return Q


def test_proposition_1_every_prefix_is_a_tree_with_maximal_S():
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 9))
        tree = random_tree(rng, n)
        q = rng.uniform(0.05, 1.0, size=n)
        if trial % 3 == 0:  # ties, including q == 1, must still put parents first
            q = rng.choice([0.5, 1.0], size=n)
        r = rank(tree, q)
        Q = path_products(tree, q)
        np.testing.assert_allclose(r.Q, Q, rtol=1e-9)
        position = np.empty(n, dtype=int)
        position[r.order] = np.arange(n)
        for k in range(n + 1):
            prefix = set(r.order[:k].tolist())
            assert all(tree.parent[j] < 0 or tree.parent[j] in prefix for j in prefix)
            best = max(sum(Q[list(s)]) for s in closed_subsets(tree.parent.tolist(), k))
            assert r.S(k + 1) == pytest.approx(best, rel=1e-9, abs=1e-12)
        # decreasing Q, ties toward the lower index (exact here: q in {0.5, 1} gives powers of 2)
        for a, b in zip(r.order[:-1], r.order[1:], strict=True):
            assert r.Q[a] >= r.Q[b]
            if trial % 3 == 0 and Q[a] == Q[b]:
                assert a < b


def test_stop_token_subtree_gets_zero_Q_and_goes_last():
    tree = CandidateTree.from_parents([-1, 0, 1, -1], [7, 99, 8, 9], stop_ids=[99])
    r = rank(tree, np.array([0.9, 0.9, 0.9, 0.1]))
    assert r.Q[1] == 0.0 and r.Q[2] == 0.0 and r.Q[0] > 0.0
    assert r.order.tolist() == [0, 3, 1, 2]
    assert r.n_useful == 2


def small_block(rng, B=2, K=3):
    ids = rng.choice(np.arange(10, 60), size=(B, K), replace=False)
    logits = -np.sort(-rng.normal(size=(B, K)) * 2.0, axis=1)
    return Block(ids[:, 0].copy(), ids, logits, rng.uniform(0.1, 0.9, size=B))


def test_corollary_4_merged_order_beats_every_drafter_only_tree():
    rng = np.random.default_rng(1)
    model = AcceptanceModel()
    for _ in range(20):
        tree = CandidateTree.from_block(small_block(rng), anchor=1)
        first = tree.add_ngram(-1, 70, bucket=3, logit_p=float(rng.normal()))
        tree.add_ngram(first, 71, bucket=4, logit_p=float(rng.normal()))
        tree.add_ngram(0, 72, bucket=3, logit_p=float(rng.normal()))
        tree.seal()
        q = model.score(tree, 500).q_fit
        r = rank(tree, q)
        drafter = [j for j in range(tree.n_nodes) if tree.kind[j] != NGRAM]
        parents = tree.parent.tolist()
        for k in range(len(drafter) + 1):
            best = 0.0
            for subset in itertools.combinations(drafter, k):
                chosen = set(subset)
                if all(parents[j] < 0 or parents[j] in chosen for j in subset):
                    best = max(best, float(r.Q[list(subset)].sum()))
            assert r.S(k + 1) >= best - 1e-12


def test_S_split_by_source_adds_up():
    rng = np.random.default_rng(2)
    tree = CandidateTree.from_block(small_block(rng, B=3, K=4), anchor=1)
    tree.add_ngram(-1, 80, bucket=0, logit_p=1.0)
    tree.seal()
    q = rng.uniform(0.1, 0.9, size=tree.n_nodes)
    r = rank(tree, q)
    is_ng = tree.kind[r.order] == NGRAM
    np.testing.assert_allclose(r.S_ngram[-1], r.Q[r.order][is_ng].sum())
    np.testing.assert_allclose(r.S_drafter[-1] + r.S_ngram[-1], r.Q.sum())
    assert r.S(1) == 0.0


def test_block_shape_and_features():
    ids = np.array([[5, 6, 7], [8, 9, 10]])
    logits = np.array([[2.0, 1.0, 0.0], [0.5, 0.5, -100.0]])
    tree = CandidateTree.from_block(Block(ids[:, 0], ids, logits, np.array([0.7, 0.2])), 4)
    assert tree.kind.tolist() == [PICK, SIBLING, SIBLING] * 2
    assert tree.parent.tolist() == [-1, -1, -1, 0, 0, 0]
    assert tree.depth.tolist() == [1, 1, 1, 2, 2, 2]
    share = np.exp(2.0) / np.exp([2.0, 1.0, 0.0]).sum()
    assert tree.logit_share[0] == pytest.approx(np.log(share / (1 - share)))
    assert tree.log_r[1] == pytest.approx(np.log(np.e / (np.e + 1)))
    assert tree.log_r[5] == -30.0  # floored
    assert tree.head_estimate[0] == 0.7
    assert tree.head_estimate[1] == pytest.approx(np.exp(1.0) / np.exp([2.0, 1.0, 0.0]).sum())
    with pytest.raises(ValueError):
        CandidateTree.from_block(Block(np.array([6, 8]), ids, logits, np.ones(2) / 2), 4)
    with pytest.raises(ValueError):
        CandidateTree.from_block(Block(ids[:, 0], ids, logits[:1], np.ones(2) / 2), 4)


def handmade():
    # anchor -> a(0) -> b(1) -> c(2); anchor -> d(3); a -> e(4); e -> f(5)
    return CandidateTree.from_parents([-1, 0, 1, -1, 0, 4], [10, 11, 12, 13, 14, 15], anchor=9)


def test_layout_is_depth_first_likeliest_child_first_with_ancestor_mask():
    tree = handmade()
    q = np.array([0.9, 0.8, 0.7, 0.5, 0.6, 0.9])
    r = rank(tree, q)
    lay = layout(tree, r.order)
    # a (0.9) first; under a, b (0.72) before e (0.54); d (0.5) last.
    assert lay.nodes.tolist() == [-1, 0, 1, 2, 4, 5, 3]
    assert lay.tokens.tolist() == [9, 10, 11, 12, 14, 15, 13]
    assert lay.parent_rows.tolist() == [-1, 0, 1, 2, 1, 4, 0]
    assert lay.depths.tolist() == [0, 1, 2, 3, 2, 3, 1]
    expected = np.zeros((7, 7), dtype=bool)
    for row in range(7):
        a = row
        while a >= 0:
            expected[row, a] = True
            a = lay.parent_rows[a]
    assert np.array_equal(lay.mask, expected)
    with pytest.raises(ValueError):
        layout(tree, [1])  # b without its parent a


def test_accept_walk():
    tree = handmade()
    lay = layout(tree, [0, 1, 2, 4, 5, 3])  # rows: anchor a b c e f d
    # target agrees with a, then e (not b), then f; bonus after f
    out = accept(lay, [10, 14, 0, 0, 15, 77, 0])
    assert out.nodes == [0, 4, 5] and out.tokens == [10, 14, 15] and out.bonus == 77
    assert out.rows == [0, 1, 4, 5]
    assert out.committed == [10, 14, 15, 77]
    assert out.labelled_parents.tolist() == [-1, 0, 4, 5]
    assert out.parent_targets.tolist() == [10, 14, 15, 77]
    none = accept(lay, [42, 0, 0, 0, 0, 0, 0])
    assert none.nodes == [] and none.committed == [42] and none.rows == [0]
    assert accept(lay, [13, 0, 0, 0, 0, 0, 5]).committed == [13, 5]
    with pytest.raises(ValueError):
        accept(lay, [1, 2])


def test_stop_flags_and_an_ngram_free_ranking():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 6, size=(4, 3))
    block = Block(ids[:, 0].copy(), ids, np.sort(rng.normal(size=(4, 3)))[:, ::-1],
                  rng.uniform(0.1, 0.9, 4))
    for stops in ((), (2,), [2, 4], frozenset({4, 2}), (4, 2, 2)):
        tree = CandidateTree.from_block(block, 0, stops)
        want = np.isin(tree.token, list(stops))
        assert tree.stop.dtype == bool and np.array_equal(tree.stop, want)
        assert tree.stop_set == set(stops) and tree.stop_ids.tolist() == sorted(set(stops))
    q = rng.uniform(0.05, 1.0, tree.n_nodes)
    ranking = rank(tree, q)
    Q = path_products(tree, np.where(tree.stop, 0.0, q))  # nothing at or below a stop
    assert not tree.has_ngram and not ranking.S_ngram.any()
    assert np.allclose(ranking.S_drafter, np.concatenate([[0.0], np.cumsum(Q[ranking.order])]))
