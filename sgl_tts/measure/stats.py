"""Statistics for accuracy: intervals of one arm, and paired comparisons of two arms on the same problems (their
accuracy, and the ratio of their mean costs, e.g. wall time).

Two arms run on the same problems are compared pair by pair (McNemar's exact test, a paired bootstrap): the
problems shared by both cancel out, so a difference shows with far fewer problems than two separate intervals
would need.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist

import numpy as np


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a level between 0 and 1 (exclusive), got {confidence}")


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success rate.

    With p = successes / trials, n = trials and z the two-sided normal quantile of `confidence`:

        centre = (p + z²/2n) / (1 + z²/n)
        half   = z / (1 + z²/n) · sqrt(p(1 − p)/n + z²/4n²)

    and the interval is centre ± half. At 0/n the low end is exactly 0, at n/n the high end exactly 1 (the
    formula reaches them only up to rounding). With no trials nothing is known: (0, 1).
    """
    if trials < 0:
        raise ValueError(f"trials: expected >= 0, got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes: expected 0..{trials} (the trials), got {successes}")
    _check_confidence(confidence)
    if trials == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / trials
    shrink = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / shrink
    half = z / shrink * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def _paired(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    if len(a_correct) != len(b_correct):
        raise ValueError(f"b_correct: expected one outcome per problem of a_correct ({len(a_correct)}), "
                         f"got {len(b_correct)}")
    return [bool(x) for x in a_correct], [bool(x) for x in b_correct]


@dataclass(frozen=True)
class McNemarResult:
    pairs: int  # problems compared
    b01: int  # discordant: a wrong, b right
    b10: int  # discordant: a right, b wrong
    p_value: float  # two-sided, exact

    @property
    def discordant(self) -> int:
        return self.b01 + self.b10


def mcnemar_exact(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> McNemarResult:
    """McNemar's exact test of arm a against arm b on the same problems, in the same order.

    Only the discordant pairs tell the arms apart. Under "no difference" each of the k = b01 + b10 discordant
    pairs is equally likely to favour either arm, so b01 ~ Bin(k, 1/2), and the two-sided p-value is

        p = min(1, 2 · P(X ≤ min(b01, b10))),  X ~ Bin(k, 1/2),  P(X ≤ m) = Σ_{i ≤ m} C(k, i) / 2^k

    summed exactly in integers. With no discordant pair, p = 1.
    """
    a, b = _paired(a_correct, b_correct)
    b01 = sum(1 for x, y in zip(a, b) if not x and y)
    b10 = sum(1 for x, y in zip(a, b) if x and not y)
    discordant = b01 + b10
    if discordant == 0:
        return McNemarResult(len(a), b01, b10, 1.0)
    tail = sum(math.comb(discordant, i) for i in range(min(b01, b10) + 1))
    p_value = min(Fraction(1), Fraction(2 * tail, 2**discordant))
    return McNemarResult(len(a), b01, b10, float(p_value))


def paired_bootstrap(a_correct: Sequence[bool], b_correct: Sequence[bool], resamples: int = 10000, seed: int = 0,
                     confidence: float = 0.95) -> tuple[float, float, float]:
    """accuracy(b) − accuracy(a), with its percentile bootstrap interval: (difference, low, high).

    Each resample draws n problems with replacement and takes the mean of d = b_correct − a_correct over them.
    d takes only the values −1, 0 and 1, so a resample is fully described by how many of its n draws land on
    each; those counts are Multinomial(n; share of −1, 0, 1 among the problems), which is what is drawn here
    (the same distribution as drawing indices, in O(resamples) memory). The interval is the (1 − confidence)/2
    and (1 + confidence)/2 quantiles of the resampled means. The same seed gives the same interval.
    """
    a, b = _paired(a_correct, b_correct)
    if not a:
        raise ValueError("a_correct: expected at least one problem, got none")
    if resamples < 1:
        raise ValueError(f"resamples: expected >= 1, got {resamples}")
    _check_confidence(confidence)
    n = len(a)
    worse = sum(1 for x, y in zip(a, b) if x and not y)
    better = sum(1 for x, y in zip(a, b) if not x and y)
    shares = [worse / n, (n - worse - better) / n, better / n]
    counts = np.random.default_rng(seed).multinomial(n, shares, size=resamples)
    means = (counts[:, 2] - counts[:, 0]) / n
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return (better - worse) / n, float(low), float(high)


def paired_ratio_of_means(a_costs: Sequence[float], b_costs: Sequence[float], resamples: int = 10000,
                          seed: int = 0, confidence: float = 0.95) -> tuple[float, float, float]:
    """mean(b_costs) / mean(a_costs) over the same problems, with its percentile bootstrap interval: (ratio, low,
    high). Each resample draws n problems with replacement, the same draws for both arms (the pairs stay pairs),
    and takes the ratio of the two means over them. The same seed gives the same interval."""
    a, b = np.asarray(a_costs, dtype=float), np.asarray(b_costs, dtype=float)
    if len(a) == 0 or len(a) != len(b):
        raise ValueError(f"a_costs, b_costs: expected the same problems, at least one, got {len(a)} and {len(b)}")
    if resamples < 1:
        raise ValueError(f"resamples: expected >= 1, got {resamples}")
    _check_confidence(confidence)
    draws = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    ratios = b[draws].mean(axis=1) / a[draws].mean(axis=1)
    low, high = np.quantile(ratios, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(b.mean() / a.mean()), float(low), float(high)


@dataclass(frozen=True)
class PairedOutcomes:
    keys: tuple[tuple[int, str], ...]  # (seed, problem id) of each pair
    a_correct: tuple[bool, ...]
    b_correct: tuple[bool, ...]


def pool_seeds(a_runs: Mapping[int, Mapping[str, bool]], b_runs: Mapping[int, Mapping[str, bool]]) -> PairedOutcomes:
    """Pair two arms' outcomes by (seed, problem id) across several seeds: `a_runs[seed][problem_id]` is whether
    arm a answered that problem right in that seed's run.

    Both arms must hold the same seeds and, within a seed, the same problem ids; otherwise a ValueError names
    the seeds or ids found on one side only. Pairs come in order of seed, then problem id. The pairs of one
    problem under different seeds are not independent (the problem is the same), so tests on the pooled pairs
    read a sharper difference than the problems alone can carry when outcomes repeat across seeds.
    """
    if set(a_runs) != set(b_runs):
        raise ValueError(f"b_runs: expected the seeds of a_runs {sorted(a_runs)}, got {sorted(b_runs)} "
                         f"(only in a: {sorted(set(a_runs) - set(b_runs))}, "
                         f"only in b: {sorted(set(b_runs) - set(a_runs))})")
    keys: list[tuple[int, str]] = []
    a_correct: list[bool] = []
    b_correct: list[bool] = []
    for seed in sorted(a_runs):
        a_seed, b_seed = a_runs[seed], b_runs[seed]
        if set(a_seed) != set(b_seed):
            only_a = sorted(set(a_seed) - set(b_seed))
            only_b = sorted(set(b_seed) - set(a_seed))
            raise ValueError(f"b_runs[{seed}]: expected the problem ids of a_runs[{seed}]; "
                             f"only in a ({len(only_a)}): {only_a[:10]}, only in b ({len(only_b)}): {only_b[:10]}")
        for problem_id in sorted(a_seed):
            keys.append((seed, problem_id))
            a_correct.append(bool(a_seed[problem_id]))
            b_correct.append(bool(b_seed[problem_id]))
    return PairedOutcomes(tuple(keys), tuple(a_correct), tuple(b_correct))
