"""Choosing the final answer from a problem's candidates (FastTTS §6.3: top-1 by majority vote, pass@N).

Answers that `answers_equal` deems equivalent form one group, represented by its first occurrence.
A None answer ("no answer") belongs to no group, so it never wins unless every answer is None, and then
the result is None. Ties go to the group whose first member comes earliest in the input; a NaN score
counts as 0 in a weighted vote and as the lowest score in `best_score` and `pass_at_n`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from sgl_tts.registry import Registry
from sgl_tts.search.grading import answers_equal

Equal = Callable[[str, str], bool]


def group_answers(answers: Sequence[str | None], equal: Equal = answers_equal) -> list[list[int]]:
    """Indices of equivalent answers, grouped; groups ordered by first occurrence, None answers left out."""
    groups: list[list[int]] = []
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        for group in groups:
            if equal(answers[group[0]], answer):
                group.append(index)
                break
        else:
            groups.append([index])
    return groups


def _pick(answers: Sequence[str | None], groups: list[list[int]], weight: Callable[[list[int]], float]) -> str | None:
    best_group = None
    best_weight = -math.inf
    for group in groups:  # strict > keeps the earliest group on a tie
        group_weight = weight(group)
        if group_weight > best_weight:
            best_group, best_weight = group, group_weight
    return None if best_group is None else answers[best_group[0]]


def majority_vote(answers: Sequence[str | None], equal: Equal = answers_equal) -> str | None:
    """The most frequent answer (by equivalence group)."""
    return _pick(answers, group_answers(answers, equal), len)


def weighted_vote(answers: Sequence[str | None], scores: Sequence[float], equal: Equal = answers_equal) -> str | None:
    """The answer whose equivalence group has the largest sum of verifier scores."""
    _check_lengths(answers, scores)
    return _pick(answers, group_answers(answers, equal), lambda group: sum(_finite(scores[i], 0.0) for i in group))


def best_score(answers: Sequence[str | None], scores: Sequence[float]) -> str | None:
    """The answer of the single highest-scoring candidate that has one (naive best-of-N)."""
    _check_lengths(answers, scores)
    ranked = [i for i in _rank_by_score(scores) if answers[i] is not None]
    return answers[ranked[0]] if ranked else None


def pass_at_n(correct_flags: Sequence[bool], scores: Sequence[float], n: int) -> bool:
    """Whether any of the `n` highest-scoring candidates is correct (FastTTS §6.3 Pass@N)."""
    _check_lengths(correct_flags, scores)
    if n < 1:
        raise ValueError(f"pass@n needs n >= 1, got {n}")
    return any(correct_flags[i] for i in _rank_by_score(scores)[:n])


def _rank_by_score(scores: Sequence[float]) -> list[int]:
    """Indices from highest to lowest score; equal scores keep input order (sorted is stable)."""
    return sorted(range(len(scores)), key=lambda i: -_finite(scores[i], -math.inf))


def _finite(score: float, nan_value: float) -> float:
    return nan_value if math.isnan(score) else float(score)


def _check_lengths(items: Sequence, scores: Sequence[float]) -> None:
    if len(items) != len(scores):
        raise ValueError(f"{len(items)} answers but {len(scores)} scores")


SELECTORS = Registry("selection method", {"majority": majority_vote, "weighted": weighted_vote, "best": best_score})


def select(method: str, answers: Sequence[str | None], scores: Sequence[float]) -> str | None:
    """Select by method name: one of SELECTORS."""
    SELECTORS.check(method)
    if method == "majority":
        return majority_vote(answers)
    return SELECTORS[method](answers, scores)
