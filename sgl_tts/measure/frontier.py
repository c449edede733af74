"""Cost-accuracy frontiers: which (cost, accuracy) points no other point beats, and what reaching an accuracy costs.

A point p = (cost, accuracy) is dominated when some other point q has cost_q ≤ cost_p and accuracy_q ≥ accuracy_p,
one of the two strictly. The Pareto frontier is the set of points nothing dominates: sorted by cost, each has a
higher accuracy than every cheaper one. Of equal points the first is kept.

`cost_to_reach(points, a)` = min { cost_q : accuracy_q ≥ a }, the cheapest point at least as accurate as a (None:
none is), so `cost_to_reach(ours, accuracy_peer) / cost_peer` is our cost at the peer's accuracy, as a ratio.
`cheapest_reaching` gives that point's index. `most_accurate_within(points, c)` = argmax { accuracy_q : cost_q ≤ c }
(the cheapest of equals; None: no point costs that little): the other way to read a lead, a higher accuracy at no
more cost.

`reach_ratio_interval` puts a range on that ratio. Every point is a mean over the same problems (cost c_ij and
correct y_ij of point j on problem i), so a resample draws the problems with replacement, once for all points:
each point's mean cost and accuracy over the drawn problems give a ratio r* = cost_to_reach(ours*, acc_peer*) /
cost_peer*, +inf where no point of ours reaches the peer's accuracy. The interval is the percentile interval of
r* (the inverted-CDF quantiles, so an end among the unreached resamples is +inf, not an interpolation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Point = tuple[float, float]  # (cost, accuracy)


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indices of the frontier's points, cheapest first (cost ascending, accuracy then strictly ascending)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    for index in order:
        if not front or points[index][1] > points[front[-1]][1]:
            front.append(index)
    return front


def cheapest_reaching(points: Sequence[Point], accuracy: float) -> int | None:
    """The index of the cheapest point with an accuracy of at least `accuracy` (the first of equals); None when
    none reaches it."""
    reaching = [i for i, (_, reached) in enumerate(points) if reached >= accuracy]
    return min(reaching, key=lambda i: (points[i][0], i)) if reaching else None


def cost_to_reach(points: Sequence[Point], accuracy: float) -> float | None:
    """The lowest cost among `points` with an accuracy of at least `accuracy`; None when none reaches it."""
    index = cheapest_reaching(points, accuracy)
    return None if index is None else points[index][0]


def most_accurate_within(points: Sequence[Point], cost: float) -> int | None:
    """The index of the most accurate point costing at most `cost`, the cheapest of equals; None when none does."""
    within = [i for i, (spent, _) in enumerate(points) if spent <= cost]
    return min(within, key=lambda i: (-points[i][1], points[i][0], i)) if within else None


def reach_ratio_interval(ours: Sequence[tuple[Sequence[float], Sequence[bool]]],
                         peer: tuple[Sequence[float], Sequence[bool]], resamples: int = 2000, seed: int = 0,
                         confidence: float = 0.95) -> tuple[float, float, float]:
    """The percentile bootstrap interval of cost_to_reach(ours, accuracy(peer)) / cost(peer) over problems:
    (low, high, share of resamples in which some point of ours reached the peer's accuracy). `ours` and `peer`
    give each point's (cost, correct) per problem, every point over the same problems in the same order; an end
    is +inf where the resamples beyond it did not reach. Seeded: the same inputs give the same interval."""
    problems = len(peer[0])
    lengths = {len(column) for point in [*ours, peer] for column in point}
    if problems == 0 or not ours or lengths != {problems}:
        raise ValueError(f"ours, peer: expected at least one point, every one over the same {problems} problem(s) "
                         f"as the peer's (at least one), got {len(ours)} point(s) over {sorted(lengths)}")
    costs = np.asarray([point[0] for point in ours], dtype=float)  # (points, problems)
    correct = np.asarray([point[1] for point in ours], dtype=float)
    peer_cost, peer_correct = np.asarray(peer[0], dtype=float), np.asarray(peer[1], dtype=float)
    draws = np.random.default_rng(seed).integers(0, problems, size=(resamples, problems))
    our_cost, our_accuracy = costs[:, draws].mean(axis=2), correct[:, draws].mean(axis=2)  # (points, resamples)
    wanted = peer_correct[draws].mean(axis=1)
    reached = our_accuracy >= wanted - 1e-12
    best = np.where(reached, our_cost, np.inf).min(axis=0)
    ratios = best / peer_cost[draws].mean(axis=1)
    low, high = np.quantile(ratios, [(1 - confidence) / 2, (1 + confidence) / 2], method="inverted_cdf")
    return float(low), float(high), float(reached.any(axis=0).mean())
