"""How well step scores find the first wrong step: ProcessBench F1 and step AUROC.

ProcessBench (Zheng et al. 2024): a verifier's predicted first error is the first step whose score is below
a threshold, -1 when there is none. Accuracy is counted apart on erroneous solutions (prediction == label)
and on correct ones (prediction == -1); F1 is their harmonic mean. The threshold is chosen on one part of
the data and the F1 reported on another (`cross_fitted_f1`).

AUROC: P(score of a correct step > score of a first wrong step), ties counting one half; correct steps are
the steps before the first wrong one and every step of a correct solution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


def first_error(scores: Sequence[float], threshold: float) -> int:
    """Index of the first step scored below `threshold`, -1 when none is."""
    return next((k for k, s in enumerate(scores) if s < threshold), -1)


def auroc(correct: Sequence[float], wrong: Sequence[float]) -> float:
    """P(a correct step's score > a wrong step's score) + 1/2 P(equal) (Mann-Whitney U / (n m))."""
    if not len(correct) or not len(wrong):
        raise ValueError(f"AUROC needs both kinds of steps, got {len(correct)} correct and {len(wrong)} wrong")
    ordered = np.sort(np.asarray(correct, dtype=np.float64))
    wrong = np.asarray(wrong, dtype=np.float64)
    below_or_equal = np.searchsorted(ordered, wrong, side="right")
    below = np.searchsorted(ordered, wrong, side="left")
    greater = len(ordered) - below_or_equal
    return float((greater + 0.5 * (below_or_equal - below)).sum() / (len(ordered) * len(wrong)))


def labelled_step_scores(step_scores: Sequence[Sequence[float]], labels: Sequence[int]
                         ) -> tuple[list[float], list[float]]:
    """(scores of correct steps, scores of first wrong steps); steps after the first wrong one are dropped."""
    correct, wrong = [], []
    for scores, label in zip(step_scores, labels, strict=True):
        _check(scores, label)
        if label < 0:
            correct.extend(scores)
        else:
            correct.extend(scores[:label])
            wrong.append(scores[label])
    return correct, wrong


def step_auroc(step_scores: Sequence[Sequence[float]], labels: Sequence[int]) -> float:
    return auroc(*labelled_step_scores(step_scores, labels))


@dataclass(frozen=True)
class F1Result:
    f1: float  # harmonic mean of the two accuracies, in [0, 1]
    accuracy_erroneous: float  # NaN when there is no erroneous solution
    accuracy_correct: float  # NaN when there is no correct solution
    erroneous: int
    correct: int


def processbench_f1(predictions: Sequence[int], labels: Sequence[int]) -> F1Result:
    hits_err = [p == y for p, y in zip(predictions, labels, strict=True) if y >= 0]
    hits_cor = [p == -1 for p, y in zip(predictions, labels) if y < 0]
    a = float(np.mean(hits_err)) if hits_err else float("nan")
    b = float(np.mean(hits_cor)) if hits_cor else float("nan")
    f1 = float("nan") if np.isnan(a + b) else 2 * a * b / (a + b) if a + b > 0 else 0.0
    return F1Result(f1, a, b, len(hits_err), len(hits_cor))


def _check(scores: Sequence[float], label: int) -> None:
    if not -1 <= label < len(scores):
        raise ValueError(f"label {label} does not index a step of a {len(scores)}-step solution")


def _correct_intervals(step_scores: Sequence[Sequence[float]], labels: Sequence[int]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Per solution, the thresholds t with a right prediction form the interval low < t <= high.

    With prefix minima m_k = min(s_0..s_k) (m_-1 = +inf), the first score below t is at the label j iff
    m_j < t <= m_{j-1}; a correct solution is predicted -1 iff t <= m_last."""
    low, high = np.empty(len(labels)), np.empty(len(labels))
    for i, (scores, label) in enumerate(zip(step_scores, labels, strict=True)):
        _check(scores, label)
        minima = np.minimum.accumulate(np.asarray(scores, dtype=np.float64))
        if label < 0:
            low[i], high[i] = -np.inf, minima[-1]
        else:
            low[i], high[i] = minima[label], (minima[label - 1] if label > 0 else np.inf)
    return low, high


def f1_at_thresholds(step_scores: Sequence[Sequence[float]], labels: Sequence[int],
                     thresholds: Sequence[float]) -> np.ndarray:
    """F1 at each threshold (vectorised; `first_error` + `processbench_f1` give the same, one at a time)."""
    low, high = _correct_intervals(step_scores, labels)
    t = np.asarray(thresholds, dtype=np.float64)[:, None]
    right = (low[None, :] < t) & (t <= high[None, :])
    erroneous = np.asarray(labels) >= 0
    a = right[:, erroneous].mean(axis=1) if erroneous.any() else np.full(len(t), np.nan)
    b = right[:, ~erroneous].mean(axis=1) if (~erroneous).any() else np.full(len(t), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(a + b > 0, 2 * a * b / (a + b), 0.0)
    return f1


def best_threshold(step_scores: Sequence[Sequence[float]], labels: Sequence[int]) -> float:
    """The threshold with the highest F1 on these solutions: every distinct prediction is tried, each at the
    midpoint between neighbouring scores (so it transfers to other data without sitting on a score)."""
    if len({label < 0 for label in labels}) < 2:
        raise ValueError("choosing a threshold needs both erroneous and correct solutions; use more data")
    values = np.unique(np.concatenate([np.asarray(s, dtype=np.float64) for s in step_scores]))
    if not len(values):
        raise ValueError("no step scores to choose a threshold from")
    candidates = np.concatenate([[values[0] - 1.0], (values[:-1] + values[1:]) / 2, [values[-1] + 1.0]])
    f1 = f1_at_thresholds(step_scores, labels, candidates)
    return float(candidates[int(np.argmax(f1))])


def cross_fitted_f1(step_scores: Sequence[Sequence[float]], labels: Sequence[int], folds: Sequence[int]
                    ) -> tuple[F1Result, dict[int, float]]:
    """F1 where each solution is judged with the threshold chosen on the other folds; and those thresholds."""
    fold_ids = sorted(set(folds))
    if len(fold_ids) < 2:
        raise ValueError("cross-fitting needs at least two folds with solutions in them")
    thresholds, predictions = {}, [0] * len(labels)
    for fold in fold_ids:
        rest = [i for i, f in enumerate(folds) if f != fold]
        thresholds[fold] = best_threshold([step_scores[i] for i in rest], [labels[i] for i in rest])
        for i, f in enumerate(folds):
            if f == fold:
                predictions[i] = first_error(step_scores[i], thresholds[fold])
    return processbench_f1(predictions, labels), thresholds
