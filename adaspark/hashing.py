"""One streaming sha256 for the files whose identity matters (model, drafter, stores)."""

from __future__ import annotations

import hashlib
import os


def sha256_files(*paths: str | os.PathLike) -> str:
    """Hex sha256 over the files' bytes in order, read in 1 MiB chunks (models are large)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
