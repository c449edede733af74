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

import argparse
import dataclasses
import json
import re
import statistics
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path
from typing import Any

ARMS = ("baseline", "V", "P", "P+M", "P+M+S", "all")
PROGRAMS = ("beam_search", "dvts", "dynamic_branching", "varying_granularity")
QUICK = {"programs": "beam_search", "ns": "8", "arms": "baseline,all", "problems": 3, "repeats": 3,
         "concurrency": 3}
METRICS = ("goodput", "p50_latency_s", "verifier_share", "verifier_cache_hit", "evicted_tokens", "retracted")
LOWER_IS_BETTER = {"p50_latency_s", "verifier_share", "evicted_tokens", "retracted"}
SERVER_COUNTERS = {"evicted_tokens": "sglang:evicted_tokens_total",
                   "retracted": "sglang:num_retracted_requests_total"}


@dataclasses.dataclass(frozen=True)
class Arm:
    """An ablation arm: the FastTTS switches (P, M, S) and V, verifier prefix reuse (incremental scoring)."""

    label: str
    switches: str  # for fasttts.from_label: 'baseline' or P/M/S joined by '+'
    verifier_reuse: bool

    @classmethod
    def parse(cls, label: str) -> "Arm":
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
    from sgl_tts.app.metrics import aggregate

    summary = aggregate(results)
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


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def compare(arm: list[float], base: list[float], lower_is_better: bool) -> tuple[float, bool]:
    """(ratio of medians, whether the ranges are disjoint in the arm's favour)."""
    arm_median, arm_low, arm_high = spread(arm)
    base_median, base_low, base_high = spread(base)
    ratio = arm_median / base_median if base_median else float("nan")
    if len(arm) < 2 or len(base) < 2:  # one run has no range: nothing can be claimed
        return ratio, False
    separated = arm_high < base_low if lower_is_better else arm_low > base_high
    return ratio, separated


def format_table(cells: dict[tuple[str, int, str], list[dict[str, Any]]], programs: list[str], ns: list[int],
                 arms: list[str]) -> str:
    """Medians [min-max] per cell, with ratios of medians to the baseline; `*` where the ranges do not overlap."""
    header = (f"{'program':<20s} {'n':>3s} {'arm':<7s} {'goodput tok/s':>20s} {'x base':>7s} "
              f"{'p50 latency s':>20s} {'x base':>7s} {'ver share':>9s} {'ver hit':>7s} {'evicted':>8s} "
              f"{'retract':>7s}")
    lines = [header]
    for program in programs:
        for n in ns:
            base = cells.get((program, n, "baseline"))
            for arm in arms:
                runs = cells.get((program, n, arm))
                if not runs:
                    continue
                goodput = [r["goodput"] for r in runs]
                latency = [r["p50_latency_s"] for r in runs]
                g_med, g_low, g_high = spread(goodput)
                l_med, l_low, l_high = spread(latency)
                g_ratio, g_sep = compare(goodput, [r["goodput"] for r in base], False) if base else (float("nan"), False)
                l_ratio, l_sep = compare(latency, [r["p50_latency_s"] for r in base], True) if base else (float("nan"), False)
                lines.append(
                    f"{program:<20s} {n:3d} {arm:<7s} {g_med:7.3f} [{g_low:5.2f}-{g_high:5.2f}] "
                    f"{g_ratio:5.2f}x{'*' if g_sep and arm != 'baseline' else ' '} "
                    f"{l_med:7.1f} [{l_low:5.1f}-{l_high:5.1f}] {l_ratio:5.2f}x{'*' if l_sep and arm != 'baseline' else ' '} "
                    f"{statistics.median(r['verifier_share'] for r in runs):9.2f} "
                    f"{statistics.median(r['verifier_cache_hit'] for r in runs):7.2f} "
                    f"{statistics.median(r['evicted_tokens'] for r in runs):8.0f} "
                    f"{statistics.median(r['retracted'] for r in runs):7.0f}")
    return "\n".join(lines)


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
                        median, low, high = spread([r[metric] for r in runs])
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


class SessionPool:
    """Started runtimes by settings, so interleaved cells that want the same runtimes do not restart them."""

    def __init__(self, live: int):
        self.live = live
        self.pool: OrderedDict[tuple, dict[str, Any]] = OrderedDict()

    def session(self, config: Any) -> tuple[Any, bool]:
        """A session for `config` and whether its runtimes were started for it."""
        from sgl_tts.app.session import Session, planned_runtimes

        key = tuple(sorted((name, repr(rc)) for name, rc in planned_runtimes(config)[1].items()))
        reuse = self.pool.pop(key, None)
        if reuse is None:
            while len(self.pool) >= self.live:
                for runtime in self.pool.popitem(last=False)[1].values():
                    runtime.stop()
        session = Session(config, reuse=reuse)
        session.pool_key = key
        return session, reuse is None

    def give_back(self, session: Any) -> None:
        self.pool[session.pool_key] = session.detach()

    def close(self) -> None:
        for runtimes in self.pool.values():
            for runtime in runtimes.values():
                runtime.stop()
        self.pool.clear()


def _base_config(args: argparse.Namespace) -> Any:
    from sgl_tts.app.session import load_run_config

    config = load_run_config(args.config)
    metrics = lambda rc: dataclasses.replace(rc, extra_args=[*rc.extra_args, "--enable-metrics"]) \
        if "--enable-metrics" not in rc.extra_args else rc
    scorer = config.scorer
    if scorer.runtime is not None:
        scorer = dataclasses.replace(scorer, runtime=metrics(scorer.runtime))
    search = dataclasses.replace(
        config.search, beam_width=args.beam_width, max_steps=args.max_steps, max_step_tokens=args.max_step_tokens,
        max_tokens=args.max_steps * args.max_step_tokens,
        step_delimiter=args.step_delimiter.encode().decode("unicode_escape"), seed=args.seed)
    return dataclasses.replace(config, generator=metrics(config.generator), scorer=scorer, search=search,
                               concurrency=args.concurrency or 3, log_dir=args.log_dir)


def run_bench(args: argparse.Namespace) -> int:
    from sgl_tts.fasttts.switches import describe_settings, from_label
    from sgl_tts.problems import load_problems

    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    programs = (args.programs or ",".join(PROGRAMS)).split(",")
    ns = [int(n) for n in (args.ns or "8,16,32").split(",")]
    arms = [Arm.parse(label) for label in (args.arms or ",".join(ARMS)).split(",")]
    repeats = args.repeats or 3
    base = _base_config(args)
    for arm in arms:
        from_label(arm.switches)
    problems = load_problems(base.dataset.name, limit=args.problems or 5, offset=base.dataset.offset)
    print(f"bench fasttts: programs={programs} n={ns} arms={[a.label for a in arms]} repeats={repeats} "
          f"problems={len(problems)} concurrency={base.concurrency} model={base.generator.model} "
          f"verifier={base.scorer.kind} beam_width={args.beam_width} steps<={args.max_steps}x{args.max_step_tokens} "
          f"KV budget {args.kv_budget_mib} MiB", flush=True)
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    pool = SessionPool(args.live_sessions)
    began = time.monotonic()
    try:
        for repeat in range(repeats):
            order = arms[repeat % len(arms):] + arms[: repeat % len(arms)]
            for arm in order:
                fast = from_label(arm.switches, kv_budget_mib=args.kv_budget_mib, hardware=args.hardware,
                                  prompt_tokens=args.prompt_tokens, max_speculative=args.max_speculative,
                                  engine_batch=args.engine_batch, seed=args.seed)
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
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench-fasttts.json").write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k != "func"},
             "cells": [{"program": p, "n": n, "arm": a, "runs": runs} for (p, n, a), runs in cells.items()]},
            indent=1, default=str))
        plot(cells, programs, ns, labels, out / "bench-fasttts.png")
        print(f"wrote {out / 'bench-fasttts.json'} and {out / 'bench-fasttts.png'}")
    return 0


def run_cell(pool: SessionPool, config: Any, problems: list[Any], describe: Any) -> dict[str, Any]:
    """One (program, n, arm) run over the problems, `config.concurrency` at a time, on flushed caches."""
    session, started = pool.session(config)
    try:
        if started:
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


def add_bench_fasttts_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser("fasttts", help="FastTTS ablation with repeats: baseline vs V, P, P+M, "
                                                         "P+M+S, all (Fig. 16)")
    parser.add_argument("--config", default="cpu-default",
                        help="run config (YAML path or packaged name): models, verifier")
    parser.add_argument("--quick", action="store_true",
                        help="beam search, n=8, baseline vs all, 3 problems, 3 repeats (about 10 minutes here)")
    parser.add_argument("--programs", default=None, help=f"comma-separated (default {','.join(PROGRAMS)})")
    parser.add_argument("--ns", default=None, help="comma-separated beam counts n (default 8,16,32)")
    parser.add_argument("--arms", default=None, help=f"comma-separated arms (default {','.join(ARMS)})")
    parser.add_argument("--problems", type=int, default=None, help="bundled problems per cell (default 5)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of every cell, interleaved (default 3)")
    parser.add_argument("--concurrency", type=int, default=None, help="searches at once (default 3)")
    parser.add_argument("--beam-width", type=int, default=4, help="children per kept beam (B)")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-step-tokens", type=int, default=24)
    parser.add_argument("--step-delimiter", default="\\n",
                        help="step delimiter, escapes allowed (default \\n: SmolLM2 writes a step per line)")
    parser.add_argument("--kv-budget-mib", type=float, default=24.0,
                        help="KV memory shared by generator and verifier (small enough to force evictions)")
    parser.add_argument("--hardware", default="this-machine", help="roofline profile for M")
    parser.add_argument("--prompt-tokens", type=int, default=80, help="expected prompt length (plan, floors)")
    parser.add_argument("--max-speculative", type=int, default=None, help="cap on one search's speculative requests")
    parser.add_argument("--engine-batch", type=int, default=16,
                        help="speculate only while the generator runs fewer requests than this")
    parser.add_argument("--live-sessions", type=int, default=2, help="runtime sets kept alive between cells")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="folder for the JSON of every run and the Fig. 16 style plot")
    parser.set_defaults(func=run_bench)
    return parser
