"""Drafter checkpoints round-trip, and a wrong-target, corrupt or missing one is refused."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_drafter_model import hiddens, tiny

from adaspark.drafter.checkpoint import load_checkpoint, save_checkpoint, target_fingerprint
from adaspark.drafter.runtime import Drafter
from adaspark.errors import UserError

TARGET = SimpleNamespace(arch="llama", n_layers=4, dim=32, vocab_size=100)


def fingerprint(**changes):
    fp = target_fingerprint(TARGET)
    fp.update(model_file="tiny.gguf", sha256="ab" * 32)
    fp.update(changes)
    return fp


@pytest.fixture
def saved(tmp_path):
    model, embed = tiny()
    with torch.no_grad():
        model.temperature.copy_(torch.tensor([1.0, 1.5, 2.0, 0.5]))
    path = tmp_path / "drafter"
    save_checkpoint(path, model, fingerprint(), info={"steps": 3})
    return path, model, embed


def test_round_trip_same_drafts(saved):
    path, model, embed = saved
    loaded = load_checkpoint(path, fingerprint(), embed)
    assert loaded.c == model.c
    torch.testing.assert_close(loaded.temperature, model.temperature)
    torch.testing.assert_close(loaded.draft_ids, model.draft_ids)
    h = hiddens(12)
    a, b = Drafter(model, embed), Drafter(loaded, embed)
    a.observe(h)
    b.observe(h)
    x, y = a.draft(6), b.draft(6)
    # fp16 storage: same candidates, values within fp16 rounding
    np.testing.assert_array_equal(x.picks, y.picks)
    np.testing.assert_allclose(x.head, y.head, atol=2e-2)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["drafter"]["target_layers"] == [0, 2] and cfg["drafter"]["markov_rank"] == 8
    assert cfg["target"]["sha256"] == "ab" * 32


@pytest.mark.parametrize(
    "change, word",
    [({"dim": 64}, "dim"), ({"n_layers": 30}, "n_layers"), ({"sha256": "cd" * 32}, "sha256"),
     ({"arch": "qwen3"}, "arch")],
)
def test_mismatched_target_refused(saved, change, word):
    path, _, embed = saved
    with pytest.raises(UserError, match=f"trained for a target with {word}="):
        load_checkpoint(path, fingerprint(**change), embed)


def test_tap_beyond_target_refused(saved):
    path, _, embed = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["drafter"]["target_layers"] = [0, 7]
    cfg["target"].pop("n_layers")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="taps layers"):
        load_checkpoint(path, fingerprint(), embed)


def test_corrupt_or_missing_refused(saved, tmp_path):
    path, _, embed = saved
    with pytest.raises(UserError, match="no drafter checkpoint"):
        load_checkpoint(tmp_path / "nowhere", fingerprint(), embed)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(path, fingerprint(), embed)
    weights.write_bytes(data)
    (path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_checkpoint(path, fingerprint(), embed)
