"""Where an engine step's wall time goes: an exclusive split of each step into parts, for the
step breakdown benchmark (benchmarks/step_breakdown.py).

A step is a root (the server's EngineWorker._serve_once: waiting for work, admission, the
batch's step, the finished requests' results); inside it, each timed method is a phase, and
phases nest (a take inside the verify's host work, the drafter's forward inside a plan). Every
interval between two clock readings goes to exactly one part, the innermost phase open then,
and consecutive intervals share their readings, so a step's parts sum to its wall exactly (up
to float rounding), whatever nests in what.

Nothing here is on the engine's hot path until install() wraps the named methods (only the
benchmark's server process calls it); uninstall() puts the originals back. A wrapped method
called on a thread with no step open (the event loop, a test) runs as it would unwrapped, but
for one thread-local look-up.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepRecord:
    """One step: when it began, its wall seconds, each part's seconds (summing to wall) and
    what the step ran (info: running, prefilling and waiting requests, ...)."""

    start: float
    wall: float
    parts: dict[str, float]
    info: dict[str, Any] = field(default_factory=dict)


class StepClock:
    """Exclusive part times of the steps that run on any thread (each its own stack)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.steps: list[StepRecord] = []
        self.events: list[tuple[str, float, dict]] = []  # (what, when, details): admissions
        self._local = threading.local()
        self._installed: list[tuple[Any, str, Any]] = []

    # ----- the accounting ------------------------------------------------------------------
    def _mark(self, now: float) -> None:
        state = self._local
        parts = state.record.parts
        part = state.stack[-1]
        parts[part] = parts.get(part, 0.0) + (now - state.last)
        state.last = now

    @property
    def open(self) -> bool:
        """Whether a step is open on this thread."""
        return getattr(self._local, "record", None) is not None

    @contextmanager
    def step(self, part: str) -> Iterator[StepRecord]:
        """A step (its own time, outside any phase, goes to `part`)."""
        if self.open:
            with self.phase(part):
                yield self._local.record
            return
        state, now = self._local, self.clock()
        state.record, state.stack, state.last = StepRecord(now, 0.0, {}), [part], now
        try:
            yield state.record
        finally:
            end = self.clock()
            self._mark(end)
            record, state.record = state.record, None
            record.wall = end - record.start
            self.steps.append(record)

    @contextmanager
    def phase(self, part: str) -> Iterator[None]:
        """A part of the open step (nothing where none is open on this thread)."""
        if not self.open:
            yield
            return
        state = self._local
        self._mark(self.clock())
        state.stack.append(part)
        try:
            yield
        finally:
            self._mark(self.clock())
            state.stack.pop()

    def note(self, **info: Any) -> None:
        """Details of the open step (none open: nothing)."""
        if self.open:
            self._local.record.info.update(info)

    def event(self, what: str, **details: Any) -> None:
        self.events.append((what, self.clock(), details))

    # ----- installing ----------------------------------------------------------------------
    def wrap(self, owner: Any, name: str, part: str, root: bool = False,
             before: Callable[..., None] | None = None,
             after: Callable[..., None] | None = None) -> None:
        """Time owner.name as `part` (root: as a step of its own where none is open);
        before(*args, **kwargs) runs first, inside it (to note what the step runs), and
        after(result, *args, **kwargs) last (to note what it did)."""
        inner = getattr(owner, name)
        enter = self.step if root else self.phase

        def timed(*args: Any, **kwargs: Any) -> Any:
            with enter(part):
                if before is not None:
                    before(*args, **kwargs)
                result = inner(*args, **kwargs)
                if after is not None:
                    after(result, *args, **kwargs)
                return result

        timed.__wrapped__ = inner
        self._installed.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, timed)

    def install(self, parts: list[tuple[str, str, str, str]]) -> None:
        """wrap() each (module, class, method, part) of `parts`."""
        for module, cls, name, part in parts:
            self.wrap(getattr(importlib.import_module(module), cls), name, part)

    def uninstall(self) -> None:
        """Put every wrapped method back as it was."""
        while self._installed:
            owner, name, original = self._installed.pop()
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


_ABSENT = object()
