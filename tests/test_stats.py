"""Paired statistics against textbook values and brute-force references."""

import itertools
import math
import random
from statistics import NormalDist

import numpy as np
import pytest

from sgl_tts.measure.stats import mcnemar_exact, paired_bootstrap, paired_ratio_of_means, pool_seeds, wilson_interval

Z95 = NormalDist().inv_cdf(0.975)


def test_wilson_textbook_value():
    low, high = wilson_interval(8, 10)
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)


def test_wilson_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(Z95**2 / (10 + Z95**2))
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(10 / (10 + Z95**2))
    narrow, wide = wilson_interval(8, 10, 0.80), wilson_interval(8, 10, 0.99)
    assert wide[0] < narrow[0] < 0.8 < narrow[1] < wide[1]


@pytest.mark.parametrize("successes, trials", [(1, 7), (8, 10), (33, 80), (79, 80), (500, 1000)])
def test_wilson_is_the_set_of_rates_the_score_test_accepts(successes, trials):
    """Brute force: the Wilson interval is {p0 : |p̂ − p0| ≤ z·sqrt(p0(1 − p0)/n)}, scanned on a fine grid."""
    rate = successes / trials
    accepted = [p0 for p0 in (i / 100000 for i in range(100001))
                if abs(rate - p0) <= Z95 * math.sqrt(p0 * (1 - p0) / trials)]
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(min(accepted), abs=1e-5) and high == pytest.approx(max(accepted), abs=1e-5)


@pytest.mark.parametrize("arguments, message", [
    ((11, 10), r"successes: expected 0\.\.10"),
    ((-1, 10), r"successes: expected 0\.\.10"),
    ((0, -1), r"trials: expected >= 0"),
    ((1, 2, 1.0), r"confidence: expected a level between 0 and 1"),
])
def test_wilson_refuses_bad_input(arguments, message):
    with pytest.raises(ValueError, match=message):
        wilson_interval(*arguments)


def outcomes(b01: int, b10: int, both: int, neither: int, seed: int) -> tuple[list[bool], list[bool]]:
    """Paired outcomes (a, b) with the given cell counts, in a shuffled order."""
    pairs = [(False, True)] * b01 + [(True, False)] * b10 + [(True, True)] * both + [(False, False)] * neither
    random.Random(seed).shuffle(pairs)
    return [a for a, _ in pairs], [b for _, b in pairs]


def test_mcnemar_against_enumerating_every_sign_assignment():
    """Brute force: each of the k discordant pairs favours a or b with probability 1/2; the p-value is the share
    of the 2^k assignments at least as far from k/2 as the one observed."""
    for discordant in range(0, 13):
        assignments = list(itertools.product((0, 1), repeat=discordant))
        for b01 in range(discordant + 1):
            b10 = discordant - b01
            extreme = sum(1 for signs in assignments if abs(sum(signs) - discordant / 2) >= abs(b01 - discordant / 2))
            a, b = outcomes(b01, b10, both=3, neither=2, seed=discordant * 100 + b01)
            result = mcnemar_exact(a, b)
            assert (result.pairs, result.b01, result.b10, result.discordant) == (discordant + 5, b01, b10, discordant)
            assert result.p_value == pytest.approx(extreme / 2**discordant, rel=1e-12), (b01, b10)


def test_mcnemar_hand_values_and_large_counts():
    assert mcnemar_exact(*outcomes(0, 6, 4, 4, seed=1)).p_value == pytest.approx(2 / 64)
    assert mcnemar_exact(*outcomes(1, 6, 0, 0, seed=1)).p_value == pytest.approx(2 * 8 / 128)
    assert mcnemar_exact([True, False], [True, False]).p_value == 1.0
    large = mcnemar_exact(*outcomes(2000, 2150, 10, 10, seed=2))
    assert 0.0 < large.p_value < 0.05 and math.isfinite(large.p_value)
    with pytest.raises(ValueError, match=r"b_correct: expected one outcome per problem of a_correct \(2\), got 3"):
        mcnemar_exact([True, False], [True, False, True])


def test_paired_bootstrap_covers_the_true_difference_and_is_deterministic():
    a, b = outcomes(b01=25, b10=5, both=45, neither=25, seed=3)  # accuracy a = 0.5, b = 0.7
    difference, low, high = paired_bootstrap(a, b, seed=7)
    assert difference == pytest.approx(0.2)
    assert 0.0 < low < 0.2 < high < 0.4
    assert paired_bootstrap(a, b, seed=7) == (difference, low, high)
    few = {paired_bootstrap(a, b, resamples=40, seed=seed) for seed in range(20)}
    assert len(few) > 1, "the seed drives the resampling"
    assert paired_bootstrap(b, a, seed=7)[0] == pytest.approx(-0.2)
    assert paired_bootstrap([True] * 5, [True] * 5) == (0.0, 0.0, 0.0)


def test_paired_bootstrap_matches_exact_enumeration_of_resamples():
    """Brute force: every one of the n^n equally likely resamples of n = 5 problems, and their means' quantiles."""
    a = [False, False, True, True, False]
    b = [True, True, True, False, False]  # differences b − a: 1, 1, 0, −1, 0
    differences = [int(y) - int(x) for x, y in zip(a, b)]
    means = sorted(sum(differences[i] for i in picks) / 5 for picks in itertools.product(range(5), repeat=5))
    atoms = sorted(set(means))
    cdf = {atom: sum(1 for m in means if m <= atom) / len(means) for atom in atoms}
    exact_low = next(atom for atom in atoms if cdf[atom] > 0.025)
    exact_high = next(atom for atom in atoms if cdf[atom] >= 0.975)
    # The sampled quantiles land on these atoms only if the CDF does not jump within sampling error of 2.5%/97.5%.
    assert all(abs(value - level) > 0.005 for value in cdf.values() for level in (0.025, 0.975))
    difference, low, high = paired_bootstrap(a, b, resamples=20000, seed=0)
    assert difference == pytest.approx(0.2)
    assert (low, high) == pytest.approx((exact_low, exact_high))


def test_paired_bootstrap_agrees_with_resampling_indices():
    a, b = outcomes(b01=14, b10=6, both=30, neither=10, seed=4)
    differences = np.array(b, dtype=float) - np.array(a, dtype=float)
    picks = np.random.default_rng(123).integers(0, len(a), size=(20000, len(a)))
    reference = np.quantile(differences[picks].mean(axis=1), [0.025, 0.975])
    _, low, high = paired_bootstrap(a, b, resamples=20000, seed=5)
    assert (low, high) == pytest.approx(tuple(reference), abs=0.02)


@pytest.mark.parametrize("arguments, message", [
    (([], []), r"a_correct: expected at least one problem"),
    (([True], [True], 0), r"resamples: expected >= 1"),
    (([True], [True, False]), r"b_correct: expected one outcome per problem"),
])
def test_paired_bootstrap_refuses_bad_input(arguments, message):
    with pytest.raises(ValueError, match=message):
        paired_bootstrap(*arguments)


def test_paired_ratio_of_means_against_every_resample():
    """Brute force: the ratio of means over every one of the 4^4 equally likely resamples of 4 problems; the
    bootstrap's quantiles are those of that exact distribution, within sampling error."""
    a, b = [1.0, 2.0, 4.0, 3.0], [1.5, 1.0, 4.0, 6.0]
    ratios = np.array([sum(b[i] for i in picks) / sum(a[i] for i in picks)
                       for picks in itertools.product(range(4), repeat=4)])
    exact_low, exact_high = np.quantile(ratios, [0.025, 0.975])
    ratio, low, high = paired_ratio_of_means(a, b, resamples=40000, seed=3)
    assert ratio == pytest.approx(12.5 / 10)
    assert (low, high) == pytest.approx((exact_low, exact_high), abs=0.03)
    assert paired_ratio_of_means(a, b, 500, seed=1) == paired_ratio_of_means(a, b, 500, seed=1)


def test_paired_ratio_of_means_keeps_the_pairs():
    """b twice a problem by problem: every resample's ratio is 2, however far the problems' costs spread (resampling
    the arms apart would spread the ratio)."""
    a = [0.2, 5.0, 1.0, 9.0, 0.7]
    assert paired_ratio_of_means(a, [2 * x for x in a], resamples=2000) == pytest.approx((2.0, 2.0, 2.0))
    with pytest.raises(ValueError, match=r"a_costs, b_costs: expected the same problems"):
        paired_ratio_of_means([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"resamples: expected >= 1"):
        paired_ratio_of_means([1.0], [1.0], resamples=0)


def test_pool_seeds_pairs_by_seed_and_problem():
    a_runs = {1: {"p2": True, "p1": False}, 0: {"p1": True, "p2": True}}
    b_runs = {0: {"p2": False, "p1": True}, 1: {"p1": True, "p2": True}}
    pooled = pool_seeds(a_runs, b_runs)
    assert pooled.keys == ((0, "p1"), (0, "p2"), (1, "p1"), (1, "p2"))
    assert pooled.a_correct == (True, True, False, True)
    assert pooled.b_correct == (True, False, True, True)
    assert mcnemar_exact(pooled.a_correct, pooled.b_correct).discordant == 2


def test_pool_seeds_refuses_mismatched_seeds_and_ids():
    with pytest.raises(ValueError, match=r"b_runs: expected the seeds of a_runs \[0, 1\], got \[0\].*only in a: \[1\]"):
        pool_seeds({0: {"p1": True}, 1: {"p1": True}}, {0: {"p1": True}})
    with pytest.raises(ValueError, match=r"b_runs\[0\]: expected the problem ids of a_runs\[0\]; "
                                         r"only in a \(1\): \['p2'\], only in b \(1\): \['p3'\]"):
        pool_seeds({0: {"p1": True, "p2": False}}, {0: {"p1": True, "p3": False}})
