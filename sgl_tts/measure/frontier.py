"""Cost-accuracy frontiers: which (cost, accuracy) points no other point beats, and what reaching an accuracy costs.

A point p = (cost, accuracy) is dominated when some other point q has cost_q ≤ cost_p and accuracy_q ≥ accuracy_p,
one of the two strictly. The Pareto frontier is the set of points nothing dominates: sorted by cost, each has a
higher accuracy than every cheaper one. Of equal points the first is kept.

`cost_to_reach(points, a)` = min { cost_q : accuracy_q ≥ a }, the cheapest point at least as accurate as a (None:
none is), so `cost_to_reach(ours, accuracy_peer) / cost_peer` is our cost at the peer's accuracy, as a ratio.
"""

from __future__ import annotations

from collections.abc import Sequence

Point = tuple[float, float]  # (cost, accuracy)


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indices of the frontier's points, cheapest first (cost ascending, accuracy then strictly ascending)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    for index in order:
        if not front or points[index][1] > points[front[-1]][1]:
            front.append(index)
    return front


def cost_to_reach(points: Sequence[Point], accuracy: float) -> float | None:
    """The lowest cost among `points` with an accuracy of at least `accuracy`; None when none reaches it."""
    costs = [cost for cost, reached in points if reached >= accuracy]
    return min(costs) if costs else None
