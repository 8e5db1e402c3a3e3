"""The learned store: exact round trip, fingerprint refusal, corrupt files, crash-safe saves."""

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from adaspark.errors import UserError
from adaspark.scheduler.chooser import Chooser
from adaspark.scheduler.cost import CostModel
from adaspark.scheduler.store import FORMAT_VERSION, Store

FINGERPRINT = {"model": "b179c952", "drafter": "d00d", "device": "cpu:x86_64", "build": "k1"}


def learned_state():
    rng = random.Random(4)
    cost, chooser = CostModel(), Chooser()
    for _ in range(120):
        width = cost.probe() or 16
        c = rng.randint(50, 9000)
        cost.observe(width, width, c, 10 + width * rng.random(), 2 + rng.random())
        chooser.learn(width, c, rng.randint(0, 6), 20 * rng.random() + 1, [4, 8, 16],
                      [0.0, 1.0, 1.0, 2.0] * 4, [0.0] * 16,
                      [0.0] + [rng.random() for _ in range(15)], [0.0] * 16)
    cost.end_request()
    return {"cost": cost.state_dict(), "chooser": chooser.state_dict(),
            "odd_floats": [0.1 + 0.2, 1e-300, 5e-324, -0.0, 1.7976931348623157e308,
                           rng.random() / 3]}


def float_bits(value):
    """Every float of a nested value as its 64 bits, so equality is bit for bit (-0.0 too)."""
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, dict):
        return {k: float_bits(v) for k, v in value.items()}
    if isinstance(value, list):
        return [float_bits(v) for v in value]
    return value


def test_round_trip_is_bit_for_bit(tmp_path):
    state = learned_state()
    Store(tmp_path, FINGERPRINT).save(state)
    loaded = Store(tmp_path, dict(FINGERPRINT)).load()
    assert float_bits(loaded) == float_bits(json.loads(json.dumps(state)))
    cost = CostModel()
    cost.load_state_dict(loaded["cost"])
    assert cost.state_dict() == state["cost"]


def test_missing_store_is_empty_and_one_file_per_fingerprint(tmp_path):
    store = Store(tmp_path / "stores", FINGERPRINT)
    assert store.load() is None and store.rejection is None
    other = Store(tmp_path / "stores", {**FINGERPRINT, "device": "cuda:H200"})
    assert other.path != store.path
    store.save({"a": 1.5})
    other.save({"a": 2.5})
    assert store.load() == {"a": 1.5} and other.load() == {"a": 2.5}


def rejected_files(directory):
    return sorted(p.name for p in directory.iterdir() if ".rejected-" in p.name)


def test_wrong_fingerprint_is_refused_and_set_aside(tmp_path):
    theirs = Store(tmp_path, {**FINGERPRINT, "model": "another"})
    theirs.save({"learned": 1.0})
    ours = Store(tmp_path, FINGERPRINT)
    shutil.copy(theirs.path, ours.path)          # a store copied in under our name
    assert ours.load() is None
    assert "fingerprint" in ours.rejection and "another" in ours.rejection
    assert not ours.path.exists()
    (kept,) = rejected_files(tmp_path)
    assert kept.startswith(f"{ours.path.name}.rejected-")
    ours.save({"learned": 2.0})                  # a fresh store; the refused one is kept
    assert ours.load() == {"learned": 2.0} and len(rejected_files(tmp_path)) == 1
    assert (ours.saves, ours.rejections) == (1, 1)  # what the server's metrics count
    assert theirs.load() == {"learned": 1.0}


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00", b"[1, 2]",
                                     json.dumps({"format": FORMAT_VERSION + 1,
                                                 "fingerprint": FINGERPRINT,
                                                 "state": {}}).encode()])
def test_unreadable_store_is_refused_and_set_aside(tmp_path, content):
    store = Store(tmp_path, FINGERPRINT)
    store.path.write_bytes(content)
    assert store.load() is None and store.rejection
    (kept,) = rejected_files(tmp_path)
    assert (tmp_path / kept).read_bytes() == content


def test_save_never_silently_overwrites_a_store_it_cannot_read(tmp_path):
    store = Store(tmp_path, FINGERPRINT)
    store.path.write_text("garbage")
    store.save({"x": 1.0})                       # without a load first
    assert store.load() == {"x": 1.0}
    assert (store.saves, store.rejections) == (1, 1)
    (kept,) = rejected_files(tmp_path)
    assert (tmp_path / kept).read_text() == "garbage"


def test_a_crash_between_write_and_rename_leaves_the_previous_store(tmp_path):
    store = Store(tmp_path, FINGERPRINT)
    store.save({"generation": 1.0})
    # A child process writes and fsyncs its temporary file, then dies before the rename.
    script = textwrap.dedent(f"""
        import os, signal
        from adaspark.scheduler import store as module
        module.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
        module.Store({str(tmp_path)!r}, {FINGERPRINT!r}).save({{"generation": 2.0}})
    """)
    child = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), timeout=60)
    assert child.returncode == -9
    leftovers = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and "generation" in leftovers[0].read_text()
    assert Store(tmp_path, FINGERPRINT).load() == {"generation": 1.0}
    # A partial temporary file (a crash mid-write) is never read either.
    leftovers[0].write_text('{"format": 1, "fingerprint"')
    assert Store(tmp_path, FINGERPRINT).load() == {"generation": 1.0}
    store.save({"generation": 3.0})
    assert Store(tmp_path, FINGERPRINT).load() == {"generation": 3.0}


def test_bad_fingerprints_and_states_are_clear_errors(tmp_path):
    with pytest.raises(UserError):
        Store(tmp_path, {})
    with pytest.raises(UserError):
        Store(tmp_path, {"device": object()})
    store = Store(tmp_path, FINGERPRINT)
    with pytest.raises(UserError):
        store.save({"nan": float("nan")})
    with pytest.raises(UserError):
        store.save([1, 2])
    assert not store.path.exists()
    assert (store.saves, store.save_failures) == (0, 2)  # each failed save counted (metrics)
    blocked = Store(tmp_path / "a-file" / "stores", FINGERPRINT)
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(UserError, match="cannot write learned store"):
        blocked.save({"x": 1.0})
    assert blocked.save_failures == 1


def test_a_store_directory_that_is_no_directory_is_a_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    store = Store(tmp_path / "a-file" / "stores", FINGERPRINT)
    with pytest.raises(UserError, match="cannot be set aside"):
        store.load()
