"""The shared row budget (scheduler/budget.py): Eq. (7) over one batched step, hand-computed."""

import numpy as np
import pytest

from adaspark.scheduler.bands import context_band
from adaspark.scheduler.budget import allocate, merged_order
from adaspark.scheduler.chooser import RATE_WARM_ROUNDS, BandRate, Chooser
from adaspark.sim.curves import MAX_ROWS, load_curve

LINEAR = lambda rows: 10.0 + 2.0 * rows  # noqa: E731  ms: each row costs 2 ms


def test_a_node_pays_while_its_q_beats_its_rows_time_at_the_rate():
    # 2 ms a row at 0.1 tokens per ms: a node must bring more than 0.2 tokens; 0.2 is a tie
    # and ties go to fewer rows
    assert allocate([[0.9, 0.5, 0.2, 0.1]], LINEAR, 0.1) == [2]
    assert allocate([[0.9, 0.5, 0.2, 0.1]], LINEAR, 0.05) == [4]  # 0.1 a row: all but none
    assert allocate([[0.9, 0.5, 0.2, 0.1]], LINEAR, 0.5) == [0]  # a row is worth 1 token


def test_two_requests_share_one_order_by_q():
    a, b = [0.9, 0.6, 0.3], [0.7, 0.25]
    # threshold 0.2: every node pays; threshold 0.3: 0.9, 0.7, 0.6 (0.3 ties, not taken)
    assert allocate([a, b], LINEAR, 0.1) == [3, 2]
    assert allocate([a, b], LINEAR, 0.15) == [2, 1]
    # threshold 0.5: the higher-Q request gets both of its nodes above it, the other one
    assert allocate([a, b], LINEAR, 0.25) == [2, 1]
    assert allocate([[0.95, 0.9, 0.85], [0.4, 0.3]], LINEAR, 0.2) == [3, 0]


def test_a_flat_curve_takes_every_node_that_can_be_accepted():
    flat = lambda rows: 30.0  # noqa: E731
    assert allocate([[0.5, 0.1, 1e-6, 0.0, 0.0], [0.0], []], flat, 10.0) == [3, 0, 0]


def test_a_steep_curve_takes_only_the_plain_rows():
    steep = lambda rows: 10.0 * rows  # noqa: E731
    rate = 3 / steep(3)  # three plain rows: 3 tokens in 30 ms; a node costs a whole token
    assert allocate([[0.99, 0.9], [0.95], [0.8, 0.7]], steep, rate) == [0, 0, 0]


def test_a_price_step_is_crossed_when_the_nodes_past_it_pay_for_all_of_it():
    step = lambda rows: 10.0 if rows == 1 else 30.0  # noqa: E731
    # one node alone costs 20 ms x 0.05 = 1 token > 0.9, but four bring 3.6 for the same 1
    assert allocate([[0.9, 0.9, 0.9, 0.9]], step, 0.05) == [4]
    assert allocate([[0.8, 0.05, 0.05, 0.05]], step, 0.05) == [0]  # 0.95 tokens < 1


def test_total_rows_never_exceed_the_cap_and_the_cap_keeps_the_best_q():
    flat = lambda rows: 30.0  # noqa: E731
    counts = allocate([[0.9, 0.5, 0.4], [0.8, 0.7, 0.1]], flat, 1.0, cap=5)
    assert counts == [1, 2]  # 2 plain rows + 0.9, 0.8, 0.7
    rng = np.random.default_rng(0)
    for _ in range(50):
        lists = [np.sort(rng.random(rng.integers(0, 20)))[::-1] for _ in range(4)]
        cap = int(rng.integers(4, 40))
        counts = allocate(lists, flat, 0.01, cap=cap)
        assert sum(counts) + 4 <= cap
        assert all(0 <= k <= len(q) for k, q in zip(counts, lists, strict=True))
    with pytest.raises(ValueError, match="at least 3 rows"):
        allocate([[0.5], [0.5], [0.5]], flat, 1.0, cap=2)


def test_merged_order_keeps_each_requests_prefix_and_breaks_ties_by_request():
    q, owner = merged_order([[0.5, 0.5, 0.2], [0.5, 0.3]])
    assert q.tolist() == [0.5, 0.5, 0.5, 0.3, 0.2]
    assert owner.tolist() == [0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="non-increasing"):
        merged_order([[0.2, 0.5]])
    assert allocate([], LINEAR, 0.1) == []


def _warm_chooser(rate: float, context: int) -> Chooser:
    chooser = Chooser(hysteresis=False)
    band = BandRate()
    for _ in range(RATE_WARM_ROUNDS):
        band.observe(rate * 100.0, 100.0)  # tokens over ms: the band's rate is `rate`
    chooser.rates[context_band(context)] = band
    return chooser


def test_one_request_is_the_single_request_choosers_choice():
    curve = load_curve("cpu-avx2")
    context = 900
    price = lambda rows: 1000.0 * curve.verify_s(rows, context)  # noqa: E731
    offers = [(w, price(w)) for w in range(1, MAX_ROWS + 1)]
    q = 0.93 ** np.arange(1, 57) * np.linspace(1.0, 0.4, 56)  # a drafted tree's Q, best first
    s_drafter = np.concatenate([[0.0], np.cumsum(q)]).tolist()
    s_ngram = [0.0] * len(s_drafter)
    widths = set()
    for rate in (0.02, 0.05, 0.08, 0.1, 0.13, 0.16, 0.2, 0.3):
        chooser = _warm_chooser(rate, context)
        width = chooser.choose(offers, s_drafter, s_ngram, 2.8, context)
        assert 1 + allocate([q], price, rate, cap=MAX_ROWS)[0] == width
        widths.add(width)
    assert len(widths) >= 4  # the rates span narrow to wide choices, so the match is not idle


def test_a_draft_pays_only_where_its_expected_tree_beats_the_ngram_tree_at_the_step_price():
    from adaspark.scheduler.budget import StepPrice, draft_pays

    step = StepPrice(rows=4, step_ms=LINEAR, rate=0.1)  # 2 ms a row: 0.2 tokens a row
    drafted, ngram = [0.0, 0.9, 1.5, 1.8], [0.0, 0.5]
    # by hand: max(0, 0.9-0.2, 1.5-0.4, 1.8-0.6) = 1.2; the n-gram tree's max(0, 0.5-0.2) = 0.3
    assert step.value(drafted) == pytest.approx(1.2) and step.value(ngram) == pytest.approx(0.3)
    assert draft_pays(drafted, ngram, 5.0, step)  # 1.2 - 0.5 = 0.7 > 0.3
    assert not draft_pays(drafted, ngram, 9.0, step)  # 1.2 - 0.9 = 0.3: a tie does not draft
    # a kernel step at 8 rows: free up to it, 20 ms past it
    stepped = lambda rows: 10.0 if rows <= 8 else 30.0  # noqa: E731
    assert draft_pays(drafted, [0.0], 5.0, StepPrice(4, stepped, 0.1))  # 1.8 - 0.5 > 0
    assert not draft_pays(drafted, [0.0], 5.0, StepPrice(8, stepped, 0.1))  # 0.9 - 2 < 0
