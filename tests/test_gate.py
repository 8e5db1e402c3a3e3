"""The draft gate alone: warming alternates, then the faster mode runs, the other every EXPLORE."""

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
