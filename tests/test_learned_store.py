"""The engine's learned store: fingerprint, default place, restore/fresh, a restart in another
process, and a `kill -9` in the middle of saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import numpy as np
import torch

from adaspark.learned_store import default_store_dir, fingerprint, open_store, restore
from adaspark.scheduler.record import RoundTimes
from adaspark.scheduler.round import STATE_VERSION, Scheduler
from adaspark.scheduler.tree import Block

TARGET = SimpleNamespace(device=torch.device("cpu"), precision="fast",
                         kernels=SimpleNamespace(best={1: "int4", 16: "bf16"}))


def as_json(state: dict) -> str:
    return json.dumps(state, sort_keys=True, default=lambda v: v.tolist())


def learned_scheduler(seed: int = 0, rounds: int = 60) -> Scheduler:
    """A scheduler after real rounds on handmade blocks: a target that follows the drafter's
    picks for a random number of steps, with verify times that grow with the rows."""
    rng = np.random.default_rng(seed)
    sched = Scheduler("adaspark")
    sched.begin_request(list(range(10, 60)))
    for _ in range(rounds):
        B, K = 7, 4
        picks = rng.integers(100, 200, B)
        ids = np.column_stack([picks] + [rng.integers(300, 400, B) + 100 * k for k in range(1, K)])
        block = Block(picks, ids, np.tile(np.linspace(3.0, 0.0, K), (B, 1)), rng.random(B))
        plan = sched.plan_round(60, lambda b=block: b, stop_ids=[2])
        run = int(rng.integers(0, B))
        argmax = np.full(plan.rows, 7, dtype=np.int64)
        for r in range(plan.rows):  # rows on the followed spine predict the next pick
            d = int(plan.depths[r])
            if d < run and all(plan.tokens[a] == ([plan.tokens[0]] + picks.tolist())[
                    int(plan.depths[a])] for a in np.flatnonzero(plan.mask[r])):
                argmax[r] = picks[d]
        outcome = sched.accept(plan, argmax)
        sched.learn(outcome, RoundTimes(0.002, 0.01 + 0.001 * plan.rows * rng.random(), 0.0005))
    sched.end_request()
    return sched


def test_fingerprint_names_model_drafter_device_and_kernel_build():
    fp = fingerprint("m" * 64, "d" * 64, TARGET)
    assert fp["model_sha256"] == "m" * 64 and fp["drafter_sha256"] == "d" * 64
    assert fp["device"] == "cpu" and fp["precision"] == "fast"
    assert fp["torch"] == torch.__version__ and fp["kernel_table"] == {"1": "int4", "16": "bf16"}
    other_kernels = SimpleNamespace(**{**vars(TARGET), "kernels":
                                       SimpleNamespace(best={1: "bf16", 16: "bf16"})})
    paths = {open_store("/x", fingerprint(*hashes, target)).path
             for hashes in (("a", "b"), ("a", "c"), ("z", "b"))
             for target in (TARGET, other_kernels)}
    assert len(paths) == 6  # every part of the fingerprint picks its own file
    assert open_store(None, fp).directory == default_store_dir()
    assert default_store_dir().name == "stores"


def test_restore_loads_unless_fresh_and_refuses_another_version(tmp_path):
    store = open_store(tmp_path, fingerprint("m", "d", TARGET))
    learned = learned_scheduler()
    store.save(learned.state_dict())
    empty = as_json(Scheduler("adaspark").state_dict())
    assert as_json(learned.state_dict()) != empty

    restored = Scheduler("adaspark")
    assert restore(restored, store) is None
    assert as_json(restored.state_dict()) == as_json(learned.state_dict())
    fresh = Scheduler("adaspark")
    assert restore(fresh, store, fresh=True) is None
    assert as_json(fresh.state_dict()) == empty

    store.save({**learned.state_dict(), "version": STATE_VERSION + 1})
    old = Scheduler("adaspark")
    assert "version" in restore(old, store)
    assert as_json(old.state_dict()) == empty  # nothing half-loaded

    other = open_store(tmp_path, fingerprint("another model", "d", TARGET))
    other.path.write_text(store.path.read_text())  # a store copied under the wrong name
    assert "fingerprint" in restore(Scheduler("adaspark"), other)
    assert not other.path.exists()  # set aside, never used


CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch
    from adaspark.learned_store import fingerprint, open_store, restore
    from adaspark.scheduler.round import Scheduler
    target = SimpleNamespace(device=torch.device("cpu"), precision="fast",
                             kernels=SimpleNamespace(best={1: "int4", 16: "bf16"}))
    store = open_store(sys.argv[2], fingerprint("m", "d", target))
    if sys.argv[1] == "load":
        sched = Scheduler("adaspark")
        print(json.dumps({"refused": restore(sched, store), "state": sched.state_dict()},
                         default=lambda v: v.tolist()))
    else:  # save forever: a big state, a counter, so a kill lands inside a save
        state = json.loads(sys.argv[3])
        pad = [0.5] * 400_000
        n = 0
        while True:
            n += 1
            store.save({**state, "saves": n, "pad": pad})
            print(n, flush=True)
""")


def child(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE,
                            text=True, **kw)


def test_store_survives_a_restart(tmp_path):
    learned = learned_scheduler(seed=1)
    store = open_store(tmp_path, fingerprint("m", "d", TARGET))
    store.save(learned.state_dict())
    out, _ = child("load", str(tmp_path)).communicate(timeout=60)
    loaded = json.loads(out)
    assert loaded["refused"] is None
    assert json.dumps(loaded["state"], sort_keys=True) == as_json(learned.state_dict())


def test_kill_9_during_saves_leaves_a_readable_store(tmp_path):
    state = json.loads(as_json(learned_scheduler(seed=2).state_dict()))
    store = open_store(tmp_path, fingerprint("m", "d", TARGET))
    last = 0
    for delay in (0.05, 0.21):
        proc = child("save", str(tmp_path), json.dumps(state))
        first = proc.stdout.readline()  # one save finished
        assert first.strip().isdigit()
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        saved = store.load()
        assert saved is not None and store.rejection is None
        assert saved["saves"] >= 1 and len(saved["pad"]) == 400_000
        assert {k: saved[k] for k in state} == state
        restored = Scheduler("adaspark")
        assert restore(restored, store) is None
        assert as_json(restored.state_dict()) == json.dumps(state, sort_keys=True)
        last = saved["saves"]
    assert last >= 1
