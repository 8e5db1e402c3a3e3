"""The learned store: everything that must outlive a request, one file per fingerprint.

API (stable):

    Store(directory, fingerprint: dict)
        .path -> pathlib.Path            the file for this fingerprint inside `directory`
        .load() -> dict | None           the saved state, or None when there is none or it was
                                         refused (another fingerprint, another format version,
                                         unreadable, corrupt): a refused file is renamed to
                                         `<name>.rejected-<timestamp>`, never used, never
                                         overwritten, and .rejection says why
        .save(state: dict) -> None       atomic: write a temporary file, fsync, rename, fsync the
                                         directory; a crash at any point leaves the old store
        .set_aside(reason: str) -> None  refuse the file on disk as load() refuses one (for a
                                         state its reader cannot use: another scheduler version)
        .rejection -> str | None         the message of the last refusal
        .saves, .rejections, .save_failures -> int
                                         saves done, files refused and saves that failed (their
                                         UserError raised) by this object (metrics)

    FORMAT_VERSION: int

The fingerprint names what the learned numbers are true of (model file hash, drafter hash,
device, kernel build, arm): costs and acceptance learned on one are wrong for another, so a
store is used only under exactly the fingerprint it was written with. The engine keeps its
stores under platformdirs.user_cache_dir("adaspark")/stores. The state is JSON; Python writes
floats with repr, so every float round-trips bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from adaspark.errors import UserError

FORMAT_VERSION = 1
_log = logging.getLogger(__name__)


def _plain(value):
    """JSON hook for numpy scalars and arrays (exact: tolist() gives Python floats and ints)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False,
                      default=_plain)


class Store:
    """One fingerprinted, atomically written JSON file of learned state."""

    def __init__(self, directory, fingerprint: dict) -> None:
        if not isinstance(fingerprint, dict) or not fingerprint:
            raise UserError("a store fingerprint must be a non-empty dict")
        try:
            key = _canonical(fingerprint)
        except (TypeError, ValueError) as exc:
            raise UserError(f"a store fingerprint must be plain JSON values: {exc}") from None
        self.fingerprint = json.loads(key)
        self.directory = Path(directory)
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        self.path = self.directory / f"store-{digest}.json"
        self.rejection: str | None = None
        self.saves = 0
        self.rejections = 0
        self.save_failures = 0

    def _problem(self) -> tuple[str | None, dict | None]:
        """Why the file on disk cannot be used (None if it can), and its state if it can."""
        try:
            document = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise                       # gone (another process set it aside): nothing to refuse
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return f"it is unreadable ({type(exc).__name__}: {exc})", None
        if not isinstance(document, dict):
            return "it is not a store document", None
        if document.get("format") != FORMAT_VERSION:
            return (f"it has format version {document.get('format')!r}, "
                    f"this build reads {FORMAT_VERSION}"), None
        if document.get("fingerprint") != self.fingerprint:
            return (f"it was written for fingerprint {document.get('fingerprint')!r}, "
                    f"not {self.fingerprint!r}"), None
        if not isinstance(document.get("state"), dict):
            return "it has no state", None
        return None, document["state"]

    def set_aside(self, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.rejected-{stamp}")
        suffix = 1
        while target.exists():
            target = self.path.with_name(f"{self.path.name}.rejected-{stamp}-{suffix}")
            suffix += 1
        try:
            os.replace(self.path, target)
        except FileNotFoundError:       # another process set it aside first
            return
        except OSError as exc:          # refused, and it cannot be moved: say so, not a trace
            raise UserError(f"refused learned store {self.path}: {reason}; it cannot be set "
                            f"aside ({exc.strerror or exc})") from None
        self.rejections += 1
        self.rejection = (f"refused learned store {self.path}: {reason}; "
                          f"set aside as {target.name}, starting from an empty store")
        _log.warning("%s", self.rejection)

    def load(self) -> dict | None:
        try:
            reason, state = self._problem()
        except FileNotFoundError:
            return None
        if reason is not None:
            self.set_aside(reason)
            return None
        return state

    def save(self, state: dict) -> None:
        try:
            self._save(state)
        except UserError:
            self.save_failures += 1
            raise

    def _save(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UserError("a store state must be a dict")
        try:
            text = _canonical({"format": FORMAT_VERSION, "fingerprint": self.fingerprint,
                               "state": state})
        except (TypeError, ValueError) as exc:
            raise UserError(f"learned state cannot be stored as JSON: {exc}") from None
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                reason, _ = self._problem()
            except FileNotFoundError:
                reason = None
            if reason is not None:      # never overwrite a store we could not have read
                self.set_aside(reason)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise UserError(f"cannot write learned store {self.path}: {exc}") from None
        _fsync_directory(self.directory)
        self.saves += 1


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); platforms without directory fds skip it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
