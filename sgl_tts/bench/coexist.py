"""`sgl-tts bench coexist`: searches beside a periodic workload with deadlines (the edge-inference interaction test).

A 50 Hz control loop (`sgl_tts.measure.periodic`: a fixed amount of numeric work, calibrated once at start to a
set fraction of the period on an idle core, a deadline each period) runs in a process of its own for the whole
bench. Beside it the bench runs its arms, one mechanism varied at a time against "search x1" (one search at a
time, FastTTS off):
- `idle`: no inference (runtimes kept from an earlier arm may be up, idle; the row says how many);
- `search x1` and `search xC`: one search, and C searches at once (`--several`);
- `P`, `M`, `S`: one FastTTS switch on, one search at a time;
- arms of `--arm NAME=KEY=VALUE,...`: "search x1" with run-config keys set (`search.*`, `fasttts.*`, `concurrency`,
  ...), e.g. a search budget once the config has one, checked like the YAML.
An inference arm keeps its searches going (`run_searches`: C workers, one search each at a time) for `--rounds`
searches a worker at least and until `--arm-s` seconds have passed, so its window is as long as the idle arm's on a
fast engine as on a slow one. Every repeat runs every arm (the order rotating by one each repeat), then, with
`--cancel`, C searches that are cancelled mid-flight: their requests in flight are aborted in the engine
(`search.api.cancel_search`), the generator's and verifier's KV in use is read from the engine's own counters
(`GET /v1/loads`, `num_used_tokens`) before the cancel and once it has settled after it, and the loop's recovery is the
time from the cancel to the first of `RECOVERED_AFTER` consecutive deadlines met.

Per arm: the loop's deadline misses (late or skipped periods), release jitter p50/p99, its worst lateness, its
CPU (the loop process's user + system time over the arm's wall time, % of one core) and the machine's, the
loop's resident memory and the machine's memory in use, and the machine's state at the arm's end (load, CPU
frequency, temperature: `sgl_tts.measure.machine_state`, "not exposed" where the machine has none); the median
[min-max] over repeats. A run that fails keeps its row, with its error; the bench goes on. Runtime start-up
and a warm-up search happen outside the measured window; caches are flushed before each.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from sgl_tts.measure.periodic import (PERIOD_S, RECOVERED_AFTER, WORK_FRACTION, LoopStats, Period, periods_between,
                                      recovery_s)
from sgl_tts.measure.summary import median_range
from sgl_tts.measure.tables import Column, console_table, markdown_table
from sgl_tts.search.stopping import Stopping

SEVERAL = 4
SWITCH_ARMS = ("P", "M", "S")
KV_SETTLE_S = 10.0  # how long the KV counters may take to settle after a cancel
ARM_PROBLEMS = 40  # problems an arm's searches go through (cycled), each prompt new to the radix cache once


@dataclasses.dataclass(frozen=True)
class CoexistArm:
    """One arm: no inference, or searches `concurrency` at a time with FastTTS `switches` (a `from_label` label)
    and run-config `overrides` ((dotted key, value) pairs)."""

    name: str
    inference: bool = True
    concurrency: int = 1
    switches: str = "baseline"
    overrides: tuple[tuple[str, Any], ...] = ()


def standard_arms(several: int) -> list[CoexistArm]:
    """idle, search x1, search x`several`, and each FastTTS switch alone at one search at a time."""
    return [CoexistArm("idle", inference=False), CoexistArm("search x1"),
            CoexistArm(f"search x{several}", concurrency=several),
            *(CoexistArm(switch, switches=switch) for switch in SWITCH_ARMS)]


def with_overrides(config: Any, overrides: Sequence[tuple[str, Any]], where: str) -> Any:
    """`config` (a RunConfig) with each dotted key set (`search.n`, `fasttts.speculative`, `concurrency`,
    `search.settings.tau`, ...), validated as a config file is: an unknown key or a bad value is a ConfigError
    naming it and `where`."""
    from sgl_tts.app.session import RunConfig, checked_program
    from sgl_tts.config import ConfigError, load_dataclass, to_dict

    data = to_dict(config)
    for key, value in overrides:
        *sections, name = key.split(".")
        node = data
        for depth, section in enumerate(sections):
            if node.get(section) is None and section == "settings":
                node[section] = {}
            if not isinstance(node.get(section), dict):
                raise ConfigError(f"{where}: '{key}': '{'.'.join(sections[:depth + 1])}' is not a section of the "
                                  f"run config (sections: {', '.join(k for k, v in data.items() if isinstance(v, dict))})")
            node = node[section]
        node[name] = value
    return checked_program(load_dataclass(RunConfig, data, where), where)


def arm_config(base: Any, arm: CoexistArm) -> Any:
    """The run config of an inference arm: `base` with the arm's concurrency, switches and overrides."""
    from sgl_tts.fasttts.switches import from_label

    config = dataclasses.replace(base, concurrency=arm.concurrency, fasttts=from_label(arm.switches))
    return with_overrides(config, arm.overrides, f"--arm {arm.name}") if arm.overrides else config


def kv_used_tokens(runtimes: dict[str, Any]) -> dict[str, int | None]:
    """Each runtime's KV tokens in use, from its engine's counters (summed over ranks); None where unreadable."""
    from sgl_tts.runtime.server import engine_loads

    used: dict[str, int | None] = {}
    for name, runtime in runtimes.items():
        try:
            used[name] = sum(int(rank.get("num_used_tokens", 0)) for rank in engine_loads(runtime))
        except (OSError, KeyError, TypeError, ValueError):
            used[name] = None
    return used


def settled_kv(runtimes: dict[str, Any], timeout_s: float = KV_SETTLE_S, poll_s: float = 0.2
               ) -> tuple[dict[str, int | None], float]:
    """The KV in use once three readings in a row agree (or `timeout_s` passed), and the seconds that took."""
    began = time.monotonic()
    readings = [kv_used_tokens(runtimes)]
    while time.monotonic() - began < timeout_s and not (len(readings) >= 3 and readings[-1] == readings[-2]
                                                         == readings[-3]):
        time.sleep(poll_s)
        readings.append(kv_used_tokens(runtimes))
    return readings[-1], time.monotonic() - began


class CaseWindow:
    """`with CaseWindow(loop_pid) as window:` the measured stretch of one arm: its monotonic begin and end, the
    machine's CPU (`CpuMeter`), the loop process's CPU and memory, the machine's memory and state at the end."""

    def __init__(self, loop_pid: int):
        self.loop_pid = loop_pid
        self.numbers: dict[str, Any] = {}

    def __enter__(self) -> "CaseWindow":
        import psutil

        from sgl_tts.measure.cpu_use import CpuMeter

        self._loop = psutil.Process(self.loop_pid)
        self._loop_cpu = _cpu_s(self._loop)
        self._meter = CpuMeter().__enter__()
        self.began = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil

        from sgl_tts.measure.machine_state import read_machine_state

        self.ended = time.monotonic()
        self._meter.__exit__()
        wall = self.ended - self.began
        use = self._meter.use
        self.numbers = {
            "began": self.began, "ended": self.ended, "wall_s": wall,
            "loop_cpu_percent": 100 * (_cpu_s(self._loop) - self._loop_cpu) / wall if wall > 0 else 0.0,
            "machine_cpu_percent": use.percent, "cores": use.cores,
            "loop_rss_mib": self._loop.memory_info().rss / 2**20,
            "machine_memory_used_gib": (lambda m: (m.total - m.available) / 2**30)(psutil.virtual_memory()),
            "machine": read_machine_state().as_dict(),
        }


def _cpu_s(process: Any) -> float:
    times = process.cpu_times()
    return times.user + times.system


def run_searches(session: Any, config: Any, problems: Sequence[Any], rounds: int = 1, arm_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """`config.concurrency` searches in flight: as many workers, each solving `problems` (in turn, cycled) one
    after another, `rounds` each at least and more until `arm_s` seconds of `clock` have passed, so that an arm
    lasts about as long on a fast engine as on a slow one. Searches, failed ones, generated tokens."""
    from sgl_tts.search.api import SearchError

    began, taken = clock(), itertools.count()

    def worker() -> list[Any]:
        results = []
        while len(results) < rounds or clock() - began < arm_s:
            problem = problems[next(taken) % len(problems)]
            try:
                results.append(session.solve(problem, config.search))
            except SearchError as exc:  # a search that failed mid-way: its partial result says what failed
                results.append(exc.result)
        return results

    with ThreadPoolExecutor(max_workers=config.concurrency) as threads:
        workers = [threads.submit(worker) for _ in range(config.concurrency)]
        results = [result for done in workers for result in done.result()]
    return {"searches": len(results), "search_errors": sum(r.error is not None for r in results),
            "tokens": sum(r.generated_tokens for r in results)}


def prepared_session(pool: Any, config: Any, problem: Any) -> Any:
    """A session of `config` from `pool`, warmed up by a short search when it started a runtime, caches flushed."""
    from sgl_tts.bench.fasttts import flush_caches

    session = pool.switch(config)
    try:
        if len(session.reused) < len(session.runtimes):
            session.solve(problem, dataclasses.replace(config.search, n=2, max_steps=1))
        flush_caches(session.runtimes)
    except BaseException:
        pool.give_back(session)
        raise
    return session


def run_arm(arm: CoexistArm, base: Any, problems: Sequence[Any], rounds: int, idle_s: float, pool: Any,
            loop_pid: int, arm_s: float = 0.0) -> dict[str, Any]:
    """One run of `arm` (searches: `run_searches`); an error is kept in the record (`error`), not raised."""
    record: dict[str, Any] = {"arm": arm.name}
    try:
        if not arm.inference:
            record["runtimes_alive"] = sum(len(kept) for kept in pool.kept.values())
            with CaseWindow(loop_pid) as window:
                time.sleep(idle_s)
        else:
            config = arm_config(base, arm)
            session = prepared_session(pool, config, problems[0])
            try:
                with CaseWindow(loop_pid) as window:
                    record.update(run_searches(session, config, problems, rounds, arm_s))
            finally:
                pool.give_back(session)
        record.update(window.numbers)
    except Exception as exc:  # the arm's failure is a result: shown in its row, the bench goes on
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


def run_cancel(base: Any, problems: Sequence[Any], concurrency: int, cancel_after_s: float, watch_s: float,
               pool: Any, loop_pid: int) -> dict[str, Any]:
    """`concurrency` searches at once, cancelled `cancel_after_s` into the run while they have requests in
    flight; the KV in use before and after, the cancel's times, and `watch_s` of the loop after it."""
    from sgl_tts.search.api import cancel_search

    record: dict[str, Any] = {"arm": f"cancel x{concurrency}"}
    try:
        config = arm_config(base, CoexistArm("cancel", concurrency=concurrency))
        chosen = [problems[i % len(problems)] for i in range(concurrency)]
        session = prepared_session(pool, config, chosen[0])
        try:
            with CaseWindow(loop_pid) as window, ThreadPoolExecutor(max_workers=concurrency) as threads:
                contexts = [session.new_search(problem, config.search) for problem in chosen]
                futures = [threads.submit(session.solve, problem, config.search, context)
                           for problem, context in zip(chosen, contexts)]
                began = time.monotonic()
                while not all(f.done() for f in futures) and (time.monotonic() - began < cancel_after_s
                                                                or not any(c.in_flight() for c in contexts)):
                    time.sleep(0.05)
                record["in_flight_at_cancel"] = sum(len(c.in_flight()) for c in contexts)
                record["kv_before"] = kv_used_tokens(session.runtimes)
                record["cancel_at"] = cancelled = time.monotonic()
                cancels = [threading.Thread(target=cancel_search, args=(c, session.search_runtimes))
                           for c in contexts]
                for thread in cancels:
                    thread.start()
                for thread in cancels:
                    thread.join()
                record["abort_s"] = time.monotonic() - cancelled
                outcomes = [future.exception() for future in futures]
                record["searches_ended_s"] = time.monotonic() - cancelled
                record["searches"] = len(futures)
                record["stopped"] = sum(o is not None for o in outcomes)  # ended by the cancel (an error)
                record["returned"] = sum(o is None for o in outcomes)  # a result: done before, or partial
                record["kv_after"], record["kv_settle_s"] = settled_kv(session.runtimes)
                time.sleep(max(0.0, watch_s - (time.monotonic() - cancelled)))
        finally:
            pool.give_back(session)
        record.update(window.numbers)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


# -- figures from the records and the loop's trace ------------------------------------------------------------


def loop_figures(record: dict[str, Any], trace: Sequence[Period]) -> dict[str, Any]:
    """The loop's figures in the record's window (`LoopStats`), and, for a cancel, the recovery and the misses
    before and after it."""
    if "began" not in record:
        return {}
    window = periods_between(trace, record["began"], record["ended"])
    stats = LoopStats.of(window)
    figures = {"periods": stats.periods, "missed": stats.missed, "skipped": stats.skipped,
               "miss_share": stats.miss_share, "jitter_p50_s": stats.jitter_p50_s,
               "jitter_p99_s": stats.jitter_p99_s, "worst_late_s": stats.worst_late_s}
    if "cancel_at" in record:
        cancel = record["cancel_at"]
        figures["recovery_s"] = recovery_s(window, cancel)
        figures["missed_before_cancel"] = LoopStats.of(periods_between(window, record["began"], cancel)).missed
        figures["missed_after_cancel"] = LoopStats.of(periods_between(window, cancel, record["ended"])).missed
    return figures


def _ms(value: float | None) -> float | None:
    return None if value is None else 1000 * value


def _cell(values: Sequence[float | None], spec: str, range_spec: str | None = None) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    return median_range(present, spec, range_spec) if len(present) > 1 else f"{present[0]:{spec}}"


def machine_cells(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Load (1 min), CPU MHz (cpuinfo, else cpufreq) and the hottest temperature at the runs' ends, or what is not
    exposed."""
    machines = [r["machine"] for r in runs if "machine" in r]
    load = _cell([m["load"][0] for m in machines], ".2f")
    mhz = [statistics.mean(m["cpuinfo_mhz"] or m["cpufreq_mhz"]) for m in machines
           if m["cpuinfo_mhz"] or m["cpufreq_mhz"]]
    temps = [max(m["temperatures_c"].values()) for m in machines if m["temperatures_c"]]
    return [load, _cell(mhz, ".0f") if mhz else "not exposed", _cell(temps, ".0f") if temps else "not exposed"]


ARM_COLUMNS = (Column("arm", None, "<"), Column("runs"), Column("periods"), Column("missed"),
               Column("skipped"), Column("jitter p50 ms"), Column("jitter p99 ms"), Column("worst late ms"),
               Column("loop CPU %"), Column("machine CPU %"), Column("loop RSS MiB"), Column("mem used GiB"),
               Column("searches (failed)"), Column("tok/s"), Column("load 1m"), Column("MHz"), Column("temp C"),
               Column("error", None, "<"))

CANCEL_COLUMNS = (Column("arm", None, "<"), Column("repeat"), Column("in flight"), Column("abort s"),
                  Column("searches ended s"), Column("stopped/returned"), Column("recovery s"),
                  Column("missed before/after"), Column("KV gen before->after (freed)"),
                  Column("KV ver before->after (freed)"), Column("KV settle s"), Column("load 1m"), Column("MHz"),
                  Column("temp C"), Column("error", None, "<"))


def arm_rows(records: Sequence[dict[str, Any]], trace: Sequence[Period], arms: Sequence[str]) -> list[list[str]]:
    """One row per arm: median [min-max] over its runs that did not fail; the failures' errors in the last
    column (how many, and the first one's message)."""
    rows = []
    for arm in arms:
        runs = [r for r in records if r["arm"] == arm]
        good = [{**r, **loop_figures(r, trace)} for r in runs if "error" not in r]
        failed = [r["error"] for r in runs if "error" in r]
        get = lambda key, scale=None: [scale(r.get(key)) if scale else r.get(key) for r in good]  # noqa: E731
        searches = "-" if not any("searches" in r for r in good) else (
            f"{sum(r['searches'] for r in good)} ({sum(r['search_errors'] for r in good)})")
        throughput = [r["tokens"] / r["wall_s"] for r in good if "tokens" in r and r["wall_s"] > 0]
        idle_note = f" ({good[0]['runtimes_alive']} runtimes up)" if good and good[0].get("runtimes_alive") else ""
        rows.append([
            arm + idle_note, f"{len(good)}/{len(runs)}", _cell(get("periods"), ".0f"), _cell(get("missed"), ".0f"),
            _cell(get("skipped"), ".0f"), _cell(get("jitter_p50_s", _ms), ".2f"),
            _cell(get("jitter_p99_s", _ms), ".2f"), _cell(get("worst_late_s", _ms), ".1f"),
            _cell(get("loop_cpu_percent"), ".0f"), _cell(get("machine_cpu_percent"), ".0f"),
            _cell(get("loop_rss_mib"), ".0f"), _cell(get("machine_memory_used_gib"), ".1f"), searches,
            _cell(throughput, ".1f") if throughput else "-", *machine_cells(good),
            (f"{len(failed)} failed: {failed[0]}" if failed else "")])
    return rows


def _kv_cell(record: dict[str, Any], name: str) -> str:
    before, after = record.get("kv_before", {}).get(name), record.get("kv_after", {}).get(name)
    if before is None or after is None:
        return "-" if name not in record.get("kv_before", {}) else "not readable"
    return f"{before}->{after} ({before - after})"


def cancel_rows(records: Sequence[dict[str, Any]], trace: Sequence[Period]) -> list[list[str]]:
    """One row per cancel run: when, how fast the aborts went, the loop's recovery, the KV the engines freed."""
    rows = []
    for record in records:
        figures = loop_figures(record, trace) if "error" not in record else {}
        recovery = figures.get("recovery_s", "-")
        rows.append([
            record["arm"], str(record.get("repeat", "")), str(record.get("in_flight_at_cancel", "-")),
            f"{record['abort_s']:.2f}" if "abort_s" in record else "-",
            f"{record['searches_ended_s']:.2f}" if "searches_ended_s" in record else "-",
            f"{record['stopped']}/{record['returned']}" if "stopped" in record else "-",
            "not within the run" if recovery is None else recovery if isinstance(recovery, str) else f"{recovery:.2f}",
            f"{figures['missed_before_cancel']}/{figures['missed_after_cancel']}" if "missed_after_cancel" in figures
            else "-",
            _kv_cell(record, "generator"), _kv_cell(record, "scorer"),
            f"{record['kv_settle_s']:.1f}" if "kv_settle_s" in record else "-",
            *machine_cells([record] if "machine" in record else []), record.get("error", "")])
    return rows


# -- the bench --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    config: str = "cpu-default"
    program: str = "beam_search"
    n: int = 8
    beam_width: int = 4
    max_steps: int = 3
    max_step_tokens: int = 24
    step_delimiter: str = "\\n"
    several: int = SEVERAL
    rounds: int = 1  # searches per worker (of `concurrency`) per inference arm, at least
    arm_s: float = 10.0  # an inference arm's searches go on until this long (as long as the idle arm)
    idle_s: float = 10.0
    repeats: int = 2
    arms: str | None = None  # comma-separated names of the standard arms (default all)
    arm: tuple[CoexistArm, ...] = ()  # --arm: pass-through arms
    cancel: bool = True
    cancel_after_s: float = 0.5  # one search of the default arms takes about 1 s on a 2-core AVX-512 Xeon
    watch_s: float = 8.0  # of the loop after a cancel
    period_ms: float = 1000 * PERIOD_S
    work_fraction: float = WORK_FRACTION
    live_sessions: int = 2
    seed: int = 0
    log_dir: str | None = None
    out: str | None = None


def base_config(options: BenchOptions) -> Any:
    from sgl_tts.app.session import load_run_config

    config = load_run_config(options.config)
    search = dataclasses.replace(
        config.search, program=options.program, n=options.n, beam_width=options.beam_width,
        max_steps=options.max_steps, max_step_tokens=options.max_step_tokens,
        max_tokens=options.max_steps * options.max_step_tokens, settings=None if options.program !=
        config.search.program else config.search.settings,
        step_delimiter=options.step_delimiter.encode().decode("unicode_escape"), seed=options.seed,
        stopping=Stopping())  # the arms vary one mechanism at a time: budgets, not stopping rules
    return dataclasses.replace(config, search=search, log_dir=options.log_dir)


def chosen_arms(options: BenchOptions) -> list[CoexistArm]:
    standard = {arm.name: arm for arm in standard_arms(options.several)}
    aliases = {"search xC": f"search x{options.several}", "x1": "search x1", "xC": f"search x{options.several}"}
    names = [aliases.get(n.strip(), n.strip()) for n in options.arms.split(",")] if options.arms else list(standard)
    unknown = [n for n in names if n not in standard]
    if unknown:
        raise ValueError(f"--arms: unknown arm {unknown[0]!r}; known: {', '.join(standard)} (x1, xC too)")
    taken = set(names)
    for arm in options.arm:
        if arm.name in taken:
            raise ValueError(f"--arm {arm.name}: an arm of that name is already in the bench")
        taken.add(arm.name)
    return [standard[n] for n in names] + list(options.arm)


def run_bench(options: BenchOptions) -> int:
    from sgl_tts.app.session import SessionPool
    from sgl_tts.measure.machine_state import read_machine_state
    from sgl_tts.measure.periodic import LoopProcess
    from sgl_tts.problems import load_problems
    from sgl_tts.runtime.hardware import cpu_summary

    base = base_config(options)
    arms = chosen_arms(options)
    for arm in arms:
        if arm.inference:
            arm_config(base, arm)  # a bad pass-through key fails now, not after minutes of other arms
    problems = load_problems(base.dataset.name, limit=max(ARM_PROBLEMS, max(arm.concurrency for arm in arms)
                                                          * options.rounds + options.several),
                             offset=base.dataset.offset)
    began = time.monotonic()
    header = (f"bench coexist: a {1000 / options.period_ms:.0f} Hz loop (work {options.work_fraction:g} of the "
              f"{options.period_ms:g} ms period on an idle core) beside {base.search.program} n={base.search.n} "
              f"(B={base.search.beam_width}, {base.search.max_steps}x{base.search.max_step_tokens} tokens), "
              f"{base.generator.model}, verifier {base.scorer.kind}; arms {[a.name for a in arms]}, "
              f"{options.repeats} interleaved repeats" + (f", then a cancel of {options.several} searches "
                                                           f"{options.cancel_after_s:g} s in" if options.cancel else ""))
    print(header, flush=True)
    print(f"machine: {cpu_summary()}; at start: {read_machine_state().describe()}", flush=True)
    records: list[dict[str, Any]] = []
    cancels: list[dict[str, Any]] = []
    pool = SessionPool(options.live_sessions)
    loop = LoopProcess(options.period_ms / 1000, options.work_fraction)
    try:
        with loop:
            print(f"loop: pid {loop.pid}, {loop.calibration['rounds']} rounds per period, "
                  f"{1000 * loop.calibration['work_s']:.2f} ms of work on start", flush=True)
            for repeat in range(options.repeats):
                order = arms[repeat % len(arms):] + arms[: repeat % len(arms)]
                for arm in order:
                    record = {**run_arm(arm, base, problems, options.rounds, options.idle_s, pool, loop.pid,
                                        options.arm_s), "repeat": repeat + 1}
                    records.append(record)
                    print(f"[repeat {repeat + 1} {arm.name}] " + (record.get("error") or (
                        f"{record['wall_s']:.1f} s, machine CPU {record['machine_cpu_percent']:.0f}%, "
                        f"{record.get('searches', 0)} searches")), flush=True)
                if options.cancel:
                    record = {**run_cancel(base, problems, options.several, options.cancel_after_s, options.watch_s,
                                           pool, loop.pid), "repeat": repeat + 1}
                    cancels.append(record)
                    print(f"[repeat {repeat + 1} {record['arm']}] " + (record.get("error") or (
                        f"{record['in_flight_at_cancel']} requests in flight, aborted in {record['abort_s']:.2f} s, "
                        f"KV {record['kv_before']} -> {record['kv_after']}")), flush=True)
    except BaseException:
        if records or cancels:
            print("\nbench coexist stopped by an error; what was measured so far:", flush=True)
            report(options, header, records, cancels, loop, arms, began, partial=True)
        raise
    finally:
        pool.close()
    report(options, header, records, cancels, loop, arms, began)
    return 0


def report(options: BenchOptions, header: str, records: list[dict[str, Any]], cancels: list[dict[str, Any]],
           loop: Any, arms: Sequence[CoexistArm], began: float, partial: bool = False) -> None:
    """Print the arm and cancel tables and, with `--out`, write the JSON (every record, the loop's calibration)
    and the Markdown tables."""
    from sgl_tts.measure.machine_state import read_machine_state
    from sgl_tts.paths import write_atomic
    from sgl_tts.runtime.hardware import cpu_summary

    rows = arm_rows(records, loop.trace, [a.name for a in arms])
    cancel_table = cancel_rows(cancels, loop.trace)
    machine = f"{cpu_summary()}; at the end: {read_machine_state().describe()}"
    made = f"{time.monotonic() - began:.0f} s in all"
    caption = (f"median [min-max] over repeats; missed = late or skipped periods; jitter = start - release; "
               f"CPU % of one core; recovery = cancel to the first of {RECOVERED_AFTER} deadlines met in a row "
               f"({made})" + ("; PARTIAL" if partial else ""))
    print(f"\n{header}\n{machine}\n{caption}")
    print(console_table(ARM_COLUMNS, rows))
    if cancel_table:
        print()
        print(console_table(CANCEL_COLUMNS, cancel_table))
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "bench-coexist.json", json.dumps(
            {"header": header, "machine": machine, "partial": partial, "calibration": loop.calibration,
             "args": dataclasses.asdict(options), "records": records, "cancels": cancels,
             "figures": [{**r, **loop_figures(r, loop.trace)} for r in records + cancels]}, indent=1, default=str))
        write_atomic(out / "bench-coexist.md", f"{header}\n\nMachine: {machine}; {caption}.\n\n"
                     + markdown_table([c.title for c in ARM_COLUMNS], rows) + "\n"
                     + ("\n" + markdown_table([c.title for c in CANCEL_COLUMNS], cancel_table) + "\n"
                        if cancel_table else ""))
        print(f"wrote {out / 'bench-coexist.json'} and {out / 'bench-coexist.md'}")
