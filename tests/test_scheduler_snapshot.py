"""Scheduler.snapshot(): the learned state as plain values, equal to the scheduler's own numbers."""

import json

import numpy as np
import pytest
from test_round import argmax_following, make_block

from adaspark.scheduler import Scheduler
from adaspark.scheduler.cost import basis
from adaspark.scheduler.record import RoundTimes
from adaspark.scheduler.snapshot import CURVE_POINTS, band_contexts


def served(arm: str = "adaspark,gate", rounds: int = 120, period: int = 40):
    """Rounds over two requests on a text repeating every `period` tokens, a drafter right on
    its first two picks; -> (scheduler, the learn() records)."""
    sched = Scheduler(arm)
    truth = [3 + i % period for i in range(20_000)]
    records, context = [], 0
    for request in range(2):
        context = 100 + 200 * request
        sched.begin_request(truth[:context])
        for i in range(rounds // 2):
            ahead = truth[context:context + 8]
            plan = sched.plan_round(context,
                                    lambda a=ahead: make_block([a[0], a[1], 9_999]))
            outcome = sched.accept(plan, argmax_following(plan, truth[context:]))
            records.append(sched.learn(outcome, RoundTimes(0.004, 0.010 + 0.001 * plan.rows,
                                                           0.0005),
                                       last_round=i == rounds // 2 - 1))
            context += len(outcome.committed)
        sched.end_request()
    return sched, records


@pytest.fixture(scope="module")
def learned():
    sched, records = served()
    return sched, records, sched.snapshot()


def test_snapshot_is_plain_json(learned):
    _, _, snap = learned
    assert json.loads(json.dumps(snap)) == snap


def test_width_share_counts_every_round_by_rows(learned):
    sched, records, snap = learned
    assert snap["rounds"] == len(records)
    rows = [r.rows for r in records]
    assert {w["rows"]: w["rounds"] for w in snap["width_share"]} == \
        {n: rows.count(n) for n in set(rows)}
    assert sum(w["share"] for w in snap["width_share"]) == pytest.approx(1.0)


def test_cost_laws_and_samples_are_the_cost_models(learned):
    sched, _, snap = learned
    cost = snap["cost"]
    assert [k["top"] for k in cost["classes"]] == sched.cost.widths
    contexts = cost["contexts"]
    assert 2 <= len(contexts) <= CURVE_POINTS and contexts == sorted(contexts)
    measured = 0
    for shown, k in zip(cost["classes"], sched.cost.classes, strict=True):
        assert shown["samples"] == k.law.samples and shown["measured"] == k.measured
        assert {b["band"]: b["samples"] for b in shown["bands"]} == \
            {b: [list(s) for s in samples] for b, samples in k.law.bank.items()}
        for band in shown["bands"]:
            lo, hi = band["contexts"]
            assert all(lo <= c <= hi for c, _ in band["samples"])
        if k.law.fitted:
            measured += 1
            for c, ms in shown["curve"]:
                assert ms == k.law.predict(c)
            for (c, ms), (c2, _) in zip(shown["price_curve"], shown["curve"], strict=True):
                assert c == c2 and ms == k.price_basis(basis(c), sched.cost.clock)
    assert measured >= 2  # the probes measured the ladder's first widths
    fixed = cost["fixed"]
    assert fixed["samples"] == sched.cost.fixed.samples > 0
    assert [ms for _, ms in fixed["curve"]] == [sched.cost.fixed.predict(c) for c in contexts]


def test_calibration_bins_hold_every_label(learned):
    sched, records, snap = learned
    bins = snap["acceptance"]["calibration"]
    assert len(bins) == 10 and bins[0]["lo"] == 0.0 and bins[-1]["hi"] == 1.0
    assert sum(b["count"] for b in bins) == sum(r.labels for r in records) > 0
    for b in bins:
        if b["count"]:
            assert b["lo"] <= b["predicted"] <= b["hi"] and 0.0 <= b["realised"] <= 1.0
        else:
            assert b["predicted"] is None and b["realised"] is None
    # realised rates sum back to the labels that were accepted
    accepted = sum(b["realised"] * b["count"] for b in bins if b["count"])
    assert accepted == pytest.approx(sched.acceptance.calibration[2].sum())
    assert snap["acceptance"]["fitted_preferred"] == sched.acceptance.fitted_preferred
    coefficients = snap["acceptance"]["coefficients"]
    assert list(coefficients.values()) == sched.acceptance.coefficients.tolist()


def test_band_and_gate_rates_are_the_schedulers(learned):
    sched, _, snap = learned
    bands = snap["chooser"]["bands"]
    assert [b["band"] for b in bands] == sorted(sched.chooser.rates)
    for b in bands:
        rate = sched.chooser.rates[b["band"]]
        assert b["rounds"] == rate.rounds
        assert b["rate_tok_s"] == (None if rate.rate is None else 1000.0 * rate.rate)
        assert b["contexts"] == band_contexts(b["band"])
    assert any(b["rate_tok_s"] for b in bands)
    gate = snap["gate"]
    assert gate["enabled"] and gate["fixed_ms"] == sched.gate.fixed_ms and gate["buckets"]
    assert [b["bucket"] for b in gate["buckets"]] == sorted(sched.gate.rates)
    for b in gate["buckets"]:
        undrafted, drafted = sched.gate.rates[b["bucket"]]
        assert b["drafted"]["rounds"] == drafted.rounds
        assert b["undrafted"]["rounds"] == undrafted.rounds
        faster = sched.gate.faster(b["bucket"])
        assert b["faster"] == (None if faster is None else
                               "drafted" if faster else "undrafted")


def test_snapshot_changes_nothing_the_scheduler_decides():
    sched, _ = served(rounds=40)
    before = json.dumps(sched.state_dict(), default=lambda v: v.tolist(), sort_keys=True)
    sched.snapshot()
    sched.snapshot(contexts=[10, 100, 1000])
    after = json.dumps(sched.state_dict(), default=lambda v: v.tolist(), sort_keys=True)
    assert before == after


def test_an_empty_scheduler_has_empty_curves():
    snap = Scheduler("adaspark").snapshot()
    assert snap["rounds"] == 0 and snap["width_share"] == [] and snap["cost"]["contexts"] == []
    assert all(k["curve"] == [] and k["bands"] == [] for k in snap["cost"]["classes"])
    assert all(b["count"] == 0 for b in snap["acceptance"]["calibration"])
    assert np.isclose(snap["cost"]["clock"], 1.0)
