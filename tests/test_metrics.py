"""ServerMetrics on a real scheduler's rounds (no model): every label and count follows the
rounds' own records, round by round."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_round import argmax_following, make_block

from adaspark.request import Generation, Timing
from adaspark.scheduler import Scheduler
from adaspark.scheduler.record import RoundTimes
from adaspark.server.metrics import MAX_POSITION, ServerMetrics, round_kind


def run(arm: str, rounds: int, period: int, drafter_right: bool):
    """Rounds of one request on a text repeating every `period` tokens (0: never), each
    observed by the metrics as the speculator does; -> (metrics, [(record, plan)])."""
    sched, metrics = Scheduler(arm), ServerMetrics()
    truth = [3 + (i % period if period else i) for i in range(20_000)]
    context = 300
    sched.begin_request(truth[:context])
    seen = []
    for _ in range(rounds):
        ahead = truth[context:context + 8]
        picks = ahead[:3] if drafter_right else [50_000 + context + j for j in range(3)]
        plan = sched.plan_round(context, lambda p=picks: make_block(p))
        fixed_s = 0.004 if plan.drafted else 0.0005
        outcome = sched.accept(plan, argmax_following(plan, truth[context:]))
        record = sched.learn(outcome, RoundTimes(fixed_s, 0.010 + 0.001 * plan.rows, 0.0005))
        record.arm, record.request = arm, "chatcmpl-1"
        row = record.to_json()
        metrics.observe_round(row, plan.depths)
        seen.append((row, plan))
        context += len(outcome.committed)
    return metrics, seen


def samples(metrics: ServerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def gated():
    """The gate on a drafter that is never right and a repeating text: it learns to skip."""
    return run("adaspark,gate", rounds=200, period=40, drafter_right=False)


def test_rounds_by_kind_follow_the_plans(gated):
    metrics, seen = gated
    expected = {"probe": 0, "plain": 0, "drafted": 0, "ngram": 0}
    for _, plan in seen:
        if plan.chosen_by == "probe":
            expected["probe"] += 1
        elif plan.chosen_by == "plain":
            expected["plain"] += 1
        else:
            expected["drafted" if plan.drafted else "ngram"] += 1
    got = {k: metrics.value("adaspark_rounds_total", kind=k) for k in expected}
    assert got == expected
    assert expected["probe"] and expected["drafted"] and expected["ngram"]
    plain, _ = run("adaspark,gate", rounds=120, period=0, drafter_right=False)
    assert plain.value("adaspark_rounds_total", kind="plain") > 0  # nothing to copy: 1 row


def test_gate_decisions_by_bucket(gated):
    metrics, seen = gated
    decided = [(row["gate_bucket"], row["drafted"]) for row, _ in seen
               if row["gate_bucket"] is not None]
    assert decided and any(d for _, d in decided) and not all(d for _, d in decided)
    for bucket in {b for b, _ in decided}:
        for decision, drafted in (("draft", True), ("skip", False)):
            assert metrics.value("adaspark_gate_decisions_total", bucket=str(bucket),
                                 decision=decision) == decided.count((bucket, drafted))


def test_histograms_by_width_and_per_round(gated):
    metrics, seen = gated
    got = samples(metrics)
    rows = [row["rows"] for row, _ in seen]
    for width in set(rows):
        labels = (("width", str(width)),)
        assert got[("adaspark_verify_seconds_count", labels)] == rows.count(width)
        assert got[("adaspark_draft_seconds_count", labels)] == rows.count(width)
        assert got[("adaspark_verify_seconds_sum", labels)] == pytest.approx(
            sum(row["verify"] for row, _ in seen if row["rows"] == width))
    assert got[("adaspark_round_verified_rows_sum", ())] == sum(rows)
    assert got[("adaspark_round_verified_rows_count", ())] == len(rows)
    accepted = [row["accepted"] for row, _ in seen]
    assert got[("adaspark_round_accepted_tokens_sum", ())] == sum(accepted)
    # cumulative buckets: rounds with at most 1 accepted token
    assert got[("adaspark_round_accepted_tokens_bucket", (("le", "1.0"),))] == \
        sum(a <= 1 for a in accepted)


def test_acceptance_by_position_and_source(gated):
    metrics, seen = gated
    trees = [(row, plan) for row, plan in seen if plan.rows > 1]
    for position in range(1, MAX_POSITION + 1):
        verified = sum(min(int(plan.depths.max()), MAX_POSITION) >= position
                       for _, plan in trees)
        accepted = sum(min(row["accepted"], MAX_POSITION) >= position for row, _ in trees)
        p = str(position)
        assert metrics.value("adaspark_block_position_verified_total", position=p) == verified
        assert metrics.value("adaspark_block_position_accepted_total", position=p) == accepted
    for source, key in (("drafter", "accepted_drafter"), ("ngram", "accepted_ngram"),
                        ("both", "agreed")):
        assert metrics.value("adaspark_accepted_tokens_total", source=source) == \
            sum(row[key] for row, _ in seen)
    assert metrics.value("adaspark_accepted_tokens_total", source="ngram") > 0
    priced = [row for row, _ in seen if row["pred_S"] is not None]
    assert metrics.value("adaspark_predicted_accepted_tokens_total") == \
        pytest.approx(sum(r["pred_S"] for r in priced))
    assert metrics.value("adaspark_realised_accepted_tokens_total") == \
        sum(r["accepted"] for r in priced)


def test_round_kind_reads_the_round_log_record():
    assert round_kind({"chosen_by": "probe", "drafted": True}) == "probe"
    assert round_kind({"chosen_by": "plain", "plain": True, "drafted": False}) == "plain"
    assert round_kind({"chosen_by": "chooser", "drafted": True}) == "drafted"
    assert round_kind({"chosen_by": "undrafted", "drafted": False}) == "ngram"


def test_requests_count_tokens_and_the_ar_arms_rounds():
    metrics = ServerMetrics()
    timing = Timing(prompt_tokens=30, reused_tokens=12, prefill_s=0.25, decode_s=0.5,
                    decode_tokens=7, plain_rounds=7, verified_rows=7)
    reply = Generation("a b c", [1, 2, 3, 4, 5, 6, 7], list(range(30)), "length", None, timing)
    metrics.observe_request(reply, plain_rounds_here=True)
    metrics.observe_request(reply, plain_rounds_here=False)  # a speculator counted its own
    metrics.observe_request(None, plain_rounds_here=False)
    value = metrics.value
    assert value("adaspark_requests_total", finish_reason="length") == 2
    assert value("adaspark_requests_total", finish_reason="error") == 1
    assert value("adaspark_prompt_tokens_total") == 60
    assert value("adaspark_reused_prompt_tokens_total") == 24
    assert value("adaspark_completion_tokens_total") == 14
    assert value("adaspark_decode_seconds_total") == pytest.approx(1.0)
    assert value("adaspark_prefill_seconds_total") == pytest.approx(0.5)
    assert value("adaspark_rounds_total", kind="plain") == 7
    assert value("adaspark_round_verified_rows_count") == 7


def test_garbage_collections_and_frozen_objects_are_exposed():
    metrics = ServerMetrics()
    before = samples(metrics)
    assert ("adaspark_gc_frozen_objects", ()) in before
    full = before[("python_gc_collections_total", (("generation", "2"),))]
    gc.collect()
    after = samples(metrics)
    assert after[("python_gc_collections_total", (("generation", "2"),))] == full + 1
