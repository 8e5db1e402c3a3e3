"""`kill -9` against the learned store, with real processes: a process killed at random moments
while it saves a large state, and `adaspark chat` killed in the middle of a reply. The next
Store.load() must read the last good state whole (a save is write, fsync, rename: never torn).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from adaspark.scheduler.store import Store

FINGERPRINT = {"model": "m", "drafter": "d", "device": "cpu", "arm": "adaspark"}
PAD = 400_000  # floats per state (~2.4 MB of JSON): a save takes long enough to be hit

SAVER = textwrap.dedent(f"""
    import sys
    from adaspark.scheduler.store import Store
    store = Store(sys.argv[1], {FINGERPRINT!r})
    n = (store.load() or {{}}).get("saves", 0)
    while True:  # save forever, each state marked at both ends, and say which one is on disk
        n += 1
        store.save({{"saves": n, "pad": [n + 0.5] * {PAD}, "end": n}})
        print(n, flush=True)
""")


def saved_numbers(text: str) -> list[int]:
    return [int(line) for line in text.split()]


def test_kill_9_at_random_moments_of_saves_leaves_the_last_good_state(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    last = 0  # the newest state a save finished writing, as the saver reported it
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline() if trial else ""  # trial 0 may die in its first save
        assert first.strip().isdigit() or not trial
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done = saved_numbers(first + proc.stdout.read())
        last = max([last, *done])
        store = Store(tmp_path, FINGERPRINT)
        state = store.load()
        where = f"(seed {seed}, trial {trial})"
        assert store.rejection is None, where
        if state is None:  # only before any save finished
            assert last == 0 and trial == 0, where
            continue
        n = state["saves"]
        # the last finished save, or the one the kill cut after its rename: never older
        assert n in (last, last + 1), where
        assert state["end"] == n and state["pad"] == [n + 0.5] * PAD, where
        last = n
    assert last >= 5
    assert not [p for p in tmp_path.iterdir() if ".rejected-" in p.name]


CHAT = "from adaspark.cli import main; raise SystemExit(main())"


def store_lock(path):
    return path.with_name(f".{path.name}.lock")


class Lines:
    """A pipe read on a thread: its text so far."""

    def __init__(self, pipe) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for chunk in iter(lambda: pipe.read(1), ""):
            self.text += chunk

    def wait_for(self, predicate, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)


def timing_lines(text: str) -> int:
    return sum(line.startswith("[") and "prompt tokens" in line for line in text.splitlines())


@pytest.mark.slow
def test_kill_9_during_a_reply_leaves_the_store_of_the_last_reply(tmp_path):
    from adaspark.learned_store import restore
    from adaspark.scheduler.round import Scheduler

    stores = tmp_path / "stores"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHAT, "chat", "--store", str(stores), "--max-tokens", "200"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = Lines(proc.stdout), Lines(proc.stderr)
        proc.stdin.write("Say OK.\n")
        proc.stdin.flush()
        err.wait_for(lambda text: timing_lines(text) == 1, "the first reply")  # saved by then
        (path,) = stores.glob("store-*.json")
        good = path.read_bytes()
        start = len(out.text)
        # a reply of many tokens, killed within 0.1 s of its start (the counting prompt's
        # ~50-token reply, at 230 tok/s, had ended before a kill up to 0.3 s after it)
        proc.stdin.write("Write a long story about a lighthouse keeper, at least 300 words.\n")
        proc.stdin.flush()
        out.wait_for(lambda text: len(text) > start + 2, "the second reply to start")
        time.sleep(random.uniform(0.0, 0.1))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert timing_lines(err.text) == 1, "the second reply ended before the kill"
    assert path.read_bytes() == good
    # no temporary, nothing set aside (only the store's lock file beside it)
    assert not [p for p in stores.iterdir() if p not in (path, store_lock(path))]
    fingerprint = json.loads(good)["fingerprint"]
    store = Store(stores, fingerprint)
    assert store.load() is not None and store.rejection is None
    assert restore(Scheduler(fingerprint["arm"]), store) is None
