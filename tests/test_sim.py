"""The simulator: shipped curves, the generative world, and issue 3's targets in simulation.

The target runs are the CI-sized version of `adaspark sim --curve NAME`: a few long replies per
curve, every arm from an empty store on the same requests, blocks and noise. The pinned sweep
covers the ladder up to 24 rows and the widths between; the test checks that it brackets the
best pinned width (the best is neither the narrowest nor the widest swept), so a wider or
narrower width cannot be the one AdaSpark was compared against unfairly.
"""

import json

import numpy as np
import pytest

from adaspark.cli import main
from adaspark.errors import UserError
from adaspark.sim.curves import curve_names, load_curve
from adaspark.sim.process import EOS, JUNK, World, WorldParams, target_argmax
from adaspark.sim.run import sweep

CURVES = ("cpu-smollm2", "int4-dense", "int8-dense", "moe")
TEST_WIDTHS = (2, 4, 6, 8, 12, 16, 24)
TEST_WORLD = WorldParams(reply=(1200, 2400))
TEST_REQUESTS = 6


def test_shipped_curves_have_the_papers_shapes():
    assert tuple(curve_names()) == CURVES
    int8, int4, moe, cpu = (load_curve(n) for n in ("int8-dense", "int4-dense", "moe",
                                                    "cpu-smollm2"))
    t = lambda c, n, ctx=0: c.verify_s(n, ctx)  # noqa: E731
    assert t(int8, 16) / t(int8, 2) < 1.15 and t(int8, 20) / t(int8, 16) > 1.3
    assert t(int8, 48) < t(int8, 40)  # a cheaper 48 than 40
    assert t(int4, 8) / t(int4, 2) < 1.02
    assert 1.4 < t(int4, 12) / t(int4, 8) < 1.6 and t(int4, 20) / t(int4, 16) > 1.9
    assert all(t(moe, n + 1) > t(moe, n) for n in range(1, 64))  # rises with every row
    # this CPU: the faster kernel at each width, interpolated between measured points
    assert t(cpu, 4) == pytest.approx(0.0112) and t(cpu, 6) == pytest.approx(0.0165)
    assert t(cpu, 32) == pytest.approx(0.038) and t(cpu, 64) == pytest.approx(0.050)
    for curve in (int8, int4, moe, cpu):  # wide verifies slow faster with context
        assert t(curve, 32, 8000) - t(curve, 32) > t(curve, 8, 8000) - t(curve, 8) >= 0
    with pytest.raises(UserError):
        load_curve("no-such-curve")
    with pytest.raises(UserError):
        int8.verify_s(65, 0)


def test_noise_is_one_sided_with_a_clean_low_quantile():
    world = World(7)
    verify, fixed = world.noise(world.request(0), 4000)
    assert verify[0] > 1.05 and fixed[0] > 1.05  # the first round runs cold
    assert np.percentile(verify[1:], 15) == pytest.approx(1.0, abs=0.01)
    assert verify[1:].mean() > 1.03  # a least-squares fit would absorb this
    assert np.all(verify > 0.98)


def test_blocks_are_reproducible_and_the_head_is_overconfident_at_depth():
    world = World(5)
    req = world.request(2)
    again = World(5).request(2)
    first = req.prompt_length - 1
    a, b = world.block(req, first + 10), World(5).block(again, first + 10)
    for key in ("picks", "topk_ids", "topk_logits", "head"):
        assert np.array_equal(getattr(a, key), getattr(b, key))
    assert a.topk_ids.shape == (7, 8) and np.array_equal(a.topk_ids[:, 0], a.picks)
    assert np.all(np.diff(a.topk_logits, axis=1) < 0)
    right, head = np.zeros(7), np.zeros(7)
    anchors = range(first, first + req.reply_length - 8)
    for anchor in anchors:
        blk = world.block(req, anchor)
        right += blk.picks == req.stream[anchor + 1 : anchor + 8]
        head += blk.head
    gap = head / len(anchors) - right / len(anchors)
    assert gap[-1] > gap[0] + 0.1  # miscalibrated: more overconfident deeper in the block
    assert req.stream[req.prompt_length + req.reply_length - 1] == EOS


def test_target_argmax_follows_the_stream_only_on_its_path():
    world = World(1)
    req = world.request(0)
    anchor = req.prompt_length - 1
    s = req.stream
    wrong = JUNK + 1000
    tokens = np.array([s[anchor], s[anchor + 1], wrong, s[anchor + 2]])
    depths = np.array([0, 1, 1, 2])
    parents = [-1, 0, 0, 2]  # row 3 hangs below the wrong row 2
    mask = np.zeros((4, 4), dtype=bool)
    for r, p in enumerate(parents):
        mask[r, r] = True
        while p >= 0:
            mask[r, p] = True
            p = parents[p]
    out = target_argmax(req, anchor, tokens, depths, mask)
    assert list(out) == [s[anchor + 1], s[anchor + 2], JUNK, JUNK]


@pytest.fixture(scope="module")
def runs():
    return {}


def _run(runs, curve):
    if curve not in runs:
        runs[curve] = sweep(load_curve(curve), requests=TEST_REQUESTS, seed=0,
                            widths=TEST_WIDTHS, params=TEST_WORLD, workers=2)
    return runs[curve]


@pytest.mark.parametrize("curve", CURVES)
def test_adaspark_matches_the_best_pinned_width_from_an_empty_store(runs, curve):
    result = _run(runs, curve)
    best = result["best_pinned"]
    assert TEST_WIDTHS[0] < best < TEST_WIDTHS[-1], result["pinned"]  # the sweep brackets it
    assert result["ratio_to_best"] >= (1.0 if curve == "moe" else 0.99), result
    # the cost model prices the width it chose within 2% over the run's second half
    assert result["cost_error_median"] < 0.02
    # the fitted acceptance model predicts better than the head-based estimate
    assert result["logloss_fitted"] < result["logloss_head"]


def test_sim_command(capsys):
    assert main(["sim", "--list-curves"]) == 0
    assert capsys.readouterr().out.split()[0] == "cpu-smollm2"
    assert main(["sim", "--curve", "moe", "--requests", "1", "--widths", "4,8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["curve"] == "moe" and set(out["pinned"]) == {"4", "8"}
    assert out["best_pinned"] in (4, 8) and out["adaspark"] > 0
    assert main(["sim", "--curve", "nope"]) == 2
    assert "unknown curve" in capsys.readouterr().err
    assert main(["sim", "--curve", "moe", "--widths", "0,8"]) == 2


def test_sim_gate_arm_simulates_ngram_rounds_and_counts_rounds_by_kind(capsys):
    """`adaspark sim --arm adaspark,gate` plans the gate's n-gram trees as the engine does."""
    assert main(["sim", "--curve", "int8-dense", "--arm", "adaspark+gate", "--requests", "4",
                 "--widths", "8", "--workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = out["rounds_by_kind"]
    assert set(kinds) == {"drafted", "ngram", "plain"} and sum(kinds.values()) == out["rounds"]
    assert kinds["ngram"] > 0 and kinds["drafted"] > 0
    assert main(["sim", "--curve", "moe", "--requests", "1", "--widths", "4", "--json"]) == 0
    plain_arm = json.loads(capsys.readouterr().out)["rounds_by_kind"]
    assert plain_arm["ngram"] == 0 and plain_arm["drafted"] > 0  # no gate: always drafts


def test_a_round_log_replays_as_the_curve_it_measured(tmp_path):
    """Rounds logged on a known curve (noise included) rebuild that curve at the logged widths:
    the log's records are what Scheduler.learn returns, written one JSON object per line."""
    from adaspark.scheduler import Arm
    from adaspark.sim.curves import curve_from_round_log
    from adaspark.sim.run import run_arm

    int4 = load_curve("int4-dense")
    world = World(2, WorldParams(reply=(300, 600)))
    records = []
    for width in (4, 8, 16):
        records += run_arm(int4, world, Arm.parse(f"tree:{width}"), 3, keep_records=True).records
    log = tmp_path / "rounds.jsonl"
    log.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    curve = curve_from_round_log(str(log))
    for width in (4, 8, 16):
        for context in (500, 3000):
            assert curve.verify_s(width, context) == pytest.approx(
                int4.verify_s(width, context), rel=0.03)
    assert curve.fixed_ms == pytest.approx(int4.fixed_ms, rel=0.03)
    assert curve.verify_s(12, 500) > curve.verify_s(8, 500)  # interpolated between them
    assert main(["sim", "--round-log", str(log), "--requests", "1", "--widths", "8",
                 "--json"]) == 0
    with pytest.raises(UserError):
        curve_from_round_log(str(tmp_path / "missing.jsonl"))
