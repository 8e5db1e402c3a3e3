"""Which learned store an engine uses: its fingerprint and its directory.

Learned verify prices and acceptance rates are true of one model file, one drafter, one device
and one kernel build, so the fingerprint names all four; scheduler/store.py keeps one file per
fingerprint and refuses a file written under another. The default directory is
platformdirs.user_cache_dir("adaspark")/stores; `--store PATH` names another directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from platformdirs import user_cache_dir

from adaspark.errors import UserError
from adaspark.hashing import sha256_files
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.store import Store


def default_store_dir() -> Path:
    return Path(user_cache_dir("adaspark")) / "stores"


def drafter_sha256(checkpoint: Path) -> str:
    """One hash over a drafter checkpoint's config and weights (both change what it drafts)."""
    return sha256_files(*(Path(checkpoint) / name for name in ("config.json", "model.safetensors")))


def fingerprint(model_sha256: str, drafter_hash: str, target: Any) -> dict:
    """model_sha256 / drafter_hash: the model file's and the drafter checkpoint's hashes;
    target: the loaded Transformer (its device, precision and kernel table)."""
    kernels = getattr(target, "kernels", None)
    table = {str(rows): kernel for rows, kernel in getattr(kernels, "best", {}).items()}
    return {"model_sha256": model_sha256, "drafter_sha256": drafter_hash,
            "device": str(target.device), "precision": target.precision,
            "torch": torch.__version__, "kernel_table": table}


def open_store(directory: str | Path | None, fingerprint: dict) -> Store:
    """The store for `fingerprint` in `directory` (None: the default directory)."""
    return Store(Path(directory) if directory else default_store_dir(), fingerprint)


def restore(scheduler: Scheduler, store: Store, fresh: bool = False) -> str | None:
    """Load the store into the scheduler unless `fresh`; returns why a saved file was refused
    (it is set aside and the scheduler starts empty), else None."""
    if fresh:
        return None
    state = store.load()
    if state:
        try:
            Scheduler(scheduler.arm).load_state_dict(state)  # whole or not at all
        except UserError as err:  # an older scheduler's state: start empty, overwrite on save
            return f"learned store {store.path} not used: {err}"
        scheduler.load_state_dict(state)
    return store.rejection
