"""The width chooser (§3.4): Proposition 2, hysteresis, the ratio rule, gains, band rates."""

import json
import random

import numpy as np
import pytest

from adaspark.errors import UserError
from adaspark.scheduler.chooser import GAIN_CLAMP, Chooser, RidgeGain
from adaspark.scheduler.cost import CostModel


def cumulative(per_node):
    return np.concatenate([[0.0], np.cumsum(per_node)]).tolist()


def warm_band(chooser, context, rate, rounds=8):
    """Teach the context's band an achieved rate of `rate` tokens per ms."""
    for _ in range(rounds):
        chooser.learn(8, context, 3, 4.0 / rate, offered=[], realised_drafter=[0.0],
                      realised_ngram=[0.0], predicted_drafter=[0.0], predicted_ngram=[0.0])


def test_a_maximiser_of_v_is_a_class_top():
    # Proposition 2: step cost constant on classes, non-decreasing S, gains in [0.25, 4].
    rng = random.Random(5)
    for trial in range(20):
        model = CostModel()
        steps = {w: rng.uniform(8, 40) for w in model.widths}
        while (width := model.probe()) is not None:
            model.observe(width, width, 700, steps[width], 3.0)
        every_width = [(w, model.price(w, 700)) for w in range(2, 65)]
        chooser = Chooser(hysteresis=False)
        for _ in range(trial % 5):   # gains away from 1 (they stay clamped to [0.25, 4])
            chooser.above[0].observe(1.0, rng.uniform(0, 5), 700)
            chooser.below[1].observe(1.0, rng.uniform(0, 5), 700)
        warm_band(chooser, 700, rng.uniform(0.05, 0.5))
        s_d = cumulative([rng.uniform(0, 0.6) ** (1 + i / 8) for i in range(63)])
        s_n = cumulative([rng.choice([0.0, rng.uniform(0, 0.3)]) for _ in range(63)])
        chosen = chooser.choose(every_width, s_d, s_n, 3.0, 700)
        best_anywhere = max(chooser.value(w, t) for w, t in every_width)
        best_top = max(chooser.value(w, model.price(w, 700)) for w in model.widths)
        assert best_top == pytest.approx(best_anywhere, abs=1e-12)
        assert chooser.value(chosen, model.price(chosen, 700)) == best_anywhere


def offers_and_sums():
    offers = [(8, 10.0), (16, 14.0)]
    s_d = cumulative([0.5] * 7 + [0.125] * 8)       # tokens(8) = 4.5, tokens(16) = 5.5
    return offers, s_d, [0.0] * len(s_d)


def test_ratio_rule_until_the_band_holds_eight_rounds_then_long_run_rate():
    offers, s_d, s_n = offers_and_sums()
    chooser = Chooser()
    # Ratio: 4.5/12 = 0.375 against 5.5/16 = 0.344: the narrower width wins by over 4%.
    assert chooser.choose(offers, s_d, s_n, 2.0, 1000) == 8
    warm_band(chooser, 1000, 0.2, rounds=7)
    assert chooser.choose(offers, s_d, s_n, 2.0, 1000) == 8
    warm_band(chooser, 1000, 0.2, rounds=1)
    # At rate 0.2: V(8) = 4.5 − 2.4 = 2.1, V(16) = 5.5 − 3.2 = 2.3 > 2.1 + 0.04·4.5.
    assert chooser.choose(offers, s_d, s_n, 2.0, 1000) == 16
    assert Chooser(ratio_rule=True).choose(offers, s_d, s_n, 2.0, 1000) == 8
    # Another band is still cold.
    assert chooser.choose(offers, s_d, s_n, 2.0, 5000) == 8


def test_first_incumbent_is_the_widest_offered_width():
    offers, s_d, s_n = offers_and_sums()
    chooser = Chooser()
    warm_band(chooser, 1000, 0.2)
    # At 15.2 ms V(16) = 2.06 < V(8) = 2.1, but not by the margin 0.04 · 5.5: 16 is held.
    assert chooser.choose([(8, 10.0), (16, 15.2)], s_d, s_n, 2.0, 1000) == 16
    assert chooser.incumbent == 16


def test_hysteresis_holds_the_incumbent_against_a_small_win():
    s_d = cumulative([0.5] * 7 + [0.125] * 8)
    chooser = Chooser()
    warm_band(chooser, 1000, 0.2)
    assert chooser.choose([(8, 10.0), (16, 14.0)], s_d, [0.0] * 16, 2.0, 1000) == 16
    # At 15.9 ms V(16) = 1.92: V(8) = 2.1 beats it by 0.18 < 0.22 = 0.04 · tokens(16).
    assert chooser.choose([(8, 10.0), (16, 15.9)], s_d, [0.0] * 16, 2.0, 1000) == 16
    restless = Chooser(hysteresis=False)
    warm_band(restless, 1000, 0.2)
    assert restless.choose([(8, 10.0), (16, 14.0)], s_d, [0.0] * 16, 2.0, 1000) == 16
    assert restless.choose([(8, 10.0), (16, 15.9)], s_d, [0.0] * 16, 2.0, 1000) == 8
    # A big enough win moves it: V(16) = 1.7 at 17 ms, beaten by 0.4 > 0.22.
    assert chooser.choose([(8, 10.0), (16, 17.0)], s_d, [0.0] * 16, 2.0, 1000) == 8
    assert chooser.wins(16, 10.0) and not chooser.wins(16, 16.0)


def test_ties_go_narrower_and_pinned_width_is_kept():
    chooser = Chooser(hysteresis=False)
    s_d = cumulative([0.5] * 3 + [0.0] * 12)          # rows past 4 add nothing
    assert chooser.choose([(4, 10.0), (8, 10.0), (16, 10.0)], s_d, [0.0] * 16, 2.0, 500) == 4
    pinned = Chooser(pinned=12)
    assert pinned.choose([(4, 10.0), (8, 10.0)], s_d, [0.0] * 16, 2.0, 500) == 12
    with pytest.raises(UserError):
        Chooser(pinned=0)
    with pytest.raises(UserError):
        chooser.choose([], s_d, [0.0] * 16, 2.0, 500)


def test_gains_clamp():
    high, low = RidgeGain(), RidgeGain()
    for _ in range(500):
        high.observe(1.0, 10.0, 4000)
        low.observe(1.0, 0.0, 4000)
    assert high.value(4000) == GAIN_CLAMP[1] and low.value(4000) == GAIN_CLAMP[0]
    assert RidgeGain().value(123) == 1.0       # with nothing learned, the prior: 1


def test_gains_learn_a_line_in_context_toward_the_truth():
    rng = np.random.default_rng(11)
    gain = RidgeGain()
    truth = lambda u: 1.5 - 0.8 * (u - 0.5)   # noqa: E731 (over-realised short, under long)
    for _ in range(3000):
        c = rng.uniform(0, 8192)
        p = rng.uniform(0.2, 2.0)
        gain.observe(p, truth(c / 8192) * p + rng.normal(0, 0.2), c)
    for c in (500, 4000, 8000):
        assert gain.value(c) == pytest.approx(truth(c / 8192), abs=0.1)


def round_arrays(rows, accepted_prefix):
    """Predicted 0.5 per node; the first `accepted_prefix` nodes of the order were accepted."""
    predicted = cumulative([0.5] * (rows - 1))
    realised = cumulative([1.0 if i < accepted_prefix else 0.0 for i in range(rows - 1)])
    return predicted, realised


def test_gains_above_learn_only_from_rounds_wider_than_n0_below_from_narrower_rows():
    chooser = Chooser()
    predicted, realised = round_arrays(16, 10)
    zero = [0.0] * 16
    before = json.dumps(chooser.state_dict())
    chooser.learn(8, 600, 3, 20.0, [4, 8, 16], realised, zero, predicted, zero)
    state = chooser.state_dict()
    assert state["above"] == json.loads(before)["above"]      # 8 rows: nothing above n0
    # Below: rows between the narrowest offered (4) and min(8, n0) = 8 revealed 4 nodes each.
    assert state["below"][0]["xy"][0] == pytest.approx(2.0 * 4.0)
    chooser.learn(16, 600, 10, 25.0, [4, 8, 16], realised, zero, predicted, zero)
    above = chooser.state_dict()["above"][0]
    assert above["xx"][0] == pytest.approx(4.0 ** 2) and above["xy"][0] == pytest.approx(4 * 3)
    assert chooser.state_dict()["above"][1] == json.loads(before)["above"][1]  # no n-gram rows


def test_last_round_teaches_nothing_but_hold_counts():
    chooser = Chooser()
    offers, s_d, s_n = offers_and_sums()
    width = chooser.choose(offers, s_d, s_n, 2.0, 1000)
    predicted, realised = round_arrays(16, 4)
    before = chooser.state_dict()
    chooser.learn(width, 1000, 4, 20.0, [8, 16], realised, [0.0] * 16, predicted, [0.0] * 16,
                  teach=False)
    assert chooser.state_dict() == before and chooser.held_rounds == 1
    chooser.learn(2, 1000, 1, 20.0, [8, 16], realised, [0.0] * 16, predicted, [0.0] * 16)
    assert chooser.held_rounds == 0           # a round at another width (a probe) breaks a hold


def test_band_rate_uses_decayed_tokens_over_time():
    chooser = Chooser()
    for _ in range(64):
        chooser.learn(8, 300, 3, 10.0, [], [0.0], [0.0], [0.0], [0.0])   # 0.4 tokens per ms
    for _ in range(64):
        chooser.learn(8, 300, 1, 10.0, [], [0.0], [0.0], [0.0], [0.0])   # 0.2 tokens per ms
    rate = chooser.rates[9].rate
    # Weights 0.25 : 0.5 for the older and newer 64 rounds (half-life 64).
    assert rate == pytest.approx((4 * 0.25 + 2 * 0.5) / (10 * 0.75), rel=1e-9)


def test_state_dict_round_trips_exactly():
    rng = random.Random(2)
    chooser = Chooser()
    for _ in range(300):
        rows = rng.choice([4, 8, 16, 32])
        predicted, realised = round_arrays(32, rng.randint(0, 31))
        chooser.learn(rows, rng.randint(10, 9000), rng.randint(0, 8), rng.uniform(5, 50),
                      [4, 8, 16, 32], realised, realised, predicted, predicted)
    state = chooser.state_dict()
    restored = Chooser()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    for c in (100, 5000):
        assert [g.value(c) for g in restored.above + restored.below] == \
            [g.value(c) for g in chooser.above + chooser.below]
    with pytest.raises(UserError):
        restored.load_state_dict({"above": [], "below": [], "rates": []})


def test_cost_model_splits_only_where_the_chooser_says_a_width_could_win():
    def measured():
        model = CostModel()
        steps = {2: 10.0, 4: 10.2, 8: 10.5, 16: 15.0, 32: 30.0, 64: 26.0}
        while (width := model.probe()) is not None:
            model.observe(width, width, 700, steps[width], 2.0)
        return model

    def held(chooser, model, s_d, rounds=8):
        for _ in range(rounds):
            width = chooser.choose(model.offers(700), s_d, [0.0] * len(s_d), 2.0, 700)
            chooser.learn(width, 700, 3, 20.0, [], [0.0], [0.0], [0.0], [0.0])
        return width

    # Rows past 8 accept nothing: no width inside any interval can beat the held 8 rows.
    model, chooser = measured(), Chooser()
    warm_band(chooser, 700, 0.2)
    flat = cumulative([0.5] * 7 + [0.0] * 56)
    assert held(chooser, model, flat) == 8
    assert model.maybe_split(8, chooser.held_rounds, 700, chooser.wins) is None
    # Rows 9-16 accept 0.3 each: 16 rows are held, and 15 rows at the 8-row price would win.
    model, chooser = measured(), Chooser()
    warm_band(chooser, 700, 0.2)
    rising = cumulative([0.5] * 7 + [0.3] * 8 + [0.0] * 48)
    assert held(chooser, model, rising) == 16
    assert model.maybe_split(16, chooser.held_rounds, 700, chooser.wins) == 15


def test_scores_are_eq7_of_every_offer_and_ties_go_narrower():
    # choose() scores every offer in one inlined loop: each score must be V(n) of Eq. (7) (or
    # the ratio under ratio_rule / a cold band), summed in the docstring's order.
    s_d = cumulative([0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01])
    s_n = cumulative([0.0, 0.2, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0])  # 11 prefix sums
    offers = [(2, 6.0), (4, 7.0), (8, 9.5), (16, 14.0), (32, 25.0)]
    for ratio_rule in (True, False):
        rng = random.Random(7)
        chooser = Chooser(ratio_rule=ratio_rule)
        for _ in range(40):           # gains away from 1 above and below n0, a warm band
            chooser.learn(16, 900, 5, 30.0, offered=[4, 8, 16, 32], realised_drafter=[0.0] + [
                rng.uniform(0, 6) for _ in range(10)], realised_ngram=[0.0] + [
                rng.uniform(0, 2) for _ in range(10)], predicted_drafter=s_d,
                predicted_ngram=s_n)
        scores = chooser._scores(offers, s_d, s_n, 3.0, 900)  # what choose() ranks by
        r = chooser._round
        assert (r["rate"] is None) == ratio_rule and r["gains_above"] != (1.0, 1.0)
        for width, verify_ms in offers:
            k = min(width - 1, 10)
            g_d, g_n = r["gains_above"] if width >= 8 else r["gains_below"]
            tokens = 1.0 + s_d[7] + s_n[7] + g_d * (s_d[k] - s_d[7]) + g_n * (s_n[k] - s_n[7])
            time = 3.0 + verify_ms
            want = tokens / time if ratio_rule else tokens - r["rate"] * time
            assert scores[width] == want == chooser.value(width, verify_ms)
            assert chooser.tokens(width) == tokens
    tie = Chooser(hysteresis=False)
    assert tie.best([(8, 10.0), (4, 10.0)], [0.0, 1.0], [0.0, 0.0], 0.0, 100) == (4, 10.0)
