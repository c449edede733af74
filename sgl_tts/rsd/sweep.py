"""RSD statistics over a run, and the delta sweep `sgl-tts rsd-sweep` (RSD Fig. 5 and Fig. B.1).

Statistics (`run_statistics`): from the step records the rsd program puts in `SearchResult.extra["rsd"]`:
fraction of problems solved by the draft alone, target invocation rate, tokens per model (rejected draft
tokens included), FLOPs by the 2N-per-token rule, seconds per model, and, beyond the paper, latency and
throughput. Latency is measured twice: wall-clock per problem (`total_time_s`) and the sum of the model
calls' measured seconds (RSD is sequential within a problem, so the two differ only by the program's own
overhead; the second one is what a sweep can replay).

How the sweep runs: the path RSD takes depends on every acceptance decision, so each delta is a full rerun
of the rsd program over the problems. The reruns share one `sgl_tts.rsd.step_cache.StepCache`, keyed by the context
(prompts, steps so far, step budget): the draft step at a context, its PRM score and the target's step at
that context are computed once, the first time any delta reaches that context, and reused by every
delta whose path passes through it. Deltas mostly agree on early steps, so most of the work is shared.
- At temperature 0 (the paper's setting and the default) a cached entry is exactly what a rerun would
  compute, up to the server's floating-point nondeterminism: the sweep is faithful.
- With sampling, deltas share each context's samples (common random numbers): the comparison between
  deltas has less noise than independent reruns would; `--no-cache` gives independent reruns.
Records of a cached step carry the seconds measured when it was computed, so the per-delta latency and
FLOPs are those of a run without the cache; the `elapsed` column is the time the sweep itself spent.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from sgl_tts.search.grading import grade
from sgl_tts.search.records import SearchResult
from sgl_tts.rsd.acceptance import MODELS, StepRecord, summarize_run

SWEEP_WEIGHTINGS = ("binary", "logistic")  # the weightings that delta parametrises
DEFAULT_DELTAS = tuple(round(0.1 * i, 1) for i in range(11))


def step_records(result: SearchResult) -> list[StepRecord]:
    """The rsd program's step records of one result."""
    if "rsd" not in result.extra:
        raise ValueError(f"result of problem {result.problem_id} has no RSD records (program {result.program})")
    return [StepRecord(**step) for step in result.extra["rsd"]["steps"]]


def _serial_seconds(records: Sequence[StepRecord]) -> float:
    return sum(r.draft_time_s + r.target_time_s + r.prm_time_s for r in records)


def run_statistics(results: Sequence[SearchResult]) -> dict[str, Any]:
    """Run-level RSD statistics over the results that carry RSD records (see the module docstring)."""
    results = [r for r in results if "rsd" in r.extra]
    if not results:
        raise ValueError("no RSD results to summarise")
    problems = [step_records(r) for r in results]
    params = results[0].extra["rsd"]["params"]
    counts = [params.get(model) for model in MODELS]
    stats = dataclasses.asdict(summarize_run(problems, *(count or 0 for count in counts)))
    if None in counts:
        stats["flops"] = stats["total_flops"] = None
    stats["params"] = dict(params)
    stats["flops_per_problem"] = None if stats["total_flops"] is None else stats["total_flops"] / len(problems)
    serial = [_serial_seconds(records) for records in problems]
    solution_tokens = sum(c.tokens for r in results for c in r.candidates)
    stats["solution_tokens"] = solution_tokens
    stats["latency_s"] = statistics.fmean(r.total_time_s for r in results)  # mean wall seconds per problem
    stats["model_latency_s"] = statistics.fmean(serial)  # mean model-call seconds per problem
    # Tokens of the kept solution per second of a problem's model calls: the decode rate a user sees.
    stats["throughput_tok_s"] = solution_tokens / sum(serial) if sum(serial) > 0 else None
    stats["target_is_draft_model"] = any(r.extra["rsd"]["target_is_draft_model"] for r in results)
    return stats


def _si(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def target_note(settings: dict[str, Any] | None = None) -> str:
    return ("note: the target is the draft model itself (same weights); a rejected step is rewritten by the "
            "same model" + (", greedily, so into the same text (up to numerical noise): accuracy barely "
                            "depends on delta here" if settings and settings.get("temperature") == 0 else "")
            + ". This setup shows RSD's mechanism and costs, not its accuracy gain.")


def summary_lines(results: Sequence[SearchResult]) -> list[str]:
    """The RSD lines of the `sgl-tts run` report."""
    stats = run_statistics(results)
    settings = next(r.extra["rsd"]["settings"] for r in results if "rsd" in r.extra)
    tokens, seconds, flops = stats["tokens"], stats["time_s"], stats["flops"] or {}
    lines = [
        f"rsd: weighting {settings['weighting']} delta {settings['delta']} | steps {stats['steps']} | "
        f"solved by draft alone {stats['draft_only_fraction']:.0%} of problems | "
        f"target invocation rate {stats['target_invocation_rate']:.0%} of steps",
        f"rsd tokens: draft {tokens['draft']} (rejected {stats['rejected_draft_tokens']}), "
        f"target {tokens['target']}, prm {tokens['prm']} | "
        f"seconds: draft {seconds['draft']:.1f}, target {seconds['target']:.1f}, prm {seconds['prm']:.1f}",
        "rsd FLOPs (2N per token): " + (", ".join(f"{m} {_si(flops[m], 'FLOP')}" for m in MODELS)
                                        + f" | total {_si(stats['total_flops'], 'FLOP')}, "
                                        f"{_si(stats['flops_per_problem'], 'FLOP')} per problem"
                                        if stats["total_flops"] is not None else "n/a (parameter counts unknown)"),
        f"rsd latency per problem: wall {stats['latency_s']:.1f} s mean, "
        f"model calls {stats['model_latency_s']:.1f} s mean | "
        f"throughput {_si(stats['throughput_tok_s'], 'tok/s')} (solution tokens / model-call seconds)",
    ]
    if stats["target_is_draft_model"]:
        lines.append(target_note(settings))
    return lines


# --- the sweep --------------------------------------------------------------------------------------------


@dataclass
class SweepRow:
    delta: float
    problems: int
    accuracy: float
    draft_only_fraction: float
    target_invocation_rate: float
    flops_per_problem: float | None
    tokens: dict[str, int]
    latency_s: float  # mean per problem, sum of the model calls' measured seconds
    throughput_tok_s: float | None
    elapsed_s: float  # what this delta's pass of the sweep took (less than latency when cached)
    cache_hits: int
    by_level: dict[str, dict[str, float]] = field(default_factory=dict)


def _level(problem: Any) -> str | None:
    level = (getattr(problem, "meta", None) or {}).get("level")
    return None if level is None else str(level)


def sweep_row(delta: float, problems: Sequence[Any], results: Sequence[SearchResult], elapsed_s: float) -> SweepRow:
    correct = [problem.gold is not None and grade(result.answer, problem.gold)
               for problem, result in zip(problems, results)]
    stats = run_statistics(results)
    by_level: dict[str, dict[str, float]] = {}
    levels = sorted({lv for p in problems if (lv := _level(p)) is not None})
    for level in levels:
        members = [i for i, p in enumerate(problems) if _level(p) == level]
        level_stats = run_statistics([results[i] for i in members])
        by_level[level] = {"problems": len(members), "accuracy": sum(correct[i] for i in members) / len(members),
                           "draft_only_fraction": level_stats["draft_only_fraction"],
                           "target_invocation_rate": level_stats["target_invocation_rate"]}
    return SweepRow(
        delta=delta, problems=len(results), accuracy=sum(correct) / len(correct),
        draft_only_fraction=stats["draft_only_fraction"], target_invocation_rate=stats["target_invocation_rate"],
        flops_per_problem=stats["flops_per_problem"], tokens=stats["tokens"],
        latency_s=stats["model_latency_s"], throughput_tok_s=stats["throughput_tok_s"], elapsed_s=elapsed_s,
        cache_hits=sum(r.extra["rsd"]["cache_hits"] for r in results), by_level=by_level)


def run_sweep(problems: Sequence[Any], deltas: Sequence[float], runtimes: Any, search: Any, concurrency: int = 4,
              cache: bool = True, on_delta=None, params: dict[str, int | None] | None = None,
              ) -> tuple[list[SweepRow], dict[float, list]]:
    """Run `search.program` (RSD: a program whose settings have RSD's `delta` and `weighting`) with `search` (its
    settings but delta) over `problems` once per delta; returns the rows and each delta's results. `params`: the
    parameter counts for FLOPs, if the runtimes do not give them."""
    from sgl_tts.rsd.step_cache import StepCache
    from sgl_tts.search.programs import load_program, program_settings

    run = load_program(search.program)
    settings = program_settings(search.program, search.settings, "rsd-sweep")
    if not hasattr(settings, "delta") or not hasattr(settings, "weighting"):
        raise ValueError(f"the sweep varies search.settings.delta: program {search.program!r} has no RSD settings")
    if settings.weighting not in SWEEP_WEIGHTINGS:
        raise ValueError(f"the sweep varies search.settings.delta, which weighting {settings.weighting!r} ignores: "
                         f"use one of {', '.join(SWEEP_WEIGHTINGS)}")
    shared = StepCache() if cache else None
    rows, all_results = [], {}
    for delta in deltas:
        swept = dataclasses.replace(search, settings=dataclasses.replace(settings, delta=delta))
        began = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(lambda problem: run(problem, swept, runtimes, step_cache=shared, params=params),
                                    problems))
        row = sweep_row(delta, problems, results, time.monotonic() - began)
        rows.append(row)
        all_results[delta] = results
        if on_delta is not None:
            on_delta(row)
    return rows, all_results


TABLE_COLUMNS = ("delta", "accuracy", "draft only", "target rate", "FLOPs/problem", "draft tok", "target tok",
                 "prm tok", "latency s", "tok/s", "elapsed s")


def table_cells(row: SweepRow) -> list[str]:
    return [f"{row.delta:.2f}", f"{row.accuracy:.0%}", f"{row.draft_only_fraction:.0%}",
            f"{row.target_invocation_rate:.0%}", _si(row.flops_per_problem), str(row.tokens["draft"]),
            str(row.tokens["target"]), str(row.tokens["prm"]), f"{row.latency_s:.1f}",
            "n/a" if row.throughput_tok_s is None else f"{row.throughput_tok_s:.1f}", f"{row.elapsed_s:.0f}"]


def plot_sweep(rows: Sequence[SweepRow], path: Path, title: str) -> None:
    """Fig. 5 of the paper: accuracy (line) and problems solved by the draft alone (bars) against delta; a
    second panel with FLOPs and latency per problem."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deltas = [row.delta for row in rows]
    width = 0.6 * min((b - a for a, b in zip(deltas, deltas[1:])), default=0.1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = left.twinx()
    bars.bar(deltas, [100 * row.draft_only_fraction for row in rows], width=width, color="tab:orange", alpha=0.35,
             label="solved by draft alone (%)")
    bars.set_ylabel("solved by draft alone (%)")
    bars.set_ylim(0, 105)
    left.plot(deltas, [100 * row.accuracy for row in rows], "o-", color="tab:blue", label="accuracy (%)")
    left.set_zorder(bars.get_zorder() + 1)
    left.patch.set_visible(False)
    left.set_xlabel("threshold delta")
    left.set_ylabel("accuracy (%)")
    left.set_ylim(0, 105)
    left.set_title("accuracy and draft-only problems")
    handles = left.get_legend_handles_labels()[0] + bars.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], loc="lower left", fontsize=8)

    if all(row.flops_per_problem is not None for row in rows):
        right.plot(deltas, [row.flops_per_problem for row in rows], "s-", color="tab:green", label="FLOPs / problem")
    right.set_xlabel("threshold delta")
    right.set_ylabel("FLOPs per problem (2N per token)")
    right.set_title("cost")
    latency = right.twinx()
    latency.plot(deltas, [row.latency_s for row in rows], "^--", color="tab:red", label="latency / problem (s)")
    latency.set_ylabel("latency per problem (s)")
    handles = right.get_legend_handles_labels()[0] + latency.get_legend_handles_labels()[0]
    right.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_levels(rows: Sequence[SweepRow], path: Path, title: str) -> None:
    """Fig. B.1 of the paper: accuracy and draft-only fraction per difficulty level against delta."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({level for row in rows for level in row.by_level})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for level in levels:
        points = [(row.delta, row.by_level[level]) for row in rows if level in row.by_level]
        left.plot([d for d, _ in points], [100 * s["accuracy"] for _, s in points], "o-", label=f"level {level}")
        right.plot([d for d, _ in points], [100 * s["draft_only_fraction"] for _, s in points], "o-",
                   label=f"level {level}")
    left.set(xlabel="threshold delta", ylabel="accuracy (%)", title="accuracy by level")
    right.set(xlabel="threshold delta", ylabel="solved by draft alone (%)", title="draft-only problems by level")
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
