"""The round API end to end on handmade blocks: plan -> accept -> learn, and the arms' switches."""

import json

import numpy as np
import pytest

from adaspark.errors import UserError
from adaspark.scheduler import Arm, Scheduler, driver
from adaspark.scheduler.cost import LADDER
from adaspark.scheduler.gate import NO_PROPOSAL
from adaspark.scheduler.record import RoundRecord, RoundTimes
from adaspark.scheduler.round import KERNEL_CLASSES, PROBE_BUDGET
from adaspark.scheduler.store import Store
from adaspark.scheduler.tree import NGRAM, Block
from adaspark.sim.curves import load_curve
from adaspark.sim.process import EOS, World
from adaspark.sim.run import SimTarget

PROMPT = [5, 6, 7, 8]


def make_block(picks, K=3, head=0.7):
    """Picks plus K-1 siblings per position with distinct ids, logits descending."""
    picks = np.asarray(picks, dtype=np.int64)
    B = picks.size
    ids = np.empty((B, K), dtype=np.int64)
    ids[:, 0] = picks
    for i in range(B):
        ids[i, 1:] = 1000 + 10 * i + np.arange(1, K)
    logits = np.tile(np.linspace(2.0, 0.0, K), (B, 1))
    return Block(picks, ids, logits, np.full(B, head))


def argmax_following(plan, truth):
    """A target whose greedy continuation after the anchor is `truth`: each row on the true
    path predicts the next true token, every other row a token no candidate proposes."""
    out = np.full(plan.rows, -7, dtype=np.int64)
    on = np.zeros(plan.rows, dtype=bool)
    for r in range(plan.rows):
        d = int(plan.depths[r])
        on[r] = r == 0 or (on[plan.parents[r]] and plan.tokens[r] == truth[d - 1])
        if on[r]:
            out[r] = truth[d]
    return out


def run_round(sched, block, truth, context, last=False):
    plan = sched.plan_round(context, lambda: block)
    outcome = sched.accept(plan, argmax_following(plan, truth))
    record = sched.learn(outcome, RoundTimes(fixed_s=0.005, verify_s=0.02, commit_s=0.0005),
                         last_round=last)
    return plan, outcome, record


def test_plan_accept_learn_end_to_end():
    sched = Scheduler(Arm.parse("adaspark"))
    sched.begin_request(PROMPT)
    plan, outcome, record = run_round(sched, make_block([11, 12, 13]), [11, 12, 99, 5], 4)
    assert plan.chosen_by == "probe" and plan.width_chosen == 2 and plan.rows == 2
    assert plan.tokens[0] == PROMPT[-1] and plan.tokens[1] == 11  # the pick is likeliest
    # the mask is the ancestor relation of the parent rows, and depth follows it
    for i in range(plan.rows):
        ancestors = {i}
        j = i
        while plan.parents[j] >= 0:
            j = plan.parents[j]
            ancestors.add(j)
        assert set(np.flatnonzero(plan.mask[i])) == ancestors
        if i:
            assert plan.depths[i] == plan.depths[plan.parents[i]] + 1
    assert outcome.tokens == [11] and outcome.bonus == 12 and outcome.rows == [0, 1]
    assert list(outcome.committed) == [11, 12]
    assert record.accepted == 1 and record.rows == 2 and record.labels > 0
    line = json.loads(json.dumps(record.to_json()))  # the round log is JSON lines
    assert line["ctx"] == 4 and line["chosen_by"] == "probe" and line["cold"]
    assert RoundRecord.from_json(line) == record  # the typed record round-trips
    # the n-gram index learned the committed tokens; the bonus is the next anchor
    assert sched.index.hist[-2:] == [11, 12]
    plan2 = sched.plan_round(6, lambda: make_block([13, 14, 15]))
    assert plan2.tokens[0] == 12


def test_first_round_teaches_the_cost_model_nothing():
    sched = Scheduler()
    empty = json.dumps(sched.cost.state_dict())
    sched.begin_request(PROMPT)
    run_round(sched, make_block([11, 12, 13]), [11, 12, 13, 14], 4)
    assert json.dumps(sched.cost.state_dict()) == empty
    run_round(sched, make_block([21, 22, 23]), [21, 22, 23, 24], 8)
    assert sched.cost.classes[0].law.samples == 1 and sched.cost.fixed.samples == 1


def test_last_round_teaches_no_acceptance():
    sched = Scheduler()
    sched.begin_request(PROMPT)
    run_round(sched, make_block([11, 12, 13]), [11, 12, 13, 14], 4)
    before = sched.acceptance.state_dict()
    _, _, record = run_round(sched, make_block([21, 22, 23]), [21, 9, 9, 9], 8, last=True)
    assert record.labels == 0
    assert sched.acceptance.state_dict() == before


@pytest.mark.parametrize("arm,rows", [("adaspark:5", 5), ("tree:6", 6), ("adaspark:3", 3)])
def test_pinned_width_is_honoured(arm, rows):
    sched = Scheduler(arm)
    sched.begin_request(PROMPT)
    for k in range(4):
        plan, _, _ = run_round(sched, make_block([11 + k, 12 + k, 13 + k]), [11 + k, 0, 0, 0],
                               4 + k)
        assert plan.rows == rows and plan.chosen_by == "pinned"


def test_ngram_off_has_no_ngram_rows():
    repeating = [3, 4, 5, 6, 7, 8, 9, 10] * 4  # the index proposes copies of this passage

    def ngram_nodes(arm):
        sched = Scheduler(arm)
        sched.begin_request(repeating)
        plan = sched.plan_round(len(repeating), lambda: make_block([40, 41, 42]))
        tree = plan.tree
        return int(np.count_nonzero(tree.kind == NGRAM)), plan

    with_ngram, _ = ngram_nodes("adaspark:16")
    assert with_ngram > 0
    without, plan = ngram_nodes("adaspark:16,no-ngram")
    assert without == 0 and plan.rows == 10  # every drafter candidate, nothing else


def test_head_only_arms_never_price_with_the_fitted_model():
    for arm, fitted in (("adaspark", True), ("cost", False), ("adaspark,head", False),
                        ("tree:4", False)):
        sched = Scheduler(arm)
        sched.acceptance.guard_fitted, sched.acceptance.guard_head = 0.0, 1.0  # guard: fitted
        sched.begin_request(PROMPT)
        plan = sched.plan_round(4, lambda: make_block([11, 12, 13]))
        assert plan.fitted_prices is fitted
        q = plan._scored.q_fit if fitted else plan._scored.q_head
        assert np.array_equal(plan._scored.q, q)


def test_chain_arms_lay_out_a_chain():
    block = make_block([11, 12, 13, 14, 15])
    sched = Scheduler("chain3")
    sched.begin_request(PROMPT)
    plan = sched.plan_round(4, lambda: block)
    assert list(plan.tokens) == [8, 11, 12, 13] and list(plan.parents) == [-1, 0, 1, 2]
    sched = Scheduler("chain")
    sched.begin_request(PROMPT)
    plan = sched.plan_round(4, lambda: block)
    assert list(plan.tokens) == [8, 11, 12, 13, 14, 15] and plan.chosen_by == "chain"
    # nothing is verified below a stop token
    plan = sched.plan_round(4, lambda: block, stop_ids=(12,))
    assert list(plan.tokens) == [8, 11, 12]
    outcome = sched.accept(plan, [11, 12, 77])
    assert outcome.tokens == [11, 12] and outcome.bonus == 77


def test_ar_arm_runs_plain_rounds():
    sched = Scheduler("ar")
    sched.begin_request(PROMPT)
    plan = sched.plan_round(4, lambda: pytest.fail("the ar arm never drafts"))
    assert plan.rows == 1 and plan.tokens[0] == 8 and plan.chosen_by == "plain"
    outcome = sched.accept(plan, [42])
    assert list(outcome.committed) == [42]
    sched.learn(outcome, RoundTimes(0.0, 0.01, 0.0001))
    assert sched.plan_round(5, None).tokens[0] == 42


def test_arm_parse():
    assert Arm.parse("tree:8").pinned == 8 and not Arm.parse("tree:8").fitted
    assert Arm.parse("adaspark").ngram and Arm.parse("adaspark").pinned is None
    assert Arm.parse("chain3").chain == 3 and not Arm.parse("cost").ngram
    arm = Arm.parse("adaspark,ratio,no-hysteresis,plain")
    assert arm.ratio_rule and not arm.hysteresis and arm.plain_rounds
    # the default arm's paced cold start comes with the gate; `ladder` restores the paper's
    assert Arm.parse("adaspark,gate").paced and not Arm.parse("adaspark").paced
    assert not Arm.parse("adaspark,gate,ladder").paced and Arm.parse("adaspark,ladder,gate").gate
    assert not Arm.parse("adaspark,ladder,gate").paced
    for bad in ("tree", "foo", "adaspark,bogus", "adaspark:0", "chain:4", "tree:x"):
        with pytest.raises(UserError):
            Arm.parse(bad)


def test_arm_parse_takes_both_spellings_and_pins_with_modifiers():
    """The bench's `adaspark+gate` and the engine's `adaspark,gate` are one arm, one name."""
    plus, comma = Arm.parse("adaspark+gate+plain"), Arm.parse("adaspark, gate,plain")
    assert plus == comma and plus.name == "adaspark,gate,plain" and plus.gate
    assert Arm.parse(plus) is plus
    pinned = plus.at_width(8)
    assert pinned.pinned == 8 and pinned.gate and pinned.name == "adaspark:8,gate,plain"
    assert Arm.parse("adaspark:4").at_width(16).name == "adaspark:16"
    with pytest.raises(UserError):
        Arm.parse("adaspark+bogus")


def test_classes_arm_offers_only_the_kernel_row_classes():
    """Modifier `classes` (Table 9): the width table is the kernel's row classes, never split."""
    world = World(3)
    widths = {}
    for arm in ("adaspark", "adaspark+classes"):
        sched = Scheduler(arm)
        assert sched.cost.widths == (list(KERNEL_CLASSES) if arm.endswith("classes")
                                     else [2, 4, 8, 16, 32, 64])
        sim = SimTarget(load_curve("int8-dense"), world, world.request(0))
        sched.begin_request(sim.req.stream[: sim.context])
        while sim.context < sim.end:
            r = driver.run_round(sched, sim, sim.context, (EOS,))
            sim.context += len(r.committed.emitted)
            sim.k += 1
        widths[arm] = sched.cost.widths
    assert len(widths["adaspark"]) > 6  # the learned table split; the kernel's did not
    # (the drafter's reach may cap the widest class, as on any arm)
    assert set(widths["adaspark+classes"]) <= set(KERNEL_CLASSES) | {sched.cost.reach}
    assert len(widths["adaspark+classes"]) <= len(KERNEL_CLASSES)


def test_the_driver_runs_the_simulator():
    """One run_round: the simulator's target is a driver Target, and a round through it equals
    plan_round -> accept -> learn done by hand (the engine runs the same parts as batch steps:
    speculative.RoundDecode)."""
    from adaspark.sim import run as sim_run

    assert sim_run.run_round is driver.run_round
    assert issubclass(SimTarget, driver.Target)
    world = World(1)
    by_hand, driven = Scheduler("adaspark,gate"), Scheduler("adaspark,gate")
    sim = SimTarget(load_curve("int8-dense"), world, world.request(0))
    for sched in (by_hand, driven):
        sched.begin_request(sim.req.stream[: sim.context])
    for _ in range(40):
        r = driver.run_round(driven, sim, sim.context, (EOS,))
        plan = by_hand.plan_round(sim.context, sim.draft, (EOS,))
        outcome = by_hand.accept(plan, sim.verify(plan))
        record = by_hand.learn(outcome, r.times, last_round=r.committed.done)
        assert np.array_equal(plan.tokens, r.plan.tokens) and outcome.rows == r.outcome.rows
        assert record == r.record
        sim.context += len(r.committed.emitted)
        sim.k += 1


def test_state_round_trips_through_the_store(tmp_path):
    from adaspark.sim.process import EOS, World, target_argmax

    world = World(3)
    sched = Scheduler()
    req = world.request(0)
    context = req.prompt_length
    sched.begin_request(req.stream[:context])
    for _ in range(30):
        plan = sched.plan_round(context, lambda c=context: world.block(req, c - 1), (EOS,))
        argmax = target_argmax(req, context - 1, plan.tokens, plan.depths, plan.mask)
        outcome = sched.accept(plan, argmax)
        sched.learn(outcome, RoundTimes(0.005, 0.02 + 0.001 * plan.rows, 0.0005))
        context += len(outcome.committed)
    sched.end_request()
    store = Store(tmp_path, {"model": "m", "drafter": "d"})
    store.save(sched.state_dict())
    restored = Scheduler()
    restored.load_state_dict(store.load())
    assert json.dumps(restored.state_dict(), sort_keys=True) == json.dumps(
        sched.state_dict(), sort_keys=True)
    # the restored scheduler plans the next request's first round exactly as the original
    req = world.request(1)
    plans = []
    for s in (sched, restored):
        s.begin_request(req.stream[: req.prompt_length])
        plans.append(s.plan_round(req.prompt_length,
                                  lambda: world.block(req, req.prompt_length - 1), (EOS,)))
    assert np.array_equal(plans[0].tokens, plans[1].tokens)
    assert plans[0].width_chosen == plans[1].width_chosen
    with pytest.raises(UserError):
        restored.load_state_dict({"version": 99})


def test_plain_rounds_replace_speculation_that_cannot_pay():
    """A drafter that is never right and a tree verify that costs 3x a plain step: with plain
    rounds on, the scheduler measures the 1-row step and then stops drafting (re-checking every
    16th round); with them off (the paper's arms) it always drafts."""
    rounds = {}
    for arm in ("adaspark,plain", "adaspark"):
        sched = Scheduler(arm)
        sched.begin_request(list(range(3, 303)))
        context, kinds = 300, []
        for k in range(120):
            plan = sched.plan_round(context, lambda k=k: make_block([5000 + k, 5001 + k, 5002 + k]))
            verify_s, fixed_s = (0.03, 0.01) if plan.drafted else (0.01, 0.0)
            outcome = sched.accept(plan, np.full(plan.rows, 7 + k % 50))  # never a candidate
            sched.learn(outcome, RoundTimes(fixed_s, verify_s, 0.0005))
            context += len(outcome.committed)
            kinds.append(plan.chosen_by)
        rounds[arm] = kinds
    assert "plain" not in rounds["adaspark"]
    late = rounds["adaspark,plain"][60:]
    assert late.count("plain") >= 0.9 * len(late)
    assert late.count("plain") < len(late)  # it keeps checking whether drafting pays again


def gate_rounds(arm: str, drafter_right: bool, rounds: int = 160, text_period: int = 0):
    """Rounds on a text that repeats with `text_period` (0: never), a drafter that is always or
    never right, a draft forward as dear as a 2-row verify; -> (kinds, scheduler)."""
    sched = Scheduler(arm)
    period = text_period or 10**9
    truth = [3 + (i % period if text_period else i) for i in range(20_000)]
    prompt = truth[:300]
    sched.begin_request(prompt)
    context, kinds = len(prompt), []
    for _ in range(rounds):
        ahead = truth[context:context + 8]
        picks = ahead[:3] if drafter_right else [50_000 + context + j for j in range(3)]
        plan = sched.plan_round(context, lambda p=picks: make_block(p))
        fixed_s = 0.004 if plan.drafted else 0.0005
        verify_s = 0.010 + 0.001 * plan.rows
        outcome = sched.accept(plan, argmax_following(plan, truth[context:]))
        sched.learn(outcome, RoundTimes(fixed_s, verify_s, 0.0005))
        context += len(outcome.committed)
        kinds.append("drafted" if plan.drafted else plan.chosen_by)
    return kinds, sched


def test_gate_stops_drafting_where_the_ngram_index_does_better():
    """A drafter that is never right, a text that repeats: the gate learns that undrafted
    n-gram rounds are faster and runs them, drafting again now and then (exploration, and the
    cost model's probes, which always draft)."""
    kinds, sched = gate_rounds("adaspark,gate", drafter_right=False, text_period=40)
    late = kinds[80:]
    assert late.count("undrafted") >= 0.7 * len(late)
    assert 0 < late.count("drafted") < 0.3 * len(late)
    assert sched.gate.fixed_ms is not None and sched.gate.fixed_ms < 1.0
    paper, _ = gate_rounds("adaspark", drafter_right=False, text_period=40)
    assert set(paper) <= {"drafted"}  # without the modifier every round drafts


def test_gate_keeps_drafting_a_drafter_that_pays():
    kinds, _ = gate_rounds("adaspark,gate", drafter_right=True)
    late = kinds[80:]
    assert late.count("drafted") >= 0.8 * len(late)


def test_gate_runs_plain_rounds_where_nothing_is_proposed():
    """No repeats in the text and a useless drafter: the undrafted rounds are 1-row rounds."""
    kinds, _ = gate_rounds("adaspark,gate", drafter_right=False)
    late = kinds[80:]
    assert late.count("plain") >= 0.8 * len(late)


def test_gate_state_round_trips_and_old_stores_load():
    _, sched = gate_rounds("adaspark,gate", drafter_right=False, rounds=80, text_period=40)
    state = json.loads(json.dumps(sched.state_dict()))
    restored = Scheduler("adaspark,gate")
    restored.load_state_dict(state)
    assert restored.gate.state_dict() == sched.gate.state_dict()
    del state["gate"]  # a store written before the gate existed
    Scheduler("adaspark,gate").load_state_dict(state)
    state["gate"] = {"rates": [[0, 1.0]], "fixed_ms": None}
    with pytest.raises(UserError, match="draft gate state"):
        Scheduler("adaspark,gate").load_state_dict(state)


def test_a_stop_cut_last_round_teaches_no_reach():
    """Issue 24 item 2 through the scheduler: widths 2/4/8 measured, then 16-row probes whose
    tree a stop token cut to 6 rows (its subtree has Q = 0), each in a reply's last round. They
    taught the old table a reach of 6 and erased the measured 8 ([2, 4, 6]); the drafter's whole
    tree had 22 rows, so they teach no reach and the 16-row class is still to be measured."""
    picks = [11, 12, 13, 14, 15, 16, 17]  # B = 7, K = 3: 21 nodes
    sched = Scheduler("adaspark")
    sched.begin_request(PROMPT)
    context = 4
    while sched.cost.probe() in (2, 4, 8):
        _, outcome, _ = run_round(sched, make_block(picks, K=3), picks + [0], context)
        context += len(outcome.committed)
    assert sched.cost.widths == list(LADDER) and sched.cost.probe() == 16
    stop = EOS
    cut = make_block([11, stop, 13, 14, 15, 16, 17], K=3)
    for _ in range(3):
        sched.begin_request(PROMPT)
        for last in (False, True):  # a cold first round, then the reply's last
            plan = sched.plan_round(context, lambda: cut, stop_ids=(stop,))
            assert plan.width_chosen == 16 and plan.rows == 6
            outcome = sched.accept(plan, argmax_following(plan, [11, stop, 0]))
            sched.learn(outcome, RoundTimes(0.005, 0.02, 0.0005), last_round=last)
        sched.end_request()
    assert sched.cost.reach is None and sched.cost.widths == list(LADDER)
    assert sched.cost.probe() == 16


def cold_rounds(arm: str, rounds: int = 160):
    """From an empty store, a drafter that is never right on a text that never repeats (its
    tree: 7 positions x 8 candidates, 57 rows), on an AVX2-like machine (D 0.45x a plain step,
    each extra row 0.3x): -> (plans, times, sched)."""
    sched = Scheduler(arm)
    truth = list(range(3, 20_000))
    sched.begin_request(truth[:300])
    context, plans, times = 300, [], []
    for _ in range(rounds):
        picks = [50_000 + context + j for j in range(7)]
        plan = sched.plan_round(context, lambda p=picks: make_block(p, K=8))
        t = RoundTimes(0.0028 if plan.drafted else 0.0002, 0.006 * (1 + 0.3 * (plan.rows - 1)),
                       0.0003)
        outcome = sched.accept(plan, argmax_following(plan, truth[context:]))
        sched.learn(outcome, t)
        context += len(outcome.committed)
        plans.append(plan)
        times.append(t.fixed_s + t.verify_s + t.commit_s)
    return plans, times, sched


def test_the_default_arms_cold_start_pays_only_for_measurements_that_could_pay():
    """Issue 22's cold start. The default arm measures the plain step first (every width must
    beat it), probes narrow widths only, and its probe rounds lose, against plain steps making
    their tokens, at most PROBE_BUDGET of the decode time (plus the one probe that crosses it).
    With `ladder`, as in the paper's arm, every width of the ladder up to 64 is measured."""
    plans, times, sched = cold_rounds("adaspark,gate")
    assert [p.chosen_by for p in plans[1:4]] == ["plain"] * 3
    probes = [(p, t) for p, t in zip(plans, times, strict=True) if p.chosen_by == "probe"]
    plain_s = times[plans.index(next(p for p in plans[1:] if p.chosen_by == "plain"))]
    lost = sum(t - (1 + 0) * plain_s for _, t in probes)  # a probe commits only its bonus
    assert max(p.width_chosen for p, _ in probes) <= 4
    assert lost <= PROBE_BUDGET * sum(times) + max(t for _, t in probes)
    # the gate counts time in plain steps (a 1-row verify): a plain round of 6.5 ms, a verify of
    # 6 ms, makes 6 / 6.5 tokens per step
    assert sched.gate.rates[NO_PROPOSAL][0].rate == pytest.approx(6.0 / 6.5, rel=0.02)
    for arm in ("adaspark,gate,ladder", "adaspark"):
        plans, times, sched = cold_rounds(arm)
        widths = [p.width_chosen for p in plans if p.chosen_by == "probe"]
        # the first round, 3 measurements of each width, 64 short (the tree's 57 rows): 57
        assert widths[:16] == [2] + [w for w in LADDER[:-1] for _ in range(3)]
        assert 64 in widths and sched.cost.reach == 57
        assert sum(t for p, t in zip(plans, times, strict=True) if p.chosen_by == "probe") > 0.5


def batch_drafts(step_ms, rate: float, requests: int = 3, rounds: int = 6,
                 step=None) -> tuple[int, int]:
    """`requests` requests on one `adaspark,no-ngram` scheduler (no n-gram tree competes with a
    draft), each round planned as beside the
    others in a step priced by step_ms at `rate` (budget.StepPrice, the step's plain rows
    being the requests'; or the given `step`). Returns (drafts made, the rounds after each
    request's first)."""
    from adaspark.scheduler.budget import StepPrice

    sched, drafts = Scheduler(Arm.parse("adaspark,no-ngram")), []
    step = StepPrice(requests, step_ms, rate) if step is None else step
    states = [sched.begin_request([5 + 20 * i, 6 + 20 * i, 7 + 20 * i]) for i in range(requests)]

    def draft():
        drafts.append(1)
        return make_block([11, 12, 13, 14])

    for r in range(rounds):
        for state in states:
            plan = sched.plan_round(3 + r, draft, request=state, step=step)
            outcome = sched.accept(plan, argmax_following(plan, [11, 12, 99, 5, 6]))
            sched.learn(outcome, RoundTimes(fixed_s=0.0005, verify_s=0.01, commit_s=0.0),
                        request=state, cost=False)
    return len(drafts) - requests, requests * (rounds - 1)


def test_beside_others_a_round_drafts_only_where_the_step_price_pays_for_its_tree():
    """By hand: every Q is at most 1, so where each row past the step's plain ones costs a
    whole token at the rate (3 plain rows at 10 ms each: 0.1 tokens per ms, 10 ms a row), no
    tree pays and nothing beyond the first rounds drafts; with rows free up to 64 at a rate of
    0.1 its tree (four picks at head 0.7, the first alone Q = 0.7) pays for a draft (D is not
    learned from shared rounds here: 0), so every round drafts."""
    expensive, total = batch_drafts(lambda rows: 10.0 * rows, 0.1)
    assert expensive == 0 and total == 15
    cheap, total = batch_drafts(lambda rows: 30.0, 0.1)
    assert cheap == total



def test_end_request_can_leave_the_refit_to_a_later_call():
    """A batch ends a request beside others without the refit (it would stall their step) and
    refits once they are done: the same laws as refitting at the end."""
    _, now = gate_rounds("adaspark,gate", drafter_right=True, rounds=60)
    _, later = gate_rounds("adaspark,gate", drafter_right=True, rounds=60)
    before = json.dumps(later.cost.state_dict())
    adopted = now.end_request()
    assert later.end_request(refit=False) == 0 and later.request is None
    assert json.dumps(later.cost.state_dict()) == before  # nothing refitted yet
    assert later.refit() == adopted and adopted > 0
    assert json.dumps(later.cost.state_dict()) == json.dumps(now.cost.state_dict())


def test_the_ngram_tree_at_the_anchor_is_a_fresh_tree_each_round():
    """_ngram_tree copies one empty tree (made once per stop ids) instead of building one: every
    copy equals CandidateTree.undrafted + chains at its anchor, and chains on one copy (n-gram
    nodes at a repeating anchor) leave the next (nothing proposed) empty."""
    from adaspark.scheduler.ngram import NgramIndex
    from adaspark.scheduler.tree import CandidateTree

    sched = Scheduler(Arm.parse("adaspark,gate"))
    stops = (2, 7)
    repeating = [5, 6, 8, 9, 10, 11] * 4  # its last token is followed by 5, 6, ... before
    for tokens in (repeating, [3, 4], repeating, [13, 12, 14]):
        sched.begin_request(tokens)
        got = sched._ngram_tree(stops)
        want = CandidateTree.undrafted(tokens[-1], stops)
        NgramIndex(tokens).chains(want)
        assert got is not want and got.anchor == want.anchor == tokens[-1]
        assert got.n_nodes == want.n_nodes and (got.n_nodes > 0) == (tokens is repeating)
        for name, value in vars(want).items():
            if isinstance(value, np.ndarray):
                assert np.array_equal(getattr(got, name), value), name
        assert got._pending == ([], [], [], [], [])


@pytest.mark.parametrize("arm", ["adaspark", "adaspark,gate"])
def test_beside_others_a_round_never_probes_a_width_it_could_not_measure(arm):
    """A probe measures a width's price, and a verify shared with other requests' rows is not
    that price (learn_shared_verify teaches only a call of exactly a class's top rows): beside
    others a round picks among the measured widths. Alone the same round probes the
    unmeasured 8-row class (the paper's ladder; the paced arm because its optimistic price
    pays for this tree of seven sure picks)."""
    from adaspark.scheduler.budget import StepPrice
    from adaspark.scheduler.cost import MEASUREMENTS

    block = make_block([11, 12, 13, 14, 15, 16, 17], K=3, head=0.97)
    chosen = {}
    for beside in (False, True):
        sched = Scheduler(Arm.parse(arm))
        for _ in range(MEASUREMENTS):  # the plain step and the 2- and 4-row classes
            sched.plain_law.learn(600, 4.0)
            for top, ms in ((2, 4.2), (4, 4.6)):
                sched.cost.observe(top, top, 600, ms, 0.5)
        assert sched.cost.probe() == 8
        state = sched.begin_request(PROMPT)
        state.rounds = 1  # past its first round (which runs cold)
        step = StepPrice(3, lambda rows: 4.0 + 0.3 * rows, 0.2) if beside else None
        plan = sched.plan_round(600, lambda: block, request=state, step=step)
        chosen[beside] = (plan.chosen_by, plan.rows)
    assert chosen[False] == ("probe", 8)
    assert chosen[True][0] == "chooser" and chosen[True][1] <= 4
