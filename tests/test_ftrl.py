import json

import numpy as np
import pytest

from adaspark.errors import UserError
from adaspark.scheduler.ftrl import AdaGradScalar, FTRLProximal


def test_ftrl_recovers_a_quadratic_minimum():
    target = np.array([0.7, -1.3, 2.0])
    model = FTRLProximal(prior=[0.5, 0.0, 0.0], alpha=0.5, beta=1.0, n_cap=400.0)
    for _ in range(3000):
        model.update(model.weights - target)  # gradient of 0.5*|w - target|^2
    np.testing.assert_allclose(model.weights, target, atol=1e-3)


def test_gate_holds_prior_under_zero_mean_noise_and_leaves_under_a_real_signal():
    rng = np.random.default_rng(0)
    held = FTRLProximal(prior=[1.0, 2.0], alpha=0.05, gate=3.0)
    for _ in range(200):
        held.update(rng.choice([-1.0, 1.0], size=2) * 0.5)
    assert held.weights.tolist() == [1.0, 2.0]

    moved = FTRLProximal(prior=[1.0, 2.0], alpha=0.05, gate=3.0)
    for _ in range(200):
        moved.update(np.array([0.5, 0.0]) + rng.choice([-1.0, 1.0], size=2) * 0.5)
    assert moved.weights[0] < 1.0
    assert moved.weights[1] == 2.0


def test_squared_gradient_cap_floors_the_rate():
    model = FTRLProximal(prior=[0.0], alpha=1.0, beta=1.0, n_cap=4.0)
    for _ in range(10):
        model.update([1.0])
    assert model.n[0] == 4.0
    before = model.weights[0]
    model.update([1.0])
    # Once capped, each further unit gradient moves the weight by alpha / (beta + sqrt(cap)).
    assert before - model.weights[0] == pytest.approx(1.0 / 3.0)


def test_lower_clamp_applies_to_the_coefficient():
    model = FTRLProximal(prior=[0.0, 0.0], alpha=1.0, lower=[-np.inf, 0.0])
    for _ in range(50):
        model.update([1.0, 1.0])
    assert model.weights[0] < 0.0
    assert model.weights[1] == 0.0


def test_state_round_trips_bit_for_bit_through_json():
    rng = np.random.default_rng(1)
    a = FTRLProximal(prior=[0.3, -0.1, 0.0], alpha=[0.05, 0.05, 0.5], l2=0.01, gate=3.0)
    for _ in range(100):
        a.update(rng.normal(size=3) + 0.4)
    b = FTRLProximal(prior=[0.3, -0.1, 0.0], alpha=[0.05, 0.05, 0.5], l2=0.01, gate=3.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.weights.tobytes() == a.weights.tobytes()
    g = rng.normal(size=3)
    a.update(g)
    b.update(g)
    assert b.weights.tobytes() == a.weights.tobytes()


def test_bad_state_and_gradient_are_refused():
    model = FTRLProximal(prior=[0.0, 0.0], alpha=0.1)
    with pytest.raises(UserError):
        model.load_state_dict({"z": [0.0], "n": [0.0], "m": [0]})
    with pytest.raises(UserError):
        model.load_state_dict({"n": [0.0, 0.0]})
    with pytest.raises(UserError):
        model.update([1.0, 2.0, 3.0])


def test_adagrad_scalar_steps_clamps_caps_and_resets():
    b = AdaGradScalar(rate=0.15, band=2.0, g2_cap=16.0)
    b.update(1.0)
    assert b.value == pytest.approx(-0.15)
    for _ in range(200):
        b.update(1.0)
    assert b.value == -2.0 and b.g2 == 16.0
    b.update(-1.0)
    assert b.value == pytest.approx(-2.0 + 0.15 / 4.0)
    b.reset()
    assert (b.value, b.g2) == (0.0, 0.0)
    c = AdaGradScalar(rate=0.15, band=2.0, g2_cap=16.0)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert c.state_dict() == b.state_dict()


def test_expected_variance_keeps_the_gate_shut_before_a_rare_outcome():
    # A rare outcome (probability q) that has not happened yet: each update's gradient is q.
    # The realised sum of squares grows by q**2 only, so without the model's own variance the
    # gate opens long before the outcome is overdue; with it, the prior holds.
    q = 0.02
    realised = FTRLProximal(prior=[0.0], alpha=0.5, gate=3.0)
    expected = FTRLProximal(prior=[0.0], alpha=0.5, gate=3.0)
    for _ in range(40):
        realised.update([q])
        expected.update([q], variance=[q * (1 - q)])
    assert realised.weights[0] < 0.0
    assert expected.weights[0] == 0.0


def reference_update(ftrl, g, variance=None):
    """FTRLProximal's step as first written: every term recomputed, clip always applied."""
    if variance is not None:
        ftrl.v = np.minimum(ftrl.v + variance, ftrl.n_cap)
    n_new = np.minimum(ftrl.n + g * g, ftrl.n_cap)
    sigma = (np.sqrt(n_new) - np.sqrt(ftrl.n)) / ftrl.alpha
    ftrl.z += g - sigma * (ftrl.w - ftrl.prior)
    ftrl.n = n_new
    threshold = ftrl.l1 + ftrl.gate * np.sqrt(np.maximum(ftrl.n, ftrl.v))
    shrunk = np.sign(ftrl.z) * np.maximum(np.abs(ftrl.z) - threshold, 0.0)
    ftrl.w = np.clip(ftrl.prior + -shrunk / ((ftrl.beta + np.sqrt(ftrl.n)) / ftrl.alpha
                                             + ftrl.l2), ftrl.lower, ftrl.upper)


@pytest.mark.parametrize("gate, lower", [(0.0, None), (3.0, None), (0.0, [0.0, -1.0, 0.0])])
def test_update_equals_the_reference_step_bit_for_bit(gate, lower):
    from types import SimpleNamespace

    rng = np.random.default_rng(2)
    prior = np.array([1.0, 0.0, 0.5])
    ftrl = FTRLProximal(prior, [0.05, 0.5, 0.1], beta=1.0, l1=0.002, l2=0.01, gate=gate,
                        n_cap=40.0, lower=lower)
    ref = SimpleNamespace(prior=prior, alpha=ftrl.alpha, beta=1.0, l1=0.002, l2=0.01,
                          gate=gate, n_cap=40.0, lower=ftrl.lower, upper=ftrl.upper,
                          z=np.zeros(3), n=np.zeros(3), v=np.zeros(3), w=prior.copy())
    for step in range(300):             # n reaches its cap of 40
        g = rng.normal(size=3) * (step % 5 != 0)
        var = rng.uniform(0, 2, 3) if gate else None
        ftrl.update(g, var)
        reference_update(ref, g, var)
        assert ftrl.weights.tobytes() == ref.w.tobytes() and ftrl.z.tobytes() == ref.z.tobytes()
    assert ftrl.n.max() == 40.0 and not ftrl.weights.flags.writeable
