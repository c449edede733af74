"""The report of a run folder: markdown tables with the arms side by side, summary.json, PNG plots.

One table per dataset and n (FastTTS §6.1-6.3 metrics): accuracy (top-1 by majority vote, weighted vote,
the program's own answer, pass@N ranked by verifier score), precise goodput, completion latency p50/p90
with its generator/verifier parts, tokens, prefix-cache hit rate, request timing windows and runtime
start-up; each a median over seeds x repetitions (with the spread when there are several), and a column
per arm with its ratio to the baseline arm. Plots like FastTTS Fig. 12 (goodput vs n), Fig. 13 (latency
breakdown, stacked) and Fig. 14 (accuracy vs n). Then accuracy against token budget (eval/budget.py): pooled
accuracy with Wilson intervals, paired comparisons with the reference arm, accuracy per level, and the
accuracy-vs-tokens plot. Everything is computed from results.jsonl alone.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eval.budget import budget_markdown, budget_summary, plot_accuracy_vs_tokens
from eval.results import ResultStore, _finite_or_none
from sgl_tts.paths import write_atomic
from sgl_tts.measure.metrics import aggregate_rows, over_repetitions, summarize

if TYPE_CHECKING:
    from eval.experiment import Experiment

RESULTS_FILE = "results.jsonl"
WINDOWS = ("client_s", "server_e2e_s", "first_token_s", "queue_s", "prompt_processing_s", "decode_s_per_token")

# (label, key in the over-repetitions stats ({n} is the column's n), format)
TABLE_ROWS = [
    ("problems", "problems", "int"),
    ("top-1 accuracy (majority vote)", "accuracy.majority_correct", "pct"),
    ("accuracy (weighted vote)", "accuracy.weighted_correct", "pct"),
    ("accuracy (program's answer)", "accuracy.correct", "pct"),
    ("pass@{n} (ranked by verifier)", "accuracy.pass@{n}", "pct"),
    ("precise goodput, tok/s (mean)", "precise_goodput.mean", "num"),
    ("completion latency p50, s", "completion_latency_s.p50", "num"),
    ("completion latency p90, s", "completion_latency_s.p90", "num"),
    ("generator time / problem, s", "generator_time_s.mean", "num"),
    ("verifier time / problem, s", "verifier_time_s.mean", "num"),
    ("verifier share of time", "verifier_share", "pct"),
    ("generated tokens / problem", "tokens_per_problem", "num"),
    ("prefix cache hit rate", "cache_hit_rate", "pct"),
    ("generator requests / problem", "timing.requests_per_problem", "num"),
    ("request latency p50, s (server e2e)", "timing.server_e2e_s.p50", "num"),
    ("time to first token p50, s (server)", "timing.first_token_s.p50", "num"),
    ("decode time per token p50, s (server)", "timing.decode_s_per_token.p50", "num"),
    ("runtime start (model load), s", "timing.runtime_start_s", "num"),
    ("errors (search stopped early)", "errors", "int"),
]


def row_key(row: dict[str, Any]) -> tuple:
    return (row["arm"], row["dataset"], row["n"], row["seed"], row["repetition"], str(row["problem_id"]))


def latest_rows(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the last successful line per problem cell, the failed lines of cells that never succeeded)."""
    succeeded: dict[tuple, dict[str, Any]] = {}
    failed: dict[tuple, dict[str, Any]] = {}
    for record in records:
        (failed if record.get("failed") else succeeded)[row_key(record)] = record
    return list(succeeded.values()), [r for key, r in failed.items() if key not in succeeded]


def unit_aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`sgl_tts.measure.metrics.aggregate_rows` of one unit's problems, plus tokens per problem and the timing windows.

    A request window's unit-level figures summarise the per-problem means (p50 = median problem)."""
    result = aggregate_rows([r["metrics"] for r in rows])
    result["tokens_per_problem"] = result["generated_tokens"] / len(rows) if rows else None
    starts = {r["timing"]["runtime_start_s"] for r in rows if not r["timing"].get("runtimes_reused")}
    timing: dict[str, Any] = {
        "runtime_start_s": statistics.median(starts) if starts else None,  # None: runtimes kept from an arm before
        "solve_wall_s": summarize(r["timing"]["solve_wall_s"] for r in rows),
        "requests_per_problem": statistics.fmean(r["timing"]["requests"]["requests"] for r in rows),
    }
    for window in WINDOWS:
        means = [r["timing"]["requests"][window]["mean"] for r in rows if r["timing"]["requests"].get(window)]
        if means:
            timing[window] = summarize(means)
    result["timing"] = timing
    return result


def summarize_experiment(experiment: Experiment, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (dataset, arm, n) cell: its units' aggregates and the median and spread over them."""
    rows, failed = latest_rows(records)
    by_unit: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_unit[row_key(row)[:5]].append(row)
    cells: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for (arm, dataset, n, seed, repetition), unit_rows in sorted(by_unit.items()):
        cells[(dataset, arm, n)].append({"seed": seed, "repetition": repetition, **unit_aggregate(unit_rows)})
    return {
        "experiment": experiment.config.name,
        "baseline": experiment.config.baseline,
        "rows": len(rows),
        "failed": [{"arm": r["arm"], "dataset": r["dataset"], "n": r["n"], "seed": r["seed"],
                    "repetition": r["repetition"], "problem_id": r["problem_id"], "error": r.get("error")}
                   for r in failed],
        "cells": [{"dataset": dataset, "arm": arm, "n": n, "units": units, "stats": over_repetitions(units)}
                  for (dataset, arm, n), units in cells.items()],
        "budget": budget_summary(rows, [d.key for d in experiment.config.datasets],
                                 [a.name for a in experiment.config.arms], experiment.config.reference,
                                 {a.name: a.paired_with for a in experiment.config.arms if a.paired_with}),
    }


# ---------------------------------------------------------------------------------------------------------
# Markdown


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _format(stats: dict[str, Any] | None, kind: str) -> str:
    if not stats or stats.get("median") is None:
        return "–"
    median = stats["median"]
    text = {"pct": f"{median:.0%}", "int": f"{median:g}", "num": _number(median)}[kind]
    if stats["n"] > 1 and stats["std"]:
        text += " ±" + (f"{stats['std']:.0%}" if kind == "pct" else _number(stats["std"]))
    return text


def _ratio(value: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    if not value or not base or value.get("median") is None or not base.get("median"):
        return "–"
    return f"{value['median'] / base['median']:.2f}x"


def _tables(experiment: Experiment, summary: dict[str, Any]) -> list[str]:
    config = experiment.config
    cells = {(c["dataset"], c["arm"], c["n"]): c for c in summary["cells"]}
    arm_order = [config.baseline] + [a.name for a in config.arms if a.name != config.baseline]
    lines = []
    for dataset in (d.key for d in config.datasets):
        ns = experiment.listed_n_values() or [None]  # None: each arm at its own n
        for n in ns:
            columns = [next((c for (d, a, cn), c in cells.items() if d == dataset and a == arm
                             and (n is None or cn == n)), None) for arm in arm_order]
            if not any(columns):
                continue
            base = columns[0]
            repetitions = max(len(c["units"]) for c in columns if c)
            lines += ["", f"## {dataset}" + (f" · n={n}" if n is not None else ""),
                      f"median over {repetitions} seed×repetition unit(s)" + (" (± std)" if repetitions > 1 else ""),
                      ""]
            heads = [f"{arm} (baseline)" if arm == config.baseline else arm for arm in arm_order]
            ratio_heads = [f"{arm} ÷ baseline" for arm in arm_order[1:]]
            lines.append("| metric | " + " | ".join(heads + ratio_heads) + " |")
            lines.append("|---|" + "---:|" * (len(heads) + len(ratio_heads)))
            if n is None:
                lines.append("| n | " + " | ".join(str(c["n"]) if c else "–" for c in columns)
                             + " |" + " |" * len(ratio_heads))
            for label, key, kind in TABLE_ROWS:
                values = [c["stats"].get(key.format(n=c["n"])) if c else None for c in columns]
                if not any(v and v.get("median") is not None for v in values):
                    continue
                ratios = [_ratio(v, values[0]) for v in values[1:]] if kind != "int" else ["" for _ in values[1:]]
                label = label.format(n=n if n is not None else "N")
                lines.append(f"| {label} | " + " | ".join(_format(v, kind) for v in values) +
                             (" | " + " | ".join(ratios) if ratios else "") + " |")
    return lines


def markdown(experiment: Experiment, summary: dict[str, Any], run_dir: Path, runs: list[dict[str, Any]],
             plots: list[Path], partial: bool, skipped_lines: int) -> str:
    config = experiment.config
    expected = len(experiment.units())
    status = "PARTIAL (interrupted or incomplete; resume to finish)" if partial else "complete"
    lines = [f"# Evaluation `{config.name}` — {status}", "",
             f"- run folder: `{run_dir}`; config `{experiment.source}`, sha256 "
             f"`{runs[-1]['experiment_sha256'][:12] if runs else '?'}`",
             f"- backend `{config.backend}`; arms: " + ", ".join(a.name for a in config.arms)
             + f"; baseline `{config.baseline}`; {expected} unit(s) (arm × dataset × n × seed × repetition)",
             f"- problem lines: {summary['rows']}; failed: {len(summary['failed'])}; starts/resumes: {len(runs)}"
             + (f"; unreadable lines skipped: {skipped_lines}" if skipped_lines else "")]
    if runs:
        first = runs[0]
        lines.append(f"- first run id `{first['run_id']}`; hardware: {first['hardware'].get('cpu_model')} "
                     f"({first['hardware'].get('usable_cpus')} usable CPUs), GPUs: {first['hardware'].get('gpus') or 'none'}")
    lines += _tables(experiment, summary)
    lines += budget_markdown(summary["budget"])
    if summary["failed"]:
        lines += ["", "## Failed problems (retried on resume)", ""]
        lines += [f"- {f['arm']} / {f['dataset']} / n={f['n']} / seed {f['seed']} / rep {f['repetition']} / "
                  f"`{f['problem_id']}`: {(f['error'] or '').splitlines()[0][:200]}" for f in summary["failed"]]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots]
    lines += ["", "Timing windows are defined in eval/runner.py; medians are over units, latency percentiles "
                  "over the problems of a unit."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Plots (matplotlib's Agg canvas through Figure: no pyplot, no global backend switch)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "dataset"


def _median(cell: dict[str, Any], key: str) -> float | None:
    stats = cell["stats"].get(key.format(n=cell["n"]))
    return None if not stats else stats["median"]


def plot_run(experiment: Experiment, summary: dict[str, Any], out_dir: Path) -> list[Path]:
    from matplotlib.figure import Figure

    config = experiment.config
    arm_order = [config.baseline] + [a.name for a in config.arms if a.name != config.baseline]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset in (d.key for d in config.datasets):
        cells = [c for c in summary["cells"] if c["dataset"] == dataset]
        if not cells:
            continue
        ns = sorted({c["n"] for c in cells})
        series = {arm: sorted((c for c in cells if c["arm"] == arm), key=lambda c: c["n"]) for arm in arm_order}

        def finish(fig, ax_list, name):
            for ax in ax_list:
                if len(ns) > 1:
                    ax.set_xscale("log", base=2)
                ax.set_xticks(ns, [str(n) for n in ns])
                ax.set_xlabel("n (beams / samples)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            fig.tight_layout()
            path = out_dir / f"{name}-{_slug(dataset)}.png"
            fig.savefig(path, dpi=110)
            written.append(path)

        # Fig. 12: precise goodput vs n, error bars = min..max over units.
        fig = Figure(figsize=(5, 3.6))
        ax = fig.add_subplot()
        for arm, arm_cells in series.items():
            points = [(c["n"], c["stats"].get("precise_goodput.mean")) for c in arm_cells]
            points = [(n, s) for n, s in points if s]
            if points:
                ax.errorbar([n for n, _ in points], [s["median"] for _, s in points], marker="o", capsize=3,
                            yerr=[[s["median"] - s["min"] for _, s in points], [s["max"] - s["median"] for _, s in points]],
                            label=arm)
        ax.set_ylabel("precise goodput (tok/s)")
        ax.set_title(f"Goodput vs n — {dataset}")
        finish(fig, [ax], "goodput_vs_n")

        # Fig. 13: mean completion latency per problem, stacked generator / verifier / other.
        fig = Figure(figsize=(max(5, 1.4 * len(ns) * len(arm_order)), 3.6))
        ax = fig.add_subplot()
        width = 0.8 / len(arm_order)
        colors = [f"C{i}" for i in range(len(arm_order))]
        for i, arm in enumerate(arm_order):
            for c in series[arm]:
                x = ns.index(c["n"]) + (i - (len(arm_order) - 1) / 2) * width
                generator = _median(c, "generator_time_s.mean") or 0.0
                verifier = _median(c, "verifier_time_s.mean") or 0.0
                other = max(0.0, (_median(c, "completion_latency_s.mean") or 0.0) - generator - verifier)
                ax.bar(x, generator, width, color=colors[i], label=f"{arm}: generator" if c is series[arm][0] else None)
                ax.bar(x, verifier, width, bottom=generator, color=colors[i], alpha=0.45, hatch="//",
                       label=f"{arm}: verifier" if c is series[arm][0] else None)
                if other > 0:
                    ax.bar(x, other, width, bottom=generator + verifier, color="lightgrey",
                           label="other" if i == 0 and c is series[arm][0] else None)
        ax.set_xticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel("n (beams / samples)")
        ax.set_ylabel("completion latency per problem (s)")
        ax.set_title(f"Latency breakdown — {dataset}")
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"latency_breakdown-{_slug(dataset)}.png"
        fig.savefig(path, dpi=110)
        written.append(path)

        # Fig. 14: top-1 (majority vote) and pass@N vs n.
        fig = Figure(figsize=(8, 3.4))
        axes = fig.subplots(1, 2)
        for ax, (key, title) in zip(axes, (("accuracy.majority_correct", "top-1 (majority vote)"),
                                           ("accuracy.pass@{n}", "pass@N (by verifier score)"))):
            for arm, arm_cells in series.items():
                points = [(c["n"], _median(c, key)) for c in arm_cells]
                points = [(n, v) for n, v in points if v is not None]
                if points:
                    ax.plot([n for n, _ in points], [100 * v for _, v in points], marker="o", label=arm)
            ax.set_ylabel("accuracy (%)")
            ax.set_ylim(-5, 105)
            ax.set_title(f"{title} — {dataset}", fontsize=9)
        finish(fig, axes, "accuracy_vs_n")
    for budget in summary["budget"]["datasets"]:
        path = plot_accuracy_vs_tokens(budget, out_dir / f"accuracy_vs_tokens-{_slug(budget['dataset'])}.png")
        if path is not None:
            written.append(path)
    return written


def write_report(run_dir: str | Path, experiment: Experiment, partial: bool = False) -> str:
    """Write summary.md, summary.json and plots/ for the run folder; return the markdown."""
    run_dir = Path(run_dir)
    store = ResultStore(run_dir / RESULTS_FILE)
    records = store.records()
    skipped = store.skipped_lines
    runs = store.runs()
    summary = summarize_experiment(experiment, records)
    plots = plot_run(experiment, summary, run_dir / "plots") if summary["cells"] else []
    text = markdown(experiment, summary, run_dir, runs, plots, partial, skipped)
    write_atomic(run_dir / "summary.md", text)
    data = _finite_or_none({**summary, "partial": partial})
    write_atomic(run_dir / "summary.json", json.dumps(data, indent=1, default=str, allow_nan=False) + "\n")
    return text
