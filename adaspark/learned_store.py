"""Which learned store an engine uses: its fingerprint and its directory.

Learned verify prices and acceptance rates are true of one model file, one drafter, one device
and one kernel build, and of one arm: so the fingerprint names all five (the drafter as null
for `ngram`, which runs none: its store is one whether a drafter exists for the model or not);
scheduler/store.py keeps one file per fingerprint and refuses a file written under another.
The default directory is platformdirs.user_cache_dir("adaspark")/stores; `--store PATH` names
another directory.

The arm is keyed by its whole set of switches (`arm_family`), because no two arms learn the same
thing: `classes` fixes the width table to the kernel's classes where the others refine a ladder;
a pinned width or a chain teaches the chooser and the cost model one width; `cost`, `head` and
`no-ngram` teach the acceptance model from other trees; and even `gate` and `plain`, which only
decide whether a round drafts, feed their undrafted rounds into the band rate that Eq. 7 prices
every width with; `ngram` plans every tree from the n-gram index alone. Only the spelling is
free: modifier order, `+` or `,`, repeats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from platformdirs import user_cache_dir

from adaspark.errors import UserError
from adaspark.hashing import sha256_files
from adaspark.scheduler.arm import Arm
from adaspark.scheduler.round import Scheduler
from adaspark.scheduler.store import Store


def default_store_dir() -> Path:
    return Path(user_cache_dir("adaspark")) / "stores"


def drafter_sha256(checkpoint: Path) -> str:
    """One hash over a drafter's config and weights (both change what it drafts): a GGUF file
    whole, a folder's config.json and its safetensors files in name order."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return sha256_files(checkpoint)
    return sha256_files(checkpoint / "config.json", *sorted(checkpoint.glob("*.safetensors")))


def arm_family(arm: Arm | str) -> str:
    """The arms whose learning is one: the arm's base and its modifiers, sorted, once each."""
    base, *mods = Arm.parse(arm).name.split(",")
    return ",".join([base, *sorted(set(mods))])


def fingerprint(model_sha256: str, drafter_hash: str | None, target: Any, arm: Arm | str
                ) -> dict:
    """model_sha256 / drafter_hash: the model file's and the drafter checkpoint's hashes (None:
    the arm runs no drafter);
    target: the loaded Transformer (its device, precision and kernel table); arm: the
    scheduler's."""
    kernels = getattr(target, "kernels", None)
    table = {str(rows): kernel for rows, kernel in getattr(kernels, "best", {}).items()}
    return {"model_sha256": model_sha256, "drafter_sha256": drafter_hash,
            "device": str(target.device), "precision": target.precision,
            "torch": torch.__version__, "kernel_table": table, "arm": arm_family(arm)}


def open_store(directory: str | Path | None, fingerprint: dict) -> Store:
    """The store for `fingerprint` in `directory` (None: the default directory)."""
    return Store(Path(directory) if directory else default_store_dir(), fingerprint)


def restore(scheduler: Scheduler, store: Store, fresh: bool = False) -> str | None:
    """Load the store into the scheduler unless `fresh`; returns why a saved file was refused
    (it is set aside, never overwritten, and the scheduler starts empty), else None. `fresh`
    sets the saved file aside too (`<name>.replaced-<time>`), so starting over loses nothing.
    A store keyed for another arm family is a caller's error (UserError), never loaded."""
    family = arm_family(scheduler.arm)
    if store.fingerprint.get("arm") != family:
        raise UserError(f"learned store {store.path} is keyed for arm "
                        f"{store.fingerprint.get('arm')!r}, not {family!r}")
    if fresh:
        if store.path.exists():
            store.set_aside("not used (--fresh)", kind="replaced")
        return None
    state = store.load()
    if state:
        try:
            Scheduler(scheduler.arm).load_state_dict(state)  # whole or not at all
        except UserError as err:  # another scheduler's state (a version, a missing part)
            store.set_aside(f"the scheduler cannot read its state ({err})")
            return store.rejection or f"learned store {store.path} not used: {err}"
        scheduler.load_state_dict(state)
    return store.rejection
