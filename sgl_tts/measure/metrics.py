"""Per-problem and aggregate metrics computed from `SearchResult`s. Pure functions, no I/O.

Definitions (FastTTS §6.1, §6.3; edge-inference evaluation §VI):
- precise goodput = mean tokens per beam / mean beam completion time (`SearchResult.precise_goodput`), none for
  a search without generated tokens (left out of means);
- completion latency = a problem's end-to-end search time, with its generator and verifier parts, reported
  as mean and p50/p90/p99 (tails beside the mean);
- top-1 accuracy: the answer chosen by majority vote (also weighted vote and best score) graded against gold;
- pass@N: whether any of the N candidates ranked highest by verifier score is correct;
- cache hit rate = cached prompt tokens / prompt tokens, token-weighted over problems.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sgl_tts.search.grading import grade, graded_answer
from sgl_tts.search.records import SearchResult
from sgl_tts.search.selection import best_score, majority_vote, pass_at_n, weighted_vote

CORRECTNESS_KEYS = ("correct", "majority_correct", "weighted_correct", "best_correct")
ANSWER_KEYS = ("answer", "majority_answer", "weighted_answer", "best_answer")  # graded as CORRECTNESS_KEYS


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, mean, median, sample standard deviation, min, max, p50, p90, p99 (None for an empty input)."""
    data = [float(v) for v in values]
    if not data:
        return {key: None for key in ("mean", "median", "std", "min", "max", "p50", "p90", "p99")} | {"n": 0}
    return {
        "n": len(data),
        "mean": statistics.fmean(data),
        "median": statistics.median(data),
        "std": statistics.stdev(data) if len(data) > 1 else 0.0,
        "min": min(data),
        "max": max(data),
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
    }


def _as_result(result: SearchResult | dict[str, Any]) -> SearchResult:
    return result if isinstance(result, SearchResult) else SearchResult.from_dict(result)


def problem_metrics(
    result: SearchResult | dict[str, Any],
    gold: str | None = None,
    dataset: str | None = None,
    pass_ns: Sequence[int] | None = None,
    grade_fn: Callable[[str | None, str, str | None], bool] = grade,
) -> dict[str, Any]:
    """One flat, JSON-ready row of metrics for one problem.

    The answers (ANSWER_KEYS) are in the form grading compares with the gold (`graded_answer`: "9" for
    "7 + 2 = 9"); `answer_text` is the program's answer as extracted. Correctness fields are None when there is
    no gold answer. `pass_ns` defaults to the candidate count.
    """
    result = _as_result(result)
    answers = [c.answer for c in result.candidates]
    scores = [c.score for c in result.candidates]
    picked = dict(zip(ANSWER_KEYS, (result.answer, majority_vote(answers), weighted_vote(answers, scores),
                                    best_score(answers, scores))))
    row: dict[str, Any] = {
        "problem_id": result.problem_id,
        "program": result.program,
        "gold": gold,
        "n_candidates": len(result.candidates),
        **{key: graded_answer(answer, gold) for key, answer in picked.items()},
        "answer_text": result.answer,
    }
    graded = gold is not None
    flags = [graded and a is not None and grade_fn(a, gold, dataset) for a in answers]
    for key, answer in zip(CORRECTNESS_KEYS, picked.values()):
        row[key] = (answer is not None and grade_fn(answer, gold, dataset)) if graded else None
    for n in pass_ns if pass_ns is not None else [max(len(answers), 1)]:
        row[f"pass@{n}"] = pass_at_n(flags, scores, n) if graded else None
    row.update(
        precise_goodput=result.precise_goodput,
        mean_beam_tokens=result.mean_beam_tokens,
        mean_beam_completion_s=result.mean_beam_completion_s,
        total_time_s=result.total_time_s,
        generator_time_s=result.generator_time_s,
        verifier_time_s=result.verifier_time_s,
        generated_tokens=result.generated_tokens,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        cache_hit_rate=result.cache_hit_rate,
        iterations=result.iterations,
        verifier_calls=result.verifier_calls,
        error=result.error,
    )
    return row


def aggregate_rows(rows: Iterable[dict[str, Any] | SearchResult]) -> dict[str, Any]:
    """Aggregate per-problem rows (from `problem_metrics`; a bare SearchResult is taken ungraded)."""
    rows = [problem_metrics(r) if isinstance(r, SearchResult) else r for r in rows]
    accuracy_keys = list(CORRECTNESS_KEYS) + sorted(
        {k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:])
    )
    accuracy = {}
    for key in accuracy_keys:
        flags = [bool(r[key]) for r in rows if r.get(key) is not None]
        accuracy[key] = sum(flags) / len(flags) if flags else None
    with_beams = [r for r in rows if r.get("n_candidates", 0) > 0]
    prompt_tokens = sum(r.get("prompt_tokens", 0) for r in rows)
    generator_s = sum(r.get("generator_time_s", 0.0) for r in rows)
    verifier_s = sum(r.get("verifier_time_s", 0.0) for r in rows)
    return {
        "problems": len(rows),
        "graded": sum(1 for r in rows if r.get("correct") is not None),
        "errors": sum(1 for r in rows if r.get("error")),
        "accuracy": accuracy,
        "precise_goodput": summarize(r["precise_goodput"] for r in with_beams if r["precise_goodput"] is not None),
        "completion_latency_s": summarize(r["total_time_s"] for r in rows),
        "beam_completion_s": summarize(r["mean_beam_completion_s"] for r in with_beams),
        "generator_time_s": summarize(r["generator_time_s"] for r in rows),
        "verifier_time_s": summarize(r["verifier_time_s"] for r in rows),
        "verifier_share": verifier_s / (generator_s + verifier_s) if generator_s + verifier_s > 0 else None,
        "generated_tokens": sum(r.get("generated_tokens", 0) for r in rows),
        "cache_hit_rate": sum(r.get("cached_tokens", 0) for r in rows) / prompt_tokens if prompt_tokens else None,
    }


def mean_goodput(results: Iterable[SearchResult]) -> float | None:
    """The mean precise goodput of the results that have one; None when none has (no goodput from zero tokens)."""
    goodputs = [g for g in (r.precise_goodput for r in results) if g is not None]
    return statistics.fmean(goodputs) if goodputs else None


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix + key] = float(value)
    return flat


def over_repetitions(aggregates: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | int | None]]:
    """Median and spread across repeated runs: `summarize` of every numeric metric (dotted key) they all have."""
    flats = [_flatten(a) for a in aggregates]
    if not flats:
        return {}
    common = [key for key in flats[0] if all(key in flat for flat in flats[1:])]
    return {key: summarize(flat[key] for flat in flats) for key in common}
