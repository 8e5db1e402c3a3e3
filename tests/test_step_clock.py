"""The step breakdown's accounting (adaspark/bench/step_clock.py, benchmarks/step_breakdown.py):
every interval of a step goes to exactly one part, so the parts sum to the step; nothing is
timed, or even wrapped, until the benchmark installs the clock, and uninstalling puts every
method back; on the real engine, each step of the server's engine thread splits into its parts
to within the clock's resolution."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import pytest

from adaspark.bench.step_clock import StepClock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_breakdown  # noqa: E402


class Ticks:
    """A clock that moves by a given amount at each reading."""

    def __init__(self, steps: list[float]):
        self.steps, self.now, self.readings = list(steps), 0.0, 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.steps.pop(0)
        return self.now


def test_nested_phases_split_a_step_into_exclusive_parts_that_sum_to_it():
    ticks = Ticks([0, 1, 2, 4, 8, 16, 32, 64])
    clock = StepClock(ticks)
    with clock.step("root"):          # 1: root
        with clock.phase("a"):        # 2: a
            with clock.phase("b"):    # 4: b
                pass                  # 8: a
            clock.note(running=3)
        with clock.phase("b"):        # 16: root
            pass                      # 32: b
    (step,) = clock.steps            # 64: root (to the end)
    assert step.parts == {"root": 1 + 16 + 64, "a": 2 + 8, "b": 4 + 32}
    assert sum(step.parts.values()) == step.wall == 127
    assert step.info == {"running": 3}


def test_a_phase_outside_any_step_reads_no_clock():
    ticks = Ticks([])
    clock = StepClock(ticks)
    with clock.phase("a"):
        clock.note(running=1)
    assert ticks.readings == 0 and clock.steps == []


def test_a_step_on_another_thread_has_its_own_stack():
    clock = StepClock()
    inside, go_on = threading.Event(), threading.Event()

    def other():
        with clock.step("theirs"):
            inside.set()
            go_on.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    assert not clock.open  # theirs is open on their thread only
    with clock.phase("a"):
        pass
    go_on.set()
    thread.join()
    assert [list(s.parts) for s in clock.steps] == [["theirs"]]


def test_nothing_is_wrapped_until_installed_and_uninstall_restores_every_method():
    import importlib

    def methods():
        return {(m, c, n): importlib.import_module(m).__dict__[c].__dict__.get(n)
                for m, c, n, _ in step_breakdown.PARTS}

    from adaspark.batch import Batch
    from adaspark.server.worker import EngineWorker

    before = methods()
    plain = (Batch.step, EngineWorker._serve_once, EngineWorker.submit, EngineWorker._next_job)
    assert not any(hasattr(f, "__wrapped__") for f in before.values() if f is not None)
    assert not any(hasattr(f, "__wrapped__") for f in plain)
    clock = StepClock()
    step_breakdown.install(clock)
    try:
        assert all(hasattr(f, "__wrapped__") for f in methods().values())
        assert hasattr(Batch.step, "__wrapped__")
    finally:
        clock.uninstall()
    assert methods() == before
    assert (Batch.step, EngineWorker._serve_once, EngineWorker.submit,
            EngineWorker._next_job) == plain


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_the_engine_threads_steps_split_into_parts_that_sum_to_each(fast_model, model_path):
    from adaspark.engine import Engine
    from adaspark.model.tokenizer import Tokenizer
    from adaspark.server.worker import EngineWorker, Job

    engine = Engine(fast_model, Tokenizer.from_gguf(model_path), model_path)
    engine.reset()
    clock = StepClock()
    step_breakdown.install(clock)
    try:
        worker = EngineWorker(lambda: engine, parallel=2)
        place = worker.reserve()
        prompt = [(37 * i) % 9000 + 100 for i in range(40)]
        futures = [place.submit(Job(prompt[i:], 6, [], cancel=place.cancel)) for i in range(3)]
        assert all(len(f.result(timeout=120).token_ids) == 6 for f in futures)
        place.release()
        worker.close()
    finally:
        clock.uninstall()
        engine.reset()
    steps = [s for s in clock.steps if s.info.get("running")]
    assert steps
    for s in clock.steps:  # the clock's resolution: one float's rounding over the readings
        assert math.isclose(sum(s.parts.values()), s.wall, rel_tol=1e-9, abs_tol=1e-9)
    parts = {part for s in clock.steps for part in s.parts}
    assert {"admission", "prefill: forward", "verify: forward", "request: plan",
            "request: take (accept, commit, sample)", step_breakdown.ROOT,
            step_breakdown.IDLE} <= parts
    assert max(s.info["running"] for s in steps) == 2
    kinds = [what for what, _, _ in clock.events]
    assert kinds.count("admit") == 3 and kinds.count("submit") == 3
    waits = step_breakdown.admission_waits(clock.events, 0.0, math.inf)
    assert waits["queue"]["n"] == 3 and waits["prepare"]["n"] == 1


def test_a_pass_breakdown_sums_its_parts_and_finds_its_tail():
    idle, root = step_breakdown.IDLE, step_breakdown.ROOT

    def step(start, running, waiting, parts):
        return {"start": start, "wall": sum(parts.values()), "parts": parts,
                "info": {"running": running, "waiting": waiting}}

    record = {"steps": [step(0.0, 0, 0, {idle: 1.0, "admission": 0.5}),
                        step(2.0, 4, 1, {"verify: forward": 2.0, root: 0.5}),
                        step(5.0, 2, 0, {"verify: forward": 1.0, idle: 0.25}),
                        step(9.5, 0, 0, {idle: 2.0}),  # waits past the pass's end
                        step(99.0, 4, 0, {"verify: forward": 9.0})],  # after the pass
              "events": [("reserve", 0.1, {"place": 7}), ("submit", 0.3, {"job": 1, "place": 7}),
                         ("admit", 1.4, {"job": 1, "place": 7}),
                         ("submit", 0.5, {"job": 2, "place": 7}),
                         ("admit", 4.0, {"job": 2, "place": 7})]}
    b = step_breakdown.breakdown(record, 0.0, 10.0, clients=4)
    assert b["steps"] == 4 and b["in_steps_s"] == 5.75
    assert b["parts_s"] == {idle: 1.75, "admission": 0.5, "verify: forward": 3.0, root: 0.5}
    assert math.isclose(sum(b["parts_share"].values()), 1.0)
    assert b["tail"] == {"underfilled_steps": 3, "underfilled_s": 3.25,
                         "underfilled_idle_s": 1.75, "after_last_admission_s": 6.0}
    assert b["by_running"][4]["steps"] == 1 and b["by_running"][2]["wall_s"] == 1.25
    waits = b["admission"]
    assert waits["queue"]["n"] == 2 and math.isclose(waits["queue"]["sum_s"], 1.1 + 3.5)
    assert waits["prepare"]["n"] == 1 and math.isclose(waits["prepare"]["sum_s"], 0.2)
