"""benchmarks/arrivals.py: the seeded Poisson schedule and the open-loop dispatcher."""

from __future__ import annotations

import math
import statistics
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import arrivals  # noqa: E402

# A count or a statistic within this many standard deviations of its expectation: a false
# failure is then a five-sigma event (about 6e-7), and the seeds are fixed anyway.
SIGMAS = 5


class FakeClock:
    """Time that moves only when the dispatcher sleeps (by `overshoot` more, once, if set)."""

    def __init__(self, overshoot: float = 0.0):
        self.t = 0.0
        self.overshoot = overshoot
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds + self.overshoot
        self.overshoot = 0.0


def test_the_schedule_is_reproducible_from_its_seed():
    first = arrivals.poisson_arrivals(50, 2.0, seed=7)
    assert first == arrivals.poisson_arrivals(50, 2.0, seed=7)
    assert first != arrivals.poisson_arrivals(50, 2.0, seed=8)
    assert len(first) == 50 and first[0] == 0.0
    assert all(b > a for a, b in zip(first, first[1:], strict=False))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_the_number_of_arrivals_in_a_window_is_poisson_at_the_rate_asked(seed, rate):
    # after the arrival at 0, the arrivals in (0, T] are Poisson with mean and variance rate * T
    horizon = 20000 / rate  # 20000 expected arrivals: a standard deviation of about 141, so
    # five of them are 3.5% of the count: a rate 5% off fails
    expected = rate * horizon
    times = arrivals.poisson_arrivals(int(expected + 20 * math.sqrt(expected)), rate, seed)
    assert times[-1] > horizon  # the schedule covers the window
    count = sum(1 for t in times if 0 < t <= horizon)
    assert abs(count - expected) <= SIGMAS * math.sqrt(expected)


@pytest.mark.parametrize("seed", range(3))
def test_arrivals_are_as_dispersed_as_a_poisson_process(seed):
    # evenly spaced arrivals have the right mean rate too; a Poisson process's counts in equal
    # windows have variance equal to their mean: (k - 1) var / mean is about chi-square with
    # k - 1 degrees of freedom, so var / mean is 1 with a standard deviation of sqrt(2 / (k - 1))
    rate, windows = 4.0, 2000
    expected = rate * windows
    times = arrivals.poisson_arrivals(int(expected + 20 * math.sqrt(expected)), rate, seed)
    counts = [0] * windows
    for t in times:
        if 0 < t < windows:
            counts[int(t)] += 1
    dispersion = statistics.variance(counts) / statistics.mean(counts)
    assert abs(dispersion - 1) <= SIGMAS * math.sqrt(2 / (windows - 1))


def test_a_schedule_needs_a_request_and_a_positive_rate():
    with pytest.raises(ValueError, match="count"):
        arrivals.poisson_arrivals(0, 1.0, 0)
    with pytest.raises(ValueError, match="rate"):
        arrivals.poisson_arrivals(3, 0.0, 0)


def test_arrivals_do_not_wait_for_replies():
    # a server so slow that no reply comes before the last request has been sent: a dispatcher
    # that waited for any reply would never send the last one (the replies time out instead)
    offsets = [0.0, 0.5, 1.25, 3.0]
    clock = FakeClock()
    last_sent = threading.Event()

    def send(i: int) -> str:
        if i == len(offsets) - 1:
            last_sent.set()
        if not last_sent.wait(timeout=60):
            raise TimeoutError(f"request {i}: the last arrival was never sent")
        return f"reply {i}"

    replies, spans, _ = arrivals.run_arrivals(offsets, send, clock=clock.now, sleep=clock.sleep)
    assert replies == [f"reply {i}" for i in range(len(offsets))]
    assert [sent for sent, _ in spans] == offsets  # each sent at its own time
    assert clock.sleeps == pytest.approx([0.5, 0.75, 1.75])


def test_a_late_dispatch_does_not_shift_the_arrivals_after_it():
    # the host woke the dispatcher 1.1 s late: the overdue arrival goes at once, the next at its
    # own time, not at its gap after the late one
    clock = FakeClock(overshoot=1.1)
    offsets = [0.0, 0.5, 1.0, 3.0]
    _, spans, _ = arrivals.run_arrivals(offsets, lambda i: i, clock=clock.now,
                                        sleep=clock.sleep)
    assert [sent for sent, _ in spans] == pytest.approx([0.0, 1.6, 1.6, 3.0])


def test_a_failed_request_is_none_and_the_others_go_on(capsys):
    def send(i: int) -> int:
        if i == 1:
            raise RuntimeError("HTTP 500")
        return i * 10

    clock = FakeClock()
    replies, spans, wall = arrivals.run_arrivals([0.0, 1.0, 2.0], send, clock=clock.now,
                                                 sleep=clock.sleep)
    assert replies == [0, None, 20]
    assert len(spans) == 3 and wall == 2.0
    assert "request 1 failed: HTTP 500" in capsys.readouterr().err


def test_mean_in_flight_is_the_requests_time_over_the_wall():
    # 2 s + 3 s + 1 s of requests over 4 s of wall: 1.5 in flight on average
    assert arrivals.mean_in_flight([(0.0, 2.0), (0.5, 3.5), (3.0, 4.0)], 4.0) == 1.5
    assert arrivals.mean_in_flight([], 0.0) == 0.0
