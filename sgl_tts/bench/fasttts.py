"""`sgl-tts bench fasttts`: FastTTS measured by the paper's own protocol (§5-6: Fig. 12, 13, 16), with repeats.

The protocol (`PROTOCOL`): one search at a time (batch size 1, "interactive edge scenarios"; `--concurrency`
can change it), n = 16, 64, 256 (`--ns`), the four programs of Fig. 11 (beam search, DVTS, dynamic branching,
varying granularity), and the arms baseline (FCFS, no speculation, a static 50/50 KV split, every path
re-scored from its start), P, P+M, P+M+S and all (V+P+M+S; V, verifier prefix reuse alone, can be asked for).
The KV budget follows the workload: each n runs at `--budget-fraction` of its working set (generator and
verifier, `sgl_tts.runtime.memory_plan.search_working_sets`), so that memory is as tight at n = 256 as at
n = 16 (a fixed budget is ample at small n and thrashes at large n). Each cell (program, n, fraction, arm)
runs `--repeats` times; the repeats are interleaved (repeat r runs every cell before repeat r+1 starts, and
the arm order rotates by one each repeat), so slow phases of a shared machine spread over all arms.

Reported per cell: the median with min-max over repeats of the mean precise goodput, the p50 completion
latency, the verifier's share of time and its cache hit, planned (`memory_plan.planned_verifier_hit` of the
verifier's KV tokens) and measured (Σ cached / Σ input tokens of the scorer's calls, from each result's
`verifier_iterations`), the generator runtime's evicted tokens and retracted requests (its Prometheus
counters), the straggler tails' idle share of the iterations' slot-time and how much of it S's requests held
(`search.api.straggler_tail`, `SpeculationStats.slot_s`), and S's polls with an idle engine slot, launches, and
head-start tokens used and discarded. A ratio
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
from pathlib import Path
from typing import Any

from sgl_tts.measure.summary import median_min_max, median_range
from sgl_tts.paths import write_atomic
from sgl_tts.measure.tables import Column, console_table
from sgl_tts.runtime.http_client import http_text, request
from sgl_tts.search.stopping import Stopping

ARMS = ("baseline", "P", "P+M", "P+M+S", "all")
PROGRAMS = ("beam_search", "dvts", "dynamic_branching", "varying_granularity")
NS = "16,64,256"
BUDGET_FRACTIONS = "0.5"
CONCURRENCY = 1
QUICK = {"programs": "beam_search", "ns": "16", "arms": "baseline,all", "problems": 3, "repeats": 3}
PROTOCOL = ("FastTTS §5-6: one search at a time (concurrency {concurrency}), n in {ns}, KV budget = "
            "{fractions} x the working set of generator + verifier at each n (memory_plan.search_working_sets)")
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


def server_counters(runtime: Any, counters: dict[str, str] = SERVER_COUNTERS) -> dict[str, float]:
    """The runtime's Prometheus `counters` (name -> metric; default: eviction and retraction), each summed over
    its label sets; 0 when the runtime exports no metrics."""
    try:
        text = http_text(runtime.url + "/metrics", timeout=30)
    except OSError:
        return {name: 0.0 for name in counters}
    return read_counters(text, counters)


def read_counters(text: str, counters: dict[str, str]) -> dict[str, float]:
    """From Prometheus exposition `text`: each of `counters` (name -> metric) summed over its label sets (0 when
    absent)."""
    return {name: sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(metric)}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            for name, metric in counters.items()}


def flush_caches(runtimes: dict[str, Any]) -> None:
    for runtime in runtimes.values():
        request("POST", runtime.url + "/flush_cache?timeout=60", timeout=60)


def measure(results: list[Any], server: dict[str, float] | None = None, plan: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """One cell's numbers: mean precise goodput, p50 latency, verifier share and cache hit (Σ cached / Σ input
    tokens of the scorer's calls, each result's `verifier_iterations`), S's counts summed over the searches,
    server counters, and `plan` (the cell's budget and split, `cell_plan`) as given."""
    from sgl_tts.measure.metrics import aggregate_rows

    summary = aggregate_rows(results)
    speculation: dict[str, int] = {}
    for result in results:
        for key, value in result.extra.get("speculation", {}).items():
            speculation[key] = speculation.get(key, 0) + value
    calls = [call for result in results for call in result.extra.get("verifier_iterations", [])]
    read, cached = sum(c["input_tokens"] for c in calls), sum(c["cached_tokens"] for c in calls)
    tails = [tail for result in results for tail in result.extra.get("straggler_tails", [])]
    tail_idle = sum(t["idle_slot_s"] for t in tails)
    slot_time = sum(t["requests"] * t["span_s"] for t in tails)
    return {
        **(plan or {}),
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
        # the iterations' straggler tails (search.api.straggler_tail): idle slot-seconds, their share of the
        # iterations' slot-time, and the share of them S's requests held (> 1: S ran past the tail's slots)
        "tail_idle_slot_s": tail_idle,
        "tail_idle_share": tail_idle / slot_time if slot_time else 0.0,
        "tail_filled_by_s": speculation.get("slot_s", 0.0) / tail_idle if tail_idle else 0.0,
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


Cell = tuple[str, int, float, str]  # (program, n, budget fraction, arm)

TABLE_COLUMNS = (Column("program", 20, "<"), Column("n", 3), Column("frac", 4), Column("arm", 7, "<"),
                 Column("goodput tok/s", 20), Column("x base", 7), Column("p50 latency s", 20), Column("x base", 7),
                 Column("ver share", 9), Column("ver hit plan/meas", 17), Column("KV gen/ver tok", 14),
                 Column("evicted", 8), Column("retract", 7), Column("tail idle share/S fill", 22),
                 Column("S idle/polls launched", 21),
                 Column("S tok used/discarded", 20))


def _median(runs: list[dict[str, Any]], get: Any) -> float:
    values = [v for v in (get(r) for r in runs) if v is not None]
    return statistics.median(values) if values else float("nan")


def format_table(cells: dict[Cell, list[dict[str, Any]]], programs: list[str], ns: list[int],
                 fractions: list[float], arms: list[str]) -> str:
    """Medians [min-max] per cell, with ratios of medians to the baseline; `*` where the ranges do not overlap."""
    return console_table(TABLE_COLUMNS, table_rows(cells, programs, ns, fractions, arms))


def table_rows(cells: dict[Cell, list[dict[str, Any]]], programs: list[str], ns: list[int],
               fractions: list[float], arms: list[str]) -> list[list[str]]:
    """The cells of `format_table` (and of the Markdown table), one row per measured arm."""
    rows = []
    for program in programs:
        for n in ns:
            for fraction in fractions:
                base = cells.get((program, n, fraction, "baseline"))
                for arm in arms:
                    runs = cells.get((program, n, fraction, arm))
                    if not runs:
                        continue
                    goodput = [r["goodput"] for r in runs]
                    latency = [r["p50_latency_s"] for r in runs]
                    nan = (float("nan"), False)
                    g_ratio, g_sep = compare(goodput, [r["goodput"] for r in base], False) if base else nan
                    l_ratio, l_sep = compare(latency, [r["p50_latency_s"] for r in base], True) if base else nan
                    spec = lambda key: _median(runs, lambda r: r["speculation"].get(key, 0))
                    rows.append([
                        program, str(n), f"{fraction:g}", arm, median_range(goodput, "7.3f", "5.2f"),
                        f"{g_ratio:5.2f}x{'*' if g_sep and arm != 'baseline' else ' '}",
                        median_range(latency, "7.1f", "5.1f"),
                        f"{l_ratio:5.2f}x{'*' if l_sep and arm != 'baseline' else ' '}",
                        f"{_median(runs, lambda r: r['verifier_share']):.2f}",
                        f"{_median(runs, lambda r: r.get('planned_verifier_hit')):.2f}/"
                        f"{_median(runs, lambda r: r['verifier_cache_hit']):.2f}",
                        f"{_median(runs, lambda r: r.get('kv_generator_tokens')):.0f}/"
                        f"{_median(runs, lambda r: r.get('kv_verifier_tokens')):.0f}",
                        f"{_median(runs, lambda r: r['evicted_tokens']):.0f}",
                        f"{_median(runs, lambda r: r['retracted']):.0f}",
                        f"{_median(runs, lambda r: r.get('tail_idle_share')):.2f}/"
                        + (f"{_median(runs, lambda r: r.get('tail_filled_by_s')):.2f}" if runs[0]["speculation"]
                           else "-"),
                        f"{spec('idle_slot_polls'):.0f}/{spec('polls'):.0f} {spec('launched'):.0f}"
                        if runs[0]["speculation"] else "-",
                        f"{spec('tokens_used'):.0f}/{spec('tokens_discarded'):.0f}" if runs[0]["speculation"] else "-"])
    return rows


def format_budgets(budgets: dict[tuple[int, float], dict[str, Any]]) -> str:
    """One line per (n, fraction): the working sets and the budget, in tokens and MiB."""
    columns = (Column("n", 4), Column("frac", 4), Column("W gen tok", 9), Column("W ver tok", 9),
               Column("W MiB", 8), Column("budget MiB", 10), Column("note", 24, "<"))
    rows = [[str(n), f"{fraction:g}", str(b["working_set_tokens"]["generator"]),
             str(b["working_set_tokens"]["verifier"]), f"{b['working_set_mib']:.1f}", f"{b['budget_mib']:.1f}",
             "raised to the floors" if b["raised_to_floors"] else ""]
            for (n, fraction), b in sorted(budgets.items())]
    return console_table(columns, rows)


def cell_budget(n: int, fraction: float, beam_width: int, prompt_tokens: int, max_tokens: int,
                max_step_tokens: int, kv_bytes: dict[str, int], searches: int = 1) -> dict[str, Any]:
    """The KV budget of a cell: `fraction` of the generator's and verifier's working sets in bytes
    (`memory_plan.search_working_sets`, `kv_bytes` per token by role), raised where needed so that equal halves
    each hold the longest request (prompt + max_tokens + max_step_tokens: the baseline's static split)."""
    from sgl_tts.runtime.memory_plan import MIB, longest_request_tokens, search_working_sets

    if not 0 < fraction:
        raise ValueError(f"a budget fraction must be positive, got {fraction}")
    sets = search_working_sets(n, beam_width, prompt_tokens, max_tokens, max_step_tokens, searches)
    working = sum(sets[role] * kv_bytes[role] for role in sets)
    floor = longest_request_tokens(prompt_tokens, max_tokens, max_step_tokens)
    floors = 2 * max(floor * kv_bytes[role] for role in sets)
    budget = max(fraction * working, floors)
    return {"working_set_tokens": sets, "working_set_mib": working / MIB, "budget_mib": budget / MIB,
            "raised_to_floors": budget > fraction * working}


def plot(cells: dict[Cell, list[dict[str, Any]]], programs: list[str], ns: list[int], fractions: list[float],
         arms: list[str], path: Path) -> None:
    """FastTTS Fig. 12 (goodput vs n) and Fig. 13 (p50 completion latency vs n): one panel per program (and
    budget fraction), one line per arm, the median with min-max bars; n on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(program, fraction) for fraction in fractions for program in programs]
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 6.4), squeeze=False)
    for col, (program, fraction) in enumerate(panels):
        for row, (metric, title) in enumerate((("goodput", "Fig. 12: precise goodput, tok/s"),
                                               ("p50_latency_s", "Fig. 13: p50 completion latency, s"))):
            ax = axes[row][col]
            for arm in arms:
                points = [(n, median_min_max([r[metric] for r in cells[(program, n, fraction, arm)]]))
                          for n in ns if cells.get((program, n, fraction, arm))]
                if not points:
                    continue
                xs = [n for n, _ in points]
                medians = [m for _, (m, _, _) in points]
                errors = [[m - low for _, (m, low, _) in points], [high - m for _, (m, _, high) in points]]
                ax.errorbar(xs, medians, yerr=errors, marker="o", capsize=2, label=arm)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("n (beams)")
            ax.set_title(f"{program}, budget {fraction:g}x working set\n{title}", fontsize=8)
            if row == 0 and col == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What `sgl-tts bench fasttts` runs; lists are comma-separated text, None takes the default (or `quick`'s)."""

    config: str = "cpu-default"  # run config (YAML path or packaged name): models, verifier
    quick: bool = False  # QUICK's values for what is not given
    programs: str | None = None  # default: PROGRAMS
    ns: str | None = None  # beam counts n (default NS)
    arms: str | None = None  # default: ARMS
    problems: int | None = None  # bundled problems per cell (default 5)
    repeats: int | None = None  # runs of every cell, interleaved (default 3)
    concurrency: int = CONCURRENCY  # searches at once (the paper: 1)
    budget_fraction: str = BUDGET_FRACTIONS  # KV budget as fractions of the working set, one cell each
    beam_width: int = 4
    max_steps: int = 3
    max_step_tokens: int = 24
    step_delimiter: str = "\\n"  # escapes allowed
    kv_budget_mib: float | None = None  # a fixed budget instead of the fractions of the working set
    hardware: str = "this-machine"
    prompt_tokens: int | None = None  # None: the longest prompt of the bench's problems (`longest_prompt_tokens`)
    max_speculative: int | None = None
    engine_batch: int | None = None  # None: from the generator's KV, on a CPU at most CPU_SPECULATION_BATCH
    live_sessions: int = 2
    seed: int = 0
    log_dir: str | None = None
    out: str | None = None  # folder for the JSON, the Markdown table and the plots of every run
    merge: str | None = None  # comma-separated JSON files of earlier runs: report them together, run nothing


def _base_config(options: BenchOptions) -> Any:
    from sgl_tts.app.session import load_run_config

    config = with_metrics(load_run_config(options.config))
    search = dataclasses.replace(
        config.search, beam_width=options.beam_width, max_steps=options.max_steps,
        max_step_tokens=options.max_step_tokens, max_tokens=options.max_steps * options.max_step_tokens,
        step_delimiter=options.step_delimiter.encode().decode("unicode_escape"), seed=options.seed,
        stopping=Stopping())  # FastTTS by its own protocol: every search runs to its end
    return dataclasses.replace(config, search=search, concurrency=options.concurrency, log_dir=options.log_dir)


def with_metrics(config: Any) -> Any:
    """The run config with SGLang's Prometheus metrics (`--enable-metrics`: /metrics) on its generator and, when
    it has one, its scorer runtime."""
    metrics = lambda rc: dataclasses.replace(rc, extra_args=[*rc.extra_args, "--enable-metrics"]) \
        if "--enable-metrics" not in rc.extra_args else rc
    scorer = config.scorer
    if scorer.runtime is not None:
        scorer = dataclasses.replace(scorer, runtime=metrics(scorer.runtime))
    return dataclasses.replace(config, generator=metrics(config.generator), scorer=scorer)


def protocol_of(options: BenchOptions, ns: list[int], fractions: list[float]) -> str:
    if options.kv_budget_mib is not None:
        budget = f"a fixed KV budget of {options.kv_budget_mib:g} MiB at every n"
        return PROTOCOL.split(", KV budget")[0].format(concurrency=options.concurrency, ns=ns) + ", " + budget
    return PROTOCOL.format(concurrency=options.concurrency, ns=ns, fractions="/".join(f"{f:g}" for f in fractions))


def resolved(options: BenchOptions) -> tuple[BenchOptions, list[str], list[int], list[float], list[FastTTSArm], int]:
    """(options with `quick`'s values filled in, programs, ns, budget fractions, arms, repeats): what runs."""
    if options.quick:
        options = dataclasses.replace(options, **{key: value for key, value in QUICK.items()
                                                  if getattr(options, key) is None})
    programs = (options.programs or ",".join(PROGRAMS)).split(",")
    ns = [int(n) for n in (options.ns or NS).split(",")]
    fractions = [float(f) for f in options.budget_fraction.split(",")]
    arms = [FastTTSArm.parse(label) for label in (options.arms or ",".join(ARMS)).split(",")]
    return options, programs, ns, fractions, arms, options.repeats or 3


def run_bench(options: BenchOptions) -> int:
    if options.merge:
        return merge_runs(options, options.merge.split(","))
    from sgl_tts.app.session import SessionPool
    from sgl_tts.fasttts.switches import describe_settings, from_label
    from sgl_tts.problems import load_problems
    from sgl_tts.runtime.memory_plan import model_spec_for

    options, programs, ns, fractions, arms, repeats = resolved(options)
    base = _base_config(options)
    for arm in arms:
        from_label(arm.switches)
    kv_bytes = {"generator": model_spec_for(base.generator).kv_bytes_per_token}
    kv_bytes["verifier"] = (model_spec_for(base.scorer.runtime).kv_bytes_per_token if base.scorer.runtime
                            else kv_bytes["generator"])
    problems = load_problems(base.dataset.name, limit=options.problems or 5, offset=base.dataset.offset)
    if options.prompt_tokens is None:
        options = dataclasses.replace(options, prompt_tokens=longest_prompt_tokens(problems, base.generator))
    budgets = {(n, fraction): cell_budget(n, fraction, options.beam_width, options.prompt_tokens,
                                          base.search.max_tokens, options.max_step_tokens, kv_bytes,
                                          options.concurrency)
               for n in ns for fraction in fractions}
    protocol = protocol_of(options, ns, fractions)
    print(f"bench fasttts ({protocol}): programs={programs} arms={[a.label for a in arms]} repeats={repeats} "
          f"problems={len(problems)} model={base.generator.model} verifier={base.scorer.kind} "
          f"beam_width={options.beam_width} steps<={options.max_steps}x{options.max_step_tokens} "
          f"prompt_tokens={options.prompt_tokens}", flush=True)
    if options.kv_budget_mib is None:
        print(format_budgets(budgets), flush=True)
    cells: dict[Cell, list[dict[str, Any]]] = {}
    pool = SessionPool(options.live_sessions)
    began = time.monotonic()
    try:
        for repeat in range(repeats):
            order = arms[repeat % len(arms):] + arms[: repeat % len(arms)]
            # n and the fraction set the budget, hence the runtimes: the programs run on the same ones
            for n in ns:
                for fraction in fractions:
                    budget = budgets[(n, fraction)]
                    for arm in order:
                        fast = from_label(arm.switches, kv_budget_mib=options.kv_budget_mib or budget["budget_mib"],
                                          hardware=options.hardware, prompt_tokens=options.prompt_tokens,
                                          max_speculative=options.max_speculative,
                                          engine_batch=options.engine_batch, seed=options.seed)
                        for program in programs:
                            search = dataclasses.replace(base.search, program=program, n=n)
                            scorer = dataclasses.replace(base.scorer, incremental=arm.verifier_reuse)
                            config = dataclasses.replace(base, search=search, scorer=scorer, fasttts=fast)
                            row = run_cell(pool, config, problems, describe_settings)
                            row.update(budget)
                            cells.setdefault((program, n, fraction, arm.label), []).append(row)
                            print(f"[repeat {repeat + 1} {program} n={n} x{fraction:g} {arm.label}] goodput "
                                  f"{row['goodput']:.3f} tok/s, p50 {row['p50_latency_s']:.1f} s, verifier share "
                                  f"{row['verifier_share']:.2f}, verifier cache hit planned "
                                  f"{row['planned_verifier_hit']} measured {row['verifier_cache_hit']:.2f}, "
                                  f"evicted {row['evicted_tokens']:.0f}, retracted {row['retracted']:.0f}, "
                                  f"errors {row['errors']}"
                                  + (f", speculation {row['speculation']}" if row["speculation"] else ""), flush=True)
    except BaseException:
        if cells:  # what was measured before the failure is kept: printed, and written with --out
            print("\nbench fasttts stopped by an error; the cells measured so far:", flush=True)
            report(options, cells, programs, ns, fractions, arms, repeats, budgets, protocol, ran_for(began),
                   partial=True)
        raise
    finally:
        pool.close()
    report(options, cells, programs, ns, fractions, arms, repeats, budgets, protocol, ran_for(began))
    return 0


def merge_runs(options: BenchOptions, paths: list[str]) -> int:
    """The table and plots of earlier runs' `bench-fasttts.json` files together (say, one run per n, each
    started on its own so that only one n's runtimes are alive at a time); a cell measured in several files
    pools its runs. Raises ValueError naming a file that is not a bench fasttts JSON."""
    cells: dict[Cell, list[dict[str, Any]]] = {}
    budgets: dict[tuple[int, float], Any] = {}
    protocols: list[str] = []
    partial = False
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            runs = [((c["program"], int(c["n"]), float(c["fraction"]), c["arm"]), c["runs"]) for c in data["cells"]]
            protocol = data["protocol"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--merge {path}: not a bench fasttts JSON (protocol, cells with program, n, "
                             f"fraction, arm, runs): {exc}") from None
        for key, measured in runs:
            cells.setdefault(key, []).extend(measured)
        for budget in data.get("budgets", []):
            budgets[(int(budget["n"]), float(budget["fraction"]))] = {
                key: value for key, value in budget.items() if key not in ("n", "fraction")}
        protocols += [protocol] if protocol not in protocols else []
        partial = partial or bool(data.get("partial"))
    if not cells:
        raise ValueError(f"--merge {','.join(paths)}: no measured cell in these files")
    order = lambda values: list(dict.fromkeys(values))  # noqa: E731
    programs = order(p for p in PROGRAMS if any(key[0] == p for key in cells)) + order(
        key[0] for key in cells if key[0] not in PROGRAMS)
    labels = order([a for a in ARMS if any(key[3] == a for key in cells)] + [key[3] for key in cells])
    ns, fractions = sorted({key[1] for key in cells}), sorted({key[2] for key in cells})
    repeats = max(len(runs) for runs in cells.values())
    report(options, cells, programs, ns, fractions, [FastTTSArm.parse(label) for label in labels], repeats,
           budgets, " + ".join(protocols), f"merged from {', '.join(paths)}", partial, sources=paths)
    return 0


def ran_for(began: float) -> str:
    return f"{time.monotonic() - began:.0f} s in all"


def report(options: BenchOptions, cells: dict[Cell, list[dict[str, Any]]], programs: list[str], ns: list[int],
           fractions: list[float], arms: list[FastTTSArm], repeats: int, budgets: dict[tuple[int, float], Any],
           protocol: str, made: str, partial: bool = False, sources: list[str] | None = None) -> None:
    """Print the table and, with `--out`, write the JSON, the Markdown table and the plots (`made`: how long the
    run took, or what was merged; `partial`: of the cells measured before a failure; `sources`: the JSON files
    merged)."""
    from sgl_tts.measure.tables import markdown_table

    labels = [a.label for a in arms]
    rows = table_rows(cells, programs, ns, fractions, labels)
    print(f"\nFastTTS, {protocol}; {repeats} interleaved repeats per cell ({made}); median [min-max]; * = ranges "
          f"do not overlap the baseline's" + ("; PARTIAL" if partial else ""))
    print(console_table(TABLE_COLUMNS, rows))
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "bench-fasttts.json", json.dumps(
            {"protocol": protocol, "concurrency": options.concurrency, "partial": partial,
             "budget_rule": (f"fixed {options.kv_budget_mib:g} MiB" if options.kv_budget_mib is not None
                             else f"fractions {fractions} of the working set"),
             "budgets": [{"n": n, "fraction": f, **b} for (n, f), b in budgets.items()],
             "args": dataclasses.asdict(options), **({"merged_from": sources} if sources else {}),
             "cells": [{"program": p, "n": n, "fraction": f, "arm": a, "runs": runs}
                       for (p, n, f, a), runs in cells.items()]},
            indent=1, default=str))
        write_atomic(out / "bench-fasttts.md",
            f"Protocol: {protocol}; {repeats} interleaved repeats ({made}); median [min-max]; * = ranges separate."
            + (" PARTIAL: the run stopped on an error." if partial else "") + "\n\n"
            + markdown_table([c.title for c in TABLE_COLUMNS], rows) + "\n")
        plot(cells, programs, ns, fractions, labels, out / "bench-fasttts.png")
        print(f"wrote {out / 'bench-fasttts.json'}, {out / 'bench-fasttts.md'} and {out / 'bench-fasttts.png'}")


def longest_prompt_tokens(problems: list[Any], generator: Any, tokenizer: Any = None) -> int:
    """The tokens of the longest of `problems`' prompts as the generator receives them (its chat format,
    `frontend.backend.chat_prompt`): what the plan's workload and the budget floors assume (`prompt_tokens`).
    `tokenizer`: the generator's (default: loaded from its model)."""
    from sgl_tts.frontend.backend import chat_prompt

    if tokenizer is None:
        from transformers import AutoTokenizer

        from sgl_tts.runtime.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(generator.model))
    return max(len(tokenizer.encode(chat_prompt(tokenizer, problem.question), add_special_tokens=False))
               for problem in problems)


def cell_plan(settings: Any, search: Any, prompt_tokens: int, searches: int) -> dict[str, Any]:
    """The split a cell's runtimes were started with (`fasttts.switches.RuntimeSettings`): KV tokens per
    runtime, S's engine batch, and the verifier cache hit that split plans (`memory_plan.planned_verifier_hit`;
    None when the scorer shares the generator's cache without a plan)."""
    import math

    from sgl_tts.runtime.memory_plan import planned_verifier_hit

    verifier = settings.verifier.max_total_tokens if settings.verifier is not None else (
        settings.plan.verifier.max_total_tokens if settings.plan is not None and settings.plan.budgets else None)
    kept = max(1, math.ceil(search.n / search.beam_width))
    planned = (round(planned_verifier_hit(verifier, prompt_tokens, search.n, kept, search.max_tokens,
                                          search.max_step_tokens, searches), 3) if verifier else None)
    return {"kv_generator_tokens": settings.generator.max_total_tokens, "kv_verifier_tokens": verifier,
            "engine_batch": settings.engine_batch, "planned_verifier_hit": planned}


def run_cell(pool: Any, config: Any, problems: list[Any], describe: Any) -> dict[str, Any]:
    """One (program, n, fraction, arm) run over the problems, `config.concurrency` at a time, on flushed caches,
    with a session from `pool` (`sgl_tts.app.session.SessionPool`)."""
    session = pool.switch(config)
    try:
        if len(session.reused) < len(session.runtimes):
            print(f"  runtimes started: {describe(session.fasttts)}", flush=True)
            session.solve(problems[0], dataclasses.replace(config.search, n=2, max_steps=1))  # warm-up
        flush_caches(session.runtimes)
        before_server = server_counters(session.runtimes["generator"])
        results = [result for _, result in session.solve_all(problems)]
        after_server = server_counters(session.runtimes["generator"])
        plan = cell_plan(session.fasttts, config.search, config.fasttts.prompt_tokens, config.concurrency)
    finally:
        pool.give_back(session)
    return measure(results, {k: after_server[k] - before_server[k] for k in SERVER_COUNTERS}, plan)
