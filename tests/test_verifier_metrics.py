"""ProcessBench F1, threshold choice and step AUROC against brute-force references."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from sgl_tts.scoring.verifier_metrics import (auroc, best_threshold, cross_fitted_f1, f1_at_thresholds,
                                              first_error, labelled_step_scores, processbench_f1, step_auroc)


def random_solutions(seed: int, count: int = 40, levels: int = 6):
    """Scores on a coarse grid (many ties) and labels in -1..steps-1."""
    rng = random.Random(seed)
    scores, labels = [], []
    for _ in range(count):
        steps = rng.randint(1, 6)
        scores.append([rng.randint(0, levels) / levels for _ in range(steps)])
        labels.append(rng.randint(-1, steps - 1))
    return scores, labels


def brute_auroc(correct, wrong):
    wins = sum(1.0 if c > w else 0.5 if c == w else 0.0 for c, w in itertools.product(correct, wrong))
    return wins / (len(correct) * len(wrong))


def brute_f1(scores, labels, threshold):
    predictions = []
    for steps in scores:
        below = [k for k, s in enumerate(steps) if s < threshold]
        predictions.append(below[0] if below else -1)
    erroneous = [p == y for p, y in zip(predictions, labels) if y >= 0]
    correct = [p == -1 for p, y in zip(predictions, labels) if y < 0]
    a, b = sum(erroneous) / len(erroneous), sum(correct) / len(correct)
    return 2 * a * b / (a + b) if a + b else 0.0


@pytest.mark.parametrize("seed", range(5))
def test_auroc_equals_pairwise_count(seed):
    scores, labels = random_solutions(seed)
    correct, wrong = labelled_step_scores(scores, labels)
    assert auroc(correct, wrong) == pytest.approx(brute_auroc(correct, wrong), abs=1e-12)
    assert step_auroc(scores, labels) == pytest.approx(brute_auroc(correct, wrong), abs=1e-12)


def test_labelled_steps_drop_the_steps_after_the_first_error():
    correct, wrong = labelled_step_scores([[0.9, 0.1, 0.7], [0.8, 0.6]], [1, -1])
    assert correct == [0.9, 0.8, 0.6] and wrong == [0.1]


def test_auroc_needs_both_kinds():
    with pytest.raises(ValueError, match="both kinds"):
        auroc([0.5], [])


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_f1_equals_one_threshold_at_a_time(seed):
    scores, labels = random_solutions(seed)
    thresholds = [-1, 0, 0.1, 1 / 6, 0.5, 0.55, 5 / 6, 1, 2]
    vectorised = f1_at_thresholds(scores, labels, thresholds)
    for t, value in zip(thresholds, vectorised):
        predictions = [first_error(s, t) for s in scores]
        assert value == pytest.approx(processbench_f1(predictions, labels).f1, abs=1e-12)
        assert value == pytest.approx(brute_f1(scores, labels, t), abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_best_threshold_is_as_good_as_any_threshold(seed):
    scores, labels = random_solutions(seed)
    fine_grid = np.linspace(-0.1, 1.1, 1201)  # step 0.001 hits every gap of the 1/6 score grid
    best_possible = max(brute_f1(scores, labels, t) for t in fine_grid)
    chosen = best_threshold(scores, labels)
    assert brute_f1(scores, labels, chosen) == pytest.approx(best_possible, abs=1e-12)
    assert not any(chosen == s for steps in scores for s in steps), "the threshold should sit between scores"


def test_cross_fitting_judges_each_fold_by_the_other_folds_threshold():
    scores, labels = random_solutions(7, count=60)
    folds = [i % 3 for i in range(len(labels))]
    result, thresholds = cross_fitted_f1(scores, labels, folds)
    predictions = []
    for i, (s, f) in enumerate(zip(scores, folds)):
        others = [j for j in range(len(labels)) if folds[j] != f]
        expected = best_threshold([scores[j] for j in others], [labels[j] for j in others])
        assert thresholds[f] == expected
        predictions.append(first_error(s, expected))
    assert result == processbench_f1(predictions, labels)


def test_f1_is_the_harmonic_mean_of_the_two_accuracies():
    result = processbench_f1([0, 2, -1, -1, 1], [0, 1, -1, -1, -1])
    assert (result.accuracy_erroneous, result.accuracy_correct) == (0.5, 2 / 3)
    assert result.f1 == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert (result.erroneous, result.correct) == (2, 3)


def test_a_label_outside_the_steps_is_refused():
    with pytest.raises(ValueError, match="label 3"):
        f1_at_thresholds([[0.5, 0.5]], [3], [0.5])


def test_without_both_kinds_of_solution_there_is_no_f1_and_no_threshold():
    assert math.isnan(processbench_f1([0, 1], [0, 1]).f1)
    with pytest.raises(ValueError, match="both erroneous and correct"):
        best_threshold([[0.5, 0.2], [0.1]], [1, 0])
