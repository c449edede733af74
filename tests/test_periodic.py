"""The periodic loop's schedule, miss and jitter accounting against a fake clock, and the machine-state readers on
fake /proc and /sys trees."""

import random

import pytest

from sgl_tts.measure.machine_state import (MachineState, cpufreq_mhz, cpuinfo_mhz, frequency_text,
                                           read_machine_state, thermal_zones_c)
from sgl_tts.measure.periodic import (LoopStats, Period, PeriodicLoop, calibrate_rounds, numeric_work,
                                      periods_between, recovery_s)


class FakeClock:
    def __init__(self, start=100.0):
        self.t = start
        self.sleeps = []

    def __call__(self):
        return self.t

    def sleep(self, seconds):
        assert seconds > 0
        self.sleeps.append(seconds)
        self.t += seconds


def run_loop(durations, period=0.02, start=100.0):
    """The loop's trace on a fake clock whose work takes `durations` in turn (stops when they run out)."""
    clock = FakeClock(start)
    works = iter(durations)
    left = [len(durations)]

    def work():
        clock.t += next(works)
        left[0] -= 1

    trace = []
    PeriodicLoop(period, work, clock, clock.sleep).run(lambda: left[0] > 0, trace.append)
    return trace, clock


def reference_schedule(durations, period, t0):
    """Brute force: step through time period by period; a period runs when the loop reaches it before its
    deadline, at max(release, previous completion), else it is skipped."""
    rows, now, k = [], t0, 0
    for duration in durations:
        while now > t0 + (k + 1) * period:
            rows.append((k, None, None))
            k += 1
        start = max(now, t0 + k * period)
        now = start + duration
        rows.append((k, start, now))
        k += 1
    return rows


def test_loop_runs_on_its_releases_when_work_fits():
    trace, clock = run_loop([0.005] * 5)
    assert [p.index for p in trace] == [0, 1, 2, 3, 4]
    assert [p.started_s for p in trace] == pytest.approx([100 + 0.02 * k for k in range(5)])
    assert not any(p.missed for p in trace)
    assert clock.sleeps == pytest.approx([0.015] * 4)  # it waits for each release, never spins
    stats = LoopStats.of(trace)
    assert (stats.periods, stats.missed, stats.skipped) == (5, 0, 0)
    assert stats.jitter_p99_s == pytest.approx(0.0)


def test_overrun_starts_late_then_skips_stale_periods():
    # period 1 takes 0.05 s: done at 100.07, past period 2's deadline (100.06) -> 2 skipped, 3 starts late
    trace, _ = run_loop([0.005, 0.05, 0.005, 0.005])
    got = [(p.index, p.skipped, p.missed) for p in trace]
    assert got == [(0, False, False), (1, False, True), (2, True, True), (3, False, False), (4, False, False)]
    late = trace[3]
    assert late.started_s == pytest.approx(100.07) and late.released_s == pytest.approx(100.06)
    stats = LoopStats.of(trace)
    assert (stats.missed, stats.skipped) == (2, 1)
    assert stats.worst_late_s == pytest.approx(0.07 - 0.04)


@pytest.mark.parametrize("seed", range(6))
def test_random_traces_match_a_brute_force_schedule(seed):
    rng = random.Random(seed)
    durations = [rng.choice([0.0021, 0.0103, 0.0187, 0.0213, 0.0351, 0.0709]) for _ in range(60)]
    trace, _ = run_loop(durations)
    expected = reference_schedule(durations, 0.02, 100.0)
    assert [(p.index, p.started_s, p.completed_s) for p in trace] == [
        (k, pytest.approx(s) if s is not None else None, pytest.approx(c) if c is not None else None)
        for k, s, c in expected]
    # misses brute force: a skipped period, or a completion past release + period
    missed = sum(s is None or c > (100.0 + k * 0.02) + 0.02 for k, s, c in expected)
    assert LoopStats.of(trace).missed == missed


def synthetic(lateness_ms, period=0.02):
    return [Period(k, k * period, (k + 1) * period, k * period + ms / 1000, k * period + ms / 1000 + 0.0005)
            for k, ms in enumerate(lateness_ms)]


def test_jitter_percentiles_of_a_known_trace():
    stats = LoopStats.of(synthetic(list(range(100))))  # start lateness 0, 1, ..., 99 ms
    assert stats.jitter_p50_s == pytest.approx(0.0495)
    assert stats.jitter_p99_s == pytest.approx(0.09801)  # linear interpolation: 98 + 0.01 ms
    # completions 0.5 ms after their starts: the ones starting 20 ms late or later miss the 20 ms deadline
    assert stats.missed == 100 - 20
    assert LoopStats.of([]).jitter_p50_s is None and LoopStats.of([]).miss_share == 0.0


def brute_recovery(periods, after, run_of):
    later = [p for p in periods if p.released_s >= after]
    for i in range(len(later) - run_of + 1):
        if not any(p.missed for p in later[i:i + run_of]):
            return max(0.0, later[i].released_s - after)
    return None


def test_recovery_matches_brute_force_on_random_traces():
    rng = random.Random(7)
    for _ in range(200):
        ms = [rng.choice([1, 2, 25, 40]) if rng.random() < 0.3 else 1 for _ in range(80)]
        periods = synthetic(ms)
        after = rng.uniform(0, 1.2)
        for run_of in (1, 3, 10):
            assert recovery_s(periods, after, run_of) == brute_recovery(periods, after, run_of)


def test_recovery_cases():
    met, bad = 1, 30
    periods = synthetic([met] * 5 + [bad] * 3 + [met] * 12)
    assert recovery_s(periods, 0.1, run_of=10) == pytest.approx(8 * 0.02 - 0.1)
    assert recovery_s(periods, 0.1, run_of=13) is None  # the trace ends first
    assert recovery_s(periods, 0.15, run_of=10) == pytest.approx(0.01)  # met from its first period on
    assert recovery_s(periods, 0.5, run_of=1) is None  # no period released after the trace
    assert [p.index for p in periods_between(periods, 0.04, 0.09)] == [2, 3, 4]


def test_calibration_hits_the_target_with_a_linear_timer():
    calls = []

    def timed(rounds):
        calls.append(rounds)
        return 2e-6 * rounds + 1e-7

    rounds = calibrate_rounds(0.006, timed)
    assert rounds == pytest.approx(3000, rel=0.01)
    assert calls[:3] == [1, 2, 4]  # doubling up to a quarter of the target
    with pytest.raises(ValueError, match="target_s"):
        calibrate_rounds(0, timed)


def test_numeric_work_is_deterministic():
    assert numeric_work(5)() == numeric_work(5)()
    assert numeric_work(5)() != numeric_work(6)()


# -- machine state ------------------------------------------------------------------------------------------


def test_machine_state_readers_on_fake_trees(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu MHz\t\t: 2596.138\n\nprocessor\t: 1\ncpu MHz\t\t: 1800.5\n")
    sys_cpu = tmp_path / "cpu"
    for cpu, khz in ((0, "2400000\n"), (10, "1200000\n"), (2, "garbage")):
        (sys_cpu / f"cpu{cpu}" / "cpufreq").mkdir(parents=True)
        (sys_cpu / f"cpu{cpu}" / "cpufreq" / "scaling_cur_freq").write_text(khz)
    thermal = tmp_path / "thermal"
    for zone, kind, temp in (("thermal_zone0", "x86_pkg_temp\n", "54000\n"), ("thermal_zone1", "acpitz", "27800"),
                             ("thermal_zone2", "broken", "n/a")):
        (thermal / zone).mkdir(parents=True)
        (thermal / zone / "type").write_text(kind)
        (thermal / zone / "temp").write_text(temp)
    assert cpuinfo_mhz(cpuinfo.read_text()) == [2596.138, 1800.5]
    assert cpufreq_mhz(sys_cpu) == [2400.0, 1200.0]  # numeric CPU order; the unreadable one left out
    assert thermal_zones_c(thermal) == {"x86_pkg_temp": 54.0, "acpitz": 27.8}
    state = read_machine_state(cpuinfo, sys_cpu, thermal, sensors=lambda: {"coretemp/Core 0": 51.0},
                               load=lambda: (1.5, 0.75, 0.25))
    assert state.describe() == ("load 1.50/0.75/0.25; 1800-2596 MHz (cpuinfo, 2 CPUs), 1200-2400 MHz (cpufreq, 2 "
                                "CPUs); temperature x86_pkg_temp 54 C, acpitz 28 C, coretemp/Core 0 51 C")


def test_machine_state_says_what_is_not_exposed(tmp_path):
    state = read_machine_state(tmp_path / "none", tmp_path / "cpu", tmp_path / "thermal", sensors=dict,
                               load=lambda: (0.1, 0.2, 0.3))
    assert state == MachineState((0.1, 0.2, 0.3))
    assert state.describe() == ("load 0.10/0.20/0.30; cpuinfo not exposed, cpufreq not exposed; "
                                "temperature not exposed")
    assert frequency_text([2000.2, 2000.4], "cpuinfo") == "2000 MHz (cpuinfo, 2 CPUs)"
