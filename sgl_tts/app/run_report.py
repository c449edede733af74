"""Console report of a run: one line per problem as it finishes, then a summary."""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from sgl_tts.measure.metrics import mean_goodput
from sgl_tts.measure.tables import Column, format_row, number_cell
from sgl_tts.search.grading import grade, graded_answer
from sgl_tts.search.records import COMPLETE, SearchResult

COLUMNS = (Column("problem", 14, "<"), Column("gold", 8), Column("answer", 12), Column("ok", 3), Column("tokens", 7),
           Column("time s", 7), Column("goodput", 8), Column("cached", 7), Column("end", 0, "<", gap=2))  # the last: as wide as its cell
# the `end` column: blank for a search that ran to its end, else why it stopped early and answered
STOPPED_EARLY = {"deadline": "deadline", "token_budget": "token budget", "settled": "settled", "ranked": "ranked"}


def _short(text: str | None, width: int = 12) -> str:
    text = "-" if text is None else str(text).replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def print_run(results: Iterable[tuple[Any, SearchResult]], config: Any) -> int:
    """Print each (problem, result) and a summary; returns the exit code (0, or 1 if any search failed)."""
    header = format_row(COLUMNS, [column.title for column in COLUMNS])
    print(header)
    print("-" * len(header))
    rows = []
    for problem, result in results:
        correct = grade(result.answer, problem.gold) if problem.gold is not None else False
        rows.append((correct, result))
        answer = graded_answer(result.answer, problem.gold)  # the value graded: "9" for "7 + 2 = 9"
        print(format_row(COLUMNS, [_short(problem.id, 14), _short(problem.gold, 8), _short(answer),
                                   "yes" if correct else "no", str(result.generated_tokens),
                                   f"{result.total_time_s:.1f}", number_cell(result.precise_goodput),
                                   f"{result.cache_hit_rate:.0%}",
                                   STOPPED_EARLY.get(result.finish_reason, result.finish_reason
                                                     if result.finish_reason != COMPLETE else "")]).rstrip()
              + (f"  error: {result.error}" if result.error else ""), flush=True)
    if not rows:
        print("no problems")
        return 0
    solved = sum(1 for correct, _ in rows if correct)
    results_only = [r for _, r in rows]
    total_tokens = sum(r.generated_tokens for r in results_only)
    print("-" * len(header))
    print(f"solved {solved}/{len(rows)} ({solved / len(rows):.0%}) | generated tokens {total_tokens} | "
          f"precise goodput mean {number_cell(mean_goodput(results_only))} tok/s | "
          f"latency p50 {statistics.median(r.total_time_s for r in results_only):.1f} s | "
          f"generator {sum(r.generator_time_s for r in results_only):.0f} s, "
          f"verifier {sum(r.verifier_time_s for r in results_only):.0f} s | "
          f"prefix cache hit {sum(r.cached_tokens for r in results_only) / max(1, sum(r.prompt_tokens for r in results_only)):.0%}")
    early = [r.finish_reason for r in results_only if r.finish_reason != COMPLETE]
    if early:
        print(f"stopped early and answered: {len(early)} of {len(rows)} ("
              + ", ".join(f"{STOPPED_EARLY.get(reason, reason)} {early.count(reason)}" for reason in sorted(set(early)))
              + ")")
    if any("rsd" in r.extra for r in results_only):
        from sgl_tts.rsd.sweep import summary_lines

        for line in summary_lines(results_only):
            print(line)
    return 1 if any(r.error for r in results_only) else 0
