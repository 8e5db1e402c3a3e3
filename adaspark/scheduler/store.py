"""The learned store: everything that must outlive a request, one file per fingerprint.

API (stable):

    Store(directory, fingerprint: dict)
        .path -> pathlib.Path            the file for this fingerprint inside `directory`
        .load() -> dict | None           the saved state, or None when there is none or it was
                                         refused (another fingerprint, another format version,
                                         unreadable, corrupt): a refused file is renamed to
                                         `<name>.rejected-<timestamp>`, never used, never
                                         overwritten by a save, and .rejection says why
        .update(merge) -> dict           load, merge, save as one step under the directory's
                                         lock: merge(state on disk or None) -> the state to
                                         write (so two writers never lose each other's work);
                                         merge raises Unusable for a state it cannot read
                                         (another scheduler version): that file is set aside
                                         as load() sets one aside, and merge(None) is written
        .save(state: dict) -> None       update() that writes `state` whatever is on disk
        .set_aside(reason: str, kind="rejected") -> None
                                         move the file on disk out of the way (refused as
                                         load() refuses one, or "replaced": `--fresh`)
        .rejection -> str | None         the message of the last refusal
        .saves, .rejections, .save_failures -> int
                                         saves done, files refused and saves that failed (what
                                         they raised re-raised) by this object (metrics)

    FORMAT_VERSION: int
    Unusable(reason)                     raised by a merge: the state on disk is not its to read

The fingerprint names what the learned numbers are true of (model file hash, drafter hash,
device, kernel build, arm): costs and acceptance learned on one are wrong for another, so a
store is used only under exactly the fingerprint it was written with. The engine keeps its
stores under platformdirs.user_cache_dir("adaspark")/stores. The state is JSON; Python writes
floats with repr, so every float round-trips bit for bit.

Several processes may share a directory (two servers, two containers on one volume): every
read-merge-write holds an advisory lock (flock on `.<name>.lock` beside the file), and each
write goes to a temporary file of its own (mkstemp: unique across hosts and PID namespaces,
where two containers are both PID 1) renamed into place. A save is write, fsync, rename, fsync
the directory, so a crash at any point leaves the old store. Files set aside are bounded: each
Store object sets aside at most one file of a kind (a later one replaces its own earlier one:
the newest of another writer's states), and at most KEEP_SET_ASIDE of a kind stay beside the
store (the oldest go).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from adaspark.errors import UserError

FORMAT_VERSION = 1
KEEP_SET_ASIDE = 3  # files of one kind ("rejected", "replaced") kept beside a store
_log = logging.getLogger(__name__)


class Unusable(Exception):
    """A merge's refusal of the state on disk (the reason): it is set aside, never merged."""


def _plain(value):
    """JSON hook for numpy scalars and arrays (exact: tolist() gives Python floats and ints)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False,
                      default=_plain)


def plain_json(value):
    """`value` as the store would read it back (numpy as lists, tuples as lists)."""
    return json.loads(_canonical(value))


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
        self.lock_path = self.directory / f".{self.path.name}.lock"
        self.rejection: str | None = None
        self.saves = 0
        self.rejections = 0
        self.save_failures = 0
        self._set_aside: dict[str, Path] = {}  # kind -> the file this object set aside

    @contextlib.contextmanager
    def _locked(self, create: bool = True) -> Iterator[None]:
        """The directory's lock for this store, held meanwhile (released when its fd closes,
        also when the process dies). create=False (a load): where no lock file can be made (no
        directory yet, a read-only one) the load reads without it, as a reader always could."""
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            if create:
                raise
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:  # a filesystem without locks (some network mounts)
                _log.warning("learned store %s: no lock (%s); two writers may lose each "
                             "other's saves", self.path, exc.strerror or exc)
            yield
        finally:
            os.close(fd)

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

    def set_aside(self, reason: str, kind: str = "rejected") -> None:
        """Move the file on disk to `<name>.<kind>-<timestamp>` (kind "rejected": refused for
        `reason`; "replaced": `--fresh` starts over); a file this object set aside before is
        replaced (the newest of a writer's states stands for it), and beyond KEEP_SET_ASIDE of
        a kind the oldest go."""
        try:
            with self._locked(create=False):
                self._move_aside(reason, kind)
        except OSError as exc:
            raise UserError(f"learned store {self.path} cannot be set aside: {exc}") from None

    def _move_aside(self, reason: str, kind: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        target = self._set_aside.get(kind)
        if target is None or not target.exists():
            target = self.path.with_name(f"{self.path.name}.{kind}-{stamp}")
            suffix = 1
            while target.exists():
                target = self.path.with_name(f"{self.path.name}.{kind}-{stamp}-{suffix}")
                suffix += 1
        try:
            os.replace(self.path, target)
        except FileNotFoundError:       # another process set it aside first
            return
        except OSError as exc:          # refused, and it cannot be moved: say so, not a trace
            raise UserError(f"refused learned store {self.path}: {reason}; it cannot be set "
                            f"aside ({exc.strerror or exc})") from None
        self._set_aside[kind] = target
        self._prune(kind)
        if kind != "rejected":
            _log.warning("learned store %s %s: set aside as %s", self.path, reason, target.name)
            return
        self.rejections += 1
        self.rejection = (f"refused learned store {self.path}: {reason}; "
                          f"set aside as {target.name}, starting from an empty store")
        _log.warning("%s", self.rejection)

    def _prune(self, kind: str) -> None:
        """Keep the newest KEEP_SET_ASIDE files of `kind` (by when they were set aside); a
        file another process removes meanwhile is no error."""
        def set_aside_at(path: Path) -> float:
            try:
                return path.stat().st_mtime
            except OSError:
                return -1.0

        kept = sorted(self.directory.glob(f"{self.path.name}.{kind}-*"),
                      key=lambda p: (set_aside_at(p), p.name))
        for old in kept[:-KEEP_SET_ASIDE]:
            with contextlib.suppress(OSError):
                old.unlink()

    def load(self) -> dict | None:
        with self._locked(create=False):
            return self._read()

    def _read(self) -> dict | None:
        """The usable state on disk, or None (a refused file is set aside); under the lock."""
        try:
            reason, state = self._problem()
        except FileNotFoundError:
            return None
        if reason is not None:
            self._move_aside(reason, "rejected")
            return None
        return state

    def save(self, state: dict) -> None:
        self.update(lambda _on_disk: state)

    def update(self, merge: Callable[[dict | None], dict]) -> dict:
        """merge(the state on disk, or None) written as the new state, all under the lock, so
        no other writer's save lands in between; returns what was written. Whatever it raises
        (the store's UserError, or a bug in `merge`) is a failed save, counted here."""
        try:
            return self._update(merge)
        except Exception:
            self.save_failures += 1
            raise

    def _update(self, merge: Callable[[dict | None], dict]) -> dict:
        try:
            with self._locked():
                try:
                    state = merge(self._read())  # a file it cannot read is set aside
                except Unusable as why:
                    self._move_aside(str(why), "rejected")
                    state = merge(None)
                self._write(state)
        except OSError as exc:
            raise UserError(f"cannot write learned store {self.path}: {exc}") from None
        self.saves += 1
        return state

    def _write(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UserError("a store state must be a dict")
        try:
            text = _canonical({"format": FORMAT_VERSION, "fingerprint": self.fingerprint,
                               "state": state})
        except (TypeError, ValueError) as exc:
            raise UserError(f"learned state cannot be stored as JSON: {exc}") from None
        fd, name = tempfile.mkstemp(prefix=f".{self.path.name}.tmp-", dir=self.directory)
        tmp = Path(name)
        try:
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the store from its other users
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        _fsync_directory(self.directory)


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
