"""The engine's learned store: fingerprint (one store per arm family), default place,
restore/fresh, a refused state set aside, a restart in another process, and a failed save that
loses no reply (engine and server). Crashes (`kill -9`): test_store_crash.py."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from adaspark.errors import UserError
from adaspark.learned_store import arm_family, default_store_dir, fingerprint, open_store, restore
from adaspark.scheduler.record import RoundTimes
from adaspark.scheduler.round import KERNEL_CLASSES, STATE_VERSION, Scheduler
from adaspark.scheduler.tree import Block

TARGET = SimpleNamespace(device=torch.device("cpu"), precision="fast",
                         kernels=SimpleNamespace(best={1: "int4", 16: "bf16"}))


def as_json(state: dict) -> str:
    return json.dumps(state, sort_keys=True, default=lambda v: v.tolist())


def learn_rounds(sched: Scheduler, seed: int, rounds: int) -> None:
    """One request of real rounds on handmade blocks: a target that follows the drafter's
    picks for a random number of steps, with verify times that grow with the rows."""
    rng = np.random.default_rng(seed)
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


def learned_scheduler(seed: int = 0, rounds: int = 60, arm: str = "adaspark") -> Scheduler:
    """A scheduler after one request of learn_rounds."""
    sched = Scheduler(arm)
    learn_rounds(sched, seed, rounds)
    return sched


def test_fingerprint_names_model_drafter_device_kernel_build_and_arm():
    fp = fingerprint("m" * 64, "d" * 64, TARGET, "adaspark,gate")
    assert fp["model_sha256"] == "m" * 64 and fp["drafter_sha256"] == "d" * 64
    assert fp["device"] == "cpu" and fp["precision"] == "fast"
    assert fp["torch"] == torch.__version__ and fp["kernel_table"] == {"1": "int4", "16": "bf16"}
    assert fp["arm"] == "adaspark,gate"
    other_kernels = SimpleNamespace(**{**vars(TARGET), "kernels":
                                       SimpleNamespace(best={1: "bf16", 16: "bf16"})})
    paths = {open_store("/x", fingerprint(*hashes, target, arm)).path
             for hashes in (("a", "b"), ("a", "c"), ("z", "b"))
             for target in (TARGET, other_kernels) for arm in ("adaspark", "adaspark,gate")}
    assert len(paths) == 12  # every part of the fingerprint picks its own file
    assert open_store(None, fp).directory == default_store_dir()
    assert default_store_dir().name == "stores"


def test_restore_loads_unless_fresh_and_refuses_another_version(tmp_path):
    store = open_store(tmp_path, fingerprint("m", "d", TARGET, "adaspark"))
    learned = learned_scheduler()
    store.save(learned.state_dict())
    empty = as_json(Scheduler("adaspark").state_dict())
    assert as_json(learned.state_dict()) != empty

    restored = Scheduler("adaspark")
    assert restore(restored, store) is None
    assert as_json(restored.state_dict()) == as_json(learned.state_dict())
    saved = store.path.read_text()
    fresh = Scheduler("adaspark")
    assert restore(fresh, store, fresh=True) is None
    assert as_json(fresh.state_dict()) == empty
    # --fresh starts over without losing the store: it is set aside, not overwritten
    (replaced,) = tmp_path.glob(f"{store.path.name}.replaced-*")
    assert replaced.read_text() == saved and not store.path.exists()

    other = open_store(tmp_path, fingerprint("another model", "d", TARGET, "adaspark"))
    other.path.write_text(saved)  # a store copied under the wrong name
    assert "fingerprint" in restore(Scheduler("adaspark"), other)
    assert not other.path.exists()  # set aside, never used


def rejected(directory) -> list:
    return sorted(p for p in directory.iterdir() if ".rejected-" in p.name)


SPOILED = {"newer version": lambda state: {**state, "version": STATE_VERSION + 1},
           "missing part": lambda state: {k: v for k, v in state.items() if k != "acceptance"},
           "malformed part": lambda state: {**state, "chooser": "garbage"}}


@pytest.mark.parametrize("spoil", SPOILED.values(), ids=SPOILED.keys())
def test_a_state_the_scheduler_refuses_is_set_aside_never_overwritten(tmp_path, spoil):
    store = open_store(tmp_path, fingerprint("m", "d", TARGET, "adaspark"))
    store.save(spoil(learned_scheduler().state_dict()))
    written = store.path.read_text()
    sched = Scheduler("adaspark")
    why = restore(sched, store)
    assert "cannot read its state" in why and "set aside" in why
    assert as_json(sched.state_dict()) == as_json(Scheduler("adaspark").state_dict())
    (aside,) = rejected(tmp_path)
    assert aside.name.startswith(f"{store.path.name}.rejected-")
    assert aside.read_text() == written and not store.path.exists()
    store.save(sched.state_dict())  # the next save writes a fresh store beside it
    assert aside.read_text() == written and rejected(tmp_path) == [aside]
    assert restore(Scheduler("adaspark"), open_store(tmp_path, store.fingerprint)) is None


FAMILIES = ("adaspark", "adaspark,gate", "adaspark,classes", "adaspark:8", "tree:8", "cost",
            "chain", "chain3", "adaspark,head")


def test_each_arm_family_keeps_its_own_store(tmp_path):
    paths = {arm: open_store(tmp_path, fingerprint("m", "d", TARGET, arm)).path
             for arm in FAMILIES}
    assert len(set(paths.values())) == len(FAMILIES)
    # only the spelling is free
    assert arm_family("adaspark+gate,classes") == arm_family("adaspark,classes,gate,gate") \
        == "adaspark,classes,gate"
    learned = {}
    for seed, arm in enumerate(FAMILIES):
        sched = learned_scheduler(seed=seed, rounds=20, arm=arm)
        open_store(tmp_path, fingerprint("m", "d", TARGET, arm)).save(sched.state_dict())
        learned[arm] = as_json(sched.state_dict())
    for arm in FAMILIES:  # every save landed in its own file: each arm reads back its own
        sched = Scheduler(arm)
        assert restore(sched, open_store(tmp_path, fingerprint("m", "d", TARGET, arm))) is None
        assert as_json(sched.state_dict()) == learned[arm]


def test_adaspark_state_never_loads_into_adaspark_classes(tmp_path):
    ladder = open_store(tmp_path, fingerprint("m", "d", TARGET, "adaspark"))
    ladder.save(learned_scheduler().state_dict())
    classes = Scheduler("adaspark,classes")
    with pytest.raises(UserError, match="keyed for arm 'adaspark', not 'adaspark,classes'"):
        restore(classes, ladder)
    ours = open_store(tmp_path, fingerprint("m", "d", TARGET, "adaspark,classes"))
    assert restore(classes, ours) is None  # its own store: none yet
    shutil.copy(ladder.path, ours.path)  # the other family's store copied in under our name
    assert "fingerprint" in restore(classes, ours) and not ours.path.exists()
    assert classes.cost.widths == list(KERNEL_CLASSES)
    assert as_json(classes.state_dict()) == as_json(Scheduler("adaspark,classes").state_dict())


CHILD = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch
    from adaspark.learned_store import fingerprint, open_store, restore
    from adaspark.scheduler.round import Scheduler
    target = SimpleNamespace(device=torch.device("cpu"), precision="fast",
                             kernels=SimpleNamespace(best={1: "int4", 16: "bf16"}))
    store = open_store(sys.argv[2], fingerprint("m", "d", target, "adaspark"))
    sched = Scheduler("adaspark")
    print(json.dumps({"refused": restore(sched, store), "state": sched.state_dict()},
                     default=lambda v: v.tolist()))
""")


def child(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE,
                            text=True, **kw)


def test_store_survives_a_restart(tmp_path):
    learned = learned_scheduler(seed=1)
    store = open_store(tmp_path, fingerprint("m", "d", TARGET, "adaspark"))
    store.save(learned.state_dict())
    out, _ = child("load", str(tmp_path)).communicate(timeout=60)
    loaded = json.loads(out)
    assert loaded["refused"] is None
    assert json.dumps(loaded["state"], sort_keys=True) == as_json(learned.state_dict())


# --- a failed save loses no reply: the engine, then over HTTP --------------------------------
HELLO = [{"role": "user", "content": "Name three colours."}]


def block_saves(store):
    """Make the store's saves fail as a read-only disk would (the tests run as root, whom a
    mode does not stop): a directory takes the name of the lock file every save opens for
    writing. Returns it (rmdir ends it)."""
    blocker = store.lock_path
    blocker.unlink(missing_ok=True)  # the lock file of earlier saves (no save holds it now)
    blocker.mkdir(parents=True)
    return blocker


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The embedded model with the default arm and the shipped drafter, on an empty store."""
    from adaspark.engine import Engine
    from adaspark.model.sources import default_model_path

    return Engine.load(default_model_path(download=False), arm="adaspark,gate",
                       store=tmp_path_factory.mktemp("stores"), fresh=True)


@pytest.mark.slow
def test_a_failed_save_keeps_the_reply_and_the_last_good_store(engine, caplog):
    store = engine.speculator.store
    engine.generate(HELLO, max_tokens=8)
    good, saves = store.path.read_bytes(), store.saves
    blocker = block_saves(store)
    try:
        with caplog.at_level(logging.WARNING, logger="adaspark.speculative"):
            gen = engine.generate(HELLO, max_tokens=8)
    finally:
        blocker.rmdir()
    assert gen.text and len(gen.token_ids) == 8
    assert store.path.read_bytes() == good  # the last good store, untouched
    assert (store.saves, store.save_failures) == (saves, 1)
    assert "learned state not saved" in caplog.text and "cannot write learned store" in caplog.text
    engine.generate(HELLO, max_tokens=8)  # the disk is back: the next request saves again
    assert store.saves == saves + 1 and store.load() is not None


def save_failures(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "adaspark_store_save_failures_total")


@pytest.mark.slow
def test_a_failed_save_over_http_still_replies_and_is_counted(engine):
    from test_server import _serving, _wait

    from adaspark.server import create_app

    store = engine.speculator.store
    body = {"model": "m", "messages": HELLO, "max_tokens": 8}
    url = "/v1/chat/completions"
    with _serving(create_app(lambda: engine, model_id="m")) as base:
        _wait(lambda: httpx.get(base + "/health").status_code == 200, "the model to load")
        before = save_failures(base)
        blocker = block_saves(store)
        try:  # each request's save runs once the server is idle (IDLE_SAVE_S), and fails
            plain = httpx.post(base + url, json=body, timeout=300)
            _wait(lambda: save_failures(base) == before + 1, "the first idle save")
            with httpx.stream("POST", base + url, json={**body, "stream": True},
                              timeout=300) as streamed:
                events = [line for line in streamed.iter_lines() if line]
            _wait(lambda: save_failures(base) == before + 2, "the second idle save")
        finally:
            blocker.rmdir()
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["message"]["content"]
        assert str(store.directory) not in plain.text
        assert streamed.status_code == 200 and events[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in events)
