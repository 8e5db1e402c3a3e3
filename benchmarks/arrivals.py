"""Open-loop arrivals for benchmarks/concurrency.py: a seeded Poisson schedule, and a dispatcher
that sends each request at its time whether or not earlier replies have come.

Closed-loop clients ask again the moment a reply ends, so a slow server slows its own load and
capped replies that end together bring their next prompts together. Here the arrival times are
fixed before the run (the same for every arm: same seed, same rate), and a request still running
when the next one is due does not hold it back.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def poisson_arrivals(count: int, rate_per_s: float, seed: int) -> list[float]:
    """`count` arrival times in seconds, the first at 0 and then exponential gaps of mean
    1 / rate_per_s drawn from `seed`: a Poisson process of that rate, started at an arrival
    (memoryless, so the later arrivals are still Poisson). The same arguments give the same
    times."""
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    if not rate_per_s > 0:
        raise ValueError(f"the rate must be positive, not {rate_per_s}")
    draw = random.Random(seed)
    times, now = [0.0], 0.0
    for _ in range(count - 1):
        now += draw.expovariate(rate_per_s)
        times.append(now)
    return times


def run_arrivals(
    offsets: Sequence[float], send: Callable[[int], T],
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[T | None], list[tuple[float, float]], float]:
    """send(i) for each i at offsets[i] seconds after the start, each on its own thread (open
    loop: nothing waits for a reply before the next arrival is due). A dispatch that comes late
    (a busy host) does not shift the ones after it: each is due at its own absolute time.

    Returns each request's result (None: send raised, reported on stderr and left out as the
    closed-loop clients leave it out), its (sent, done) seconds since the start, and the wall
    seconds from the start to the last reply."""
    results: list[T | None] = [None] * len(offsets)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(offsets)
    start = clock()

    def one(i: int, sent: float) -> None:
        try:
            results[i] = send(i)
        except Exception as err:  # counted as a failure, the others go on
            print(f"  request {i} failed: {err}", file=sys.stderr)
        spans[i] = (sent, clock() - start)

    threads = []
    for i, offset in enumerate(offsets):
        wait = start + offset - clock()
        if wait > 0:
            sleep(wait)
        # the send time is taken here, not in the thread, so it is when the request was let go
        thread = threading.Thread(target=one, args=(i, clock() - start))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return results, spans, clock() - start


def mean_in_flight(spans: Sequence[tuple[float, float]], wall_s: float) -> float:
    """The mean number of requests in flight over the wall time: the sum of every request's
    time from sent to done over the wall (Little's law), failed ones included (they held the
    server too)."""
    return sum(done - sent for sent, done in spans) / wall_s if wall_s > 0 else 0.0
