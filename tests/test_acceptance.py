import json
import math

import numpy as np
import pytest

from adaspark.errors import UserError
from adaspark.scheduler.acceptance import (
    N_COEF,
    N_COEF_V1,
    TEMP0,
    AcceptanceModel,
    design,
    label_nodes,
    multinomial_log_loss,
    parent_softmax,
    prior_coefficients,
)
from adaspark.scheduler.tree import Block, CandidateTree, accept, layout, rank


def block(rng, B=4, K=5):
    ids = np.stack([rng.choice(np.arange(100, 200), size=K, replace=False) for _ in range(B)])
    logits = -np.sort(-rng.normal(size=(B, K)) * 2.0, axis=1)
    return Block(ids[:, 0].copy(), ids, logits, rng.uniform(0.05, 0.95, size=B))


def mixed_tree(rng, B=4, K=5):
    """Drafter block plus n-gram nodes, one agreed sibling and one contradicted position."""
    tree = CandidateTree.from_block(block(rng, B, K), anchor=1)
    tree.mark_agreed(K + 2, bucket=3, logit_p=1.2)  # a sibling at position 1
    tree.add_ngram(K + 2, 300, bucket=7, logit_p=0.4)  # continues below the agreed sibling
    tree.mark_contradicted(slice(2 * K, 3 * K), evidence=0, logit_p=2.0)
    first = tree.add_ngram(K, 301, bucket=0, logit_p=2.0)  # the contradicting proposal
    tree.add_ngram(first, 302, bucket=1, logit_p=2.0)
    tree.add_ngram(-1, 303, bucket=9, logit_p=-0.7)
    tree.seal()
    return tree


def test_probabilities_and_none_sum_to_one_per_parent():
    rng = np.random.default_rng(0)
    model = AcceptanceModel()
    model.ftrl.z[:] = rng.normal(size=N_COEF) * 50  # far from the prior
    model.ftrl.n[:] = 1.0
    model.ftrl._refresh()
    tree = mixed_tree(rng)
    q = model.score(tree, 3000).q_fit
    mass = np.bincount(tree.parent + 1, weights=q, minlength=tree.n_nodes + 1)
    parents = np.unique(tree.parent + 1)
    assert np.all(q > 0) and np.all(mass[parents] < 1.0)
    none = 1.0 - mass[parents]
    np.testing.assert_allclose(mass[parents] + none, 1.0)


def test_prior_prices_a_pick_at_its_head_and_splits_the_rest():
    rng = np.random.default_rng(1)
    tree = CandidateTree.from_block(block(rng, B=3, K=6), anchor=1)
    scored = AcceptanceModel().score(tree, 0)
    assert not scored.fitted_prices  # the guard starts on the head-based estimate
    q = scored.q_fit
    for i in range(3):
        h = tree.head_estimate[i * 6]
        sib = q[i * 6 + 1:i * 6 + 6]
        assert q[i * 6] == pytest.approx(h)
        assert sib.sum() == pytest.approx((1 - h) / 2)
        np.testing.assert_allclose(sib / sib.sum(), np.exp(tree.log_r[i * 6 + 1:i * 6 + 6]))


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(2)
    model = AcceptanceModel()
    tree = mixed_tree(rng)
    scored = model.score(tree, 2500)
    parents = np.array([-1, 0, 5, tree.n_nodes - 2])
    targets = np.array([tree.token[5], 999, tree.token[tree.n_nodes - 1], 999])
    labels = label_nodes(tree, parents, targets)
    # evaluate the gradient away from the prior, at weights w and intercept 0.1
    w = prior_coefficients() + rng.normal(size=N_COEF) * 0.3
    s = scored.fitted_scores(w, 0.1)
    scored.q_fit = parent_softmax(tree.parent, s)
    g_coef, g_b = model.gradient(scored, labels)

    def loss(weights, b):
        return multinomial_log_loss(tree.parent, scored.fitted_scores(weights, b), labels)

    eps = 1e-6
    numeric = np.array([(loss(w + eps * e, 0.1) - loss(w - eps * e, 0.1)) / (2 * eps)
                        for e in np.eye(N_COEF)])
    np.testing.assert_allclose(g_coef, numeric, atol=1e-6)
    assert g_b == pytest.approx((loss(w, 0.1 + eps) - loss(w, 0.1 - eps)) / (2 * eps), abs=1e-6)
    assert np.count_nonzero(g_coef) > 10  # drafter, bucket, agreed and contradicted terms


def sample_outcomes(rng, tree, q, parents):
    """The target's argmax at each parent row, drawn from q's per-parent softmax (or none)."""
    targets = []
    for p in parents:
        kids = np.flatnonzero(tree.parent == p)
        probs = np.append(q[kids], max(0.0, 1.0 - q[kids].sum()))
        pick = rng.choice(kids.size + 1, p=probs / probs.sum())
        targets.append(int(tree.token[kids[pick]]) if pick < kids.size else -5)
    return np.array(targets)


def run_rounds(model, rng, rounds, truth):
    for _ in range(rounds):
        tree = mixed_tree(rng)
        scored = model.score(tree, 1000)
        q_true = truth(tree, scored)
        parents = np.array([-1] + tree.pick_nodes.tolist()[:2])
        model.learn(scored, parents, sample_outcomes(rng, tree, q_true, parents),
                    placed_nodes=tree.pick_nodes)


def prior_truth(tree, scored):
    return parent_softmax(tree.parent, scored.fitted_scores(prior_coefficients(), 0.0))


def test_noise_free_prior_stays_exact_under_the_gate():
    gated = AcceptanceModel()
    run_rounds(gated, np.random.default_rng(3), 300, prior_truth)
    assert gated.coefficients.tobytes() == prior_coefficients().tobytes()
    ungated = AcceptanceModel(gate=0.0)
    run_rounds(ungated, np.random.default_rng(3), 300, prior_truth)
    assert not np.array_equal(ungated.coefficients, prior_coefficients())


def test_fitted_model_learns_a_miscalibrated_head_and_takes_over_pricing():
    def truth(tree, scored):  # picks are accepted far more often than the head says
        w = prior_coefficients()
        w[0], w[1] = 2.5, 0.3
        return parent_softmax(tree.parent, scored.fitted_scores(w, 0.0))

    model = AcceptanceModel()
    run_rounds(model, np.random.default_rng(4), 400, truth)
    assert model.coefficients[0] > 1.0 and model.coefficients[1] < 0.8
    stats = model.request_stats
    assert stats["fitted_loss"] < stats["head_loss"]
    assert model.fitted_preferred
    assert model.score(mixed_tree(np.random.default_rng(5)), 10).fitted_prices
    assert not model.score(mixed_tree(np.random.default_rng(5)), 10, head_only=True).fitted_prices


def test_labels_cover_unplaced_children_and_none():
    rng = np.random.default_rng(6)
    tree = CandidateTree.from_block(block(rng, B=3, K=4), anchor=1)
    model = AcceptanceModel()
    scored = model.score(tree, 100)
    r = rank(tree, scored.q)
    lay = layout(tree, r.order[:2])
    out = accept(lay, [tree.token[0]] + [tree.token[5]] * (lay.n_rows - 1))
    labels = label_nodes(tree, out.labelled_parents, out.parent_targets)
    # Anchor's 4 children are labelled; if pick 0 was accepted its 4 children too, even unplaced.
    expected = [0, 1, 2, 3] + ([4, 5, 6, 7] if 0 in out.nodes else [])
    assert labels.nodes.tolist() == expected
    hits = labels.nodes[labels.y].tolist()
    assert hits == ([0, 5] if 0 in out.nodes else [0])
    loss = model.learn(scored, out.labelled_parents, out.parent_targets, lay.nodes[1:])
    assert loss.nodes == len(expected)
    assert not label_nodes(tree, [-1], [12345]).y.any()


def test_head_offset_learns_only_from_placed_rows_and_resets_per_request():
    rng = np.random.default_rng(7)
    tree = CandidateTree.from_block(block(rng, B=2, K=3), anchor=1)
    model = AcceptanceModel()
    scored = model.score(tree, 10)
    model.learn(scored, [-1], [tree.token[0]], placed_nodes=[])
    assert model.head_offset.value == 0.0
    assert model.b_req.value != 0.0
    model.learn(scored, [-1], [tree.token[0]], placed_nodes=[0])
    assert model.head_offset.value > 0.0  # the pick was right: raise the head's estimate
    model.begin_request()
    assert (model.head_offset.value, model.b_req.value) == (0.0, 0.0)
    assert model.request_stats["nodes"] == 0


def test_state_round_trips_bit_for_bit():
    rng = np.random.default_rng(8)
    model = AcceptanceModel()
    run_rounds(model, rng, 40, prior_truth)
    model.ftrl.z[:] += rng.normal(size=N_COEF) * 100  # make the coefficients leave the prior
    model.ftrl._refresh()
    state = json.loads(json.dumps(model.state_dict()))
    other = AcceptanceModel()
    other.load_state_dict(state)
    assert other.state_dict() == model.state_dict()
    assert other.coefficients.tobytes() == model.coefficients.tobytes()
    tree = mixed_tree(rng)
    model.begin_request()
    assert other.score(tree, 77).q_fit.tobytes() == model.score(tree, 77).q_fit.tobytes()
    with pytest.raises(UserError):
        other.load_state_dict({"version": 1, "ftrl": state["ftrl"]})
    with pytest.raises(UserError):
        other.load_state_dict({**state, "version": 99})
    assert math.isfinite(other.guard_fitted)


def test_version_1_state_loads_with_the_temperature_terms_at_their_prior():
    """A store written before the temperature terms keeps its coefficients; the new ones start
    at 0 and greedy scores (T = 0) are the old model's to the bit."""
    rng = np.random.default_rng(81)
    model = AcceptanceModel()
    run_rounds(model, rng, 40, prior_truth)
    state = json.loads(json.dumps(model.state_dict()))
    old = {k: v[:N_COEF_V1] for k, v in state["ftrl"].items()}
    other = AcceptanceModel()
    other.load_state_dict({**state, "version": 1, "ftrl": old})
    assert other.coefficients[:N_COEF_V1].tobytes() == model.coefficients[:N_COEF_V1].tobytes()
    assert not other.coefficients[TEMP0:].any()
    tree = mixed_tree(rng)
    model.begin_request()
    other.begin_request()
    assert other.score(tree, 77).q_fit.tobytes() == model.score(tree, 77).q_fit.tobytes()


def test_temperature_terms_learn_only_under_sampling():
    """At T = 0 the temperature columns are zero, so greedy rounds leave them at the prior; at
    T > 0 picks right less often than the prior says pull temp_pick below zero."""
    rng = np.random.default_rng(82)
    greedy = AcceptanceModel(gate=0.0)  # ungated: every coefficient with a gradient moves
    run_rounds(greedy, rng, 60, prior_truth)
    assert not np.array_equal(greedy.coefficients[:TEMP0], prior_coefficients()[:TEMP0])
    assert not greedy.coefficients[TEMP0:].any()
    sampled = AcceptanceModel(gate=0.0)
    for _ in range(100):
        tree = mixed_tree(rng)
        scored = sampled.score(tree, 100, temperature=1.0)
        parents = np.array([-1])
        wrong = np.array([-7])  # the target picked none of the anchor's children
        sampled.learn(scored, parents, wrong, placed_nodes=np.arange(tree.n_nodes))
    assert sampled.coefficients[TEMP0] < 0
    X, _ = design(mixed_tree(rng), 100, temperature=0.7)
    assert set(np.unique(X[:, TEMP0:])) <= {0.0, 0.7}


def test_scores_follow_equation_6_term_by_term():
    rng = np.random.default_rng(9)
    K = 5
    tree = mixed_tree(rng, B=4, K=K)
    w = rng.normal(size=N_COEF)
    b, ctx = 0.3, 4096 / 8192
    s = AcceptanceModel().score(tree, 4096).fitted_scores(w, b)
    lh, ls, r = tree.logit_head, tree.logit_share, tree.log_r
    pick = 3 * K  # position 3: plain pick, depth 4
    assert s[pick] == pytest.approx(w[0] + w[1] * lh[pick] + w[2] * ls[pick] + 3 * w[7]
                                    + ctx * w[9] + b)
    sib = 3 * K + 2
    assert s[sib] == pytest.approx(w[3] + w[4] * r[sib] + w[5] * lh[sib] + w[6] * ls[sib]
                                   + 3 * w[8] + ctx * w[10] + b)
    agreed = K + 2  # sibling at position 1 agreed with bucket 3, logit p 1.2
    plain_sib = (w[3] + w[4] * r[agreed] + w[5] * lh[agreed] + w[6] * ls[agreed] + w[8]
                 + ctx * w[10] + b)
    assert s[agreed] == pytest.approx(plain_sib + 1.2 + w[12 + 12 + 2 * 3 + 1])
    contra_pick = 2 * K  # contradicted by evidence 0 with logit p 2.0
    plain_pick = (w[0] + w[1] * lh[contra_pick] + w[2] * ls[contra_pick] + 2 * w[7]
                  + ctx * w[9] + b)
    assert s[contra_pick] == pytest.approx(plain_pick - 2.0 + w[48 + 0])
    ng = np.flatnonzero(tree.token == 303)[0]  # bucket 9, logit p -0.7
    assert s[ng] == pytest.approx(-0.7 + w[12 + 9] + ctx * w[11] + b)


def test_expected_square_gradient_is_the_variance_under_the_models_own_q():
    rng = np.random.default_rng(10)
    model = AcceptanceModel()
    tree = mixed_tree(rng)
    scored = model.score(tree, 700)
    parents = [-1, 0]
    expected = model.expected_square_gradient(scored, label_nodes(tree, parents, [0, 0]))
    exact = np.zeros(N_COEF)
    for p in parents:  # enumerate each parent's outcomes: one child, or none
        kids = np.flatnonzero(tree.parent == p)
        q = scored.q_fit[kids]
        X = scored.X[kids]
        for outcome in range(kids.size + 1):
            y = np.zeros(kids.size)
            prob = 1.0 - q.sum()
            if outcome < kids.size:
                y[outcome] = 1.0
                prob = q[outcome]
            exact += prob * (X.T @ (q - y)) ** 2
    np.testing.assert_allclose(expected, exact, atol=1e-12)
