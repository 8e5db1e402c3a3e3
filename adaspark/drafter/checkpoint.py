"""Drafter checkpoints: a directory with config.json and model.safetensors.

config.json carries the DSpark fields (target layer ids, block size, mask embedding, Markov rank
and type, confidence head flags, draft vocabulary size, top-K) and the target's fingerprint
(arch, n_layers, dim, vocab size, model file name and sha256). model.safetensors holds the
trainable weights (fp16), the draft vocabulary (target ids) and the confidence temperatures.
The LM head is not stored: it is the target's embedding rows of the draft vocabulary, rebuilt
from the target at load, which the fingerprint guarantees is the same target (a head of its
own, lm_head "stored", a peer's, is stored as `lm_head`); a mask that is a target token's row
is rebuilt likewise.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adaspark.drafter.model import DrafterConfig, DraftModel, Embed
from adaspark.errors import UserError
from adaspark.hashing import sha256_files

FORMAT = "adaspark-dspark-drafter/1"
FINGERPRINT_KEYS = ("arch", "n_layers", "dim", "vocab_size")
_log = logging.getLogger(__name__)


def target_fingerprint(config, model_path: Path | None = None, sha256: str | None = None) -> dict:
    """config: the target's ModelConfig (or anything with arch, n_layers, dim, vocab_size)."""
    fp = {k: getattr(config, k) for k in FINGERPRINT_KEYS}
    if model_path is not None:
        fp["model_file"] = Path(model_path).name
        fp["sha256"] = sha256 or sha256_files(model_path)
    return fp


def save_checkpoint(path: Path, model: DraftModel, target: dict, info: dict | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(torch.float16).contiguous()
        for k, v in model.state_dict().items()
        if k != "temperature"
    }
    tensors["draft_vocab"] = model.draft_ids.to(torch.int64).contiguous()
    if model.c.lm_head == "stored":  # a head of its own (a peer's); else rebuilt from the target
        tensors["lm_head"] = model.head.to(torch.float16).contiguous()
    tensors["temperature"] = model.temperature.to(torch.float32).contiguous()
    config = {"format": FORMAT, "drafter": model.c.to_dict(), "target": target, "info": info or {}}
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, path / "model.safetensors")
    (path / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(path / "config.json.tmp", path / "config.json")


def read_config(path: Path) -> dict:
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file() or not (path / "model.safetensors").is_file():
        raise UserError(f"no drafter checkpoint at {path} (need config.json and model.safetensors)")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as err:
        msg = f"drafter checkpoint {path}: config.json is not valid JSON ({err})"
        raise UserError(msg) from err
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise UserError(f"drafter checkpoint {path}: not an {FORMAT} checkpoint")
    return config


def check_target(config: dict, target: dict, path: Path) -> None:
    """Refuse a drafter trained for another target (shape, or the same shape but another file).

    A checkpoint names its target by the model file's sha256 (save_checkpoint records
    target_fingerprint(config, model_path)), so one trained for a file of another name is
    taken when the hashes agree. A checkpoint that records no sha256 (saved without a model
    path) is taken when its shape fields agree, with a warning: what it drafts cannot change
    an emitted token (each is the target's own, verified), only how many a round accepts."""
    saved = config.get("target", {})
    for key in (*FINGERPRINT_KEYS, "sha256"):
        if key in saved and key in target and saved[key] != target[key]:
            raise UserError(
                f"drafter checkpoint {path} was trained for a target with {key}={saved[key]!r} "
                f"({_named(saved)}), but this target has {key}={target[key]!r} "
                f"({_named(target)}); train one for it with `adaspark train-drafter`"
            )
    if "sha256" not in saved:
        _log.warning("drafter checkpoint %s records no model hash: taken for %s on its shape "
                     "alone (it may draft poorly; every emitted token is still the target's)",
                     path, _named(target))
    layers = config["drafter"]["target_layers"]
    if any(not 0 <= t < target["n_layers"] for t in layers):
        raise UserError(f"drafter checkpoint {path} taps layers {layers} the target lacks")


def _named(fingerprint: dict) -> str:
    """A target fingerprint in words: its model file, else its shape."""
    if fingerprint.get("model_file"):
        return f"model file {fingerprint['model_file']}"
    return "a model with " + ", ".join(f"{k}={fingerprint[k]!r}" for k in FINGERPRINT_KEYS
                                       if k in fingerprint)


def load_checkpoint(path: Path, target: dict, embed: Embed) -> DraftModel:
    """target: target_fingerprint(...) of the loaded target; embed: its input embedding."""
    path = Path(path)
    config = read_config(path)
    check_target(config, target, path)
    try:
        c = DrafterConfig(**config["drafter"])
        tensors = load_file(str(path / "model.safetensors"))
    except Exception as err:  # bad fields or damaged tensor file: both are the checkpoint's fault
        raise UserError(f"drafter checkpoint {path} is corrupt: {err}") from err
    if "draft_vocab" not in tensors or len(tensors["draft_vocab"]) != c.draft_vocab_size:
        raise UserError(f"drafter checkpoint {path} is corrupt: draft vocabulary missing or wrong")
    draft_ids = tensors.pop("draft_vocab")
    stored = tensors.pop("lm_head", None)
    if (stored is None) != (c.lm_head != "stored"):
        raise UserError(f"drafter checkpoint {path} is corrupt: lm_head {c.lm_head!r} but its "
                        f"head {'missing' if stored is None else 'present'}")
    with torch.no_grad():
        head = embed(draft_ids).to(torch.float32) if stored is None else stored.float()
        mask_row = (embed(torch.tensor([c.mask_token_id]))[0].float()
                    if c.mask_token == "target_token" else None)
    model = DraftModel(c, draft_ids, head, mask_row=mask_row)
    state = {k: v.to(torch.float32) for k, v in tensors.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise UserError(f"drafter checkpoint {path} is corrupt: {str(err)[:200]}") from err
    if missing or unexpected:
        raise UserError(
            f"drafter checkpoint {path} is corrupt: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}"
        )
    return model.eval()
