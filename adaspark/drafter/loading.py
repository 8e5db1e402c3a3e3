"""Finding and loading the drafter for a target: the shipped default, or a path to one in our
format, llama.cpp's dflash GGUF or DeepSpec's folder (drafter/peers.py)."""

from __future__ import annotations

import json
from pathlib import Path

from adaspark.drafter import peers
from adaspark.drafter.checkpoint import load_checkpoint, read_config
from adaspark.drafter.runtime import Drafter
from adaspark.errors import UserError
from adaspark.hashing import sha256_files

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "drafters"
DEFAULT_DRAFTER = ASSETS / "smollm2-135m-instruct-dspark"


def model_sha256(model_path: Path) -> str:
    """sha256 of a model file, from the cache's `.verified` marker when it matches the file."""
    model_path = Path(model_path)
    marker = model_path.with_name(model_path.name + ".verified")
    try:
        rec = json.loads(marker.read_text())
        if rec.get("size") == model_path.stat().st_size and rec.get("sha256"):
            return rec["sha256"]
    except (OSError, ValueError):
        pass
    return sha256_files(model_path)


def target_info(target, model_path: Path) -> dict:
    """The fingerprint a checkpoint is checked against, for a loaded Transformer."""
    c = target.config
    return {"arch": c.arch, "n_layers": c.n_layers, "dim": c.dim, "vocab_size": c.vocab_size,
            "model_file": Path(model_path).name, "sha256": model_sha256(model_path)}


def default_drafter_for(info: dict) -> Path:
    """The shipped drafter if it was trained for exactly this model file, else a clear error."""
    if not (DEFAULT_DRAFTER / "config.json").is_file():
        raise UserError(f"the shipped drafter is missing from {DEFAULT_DRAFTER}")
    saved = read_config(DEFAULT_DRAFTER).get("target", {})
    if saved.get("sha256") != info.get("sha256"):
        raise UserError(
            f"no shipped drafter for {info.get('model_file')} (the shipped one is for "
            f"{saved.get('model_file')}); train one with `adaspark train-drafter --model ...` "
            "and pass it with --drafter"
        )
    return DEFAULT_DRAFTER


def load_model(target, info: dict, path: Path):
    """The DraftModel at `path` in whichever format it is (ours, a llama.cpp dflash GGUF, a
    DeepSpec folder), checked against the loaded target."""
    kind = peers.kind_of(path)
    if kind == "adaspark":
        return load_checkpoint(path, info, target.embed)
    reader = peers.read_gguf if kind == "gguf" else peers.read_deepspec
    return reader(path, peers.target_of(target))


def load_drafter(target, model_path: Path, drafter_path: Path | None = None, **kw) -> Drafter:
    """The runtime drafter for a loaded target (`Transformer`), checked against its fingerprint."""
    info = target_info(target, model_path)
    path = Path(drafter_path) if drafter_path else default_drafter_for(info)
    model = load_model(target, info, path)
    if getattr(target, "native", None) is not None:  # the drafter runs on the target's build
        kw.setdefault("native", target.native_module)
        kw.setdefault("positions", target.cache.capacity + model.c.block_size)
        if getattr(target, "packed_embeddings", None) is not None:  # the rows embed() reads
            kw.setdefault("embedding", target.packed_embeddings)
    return Drafter(model, target.embed, **kw)
