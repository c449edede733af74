"""Accuracy against token budget, from result lines alone: what the report states about accuracy and its doubt.

Per (dataset, arm, n) cell: the accuracy of the program's own answer (`metrics.correct`) with its 95% Wilson
interval, generated tokens per problem and per solved problem, and the accuracy per difficulty level when the
lines carry one (`level`, the graded set). A cell pools every problem × seed × repetition it ran: each
(seed, repetition, problem id) is one trial (`trial_groups`: the (seed, repetition) pairs seen; with more than one,
the table says that trials of one problem are not independent, as sgl_tts.measure.stats.pool_seeds warns). Lines without a gold answer are counted apart, not as trials.

With a reference arm (the experiment's `reference`, e.g. greedy decoding), every other cell of a dataset is
compared with the reference's cell there (its smallest n, usually its only one) pair by pair: a pair is one
(seed, repetition, problem id) both cells ran. On the pairs: McNemar's exact p and the paired-bootstrap 95%
interval of accuracy(cell) − accuracy(reference) (sgl_tts.measure.stats). Pairs present on one side only are
left out of the comparison and reported as a note on that cell, never dropped silently.

Also the markdown tables (accuracy vs budget, accuracy by level) and the accuracy-vs-tokens plot (the
search-and-learn accuracy-vs-budget figure: generated tokens per problem on a log axis, one line per arm over
its n values, Wilson error bars, the reference as a horizontal band).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_tts.measure.stats import mcnemar_exact, paired_bootstrap, wilson_interval

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
UNMATCHED_SHOWN = 5  # pair keys named in a note, per side

PairKey = tuple[int, int, str]  # (seed, repetition, problem id)


@dataclass(frozen=True)
class Outcome:
    correct: bool
    generated_tokens: int
    level: int | None


def cell_outcomes(rows: Iterable[dict[str, Any]]) -> tuple[dict[tuple[str, str, int], dict[PairKey, Outcome]],
                                                            dict[tuple[str, str, int], int]]:
    """(per (dataset, arm, n): each graded trial's outcome by pair key, per cell: the lines without a gold answer).

    `rows` are successful result lines, one per problem cell (eval.report.latest_rows)."""
    outcomes: dict[tuple[str, str, int], dict[PairKey, Outcome]] = defaultdict(dict)
    ungraded: dict[tuple[str, str, int], int] = defaultdict(int)
    for row in rows:
        cell = (row["dataset"], row["arm"], row["n"])
        metrics = row["metrics"]
        if metrics.get("correct") is None:
            ungraded[cell] += 1
            continue
        key = (row["seed"], row["repetition"], str(row["problem_id"]))
        outcomes[cell][key] = Outcome(bool(metrics["correct"]), int(metrics.get("generated_tokens") or 0),
                                      row.get("level"))
    return dict(outcomes), dict(ungraded)


def accuracy(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """trials, solved, accuracy and its Wilson interval; tokens per problem and per solved problem."""
    outcomes = list(outcomes)
    trials = len(outcomes)
    solved = sum(o.correct for o in outcomes)
    tokens = sum(o.generated_tokens for o in outcomes)
    low, high = wilson_interval(solved, trials, CONFIDENCE)
    return {"trials": trials, "solved": solved, "accuracy": solved / trials if trials else None,
            "interval": [low, high], "tokens_per_problem": tokens / trials if trials else None,
            "tokens_per_solved": tokens / solved if solved else None}


def by_level(outcomes: dict[PairKey, Outcome]) -> list[dict[str, Any]]:
    """`accuracy` per difficulty level, lowest first; empty when no outcome has a level."""
    levels: dict[int, list[Outcome]] = defaultdict(list)
    for outcome in outcomes.values():
        if outcome.level is not None:
            levels[outcome.level].append(outcome)
    return [{"level": level, **accuracy(levels[level])} for level in sorted(levels)]


def compare_paired(reference: dict[PairKey, Outcome], cell: dict[PairKey, Outcome]) -> dict[str, Any]:
    """The cell against the reference on the pair keys both hold: McNemar's exact p, the accuracy difference
    (cell − reference) with its paired-bootstrap interval, and the keys found on one side only."""
    shared = sorted(reference.keys() & cell.keys())
    only_reference = sorted(reference.keys() - cell.keys())
    only_cell = sorted(cell.keys() - reference.keys())
    result: dict[str, Any] = {"pairs": len(shared), "only_reference": len(only_reference),
                              "only_cell": len(only_cell),
                              "only_reference_keys": [list(k) for k in only_reference[:UNMATCHED_SHOWN]],
                              "only_cell_keys": [list(k) for k in only_cell[:UNMATCHED_SHOWN]]}
    if not shared:
        return result
    reference_correct = [reference[k].correct for k in shared]
    cell_correct = [cell[k].correct for k in shared]
    test = mcnemar_exact(reference_correct, cell_correct)
    difference, low, high = paired_bootstrap(reference_correct, cell_correct, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED,
                                             CONFIDENCE)
    result.update(difference=difference, interval=[low, high], p_value=test.p_value,
                  cell_only_correct=test.b01, reference_only_correct=test.b10)
    return result


def budget_summary(rows: list[dict[str, Any]], datasets: list[str], arms: list[str],
                   reference: str | None, paired_with: dict[str, str] | None = None) -> dict[str, Any]:
    """Per dataset (in `datasets` order): its cells in `arms` order, then by n, each with `accuracy`, its levels
    and, unless it is the reference cell, its `compare_paired` with the reference cell; a cell of an arm in
    `paired_with` (arm -> the arm it is paired with) also has `vs_paired`, its `compare_paired` with that arm's
    cell at the same n (when that ran), and that arm's name."""
    paired_with = paired_with or {}
    outcomes, ungraded = cell_outcomes(rows)
    arm_rank = {arm: i for i, arm in enumerate(arms)}
    out = []
    for dataset in datasets:
        keys = sorted((k for k in outcomes.keys() | ungraded.keys() if k[0] == dataset and k[1] in arm_rank),
                      key=lambda k: (arm_rank[k[1]], k[2]))
        reference_n = min((k[2] for k in outcomes if k[0] == dataset and k[1] == reference), default=None)
        cells = []
        for key in keys:
            _, arm, n = key
            cell_outcome = outcomes.get(key, {})
            cell = {"arm": arm, "n": n, **accuracy(cell_outcome.values()), "ungraded": ungraded.get(key, 0),
                    "levels": by_level(cell_outcome)}
            if reference_n is not None:
                is_reference = (arm, n) == (reference, reference_n)
                cell["is_reference"] = is_reference
                if not is_reference:
                    cell["vs_reference"] = compare_paired(outcomes[(dataset, reference, reference_n)], cell_outcome)
            partner = outcomes.get((dataset, paired_with.get(arm), n))
            if partner is not None:
                cell["vs_paired"] = {"arm": paired_with[arm], **compare_paired(partner, cell_outcome)}
            cells.append(cell)
        if cells:
            groups = {key[:2] for k in keys for key in outcomes.get(k, {})}
            out.append({"dataset": dataset, "reference": None if reference_n is None else
                        {"arm": reference, "n": reference_n}, "trial_groups": len(groups), "cells": cells})
    return {"reference": reference, "confidence": CONFIDENCE, "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
            "datasets": out}


# ---------------------------------------------------------------------------------------------------------
# Markdown


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def _accuracy_text(stats: dict[str, Any]) -> str:
    if not stats["trials"]:
        return "–"
    low, high = stats["interval"]
    return (f"{_percent(stats['accuracy'])}% [{_percent(low)}, {_percent(high)}] "
            f"({stats['solved']}/{stats['trials']})")


def _tokens_text(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def _key_text(key: list[Any]) -> str:
    seed, repetition, problem_id = key
    return f"seed {seed} rep {repetition} `{problem_id}`"


def _unmatched_note(cell: dict[str, Any], reference: dict[str, Any]) -> str:
    comparison = cell["vs_reference"]
    parts = []
    for side, count_key, keys_key in ((f"only in {reference['arm']} n={reference['n']}", "only_reference",
                                       "only_reference_keys"), ("only in this cell", "only_cell", "only_cell_keys")):
        if comparison[count_key]:
            shown = ", ".join(_key_text(k) for k in comparison[keys_key])
            more = "…" if comparison[count_key] > len(comparison[keys_key]) else ""
            parts.append(f"{comparison[count_key]} {side} ({shown}{more})")
    return (f"{cell['arm']} n={cell['n']}: its (seed, repetition, problem) pairs do not match the reference's; "
            f"compared on the {comparison['pairs']} shared pair(s), left out: " + "; ".join(parts))


def _comparison_text(cell: dict[str, Any], key: str = "vs_reference") -> str:
    if cell.get("is_reference") and key == "vs_reference":
        return "reference"
    comparison = cell.get(key)
    if comparison is None:
        return "–"
    mark = " ‡" if comparison["only_reference"] or comparison["only_cell"] else ""
    if not comparison["pairs"]:
        return "no shared pairs" + mark
    low, high = comparison["interval"]
    return (f"{100 * comparison['difference']:+.1f} pt [{100 * low:+.1f}, {100 * high:+.1f}], "
            f"p={comparison['p_value']:.3g}{mark}")


def budget_markdown(summary: dict[str, Any]) -> list[str]:
    """Per dataset the "accuracy vs budget" table, its notes on unmatched pairs, and the table by level."""
    lines = []
    for dataset in summary["datasets"]:
        reference = dataset["reference"]
        lines += ["", f"## Accuracy vs budget — {dataset['dataset']}", "",
                  "Accuracy of the program's answer over problems × seeds × repetitions pooled, with its 95% Wilson "
                  "interval (solved/trials)."]
        heads = ["arm", "n", "tokens / problem", "tokens / solved", "accuracy [95% CI]"]
        if reference:
            lines[-1] += (f" Against the reference `{reference['arm']}` n={reference['n']}, paired on (seed, "
                          "repetition, problem): Δ accuracy in points with its 95% paired-bootstrap interval, "
                          "McNemar exact p.")
            heads.append(f"vs {reference['arm']} n={reference['n']}: Δ [95% CI], p")
        elif summary["reference"]:
            lines[-1] += f" The reference `{summary['reference']}` has no graded results on this dataset."
        if dataset["trial_groups"] > 1:
            lines[-1] += (" The seeds × repetitions of one problem are counted as separate trials, though they "
                          "share the problem: intervals and p-values are somewhat narrower than the problems "
                          "alone support.")
        lines += ["", "| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
        notes = []
        for cell in dataset["cells"]:
            values = [cell["arm"], str(cell["n"]), _tokens_text(cell["tokens_per_problem"]),
                      _tokens_text(cell["tokens_per_solved"]), _accuracy_text(cell)]
            if reference:
                values.append(_comparison_text(cell))
                comparison = cell.get("vs_reference")
                if comparison and (comparison["only_reference"] or comparison["only_cell"]):
                    notes.append(_unmatched_note(cell, reference))
            lines.append("| " + " | ".join(values) + " |")
        if notes:
            lines += [""] + [f"‡ {note}" for note in notes]
        paired = [cell for cell in dataset["cells"] if "vs_paired" in cell]
        if paired:
            tokens = {(cell["arm"], cell["n"]): cell["tokens_per_problem"] for cell in dataset["cells"]}
            lines += ["", f"### Paired arms — {dataset['dataset']}", "",
                      "Each arm against the arm it is paired with (`paired_with`) at the same n, on the (seed, "
                      "repetition, problem) both ran: Δ accuracy in points with its 95% paired-bootstrap "
                      "interval, McNemar exact p; generated tokens per problem of both.", "",
                      "| arm | vs | n | tokens / problem | vs tokens / problem | Δ accuracy [95% CI], p |",
                      "|---|---|---:|---:|---:|---:|"]
            for cell in paired:
                other = cell["vs_paired"]["arm"]
                lines.append(f"| {cell['arm']} | {other} | {cell['n']} | {_tokens_text(cell['tokens_per_problem'])} "
                             f"| {_tokens_text(tokens.get((other, cell['n'])))} "
                             f"| {_comparison_text(cell, 'vs_paired')} |")
        ungraded = [c for c in dataset["cells"] if c["ungraded"]]
        if ungraded:
            lines += [""] + [f"- {c['arm']} n={c['n']}: {c['ungraded']} line(s) without a gold answer, not counted"
                             for c in ungraded]
        levels = sorted({level["level"] for cell in dataset["cells"] for level in cell["levels"]})
        if levels:
            lines += ["", f"### Accuracy by level — {dataset['dataset']}", "",
                      "| arm | n | " + " | ".join(f"level {level}" for level in levels) + " |",
                      "|---|---:|" + "---:|" * len(levels)]
            for cell in dataset["cells"]:
                per_level = {level["level"]: level for level in cell["levels"]}
                lines.append(f"| {cell['arm']} | {cell['n']} | " + " | ".join(
                    _accuracy_text(per_level[level]) if level in per_level else "–" for level in levels) + " |")
    return lines


# ---------------------------------------------------------------------------------------------------------
# Plot (matplotlib's Agg canvas through Figure: no pyplot, no global backend switch)


def plot_accuracy_vs_tokens(dataset: dict[str, Any], path: Path) -> Path | None:
    """Accuracy vs generated tokens per problem (log x) for one dataset of `budget_summary`: one line per arm
    over its n values with Wilson error bars, the reference cell as a horizontal band. None: nothing to plot."""
    from matplotlib.figure import Figure

    cells = [c for c in dataset["cells"] if c["trials"] and c["tokens_per_problem"]]
    reference = next((c for c in cells if c.get("is_reference")), None)
    arms = list(dict.fromkeys(c["arm"] for c in cells if c is not reference))
    if not arms and reference is None:
        return None
    fig = Figure(figsize=(5.5, 3.8))
    ax = fig.add_subplot()
    if reference is not None:
        low, high = reference["interval"]
        ax.axhspan(100 * low, 100 * high, color="grey", alpha=0.2)
        ax.axhline(100 * reference["accuracy"], color="grey", linestyle="--",
                   label=f"{reference['arm']} n={reference['n']} (reference, 95% CI)")
        ax.plot([reference["tokens_per_problem"]], [100 * reference["accuracy"]], marker="s", color="grey")
    for index, arm in enumerate(arms):
        series = sorted((c for c in cells if c["arm"] == arm and c is not reference), key=lambda c: c["n"])
        x = [c["tokens_per_problem"] for c in series]
        y = [100 * c["accuracy"] for c in series]
        errors = [[100 * (c["accuracy"] - c["interval"][0]) for c in series],
                  [100 * (c["interval"][1] - c["accuracy"]) for c in series]]
        ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, color=f"C{index}", label=arm)
        for c, xi, yi in zip(series, x, y):
            ax.annotate(f"n={c['n']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-5, 105)
    ax.set_title(f"Accuracy vs budget — {dataset['dataset']}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
