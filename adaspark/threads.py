"""How many threads the forward runs on: every core while the machine is otherwise idle, fewer
while other processes keep cores busy.

OpenMP's default waits spin, which is twice as fast as sleeping waits on a quiet machine and a
cliff on a shared one: a parallel region ends only when each of its threads has run, so a
thread that shares its core with another process makes every region wait for the scheduler
(docs/results/busy-neighbour/: plain decode 343 tok/s quiet, 7-14 with one spinning neighbour,
148-152 with OMP_WAIT_POLICY=PASSIVE, which costs 3-4x on a quiet machine). So the decode loops
call `adapt()` between steps: a few times a second it reads how many cores other processes kept
busy since the last reading (the machine's busy CPU time in /proc/stat less this process's, over
the wall time between) and gives the forward the cores they leave, at least one: a neighbour
busy half a core or more takes one; a change needs two readings in a row. A time average, not a
count of the tasks runnable at the instant of the reading: a light process that wakes with our
steps (a client reading the tokens we stream) is runnable whenever we look, and a count made
the server run on one thread of two (docs/results/zen3-s20/). A row's result does not depend
on the thread count (every row's arithmetic is one fixed sequence on any thread), so this
changes speed only. ADASPARK_THREADS=N pins N threads and turns it off; so does a machine
without /proc.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path


def busy_ticks(stat: str | None = None) -> int | None:
    """The machine's CPU time spent busy since boot, in clock ticks (/proc/stat's first line:
    user, nice, system, irq and softirq; guest time is inside user; idle, iowait and the time
    a hypervisor stole are not busy), or None where unknown."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:8]]
            if len(fields) < 7:
                return None
            user, nice, system, _idle, _iowait, irq, softirq = fields
            return user + nice + system + irq + softirq
    return None


class OtherLoad:
    """Cores other processes kept busy since the previous call: the machine's busy ticks less
    this process's (os.times: every thread of ours), over the ticks of wall time between. None
    at the first call (no interval yet), or where /proc is missing."""

    def __init__(self, busy: Callable[[], int | None] = busy_ticks,
                 own_s: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.monotonic, hz: int | None = None) -> None:
        self._busy, self._clock = busy, clock
        self._own_s = own_s or (lambda: (lambda t: t.user + t.system)(os.times()))
        self.hz = hz  # ticks a second: read from the OS at the first reading with a /proc
        self._last: tuple[int, float, float] | None = None

    def __call__(self) -> float | None:
        busy = self._busy()
        if busy is None:  # no /proc (and maybe no sysconf): nothing to read
            return None
        self.hz = self.hz or os.sysconf("SC_CLK_TCK")
        now = (busy, self._own_s() * self.hz, self._clock())
        last, self._last = self._last, now
        if last is None or now[2] <= last[2]:
            return None
        others = (now[0] - last[0]) - (now[1] - last[1])
        return max(0.0, others / ((now[2] - last[2]) * self.hz))


class Governor:
    """Adapts torch's thread count to the cores other processes leave free, never above the
    count the process started with (`--threads`, OMP_NUM_THREADS or torch's default). cpus:
    the machine's (what /proc/stat's busy time is spread over): the others take cores from
    them, not from our threads, so on 8 CPUs our 2 threads keep both beside 5 busy cores."""

    def __init__(self, cores: int | None = None, interval_s: float = 0.25,
                 others: Callable[[], float | None] | None = None,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, cpus: int | None = None) -> None:
        import torch

        self.cores = cores or min(len(os.sched_getaffinity(0)), torch.get_num_threads())
        self.cpus = max(cpus or os.cpu_count() or self.cores, self.cores)
        self.interval_s = interval_s
        self._others = others or OtherLoad()
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

    def adapt(self) -> int:
        """The thread count for the next step (reads the machine at most every interval_s)."""
        now = self._clock()
        if self.pinned is not None or now - self._last < self.interval_s:
            return self.threads
        self._last = now
        others = self._others()
        if others is None:
            return self.threads
        taken = math.floor(others + 0.5)  # cores the others keep busy: half a core takes one
        wanted = max(1, min(self.cores, self.cpus - taken))
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
