"""The thread governor: the cores other processes keep busy (a time average), two readings to
change, pinned by env."""

from __future__ import annotations

from adaspark import threads


class Machine:
    """Other processes' busy cores by reading, a clock, and the thread counts set."""

    def __init__(self, others):
        self.others, self.now, self.set = list(others), 0.0, []

    def reading(self):
        return self.others.pop(0)

    def governor(self, cores=2, cpus=None):
        return threads.Governor(cores=cores, interval_s=0.25, others=self.reading,
                                set_threads=self.set.append, clock=lambda: self.now,
                                cpus=cpus or cores)

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


def test_a_light_neighbour_keeps_every_core_and_half_a_core_takes_one(monkeypatch):
    """A client reading our stream is runnable whenever we look but busy a tenth of a core:
    it takes nothing; from half a core on, a neighbour takes one."""
    monkeypatch.delenv("ADASPARK_THREADS", raising=False)
    m = Machine([0.1, 0.3, 0.45, 0.2, 0.5, 0.7, 0.9])
    g = m.governor()
    assert [m.step(g) for _ in range(7)] == [2, 2, 2, 2, 2, 1, 1] and m.set == [1]


def test_the_others_take_cores_from_the_machine_not_from_our_threads(monkeypatch):
    """Two threads on a machine of four CPUs: one or two busy cores elsewhere leave both of
    ours; three leave one."""
    monkeypatch.delenv("ADASPARK_THREADS", raising=False)
    m = Machine([1.0, 2.0, 2.2, 3.0, 3.1, 0.0, 0.0])
    g = m.governor(cores=2, cpus=4)
    assert [m.step(g) for _ in range(7)] == [2, 2, 2, 2, 1, 1, 2] and m.set == [1, 2]


def test_the_proc_readings_parse():
    stat = "cpu  100 5 20 900 30 2 3 40 0 0\ncpu0 50 2 10 450 15 1 1 20 0 0\n"
    assert threads.busy_ticks(stat) == 100 + 5 + 20 + 2 + 3  # not idle, iowait or steal
    assert threads.busy_ticks("cpu0 1 2 3\n") is None
    assert threads.busy_ticks() > 0  # this machine's /proc/stat


def test_other_load_is_the_machine_busy_time_less_ours_over_the_wall_time():
    # ticks at 100 Hz: in one second the machine was busy 150 ticks, 100 of them ours
    readings = iter([(1000, 2.0, 10.0), (1150, 3.0, 11.0), (1160, 3.1, 11.0), (1200, 3.6, 12.0)])
    now = {}

    def busy():
        now["busy"], now["own"], now["t"] = next(readings)
        return now["busy"]

    load = threads.OtherLoad(busy=busy, own_s=lambda: now["own"], clock=lambda: now["t"],
                             hz=100)
    assert load() is None  # no interval yet
    assert abs(load() - 0.5) < 1e-9
    assert load() is None  # no wall time passed
    assert load() == 0.0  # ours exceeds the machine's by rounding of ticks: never negative


def test_other_load_without_proc_reads_nothing(monkeypatch):
    """No /proc/stat (not Linux): no reading, and no call to sysconf, which such a machine may
    not have."""
    def no_sysconf(name):
        raise AttributeError("no sysconf here")

    monkeypatch.setattr(threads.os, "sysconf", no_sysconf)
    load = threads.OtherLoad(busy=lambda: None)
    assert load() is None and load() is None
