"""The step's price table under load (Scheduler.step_prices, budget.StepPrice.table): read once
a step, rows past the measured classes only at an unmeasured class's top, hand-computed."""

import math

import numpy as np
import pytest

from adaspark.scheduler.arm import Arm
from adaspark.scheduler.budget import StepPrice, allocate, draft_pays
from adaspark.scheduler.cost import MEASUREMENTS
from adaspark.scheduler.round import Scheduler

CTX = 600


def measured(scheduler: Scheduler, plain_ms: float, classes: dict[int, float]) -> Scheduler:
    """The plain step and the classes {top: ms} measured MEASUREMENTS times each."""
    for _ in range(MEASUREMENTS):
        scheduler.plain_law.learn(CTX, plain_ms)
        for top, ms in classes.items():
            scheduler.cost.observe(top, top, CTX, ms, 0.0, drafted=False)
    return scheduler


def test_rows_past_the_measured_classes_are_priced_only_at_an_unmeasured_top():
    sched = measured(Scheduler(Arm.parse("adaspark,gate")), 4.0, {2: 4.5, 4: 5.0})
    prices = sched.step_prices(4, 20, CTX)
    assert prices[1] == sched.plain_law.predict(CTX)  # the plain step, about 4 ms
    assert prices[2] == sched.cost.price(2, CTX)  # about 4.5 ms
    assert prices[3] == prices[4] == sched.cost.price(4, CTX)  # 3 rows run on the 4-row class
    # 8 and 16: unmeasured tops, at their optimistic price (cost.optimistic_price)
    for top in (8, 16):
        want = sched.cost.optimistic_price(top, CTX, sched.plain_law.predict(CTX))
        assert prices[top] == pytest.approx(want) and prices[4] < want < math.inf
    # between them a call would teach no class and its price is a guess: not allowed
    assert all(math.isinf(prices[t]) for t in (5, 6, 7, 9, 12, 15, 17, 20))
    # the step's own plain rows are priced whatever they are (they run anyway)
    assert math.isfinite(sched.step_prices(6, 20, CTX)[6])
    assert math.isinf(sched.step_prices(4, 20, CTX)[6])


def test_a_table_step_reads_its_prices_and_never_takes_a_forbidden_total():
    prices = np.array([np.inf, 4.0, 4.5, 5.0, 5.0, np.inf, np.inf, np.inf, 6.0, np.inf])
    step = StepPrice.table(4, prices, 0.5)  # a row is worth 2 ms
    assert step.step_ms(8) == 6.0 and math.isinf(step.step_ms(5)) and math.isinf(step.step_ms(99))
    # four nodes at Q 0.9 cross to the 8-row call (3.6 tokens for 1 ms: 3.1); two cannot go
    # to 6 rows, and 8 is out of their reach: nothing
    assert step.value([0.0, 0.9, 1.8, 2.7, 3.6]) == pytest.approx(3.1)
    assert step.value([0.0, 0.9, 1.8]) == 0.0
    # at a rate of zero a forbidden total still never pays (0 x inf is no price)
    assert StepPrice.table(4, prices, 0.0).value([0.0, 0.9, 1.8]) == 0.0
    # four requests: 4 plain rows + 4 nodes = the 8-row call; 5 or 6 rows are not allowed
    assert allocate([[0.9]] * 4, step.step_ms, 0.5) == [1, 1, 1, 1]
    assert allocate([[0.9], [0.9], [], []], step.step_ms, 0.0) == [0, 0, 0, 0]
    assert draft_pays([0.0, 0.9, 1.8, 2.7, 3.6], [0.0], 2.0, step)  # 3.1 - 1 > 0
    assert not draft_pays([0.0, 0.9, 1.8], [0.0], 0.0, step)


def test_a_table_step_values_a_tree_as_the_callable_one():
    rng = np.random.default_rng(1)
    for _ in range(20):
        prices = np.sort(rng.random(40)) * 20.0 + 5.0
        prices[rng.random(40) < 0.3] = np.inf
        rows = int(rng.integers(2, 10))
        prices[rows] = 5.0
        s = np.concatenate([[0.0], np.cumsum(np.sort(rng.random(int(rng.integers(0, 45))))[::-1])])
        rate = float(rng.random())
        table = StepPrice.table(rows, prices, rate)
        call = StepPrice(rows, table.step_ms, rate)  # the same prices through step_ms
        assert table.value(s) == pytest.approx(call.value(s))


def drafts_beside_others(draft_ms: float | None, requests: int = 3, rounds: int = 6) -> int:
    """Drafts past the first rounds of `requests` requests on one `adaspark,no-ngram`
    scheduler, each round planned beside the others at a step where rows are free (30 ms
    whatever the rows) at 0.1 tokens per ms, the batch's measured draft time `draft_ms`."""
    from test_round import batch_drafts

    step = StepPrice.table(requests, np.full(64 * requests, 30.0), 0.1, draft_ms)
    return batch_drafts(None, 0.1, requests, rounds, step=step)[0]


def test_a_draft_is_priced_at_the_time_the_batch_measured_for_it():
    """Rows are free, so the tree a draft makes (Q 0.7 first) pays unless its draft costs
    more: at the cost model's D (none learned here: 0) and at a measured 1 ms (0.1 tokens)
    every later round drafts; at a measured 200 ms (20 tokens, more than the tree's 12
    nodes can bring) none does."""
    assert drafts_beside_others(None) == drafts_beside_others(1.0) == 3 * 5
    assert drafts_beside_others(200.0) == 0


def test_beside_others_an_ngram_tree_that_pays_nothing_at_the_step_price_is_a_plain_row():
    """A gated round that does not draft offers the anchor's n-gram tree; beside others, where
    no prefix of it pays at the step's price (no total past the plain rows allowed), it plans
    the plain row at once; where rows are free it plans the tree."""
    from test_round import argmax_following, make_block

    from adaspark.scheduler.record import RoundTimes

    def second_round(prices) -> object:
        sched = measured(Scheduler(Arm.parse("adaspark,gate")), 4.0, {2: 4.5, 4: 5.0, 8: 6.0})
        text = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]  # the index proposes 4, 5, 6...
        state = sched.begin_request(text)
        # a draft costs far more than any tree brings: only the n-gram tree is offered
        step = StepPrice.table(2, np.asarray(prices, dtype=float), 0.1, draft_ms=1e3)
        first = sched.plan_round(len(text), lambda: make_block([4, 5, 6]), request=state,
                                 step=step)
        truth = [4, 5, 6, 1, 2, 3] * 2
        sched.learn(sched.accept(first, argmax_following(first, truth)),
                    RoundTimes(fixed_s=0.001, verify_s=0.005, commit_s=0.0), request=state,
                    cost=False)
        return sched.plan_round(len(text) + 2, lambda: make_block([4, 5, 6]), request=state,
                                step=step)

    closed = second_round([np.inf, 4.0, 4.5] + [np.inf] * 20)
    assert closed.rows == 1 and not closed.drafted
    free = second_round([np.inf, 4.0] + [4.5] * 21)
    assert free.rows > 1 and not free.drafted and free.layout is not None


def test_a_steps_value_of_a_curve_is_read_once_and_by_its_content():
    """StepPrice.value keeps each curve's value for the step (its requests read the same
    curves): the same as a fresh step's, also for a curve changed in place after it was read,
    and a step made by dataclasses.replace keeps none of the first one's."""
    import dataclasses

    prices = np.array([np.inf, 4.0, 4.5, 5.0, 5.0, np.inf, np.inf, np.inf, 9.0])
    step = StepPrice.table(2, prices, 0.3)
    curve = np.array([0.0, 0.9, 1.6, 2.0])
    for s in (curve, np.zeros(1), curve.copy(), [0.0, 0.1], curve):
        assert step.value(s) == StepPrice.table(2, prices, 0.3).value(s)
    curve[1:] = [0.1, 0.15, 0.2]  # the gate's curve moved: a new value, not the kept one
    assert step.value(curve) == StepPrice.table(2, prices, 0.3).value(curve) < 0.9 - 0.3 * 0.5
    cheaper = dataclasses.replace(step, rate=0.0)
    assert cheaper.value(curve) == StepPrice.table(2, prices, 0.0).value(curve) != step.value(
        curve)


def test_a_lazy_step_makes_its_table_once_and_only_when_read():
    """Under load most steps' requests all plan their plain row: the step's price table is made
    at its first read, once, and prices as table() does."""
    made = []
    prices = np.array([np.inf, 4.0, 4.5, 5.0, 5.0, np.inf, np.inf, np.inf, 6.0, np.inf])

    def make():
        made.append(1)
        return prices

    step = StepPrice.lazy(4, make, 0.5, draft_ms=1.0)
    assert step.value([]) == 0.0 and not made  # no candidate: nothing to price
    curve = [0.0, 0.9, 1.8, 2.7, 3.6]
    assert step.value(curve) == StepPrice.table(4, prices, 0.5).value(curve) == pytest.approx(3.1)
    assert step.step_ms(8) == 6.0 and math.isinf(step.step_ms(5)) and step.draft_ms == 1.0
    assert made == [1] and np.array_equal(step.prices, prices)
