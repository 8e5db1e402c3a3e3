"""How many threads the forward runs on: every core while the machine is otherwise idle, fewer
while other processes keep cores busy.

OpenMP's default waits spin, which is twice as fast as sleeping waits on a quiet machine and a
cliff on a shared one: a parallel region ends only when each of its threads has run, so a
thread that shares its core with another process makes every region wait for the scheduler
(docs/results/busy-neighbour/: plain decode 343 tok/s quiet, 7-14 with one spinning neighbour,
148-152 with OMP_WAIT_POLICY=PASSIVE, which costs 3-4x on a quiet machine). So the decode loops
call `adapt()` between steps: a few times a second it counts the runnable tasks that are not
ours (/proc/stat's procs_running minus our own running threads) and gives the forward the cores
they leave, at least one; a change needs two readings in a row. A row's result does not depend
on the thread count (every row's arithmetic is one fixed sequence on any thread), so this
changes speed only. ADASPARK_THREADS=N pins N threads and turns it off; so does a machine
without /proc.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def procs_running(stat: str | None = None) -> int | None:
    """Runnable tasks on the machine now (Linux /proc/stat), or None where unknown."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return None


def own_running() -> int:
    """This process's threads in state R (running or runnable)."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if stat[stat.rindex(")") + 2] == "R":  # the state follows the parenthesised name
            count += 1
    return count


class Governor:
    """Adapts torch's thread count to the cores other processes leave free, never above the
    count the process started with (`--threads`, OMP_NUM_THREADS or torch's default)."""

    def __init__(self, cores: int | None = None, interval_s: float = 0.25,
                 others: Callable[[], int | None] | None = None,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import torch

        self.cores = cores or min(len(os.sched_getaffinity(0)), torch.get_num_threads())
        self.interval_s = interval_s
        self._others = others or self._others_from_proc
        self._set = set_threads or torch.set_num_threads
        self._clock = clock
        pinned = os.environ.get("ADASPARK_THREADS")
        self.pinned = int(pinned) if pinned else None
        self.threads = self.cores
        if self.pinned is not None:
            self.threads = self.pinned
            self._set(self.pinned)
        self._last = -float("inf")
        self._pending: int | None = None  # the count one reading asked for

    @staticmethod
    def _others_from_proc() -> int | None:
        total = procs_running()
        return None if total is None else max(0, total - own_running())

    def adapt(self) -> int:
        """The thread count for the next step (reads the machine at most every interval_s)."""
        now = self._clock()
        if self.pinned is not None or now - self._last < self.interval_s:
            return self.threads
        self._last = now
        others = self._others()
        if others is None:
            return self.threads
        wanted = max(1, min(self.cores, self.cores - others))
        if wanted == self.threads:
            self._pending = None
        elif self._pending == wanted:  # two readings in a row: a process, not a blip
            self.threads, self._pending = wanted, None
            self._set(wanted)
        else:
            self._pending = wanted
        return self.threads


_governor: Governor | None = None


def adapt() -> int:
    """The process's governor (threads are process-wide): called between decode steps."""
    global _governor
    if _governor is None:
        _governor = Governor()
    return _governor.adapt()
