"""A periodic workload beside inference: a fixed-rate control loop with a deadline each period.

Period k is released at t0 + k·P and must complete by its deadline, the next release t0 + (k+1)·P. The loop
starts a period at its release, or late, at once, when the previous one overran; a period whose deadline has
already passed when the loop comes to it is skipped (recorded, not run: a control loop drops a stale
period rather than run behind for ever). Each period does the same numeric work (`numeric_work`), sized once
at start (`calibrate_rounds`) to take a set fraction of the period on an idle core.

Per period the loop records its release, start and completion (`Period`); `LoopStats` turns a trace into the
figures the coexist bench reports: deadline misses (late completions plus skipped periods), release jitter
(start − release, p50/p99) and `recovery_s`, the time from an event (a cancel) until the loop meets its
deadlines again. `LoopProcess` runs the loop in a process of its own (`multiprocessing`, spawned), on
`time.monotonic`, the clock every process of the machine shares, so its trace can be cut by the parent's
times.

The loop and its accounting are pure: `PeriodicLoop` takes its clock, sleep and work, so tests drive it with a
fake clock.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

PERIOD_S = 0.02  # 50 Hz
WORK_FRACTION = 0.3  # of the period, on an idle core
RECOVERED_AFTER = 10  # consecutive deadlines met that count as recovered (0.2 s at 50 Hz)


@dataclass(frozen=True)
class Period:
    """One period of the loop: released at `released_s`, due at `deadline_s`; `started_s`/`completed_s` None when
    it was skipped (its deadline had passed before the loop could start it)."""

    index: int
    released_s: float
    deadline_s: float
    started_s: float | None
    completed_s: float | None

    @property
    def skipped(self) -> bool:
        return self.started_s is None

    @property
    def missed(self) -> bool:
        return self.completed_s is None or self.completed_s > self.deadline_s

    def as_tuple(self) -> tuple:
        return (self.index, self.released_s, self.deadline_s, self.started_s, self.completed_s)


class PeriodicLoop:
    """Run `work` every `period_s` (see the module docstring) on `clock`, waiting with `sleep(seconds)`."""

    def __init__(self, period_s: float, work: Callable[[], object], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] = time.sleep):
        if not period_s > 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.period_s, self.work, self.clock, self.sleep = period_s, work, clock, sleep

    def run(self, keep_going: Callable[[], bool], on_period: Callable[[Period], object]) -> None:
        """Periods until `keep_going()` is false (asked before each one); `on_period` gets every period, run or
        skipped, in order."""
        period = self.period_s
        t0 = self.clock()
        k = 0
        while keep_going():
            now = self.clock()
            while now > t0 + (k + 1) * period:  # this period's deadline has passed: skipped, not run
                on_period(Period(k, t0 + k * period, t0 + (k + 1) * period, None, None))
                k += 1
            released = t0 + k * period
            if now < released:
                self.sleep(released - now)
            started = self.clock()
            self.work()
            on_period(Period(k, released, released + period, started, self.clock()))
            k += 1


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's default); None
    for no values."""
    if not values:
        return None
    import numpy

    return float(numpy.percentile(numpy.asarray(values, dtype=float), q))


@dataclass(frozen=True)
class LoopStats:
    """A trace's figures: periods due, missed (late or skipped), skipped, release jitter p50/p99 (start −
    release of the periods that ran) and the worst completion's lateness past its deadline."""

    periods: int
    missed: int
    skipped: int
    jitter_p50_s: float | None
    jitter_p99_s: float | None
    worst_late_s: float

    @property
    def miss_share(self) -> float:
        return self.missed / self.periods if self.periods else 0.0

    @classmethod
    def of(cls, periods: Sequence[Period]) -> "LoopStats":
        ran = [p for p in periods if not p.skipped]
        jitter = [p.started_s - p.released_s for p in ran]
        late = [p.completed_s - p.deadline_s for p in ran]
        return cls(len(periods), sum(p.missed for p in periods), len(periods) - len(ran), percentile(jitter, 50),
                   percentile(jitter, 99), max([0.0, *late]))


def periods_between(periods: Sequence[Period], begin_s: float, end_s: float) -> list[Period]:
    """The periods released in [begin_s, end_s)."""
    return [p for p in periods if begin_s <= p.released_s < end_s]


def recovery_s(periods: Sequence[Period], after_s: float, run_of: int = RECOVERED_AFTER) -> float | None:
    """Seconds from `after_s` until the loop meets its deadlines again: to the release of the first of the
    first `run_of` consecutive met periods among those released from `after_s` on (0 when the loop met them
    from the start); None when the trace ends before such a run."""
    later = sorted((p for p in periods if p.released_s >= after_s), key=lambda p: p.index)
    streak = 0
    for position, period in enumerate(later):
        streak = 0 if period.missed else streak + 1
        if streak == run_of:
            return max(0.0, later[position - run_of + 1].released_s - after_s)
    return None


def numeric_work(rounds: int, size: int = 48, seed: int = 0) -> Callable[[], float]:
    """A fixed amount of numeric work: `rounds` products of a `size`×`size` matrix with a vector, renormalised
    (a stand-in for a controller's state update); returns the function doing it once."""
    import numpy

    rng = numpy.random.default_rng(seed)
    matrix = rng.standard_normal((size, size)) / math.sqrt(size)
    state = rng.standard_normal(size)

    def work() -> float:
        nonlocal state
        for _ in range(rounds):
            state = matrix @ state
            state /= numpy.linalg.norm(state) + 1e-12
        return float(state[0])

    return work


def calibrate_rounds(target_s: float, timed: Callable[[int], float], trials: int = 5,
                     max_rounds: int = 10_000_000) -> int:
    """The rounds of work that take `target_s`: `timed(rounds)` returns the seconds `rounds` take; rounds double
    until one timing reaches a quarter of the target, then the fastest of `trials` timings at that size sets the
    rate (the idle-core rate: a timing another process interrupted is only slower). At least 1."""
    if not target_s > 0:
        raise ValueError(f"target_s must be positive, got {target_s}")
    rounds = 1
    while timed(rounds) < target_s / 4 and rounds < max_rounds:
        rounds *= 2
    per_round = min(timed(rounds) for _ in range(trials)) / rounds
    return max(1, min(max_rounds, round(target_s / per_round))) if per_round > 0 else max_rounds


def timer_of(work_of: Callable[[int], Callable[[], object]],
             clock: Callable[[], float] = time.perf_counter) -> Callable[[int], float]:
    """`timed(rounds)` for `calibrate_rounds`: the seconds one call of `work_of(rounds)` takes."""

    def timed(rounds: int) -> float:
        work = work_of(rounds)
        began = clock()
        work()
        return clock() - began

    return timed


# -- the loop in a process of its own --------------------------------------------------------------------------


def _loop_main(connection, period_s: float, fraction: float, stop) -> None:
    """The loop process: calibrate, report the rounds, run until `stop` is set, then send the trace."""
    rounds = calibrate_rounds(fraction * period_s, timer_of(numeric_work))
    work = numeric_work(rounds)
    connection.send({"rounds": rounds, "work_s": statistics.median(timer_of(lambda _: work)(0) for _ in range(9))})
    trace: list[tuple] = []
    PeriodicLoop(period_s, work).run(lambda: not stop.is_set(), lambda p: trace.append(p.as_tuple()))
    connection.send(trace)
    connection.close()


class LoopProcess:
    """`with LoopProcess() as loop:` the 50 Hz loop running in its own process; `loop.pid` for its CPU use,
    `loop.calibration` (rounds per period and the seconds they took on start), and after the block `loop.trace`
    (every `Period`)."""

    def __init__(self, period_s: float = PERIOD_S, fraction: float = WORK_FRACTION, start_timeout_s: float = 120):
        self.period_s, self.fraction, self.start_timeout_s = period_s, fraction, start_timeout_s
        self.trace: list[Period] = []
        self.calibration: dict[str, float] = {}

    def __enter__(self) -> "LoopProcess":
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_loop_main, args=(send, self.period_s, self.fraction, self._stop),
                                        name="periodic-loop", daemon=True)
        self._process.start()
        send.close()
        try:
            if not self._receive.poll(self.start_timeout_s):
                raise RuntimeError(f"the periodic loop did not calibrate within {self.start_timeout_s:.0f} s")
            self.calibration = self._receive.recv()
        except (EOFError, RuntimeError) as exc:
            self._process.kill()
            raise RuntimeError(f"the periodic loop process failed to start (exit code {self._process.exitcode}): "
                               f"{exc or 'it ended before calibrating'}") from None
        self.pid = self._process.pid
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            if self._receive.poll(60):
                self.trace = [Period(*row) for row in self._receive.recv()]
        except EOFError:
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
