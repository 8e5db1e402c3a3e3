"""The online verify-cost model (§3.2): law, bank refit, probes, reach, splits, envelope, level,
clock, persistence."""

import json
import math
import random

import numpy as np
import pytest

from adaspark.errors import UserError
from adaspark.scheduler.cost import (
    LADDER,
    MAX_CLASSES,
    QUANTILE,
    RISE_SHARE,
    CostModel,
    QuantileLaw,
    _dot,
    _new_ftrl,
    _train_fresh,
    basis,
    pinball,
)


def measure_all(model, time_of, context=600, fixed_ms=3.0):
    """Run the cold-start probes to the end with a step-shaped machine `time_of(width)`."""
    rounds = 0
    while (width := model.probe()) is not None:
        model.observe(width, width, context, time_of(width), fixed_ms)
        rounds += 1
        assert rounds < 200
    return rounds


# ----- the law ------------------------------------------------------------------------------

def machine_ms(context):
    return 20.0 + 2.0 * context / 1000.0


def one_sided(rng, context):
    """Interference only slows a verify: 40% of rounds run free, the rest pay up to +60%."""
    t = machine_ms(context)
    return t if rng.random() < 0.4 else t * (1.0 + rng.expovariate(1.0 / 0.2))


def test_quantile_law_recovers_machine_time_where_least_squares_does_not():
    # Proposition 3: contexts arrive request by request; the law is refitted after each.
    rng = random.Random(7)
    law = QuantileLaw()
    contexts, times = [], []
    for start in (300, 1200, 2500, 4800, 7000, 3500, 600, 6000):
        for i in range(60):
            c = start + 5 * i
            t = one_sided(rng, c)
            law.learn(c, t)
            contexts.append(c)
            times.append(t)
        law.refit()
    grid = [400, 1500, 3000, 5000, 7200]
    quantile_error = max(abs(law.predict(c) / machine_ms(c) - 1) for c in grid)
    phi = np.array([basis(c) for c in contexts])
    theta = np.linalg.lstsq(phi, np.array(times), rcond=None)[0]
    ls_error = min(abs(float(np.dot(basis(c), theta)) / machine_ms(c) - 1) for c in grid)
    assert quantile_error < 0.03
    assert ls_error > 0.08          # least squares prices the interference in, everywhere


def test_law_never_slopes_down():
    law = QuantileLaw()
    rng = random.Random(1)
    for _ in range(200):            # a machine that (wrongly) looks faster at long context
        c = rng.uniform(100, 8000)
        law.learn(c, 30.0 - 2.0 * c / 1000.0)
    prices = [law.predict(c) for c in range(0, 16000, 250)]
    assert all(b >= a for a, b in zip(prices, prices[1:], strict=False))
    assert np.all(law.ftrl.weights[1:] >= 0.0)
    law.refit()
    prices = [law.predict(c) for c in range(0, 16000, 250)]
    assert all(b >= a for a, b in zip(prices, prices[1:], strict=False))


def test_law_prices_lowest_time_until_three_samples_then_clamps():
    law = QuantileLaw()
    assert law.predict(500) is None
    law.learn(500, 12.0)
    law.learn(500, 11.0)
    assert law.predict(9000) == 11.0 and not law.fitted
    law.learn(500, 14.0)
    assert law.fitted and law.scale == 11.0
    for _ in range(300):            # a wild sample stream cannot price above 3x the lowest
        law.learn(500, 500.0)
    assert law.predict(500) <= 3.0 * 11.0 + 1e-9
    with pytest.raises(ValueError):
        law.learn(500, -1.0)


def test_refit_trainer_is_the_shared_ftrl_bit_for_bit():
    rng = random.Random(9)
    order = [(basis(rng.uniform(0, 20000)), rng.uniform(0.6, 2.5)) for _ in range(40)]
    reference = _new_ftrl()
    for _ in range(30):             # long enough for n to reach its cap of 400
        for phi, y in order:
            w = reference.weights.tolist()
            slope = -QUANTILE if y > _dot(w, phi) else 1.0 - QUANTILE
            reference.update([slope * p for p in phi])
    fast = _train_fresh(order, 30)
    assert fast.state_dict() == reference.state_dict()
    assert max(reference.n) == 400.0
    assert fast.weights.tobytes() == reference.weights.tobytes()


def test_online_law_steps_are_the_shared_ftrl_bit_for_bit():
    # QuantileLaw learns in plain floats (LawFTRL); each step must equal FTRLProximal's.
    rng = random.Random(4)
    law, reference = QuantileLaw(), _new_ftrl()
    for k in range(600):             # long enough for the intercept's n to reach its cap
        c, ms = rng.uniform(50, 20000), rng.uniform(5.0, 40.0)
        law.learn(c, ms)
        if k < 2:
            continue
        steps = [(basis(c0), t0 / law.scale) for c0, t0 in law.first] if k == 2 else [
            (basis(c), ms / law.scale)]
        for phi, y in steps:
            w = reference.weights.tolist()
            slope = -QUANTILE if y > _dot(w, phi) else 1.0 - QUANTILE
            reference.update([slope * p for p in phi])
        assert law.ftrl.weights.tobytes() == reference.weights.tobytes()
    assert law.ftrl.state_dict() == reference.state_dict()
    assert max(reference.n) == 400.0
    restored = QuantileLaw()
    restored.load_state_dict(json.loads(json.dumps(law.state_dict())))
    law.learn(700, 12.0)
    restored.learn(700, 12.0)        # a restored law steps on exactly as the original
    assert restored.state_dict() == law.state_dict()


def test_basis_is_memoised_without_changing_a_bit():
    u = 512 / 8192
    assert basis(512) is basis(512.0)            # one entry, the same floats either way
    assert basis(512) == (1.0, u, u * u, math.sqrt(u), math.log1p(u))
    other = basis(np.float64(300.5))             # other types are computed, as they were
    assert other is not basis(300.5) and type(other[1]) is np.float64
    assert other == basis(300.5)
    zero = basis(-0.0)                           # zero is not memoised: -0.0 keeps its sign
    assert str(zero[1]) == "-0.0" and str(basis(0)[1]) == "0.0"


def test_refit_is_adopted_when_it_wins_on_held_out_samples():
    # A sparse long-context band: three online steps barely move the slope, the refit fits it.
    law = QuantileLaw()
    for _ in range(3):
        law.learn(443, 25.0)
    for _ in range(3):
        law.learn(8444, 34.2)
    online = law.predict(8444)
    judged = [(443, 25.0)] * 3 + [(8444, 34.2)] * 3
    loss_before = sum(pinball(t / law.scale - law.predict(c) / law.scale) for c, t in judged)
    assert law.refit() is True
    loss_after = sum(pinball(t / law.scale - law.predict(c) / law.scale) for c, t in judged)
    assert loss_after < loss_before
    assert abs(law.predict(8444) / 34.2 - 1) < 0.02 < abs(online / 34.2 - 1)
    assert abs(law.predict(443) / 25.0 - 1) < 0.02


def test_refit_is_refused_when_it_loses_on_held_out_samples():
    # The online law has followed the machine up to 15 ms; the bank's older 12 samples say 10.
    law = QuantileLaw()
    for _ in range(3):
        law.learn(500, 10.0)
    for _ in range(400):
        law.learn(500, 15.0)
    band = next(iter(law.bank))
    law.bank[band] = [(500.0, 10.0)] * 12 + [(500.0, 15.0)] * 4
    weights = law.ftrl.weights.copy()
    before = law.predict(500)
    assert law.refit() is False     # trained on the 12 old samples, it loses on the newest 4
    assert np.array_equal(law.ftrl.weights, weights) and law.predict(500) == before


def test_bank_keeps_newest_sixteen_per_band():
    law = QuantileLaw()
    for i in range(40):
        law.learn(300, 10.0 + i)    # band 9
        law.learn(3000, 20.0 + i)   # band 12
    assert sorted(law.bank) == [9, 12]
    assert [t for _, t in law.bank[9]] == [10.0 + i for i in range(24, 40)]


# ----- the table --------------------------------------------------------------------------

def test_probes_run_narrowest_first_three_each_and_first_round_teaches_nothing():
    model = CostModel()
    seen = []
    model.observe(2, 2, 500, 50.0, 9.0, teach=False)     # a cold first round
    while (width := model.probe()) is not None:
        seen.append(width)
        model.observe(width, width, 500, 10.0 + width / 8, 3.0)
    assert seen == [w for w in LADDER for _ in range(3)]
    assert model.price(2, 500) < 50.0


def test_short_builds_do_not_count_and_three_teach_the_reach():
    model = CostModel()
    measure_all_but = [w for w in LADDER if w < 64]
    for width in measure_all_but:
        for _ in range(3):
            model.observe(width, width, 500, 10.0, 3.0)
    assert model.probe() == 64
    model.observe(64, 55, 500, 12.0, 3.0, tree_rows=55)
    model.observe(64, 57, 500, 12.0, 3.0, tree_rows=57)
    assert model.probe() == 64 and model.reach is None   # not counted, not yet the reach
    model.observe(64, 56, 500, 12.0, 3.0, tree_rows=56)
    assert model.reach == 57 and model.widths[-1] == 57
    assert model.probe() == 57


def measured_2_4_8():
    model = CostModel()
    for width in (2, 4, 8):
        for _ in range(3):
            model.observe(width, width, 500, 10.0 + width, 3.0)
    assert model.probe() == 16
    return model


def test_only_a_whole_tree_short_of_the_width_is_the_drafters_reach():
    """Issue 24 item 2: widths 2/4/8 measured, then 16-row probes that came out at 6/5/7 rows
    (a stop token's Q = 0 cut the tree, or the reply ended in it) left the table [2, 4, 7],
    although 8 rows had been measured. A short probe whose whole tree was not short (or that
    says nothing of it: tree_rows None) teaches no reach; three whose whole tree was short
    teach one that is never below a measured class."""
    model = measured_2_4_8()
    for rows in (6, 5, 7):
        model.observe(16, rows, 500, 30.0, 3.0)                  # the round says nothing
    assert model.reach is None and model.widths == list(LADDER) and model.probe() == 16
    for rows in (6, 5, 7):
        model.observe(16, rows, 500, 30.0, 3.0, tree_rows=57)    # cut: the whole tree was wide
    assert model.reach is None and model.widths == list(LADDER) and model.probe() == 16
    for rows in (6, 5, 7):                                       # the drafter's own limit
        model.observe(16, rows, 500, 30.0, 3.0, tree_rows=rows)
    assert model.reach == 8 and model.widths == [2, 4, 8]        # 8 was filled: it stays
    assert model.probe() is None and model.price(8, 500) == pytest.approx(18.0, rel=0.05)
    state = json.loads(json.dumps(model.state_dict()))
    restored = CostModel()
    restored.load_state_dict(state)
    assert restored.widths == [2, 4, 8] and restored.reach == 8


def test_the_optimistic_price_of_an_unmeasured_width():
    model = measured_2_4_8()                       # 12, 14, 18 ms
    p4, p8 = model.price(4, 500), model.price(8, 500)
    rise = (p8 - p4) / 4                           # the last measured rise per row
    assert p8 == pytest.approx(18.0, rel=0.05) and rise > 0.5
    assert model.optimistic_price(16, 500) == pytest.approx(p8 + RISE_SHARE * rise * 8)
    assert model.optimistic_price(64, 500) == pytest.approx(p8 + RISE_SHARE * rise * 56)
    model.observe(16, 16, 500, 40.0, 3.0)          # one sample: the lowest time so far
    model.observe(16, 16, 500, 35.0, 3.0)
    assert model.optimistic_price(16, 500) == pytest.approx(35.0)
    model.classes.insert(2, type(model.classes[0])(6))   # a split inside: its bottom's price
    assert model.optimistic_price(6, 500) == pytest.approx(p4)
    one = CostModel()
    for _ in range(3):
        one.observe(2, 2, 500, 12.0, 3.0)
    p2 = one.price(2, 500)
    assert one.optimistic_price(4, 500) == pytest.approx(p2)      # no rise known: flat
    with_plain = one.optimistic_price(4, 500, plain_ms=8.0)
    assert with_plain == pytest.approx(p2 + RISE_SHARE * (p2 - 8.0) * 2)
    assert CostModel().optimistic_price(2, 500) is None


def test_frontier_splits_ignore_the_unmeasured_wide_classes():
    """The paced arm leaves wide classes unmeasured where they cannot pay: a split among the
    measured ones still runs, and waits while a class inside the measured range is pending."""
    model = measured_2_4_8()
    wins = lambda width, ms: True  # noqa: E731
    assert model.maybe_split(4, 8, 500, wins) is None               # the paper's: probes pending
    assert model.pending_inside() is False
    new = model.maybe_split(4, 8, 500, wins, frontier=True)
    assert new in (3, 5, 6, 7) and new in model.widths and model.pending_inside()
    assert model.maybe_split(4, 8, 500, wins, frontier=True) is None  # the new one is pending


def step_machine(width):
    # 4-bit-like steps: flat to 8 rows, x1.5 to 16, x2 again above 16; 64 cheaper than 32.
    return {2: 10.0, 4: 10.2, 8: 10.5, 16: 15.0, 32: 30.0, 64: 26.0}.get(width, 31.0)


def test_envelope_prices_and_offers():
    model = CostModel()
    measure_all(model, step_machine)
    offered = dict(model.offers(600))
    assert 32 not in offered        # a wider class is cheaper: the 32-row class is never chosen
    assert sorted(offered) == [2, 4, 8, 16, 64]
    assert model.price(20, 600) == model.price(64, 600) == pytest.approx(26.0, rel=0.02)
    assert model.price(9, 600) == pytest.approx(15.0, rel=0.02)
    for width in range(2, 65):      # a width's price is the cheapest class at least as wide
        wider = [p for top, p in offered.items() if top >= width]
        assert model.price(width, 600) == pytest.approx(min(wider))


def test_splits_only_where_a_width_could_win():
    model = CostModel()
    measure_all(model, step_machine)
    never = lambda width, ms: False   # noqa: E731
    always = lambda width, ms: True   # noqa: E731
    assert model.maybe_split(8, 20, 600, never) is None
    assert model.maybe_split(8, 7, 600, always) is None          # not held 8 rounds yet
    asked = []

    def only_above(width, ms):
        asked.append((width, ms))
        return width > 8
    new = model.maybe_split(8, 8, 600, only_above)
    # Nearest intervals first: (4, 8] and (8, 16] touch the held width; (4, 8] cannot win.
    assert asked[0][0] == 7 and asked[0][1] == pytest.approx(model.price(4, 600))
    assert asked[1][0] == 15 and asked[1][1] == pytest.approx(model.price(8, 600))
    assert new == 9                  # steep (15 ms over 10.5): next to the held width
    assert model.probe() == 9
    assert model.maybe_split(8, 30, 600, always) is None          # a probe is pending


def test_flat_interval_is_halved_and_table_stops_at_24():
    model = CostModel()
    measure_all(model, lambda w: 10.0 + 0.01 * w)
    assert model.maybe_split(64, 8, 600, lambda w, ms: w > 32) == 48
    while len(model.widths) < MAX_CLASSES:
        measure_all(model, lambda w: 10.0 + 0.01 * w)
        if model.maybe_split(64, 8, 600, lambda w, ms: True) is None:
            break
    measure_all(model, lambda w: 10.0 + 0.01 * w)
    assert len(model.widths) == MAX_CLASSES
    assert model.maybe_split(64, 8, 600, lambda w, ms: True) is None


def test_level_follows_the_machine_within_eight_rounds():
    model = CostModel(ladder=(8,))
    measure_all(model, lambda w: 10.0)
    for _ in range(20):
        model.observe(8, 8, 600, 10.0, 3.0)
    assert model.price(8, 600) == pytest.approx(10.0, rel=0.02)
    for _ in range(8):               # the machine slows by 30%
        model.observe(8, 8, 600, 13.0, 3.0)
    assert model.price(8, 600) == pytest.approx(13.0, rel=0.02)
    for _ in range(8):               # the level is clamped at 2x the law
        model.observe(8, 8, 600, 200.0, 3.0)
    law = model.classes[0].law.predict(600)
    assert model.price(8, 600) == pytest.approx(2.0 * law)


def test_clock_scales_classes_that_did_not_run():
    model = CostModel(ladder=(8, 16))
    measure_all(model, lambda w: 10.0 if w == 8 else 14.0, fixed_ms=3.0)
    for _ in range(10):
        model.observe(8, 8, 600, 10.0, 3.0)
    quiet = model.price(16, 600)
    for _ in range(8):               # the whole machine slows by half; only 8 rows run
        model.observe(8, 8, 600, 15.0, 4.5)
    assert model.clock == pytest.approx(1.5, rel=0.02)
    assert model.price(16, 600) == pytest.approx(1.5 * quiet, rel=0.02)
    assert model.fixed_cost(600) == pytest.approx(4.5, rel=0.02)


def test_end_request_refits_only_laws_that_learned():
    model = CostModel()
    measure_all(model, step_machine)
    model.end_request()
    assert not any(k.law.dirty for k in model.classes)
    model.observe(8, 8, 8000, 14.0, 3.0)
    dirty = [k.top for k in model.classes if k.law.dirty]
    assert dirty == [8] and model.fixed.dirty


def test_state_dict_round_trips_exactly_through_json():
    rng = random.Random(3)
    model = CostModel()
    measure_all(model, step_machine)
    for _ in range(200):
        c = rng.randint(100, 9000)
        model.observe(16, 16, c, 15.0 * (1 + c / 20000) * (1 + rng.random() * 0.1),
                      3.0 + rng.random())
    model.maybe_split(16, 8, 600, lambda w, ms: w < 16)
    model.end_request()
    state = model.state_dict()
    restored = CostModel()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    for c in (300, 3000, 9000):
        for a, b in zip(model.classes, restored.classes, strict=True):
            assert a.law.predict(c) == b.law.predict(c)
    with pytest.raises(UserError):
        CostModel().load_state_dict({"classes": []})


def test_refit_rebases_the_level_so_it_is_not_counted_twice():
    model = CostModel(ladder=(8,))
    for _ in range(3):
        model.observe(8, 8, 443, 25.0, 3.0)
    for _ in range(8):               # long context: the online law lags, the level corrects
        model.observe(8, 8, 8444, 34.2, 3.0)
    assert model.price(8, 8444) == pytest.approx(34.2, rel=0.03)
    assert model.classes[0].law.predict(8444) < 33.0
    assert model.end_request() >= 1
    assert model.classes[0].law.predict(8444) == pytest.approx(34.2, rel=0.02)
    assert model.price(8, 8444) == pytest.approx(34.2, rel=0.02)


def test_refit_of_the_fixed_cost_keeps_the_clock_a_machine_clock():
    # D grows with context, the machine does not slow: after the refit the clock reads ~1.
    model = CostModel(ladder=(8, 16))
    measure_all(model, lambda w: 10.0 if w == 8 else 14.0, context=500, fixed_ms=3.0)
    for _ in range(10):
        model.observe(8, 8, 8000, 10.0, 4.0)
    assert model.clock > 1.1        # the online law of D lags the context
    model.end_request()
    assert model.clock == pytest.approx(1.0, abs=0.03)
    assert model.price(16, 500) == pytest.approx(14.0, rel=0.03)
    assert model.fixed_cost(8000) == pytest.approx(4.0, rel=0.03)
