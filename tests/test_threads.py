"""The thread governor: the cores other processes leave, two readings to change, pinned by env."""

from __future__ import annotations

from adaspark import threads


class Machine:
    """Other processes' runnable count by reading, a clock, and the thread counts set."""

    def __init__(self, others):
        self.others, self.now, self.set = list(others), 0.0, []

    def reading(self):
        return self.others.pop(0)

    def governor(self, cores=2):
        return threads.Governor(cores=cores, interval_s=0.25, others=self.reading,
                                set_threads=self.set.append, clock=lambda: self.now)

    def step(self, g, dt=0.3):
        self.now += dt
        return g.adapt()


def test_a_busy_neighbour_takes_a_core_after_two_readings_and_gives_it_back(monkeypatch):
    monkeypatch.delenv("ADASPARK_THREADS", raising=False)
    m = Machine([0, 1, 1, 1, 0, 0])
    g = m.governor()
    assert [m.step(g) for _ in range(6)] == [2, 2, 1, 1, 1, 2]
    assert m.set == [1, 2]


def test_a_blip_changes_nothing(monkeypatch):
    monkeypatch.delenv("ADASPARK_THREADS", raising=False)
    m = Machine([1, 0, 1, 0, 2, 0])
    g = m.governor()
    assert [m.step(g) for _ in range(6)] == [2] * 6 and m.set == []


def test_readings_are_rate_limited_and_never_below_one_or_above_the_start(monkeypatch):
    monkeypatch.delenv("ADASPARK_THREADS", raising=False)
    m = Machine([5, 5, 0, 0])
    g = m.governor(cores=4)
    assert m.step(g) == 4 and m.step(g, dt=0.01) == 4  # the second call reads nothing
    assert m.step(g) == 1  # 5 others on 4 cores: one thread, not zero
    assert [m.step(g), m.step(g)] == [1, 4]
    assert m.others == []


def test_threads_pinned_by_the_environment(monkeypatch):
    monkeypatch.setenv("ADASPARK_THREADS", "1")
    m = Machine([0, 0, 3, 3])
    g = m.governor(cores=2)
    assert [m.step(g) for _ in range(4)] == [1] * 4 and m.set == [1]
    assert len(m.others) == 4  # never read


def test_without_proc_it_keeps_its_count(monkeypatch):
    monkeypatch.delenv("ADASPARK_THREADS", raising=False)
    m = Machine([None, None])
    g = m.governor()
    assert [m.step(g), m.step(g)] == [2, 2]


def test_the_proc_readings_parse():
    assert threads.procs_running("cpu 1 2 3\nprocs_running 3\nprocs_blocked 0\n") == 3
    assert threads.procs_running("cpu 1 2 3\n") is None
    assert threads.own_running() >= 1  # this thread, reading
