"""Two writers on one learned store (scheduler/store.py, scheduler/merge.py): their counts add
instead of the last writer's whole state winning, a writer that learned nothing leaves the
other's state alone, two writers with one PID never share a temporary file, a store of another
version is set aside a bounded number of times, and two processes saving into one directory at
once both keep what they learned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from test_learned_store import learn_rounds

from adaspark.scheduler.chooser import RATE_DECAY, BandRate
from adaspark.scheduler.merge import SharedState, merge_states
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.store import KEEP_SET_ASIDE, Store, plain_json

FINGERPRINT = {"model": "m", "drafter": "d", "device": "cpu", "arm": "adaspark"}
TESTS = Path(__file__).resolve().parent


def loaded(store: Store) -> Scheduler:
    sched = Scheduler("adaspark")
    sched.load_state_dict(store.load() or {})
    return sched


def rate_rounds(state: dict, part: str) -> int:
    """Rounds counted in a part's decode rates (chooser: per band; gate: per band and mode)."""
    rows = state[part]["rates"]
    return sum(int(x) for row in rows for x in row[3::3])


def test_two_writers_from_one_store_keep_both_ones_counts(tmp_path):
    store = Store(tmp_path, FINGERPRINT)
    start = Scheduler("adaspark")
    learn_rounds(start, seed=0, rounds=30)
    store.save(start.state_dict())
    base = store.load()
    # two servers start from the same store, each learns its own requests
    a, b = loaded(store), loaded(store)
    shared_a, shared_b = SharedState(a, store), SharedState(b, store)
    learn_rounds(a, seed=1, rounds=25)
    learn_rounds(b, seed=2, rounds=35)
    shared_a.save()
    shared_b.save()  # the last writer: before the merge, its state alone stood
    disk = store.load()
    ours_a, ours_b = plain_json(a.state_dict()), plain_json(b.state_dict())
    assert disk["rounds"] == 30 + 25 + 35
    for part in ("chooser", "gate"):
        assert rate_rounds(disk, part) == (rate_rounds(ours_a, part) + rate_rounds(ours_b, part)
                                           - rate_rounds(base, part))
    labels = np.array(disk["acceptance"]["bucket_labels"])
    assert (labels == np.array(ours_a["acceptance"]["bucket_labels"])
            + ours_b["acceptance"]["bucket_labels"] - base["acceptance"]["bucket_labels"]).all()
    # fitted parts are one fit: the newest writer's, whole
    assert disk["cost"] == ours_b["cost"] and disk["plain"] == ours_b["plain"]
    assert disk["acceptance"]["ftrl"] == ours_b["acceptance"]["ftrl"]
    # and the merged state is one the scheduler reads
    Scheduler("adaspark").load_state_dict(disk)


def test_a_writer_that_learned_nothing_leaves_the_others_state(tmp_path):
    store = Store(tmp_path, FINGERPRINT)
    idle, busy = Scheduler("adaspark"), Scheduler("adaspark")
    shared_idle, shared_busy = SharedState(idle, store), SharedState(busy, store)
    learn_rounds(busy, seed=3, rounds=30)
    shared_busy.save()
    written = store.path.read_bytes()
    shared_idle.save()  # an idle server's save at shutdown: before the merge, an empty state
    assert json.loads(store.path.read_bytes()) == json.loads(written)


def test_a_rate_merge_replays_our_rounds_on_top_of_theirs():
    """chooser.BandRate is linear in its observations: the merge is exact, not an average."""
    rng = np.random.default_rng(4)
    base, disk, ours, truth = BandRate(), BandRate(), BandRate(), BandRate()
    for rate in (base, disk, ours, truth):
        rate.tokens, rate.time, rate.rounds = 40.0, 90.0, 12
    theirs = [(float(rng.integers(1, 6)), float(rng.uniform(5, 20))) for _ in range(7)]
    mine = [(float(rng.integers(1, 6)), float(rng.uniform(5, 20))) for _ in range(5)]
    for tokens, ms in theirs:
        disk.observe(tokens, ms)
        truth.observe(tokens, ms)
    for tokens, ms in mine:
        ours.observe(tokens, ms)
        truth.observe(tokens, ms)

    def state(rate: BandRate) -> dict:
        return {"version": 1, "rounds": rate.rounds,
                "chooser": {"above": [], "below": [], "rates": [[3, rate.tokens, rate.time,
                                                                 rate.rounds]]}}

    merged = merge_states(state(base), state(disk), state(ours))
    (row,) = merged["chooser"]["rates"]
    assert row[0] == 3 and row[3] == truth.rounds == 24
    assert np.isclose(row[1], truth.tokens, rtol=1e-12) and np.isclose(row[2], truth.time,
                                                                        rtol=1e-12)
    assert 0.0 < RATE_DECAY < 1.0  # else the replay would prove nothing


def test_two_writers_with_one_pid_never_share_a_temporary_file(tmp_path):
    """Two containers on one volume are both PID 1; two threads of one process share a PID
    too. Before: both wrote `.tmp-<pid>` and could rename interleaved JSON into place."""
    errors: list[BaseException] = []
    pad = 200_000  # floats: each write takes long enough to overlap the other's

    def writer(tag: float) -> None:
        store = Store(tmp_path, FINGERPRINT)
        try:
            for n in range(6):
                store.save({"writer": tag, "n": n, "pad": [tag] * pad})
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in (1.0, 2.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    store = Store(tmp_path, FINGERPRINT)
    state = store.load()
    assert store.rejection is None and state["n"] == 5
    assert state["pad"] == [state["writer"]] * pad
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def another_version(store: Store, n: int) -> None:
    """A writer of another format version (an older or newer build on the same directory)."""
    store.path.write_text(json.dumps({"format": 99, "fingerprint": store.fingerprint,
                                      "state": {"n": n}}))


def set_aside(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if ".rejected-" in p.name)


def test_a_store_of_another_version_is_set_aside_a_bounded_number_of_times(tmp_path):
    ours = Store(tmp_path, FINGERPRINT)
    for n in range(10):  # the other version writes between every one of our saves
        another_version(ours, n)
        ours.save({"n": n})
    (kept,) = set_aside(tmp_path)  # one file for this writer: the newest it refused
    assert json.loads(kept.read_text())["state"] == {"n": 9}
    assert ours.rejections == 10 and ours.load() == {"n": 9}
    for n in range(10):  # each a new process (a restart): at most KEEP_SET_ASIDE files
        another_version(ours, 100 + n)
        Store(tmp_path, FINGERPRINT).save({"n": n})
    kept = set_aside(tmp_path)
    assert len(kept) == KEEP_SET_ASIDE
    assert {json.loads(p.read_text())["state"]["n"] for p in kept} == {107, 108, 109}


def test_a_scheduler_state_of_another_version_is_set_aside_not_overwritten(tmp_path):
    store = Store(tmp_path, FINGERPRINT)
    sched = Scheduler("adaspark")
    shared = SharedState(sched, store)
    learn_rounds(sched, seed=5, rounds=10)
    for n in range(5):  # another build writes its scheduler version between our saves
        theirs = {**plain_json(sched.state_dict()), "version": 99, "n": n}
        store.save(theirs)
        shared.save()
        assert store.load() == plain_json(sched.state_dict())
    (kept,) = set_aside(tmp_path)  # before: overwritten, never set aside
    assert json.loads(kept.read_text())["state"]["n"] == 4


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from test_store_writers import FINGERPRINT, learn_rounds, loaded
    from adaspark.scheduler.merge import SharedState
    from adaspark.scheduler.store import Store
    store, seed = Store(sys.argv[1], FINGERPRINT), int(sys.argv[2])
    sched = loaded(store)
    shared = SharedState(sched, store)
    print("loaded", flush=True)
    sys.stdin.readline()  # both have loaded: now they learn and save at once
    for request in range(8):  # a server: one save after every request
        learn_rounds(sched, seed=1000 * seed + request, rounds=6)
        shared.save()
    print(sched.rounds_learned, flush=True)
""")


def test_two_processes_saving_into_one_directory_keep_both_ones_rounds(tmp_path):
    store = Store(tmp_path, FINGERPRINT)
    first = Scheduler("adaspark")
    learn_rounds(first, seed=9, rounds=10)
    store.save(first.state_dict())
    children = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(seed),
                                  str(TESTS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                for seed in (1, 2)]
    assert [child.stdout.readline() for child in children] == ["loaded\n"] * 2
    for child in children:
        child.stdin.write("go\n")
        child.stdin.flush()
    outs = [child.communicate(timeout=600)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    # each process counts the store's 10 rounds it started from and its own 48
    assert [int(out) for out in outs] == [10 + 48, 10 + 48]
    disk = Store(tmp_path, FINGERPRINT)
    assert disk.load()["rounds"] == 10 + 48 + 48 and disk.rejection is None
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".rejected-" in p.name
            ] == []


def test_every_failed_save_is_counted_once_by_the_store(tmp_path, monkeypatch, caplog):
    """store.save_failures (the metrics' counter) counts a save however it failed, in the store
    itself: a learned state that is not JSON (before: raised before the store was asked, and
    never counted) and a bug in the merge (before: counted by the speculator, from outside)."""
    from adaspark.scheduler import merge
    from adaspark.speculative import Speculator

    store = Store(tmp_path, FINGERPRINT)
    sched = Scheduler("ngram")
    spec = Speculator(None, None, sched, store=store)
    spec.save()
    assert (store.saves, store.save_failures) == (1, 0)
    state_dict = sched.state_dict
    with monkeypatch.context() as patch, caplog.at_level("WARNING", "adaspark.speculative"):
        patch.setattr(sched, "state_dict", lambda: {**state_dict(), "bad": object()})
        spec.save()  # logged, as every failed save is: the reply stands
        assert store.save_failures == 1 and "cannot be stored as JSON" in caplog.text
    with monkeypatch.context() as patch:
        patch.setattr(merge, "merge_states", lambda *_: 1 / 0)
        spec.save()
        assert store.save_failures == 2
        with pytest.raises(ZeroDivisionError):  # the store's own update, whoever calls it
            store.update(lambda _disk: 1 / 0)
    assert (store.saves, store.save_failures) == (1, 3)
    spec.save()  # the state is fine again: saved
    assert store.saves == 2 and store.load() == plain_json(sched.state_dict())
