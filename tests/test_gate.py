"""The draft gate alone: warming alternates, then the faster mode runs, the other every EXPLORE."""

import pytest

from adaspark.scheduler.gate import EXPLORE, DraftGate


def test_warming_alternates_then_the_faster_mode_runs_with_exploration():
    gate = DraftGate()
    picks = []
    for _ in range(16):  # warming: each mode needs BandRate's warm rounds
        drafted = gate.choose(0)
        picks.append(drafted)
        gate.learn(0, drafted, 3 if drafted else 1, 20.0 if drafted else 10.0)  # 0.15 vs 0.1
    assert picks.count(True) == picks.count(False) == 8
    later = []
    for _ in range(3 * (EXPLORE + 1)):
        drafted = gate.choose(0)
        later.append(drafted)
        gate.learn(0, drafted, 3 if drafted else 1, 20.0 if drafted else 10.0)
    assert later.count(False) == 3  # one exploration round per EXPLORE rounds of the winner
    assert gate.faster(0) is True and gate.faster(1) is None  # buckets are independent


def test_the_undrafted_fixed_cost_is_a_moving_average():
    gate = DraftGate()
    assert gate.fixed_ms is None
    gate.learn_fixed(1.0)
    gate.learn_fixed(2.0)
    assert 1.0 < gate.fixed_ms < 2.0


def warmed(unit: str = "ms") -> DraftGate:
    gate = DraftGate(unit=unit)
    for _ in range(16):
        drafted = gate.choose(0)
        gate.learn(0, drafted, 3 if drafted else 1, 2.0 if drafted else 1.0)
    assert gate.faster(0) is True
    return gate


def test_a_restart_warms_every_bucket_again_and_keeps_the_undrafted_d():
    gate = warmed()
    gate.learn_fixed(0.5)
    gate.restart()
    assert gate.faster(0) is None and gate.fixed_ms == 0.5
    assert [gate.choose(0) for _ in range(2)] == [True, True]  # warming: fewer rounds first
    gate.learn(0, True, 3, 2.0)
    assert gate.choose(0) is False


def test_rates_stored_in_another_unit_are_not_loaded():
    """The paced arm counts round time in plain steps, the others in ms: a store written in
    one unit would compare the two modes' rates across units, so its rates start again."""
    steps = warmed("step")
    state = steps.state_dict()
    assert state["unit"] == "step"
    same = DraftGate(unit="step")
    same.load_state_dict(state)
    assert same.state_dict() == state
    other = DraftGate(unit="ms")
    other.load_state_dict(state)
    assert other.rates == {} and other.fixed_ms == steps.fixed_ms
    del state["unit"]  # a store written before the unit existed: ms
    other.load_state_dict(state)
    assert other.faster(0) is True
    with pytest.raises(ValueError):
        DraftGate(unit="s")


def test_drafted_curve_is_the_decayed_mean_of_edge_padded_trees():
    import numpy as np

    from adaspark.scheduler.gate import TREE_DECAY

    gate, weight, total = DraftGate(), 0.0, np.zeros(1)
    rng = np.random.default_rng(3)
    for size in (5, 0, 9, 3, 9, 12, 1):   # shorter and longer trees than the sum so far
        q = rng.uniform(0, 1, size)
        s = np.concatenate([[0.0], np.cumsum(q)])
        n = max(s.size, total.size)
        total, s = (np.pad(x, (0, n - x.size), mode="edge") for x in (total, s))
        weight, total = TREE_DECAY * weight + 1.0, TREE_DECAY * total + s
        gate.learn_tree(2, q)
        assert gate.drafted_curve(2).tobytes() == (total / weight).tobytes()
    assert gate.drafted_curve(None) is None
