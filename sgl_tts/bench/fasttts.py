"""`sgl-tts bench fasttts`: the FastTTS ablation (Fig. 16) as the measure of record, with repeats.

For each search program (beam search, DVTS, dynamic branching, varying granularity), each n and each arm —
the baseline (FCFS, no speculation, a static 50/50 split of a KV budget small enough to force evictions,
every path re-scored from its start), V (verifier prefix reuse alone), P, P+M, P+M+S and all (V+P+M+S) —
several problems are searched at once (`--concurrency`), as a server sees them. Each cell (program, n, arm)
runs `--repeats` times; the repeats are interleaved (repeat r runs every cell before repeat r+1 starts, and
the arm order rotates by one each repeat), so slow phases of a shared machine spread over all arms.

Reported per cell: the median with min-max over repeats of the mean precise goodput, the p50 completion
latency, the verifier's share of time and its cache hit (input tokens its runtime served from the radix
cache), and the generator runtime's evicted tokens and retracted requests (its Prometheus counters). A ratio
to the baseline is marked `*` only where the ranges do not overlap: only those are claimed as speed-ups.
Runtimes are kept alive between cells that want the same settings (at most `--live-sessions` sets at once);
a runtime's radix cache is flushed before every cell, and a new runtime is warmed up by a short search.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from sgl_tts.measure.summary import median_min_max, median_range
from sgl_tts.measure.tables import Column, console_table

ARMS = ("baseline", "V", "P", "P+M", "P+M+S", "all")
PROGRAMS = ("beam_search", "dvts", "dynamic_branching", "varying_granularity")
QUICK = {"programs": "beam_search", "ns": "8", "arms": "baseline,all", "problems": 3, "repeats": 3,
         "concurrency": 3}
METRICS = ("goodput", "p50_latency_s", "verifier_share", "verifier_cache_hit", "evicted_tokens", "retracted")
LOWER_IS_BETTER = {"p50_latency_s", "verifier_share", "evicted_tokens", "retracted"}
SERVER_COUNTERS = {"evicted_tokens": "sglang:evicted_tokens_total",
                   "retracted": "sglang:num_retracted_requests_total"}


@dataclasses.dataclass(frozen=True)
class FastTTSArm:
    """An ablation arm: the FastTTS switches (P, M, S) and V, verifier prefix reuse (incremental scoring)."""

    label: str
    switches: str  # for fasttts.from_label: 'baseline' or P/M/S joined by '+'
    verifier_reuse: bool

    @classmethod
    def parse(cls, label: str) -> "FastTTSArm":
        parts = ["V", "P", "M", "S"] if label == "all" else [] if label == "baseline" else label.split("+")
        if (label != "baseline" and not parts) or any(p not in ("V", "P", "M", "S") for p in parts) \
                or len(set(parts)) != len(parts):
            raise ValueError(f"bad arm {label!r}: use baseline, all, or V, P, M, S joined by '+'")
        switches = "+".join(p for p in ("P", "M", "S") if p in parts) or "baseline"
        return cls(label, switches, "V" in parts)


def server_counters(runtime: Any) -> dict[str, float]:
    """The runtime's eviction and retraction counters (0 when it exports no metrics)."""
    try:
        text = urllib.request.urlopen(runtime.url + "/metrics", timeout=30).read().decode()
    except OSError:
        return {name: 0.0 for name in SERVER_COUNTERS}
    return {name: sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(metric)}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name, metric in SERVER_COUNTERS.items()}


def flush_caches(runtimes: dict[str, Any]) -> None:
    for runtime in runtimes.values():
        request = urllib.request.Request(runtime.url + "/flush_cache?timeout=60", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()


def measure(results: list[Any], verifier: tuple[int, int] = (0, 0), server: dict[str, float] | None = None
            ) -> dict[str, Any]:
    """One cell's numbers: mean precise goodput, p50 latency, verifier share and cache hit, server counters.
    `verifier` is (input tokens, cached tokens) the verifier read during the cell."""
    from sgl_tts.measure.metrics import aggregate_rows

    summary = aggregate_rows(results)
    speculation: dict[str, int] = {}
    for result in results:
        for key, value in result.extra.get("speculation", {}).items():
            speculation[key] = speculation.get(key, 0) + value
    read, cached = verifier
    return {
        "problems": summary["problems"],
        "errors": summary["errors"],
        "goodput": summary["precise_goodput"]["mean"] or 0.0,
        "p50_latency_s": summary["completion_latency_s"]["p50"] or 0.0,
        "verifier_share": summary["verifier_share"] or 0.0,
        "verifier_cache_hit": cached / read if read else 0.0,
        "verifier_tokens": read,
        "cache_hit_rate": summary["cache_hit_rate"] or 0.0,
        "generated_tokens": summary["generated_tokens"],
        "speculation": speculation,
        **(server or {name: 0.0 for name in SERVER_COUNTERS}),
    }


def compare(arm: list[float], base: list[float], lower_is_better: bool) -> tuple[float, bool]:
    """(ratio of medians, whether the ranges are disjoint in the arm's favour)."""
    arm_median, arm_low, arm_high = median_min_max(arm)
    base_median, base_low, base_high = median_min_max(base)
    ratio = arm_median / base_median if base_median else float("nan")
    if len(arm) < 2 or len(base) < 2:  # one run has no range: nothing can be claimed
        return ratio, False
    separated = arm_high < base_low if lower_is_better else arm_low > base_high
    return ratio, separated


TABLE_COLUMNS = (Column("program", 20, "<"), Column("n", 3), Column("arm", 7, "<"), Column("goodput tok/s", 20),
                 Column("x base", 7), Column("p50 latency s", 20), Column("x base", 7), Column("ver share", 9),
                 Column("ver hit", 7), Column("evicted", 8), Column("retract", 7))


def format_table(cells: dict[tuple[str, int, str], list[dict[str, Any]]], programs: list[str], ns: list[int],
                 arms: list[str]) -> str:
    """Medians [min-max] per cell, with ratios of medians to the baseline; `*` where the ranges do not overlap."""
    rows = []
    for program in programs:
        for n in ns:
            base = cells.get((program, n, "baseline"))
            for arm in arms:
                runs = cells.get((program, n, arm))
                if not runs:
                    continue
                goodput = [r["goodput"] for r in runs]
                latency = [r["p50_latency_s"] for r in runs]
                g_ratio, g_sep = compare(goodput, [r["goodput"] for r in base], False) if base else (float("nan"), False)
                l_ratio, l_sep = compare(latency, [r["p50_latency_s"] for r in base], True) if base else (float("nan"), False)
                rows.append([
                    program, str(n), arm, median_range(goodput, "7.3f", "5.2f"),
                    f"{g_ratio:5.2f}x{'*' if g_sep and arm != 'baseline' else ' '}",
                    median_range(latency, "7.1f", "5.1f"),
                    f"{l_ratio:5.2f}x{'*' if l_sep and arm != 'baseline' else ' '}",
                    f"{statistics.median(r['verifier_share'] for r in runs):.2f}",
                    f"{statistics.median(r['verifier_cache_hit'] for r in runs):.2f}",
                    f"{statistics.median(r['evicted_tokens'] for r in runs):.0f}",
                    f"{statistics.median(r['retracted'] for r in runs):.0f}"])
    return console_table(TABLE_COLUMNS, rows)


def plot(cells: dict[tuple[str, int, str], list[dict[str, Any]]], programs: list[str], ns: list[int],
         arms: list[str], path: Path) -> None:
    """FastTTS Fig. 16 style: per program, goodput and p50 latency per arm and n (median, min-max bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(programs), 2, figsize=(11, 3.2 * len(programs)), squeeze=False)
    width = 0.8 / len(arms)
    for row, program in enumerate(programs):
        for col, (metric, title) in enumerate((("goodput", "precise goodput, tok/s"),
                                               ("p50_latency_s", "p50 completion latency, s"))):
            ax = axes[row][col]
            for k, arm in enumerate(arms):
                xs, medians, lows, highs = [], [], [], []
                for i, n in enumerate(ns):
                    runs = cells.get((program, n, arm))
                    if runs:
                        median, low, high = median_min_max([r[metric] for r in runs])
                        xs.append(i + (k - (len(arms) - 1) / 2) * width)
                        medians.append(median)
                        lows.append(median - low)
                        highs.append(high - median)
                ax.bar(xs, medians, width, yerr=[lows, highs], capsize=2, label=arm)
            ax.set_xticks(range(len(ns)), [f"n={n}" for n in ns])
            ax.set_title(f"{program}: {title}", fontsize=9)
            if row == 0 and col == 0:
                ax.legend(fontsize=7, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What `sgl-tts bench fasttts` runs; lists are comma-separated text, None takes the default (or `quick`'s)."""

    config: str = "cpu-default"  # run config (YAML path or packaged name): models, verifier
    quick: bool = False  # QUICK's values for what is not given
    programs: str | None = None  # default: PROGRAMS
    ns: str | None = None  # beam counts n (default 8,16,32)
    arms: str | None = None  # default: ARMS
    problems: int | None = None  # bundled problems per cell (default 5)
    repeats: int | None = None  # runs of every cell, interleaved (default 3)
    concurrency: int | None = None  # searches at once (default 3)
    beam_width: int = 4
    max_steps: int = 3
    max_step_tokens: int = 24
    step_delimiter: str = "\\n"  # escapes allowed
    kv_budget_mib: float = 24.0
    hardware: str = "this-machine"
    prompt_tokens: int = 80
    max_speculative: int | None = None
    engine_batch: int = 16
    live_sessions: int = 2
    seed: int = 0
    log_dir: str | None = None
    out: str | None = None  # folder for the JSON of every run and the plot


def _base_config(options: BenchOptions) -> Any:
    from sgl_tts.app.session import load_run_config

    config = load_run_config(options.config)
    metrics = lambda rc: dataclasses.replace(rc, extra_args=[*rc.extra_args, "--enable-metrics"]) \
        if "--enable-metrics" not in rc.extra_args else rc
    scorer = config.scorer
    if scorer.runtime is not None:
        scorer = dataclasses.replace(scorer, runtime=metrics(scorer.runtime))
    search = dataclasses.replace(
        config.search, beam_width=options.beam_width, max_steps=options.max_steps,
        max_step_tokens=options.max_step_tokens, max_tokens=options.max_steps * options.max_step_tokens,
        step_delimiter=options.step_delimiter.encode().decode("unicode_escape"), seed=options.seed)
    return dataclasses.replace(config, generator=metrics(config.generator), scorer=scorer, search=search,
                               concurrency=options.concurrency or 3, log_dir=options.log_dir)


def run_bench(options: BenchOptions) -> int:
    from sgl_tts.app.session import SessionPool
    from sgl_tts.fasttts.switches import describe_settings, from_label
    from sgl_tts.problems import load_problems

    if options.quick:
        options = dataclasses.replace(options, **{key: value for key, value in QUICK.items()
                                                  if getattr(options, key) is None})
    programs = (options.programs or ",".join(PROGRAMS)).split(",")
    ns = [int(n) for n in (options.ns or "8,16,32").split(",")]
    arms = [FastTTSArm.parse(label) for label in (options.arms or ",".join(ARMS)).split(",")]
    repeats = options.repeats or 3
    base = _base_config(options)
    for arm in arms:
        from_label(arm.switches)
    problems = load_problems(base.dataset.name, limit=options.problems or 5, offset=base.dataset.offset)
    print(f"bench fasttts: programs={programs} n={ns} arms={[a.label for a in arms]} repeats={repeats} "
          f"problems={len(problems)} concurrency={base.concurrency} model={base.generator.model} "
          f"verifier={base.scorer.kind} beam_width={options.beam_width} "
          f"steps<={options.max_steps}x{options.max_step_tokens} KV budget {options.kv_budget_mib} MiB", flush=True)
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    pool = SessionPool(options.live_sessions)
    began = time.monotonic()
    try:
        for repeat in range(repeats):
            order = arms[repeat % len(arms):] + arms[: repeat % len(arms)]
            for arm in order:
                fast = from_label(arm.switches, kv_budget_mib=options.kv_budget_mib, hardware=options.hardware,
                                  prompt_tokens=options.prompt_tokens, max_speculative=options.max_speculative,
                                  engine_batch=options.engine_batch, seed=options.seed)
                for program in programs:
                    for n in ns:
                        search = dataclasses.replace(base.search, program=program, n=n)
                        scorer = dataclasses.replace(base.scorer, incremental=arm.verifier_reuse)
                        config = dataclasses.replace(base, search=search, scorer=scorer, fasttts=fast)
                        row = run_cell(pool, config, problems, describe_settings)
                        cells.setdefault((program, n, arm.label), []).append(row)
                        print(f"[repeat {repeat + 1} {program} n={n} {arm.label}] goodput {row['goodput']:.3f} tok/s, "
                              f"p50 {row['p50_latency_s']:.1f} s, verifier share {row['verifier_share']:.2f}, "
                              f"verifier cache hit {row['verifier_cache_hit']:.2f}, evicted {row['evicted_tokens']:.0f}, "
                              f"retracted {row['retracted']:.0f}, errors {row['errors']}"
                              + (f", speculation {row['speculation']}" if row["speculation"] else ""), flush=True)
    finally:
        pool.close()
    labels = [a.label for a in arms]
    print(f"\nFastTTS ablation, {repeats} interleaved repeats per cell ({time.monotonic() - began:.0f} s in all); "
          f"median [min-max]; * = ranges do not overlap the baseline's")
    print(format_table(cells, programs, ns, labels))
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-fasttts.json").write_text(json.dumps(
            {"args": dataclasses.asdict(options),
             "cells": [{"program": p, "n": n, "arm": a, "runs": runs} for (p, n, a), runs in cells.items()]},
            indent=1, default=str))
        plot(cells, programs, ns, labels, out / "bench-fasttts.png")
        print(f"wrote {out / 'bench-fasttts.json'} and {out / 'bench-fasttts.png'}")
    return 0


def run_cell(pool: Any, config: Any, problems: list[Any], describe: Any) -> dict[str, Any]:
    """One (program, n, arm) run over the problems, `config.concurrency` at a time, on flushed caches, with a
    session from `pool` (`sgl_tts.app.session.SessionPool`)."""
    session = pool.switch(config)
    try:
        if len(session.reused) < len(session.runtimes):
            print(f"  runtimes started: {describe(session.fasttts)}", flush=True)
            session.solve(problems[0], dataclasses.replace(config.search, n=2, max_steps=1))  # warm-up
        flush_caches(session.runtimes)
        scorer = session.search_runtimes.scorer
        before_read = getattr(scorer, "tokens_processed", 0)
        before_cached = getattr(scorer, "tokens_cached", 0)
        before_server = server_counters(session.runtimes["generator"])
        results = [result for _, result in session.solve_all(problems)]
        after_server = server_counters(session.runtimes["generator"])
        verifier = (getattr(scorer, "tokens_processed", 0) - before_read,
                    getattr(scorer, "tokens_cached", 0) - before_cached)
    finally:
        pool.give_back(session)
    return measure(results, verifier, {k: after_server[k] - before_server[k] for k in SERVER_COUNTERS})
