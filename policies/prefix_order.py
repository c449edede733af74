"""Dynamic prefix-aware scheduling (FastTTS §4.2) and its eviction-cost model.

`PrefixAwareOrder` is what runs in the scheduler: forks of one parent stay together and parents keep
their tree order across iterations, so consecutive requests share the longest prefixes. The functions
below it are the paper's cost model, used by the tests to check that ordering against brute force.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

from policies.base import BeamTag, OrderingPolicy, T, TagOf

_ROOT = -1  # group key of a first-step request (parent_id None)


class PrefixAwareOrder(OrderingPolicy):
    """Group by parent, parents in tree order, problems first come first served, speculation last.

    The order, from first to last:
    1. standard work and untagged requests, by the rank of their problem: the order in which the
       policy first saw the problem (an untagged request counts as a problem of its own, so untagged
       requests keep FCFS order among the problems); within a problem by iteration, then by parent id;
    2. speculative work, by score bin (C_1 first), then the same keys.
    Requests of one group (same problem, iteration and parent) keep their queue order.

    Parent ids are positions in the search's beam list, which lists children parent by parent, so
    ordering groups by parent id keeps the parents' relative order across iterations and yields a
    depth-first order of the search tree: each subtree contiguous, which maximises the prefix shared
    by consecutive requests. The ids come with the request, so the order does not depend on which
    scheduling pass a request arrived in.

    Cost: one pass to group (O(n)), then a sort of the g group keys (small integer tuples; never
    prefixes), linear when the queue is already in order, as it is after the previous pass.
    """

    name = "prefix"

    def __init__(self, max_problems: int = 65536) -> None:
        assert max_problems > 0, f"max_problems must be positive, got {max_problems}"
        self._max_problems = max_problems
        self._problem_rank: OrderedDict[str, int] = OrderedDict()
        self._untagged_rank: dict[int, int] = {}
        self._next_rank = 0

    def _new_rank(self) -> int:
        self._next_rank += 1
        return self._next_rank - 1

    def _rank_of_problem(self, problem_id: str) -> int:
        rank = self._problem_rank.get(problem_id)
        if rank is None:
            rank = self._problem_rank[problem_id] = self._new_rank()
            if len(self._problem_rank) > self._max_problems:
                self._problem_rank.popitem(last=False)
        else:
            self._problem_rank.move_to_end(problem_id)
        return rank

    def order(self, items: Sequence[T], tag_of: TagOf) -> list[T]:
        standard: dict[tuple[int, ...], list[T]] = {}
        speculative: dict[tuple[int, ...], list[T]] = {}
        untagged_rank: dict[int, int] = {}
        for item in items:
            tag: BeamTag | None = tag_of(item)
            if tag is None:
                # Keyed by identity; only requests still waiting are remembered, so a recycled id
                # cannot inherit an old rank.
                rank = self._untagged_rank.get(id(item))
                if rank is None:
                    rank = self._new_rank()
                untagged_rank[id(item)] = rank
                standard[(rank, _ROOT, _ROOT)] = [item]
                continue
            parent = _ROOT if tag.parent_id is None else tag.parent_id
            key = (self._rank_of_problem(tag.problem_id), tag.iteration, parent)
            if tag.speculative:
                key, groups = (tag.priority_bin, *key), speculative
            else:
                groups = standard
            group = groups.get(key)
            if group is None:
                groups[key] = [item]
            else:
                group.append(item)
        self._untagged_rank = untagged_rank
        ordered: list[T] = []
        for groups in (standard, speculative):
            for key in sorted(groups):
                ordered.extend(groups[key])
        assert len(ordered) == len(items), f"ordering lost requests: {len(ordered)} of {len(items)}"
        return ordered


# ---- Eviction-cost model (FastTTS §4.2, Appendix A) ----
# A CoT is a root-to-leaf path of beam nodes. A batch is the trie of the CoTs in it; its nodes are the
# distinct prefixes of those paths.

Path = tuple[Hashable, ...]


def trie_nodes(cots: Iterable[Path]) -> frozenset[Path]:
    """The nodes of the trie holding `cots`: every non-empty prefix of every path."""
    return frozenset(cot[:k] for cot in cots for k in range(1, len(cot) + 1))


def shared_prefix(a: Path, b: Path) -> int:
    """P(a, b) for two CoTs: the number of nodes they share, i.e. their common prefix length."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def partition_batches(schedule: Sequence[Path], capacity: int | None = None) -> list[list[Path]]:
    """Split `schedule` into consecutive batches, each the longest run whose trie fits `capacity` nodes.

    `capacity=None` is Appendix A.2's single-CoT setting: one CoT per batch. A CoT larger than the
    capacity on its own still forms a batch by itself.
    """
    assert capacity is None or capacity > 0, f"capacity must be positive or None, got {capacity}"
    batches: list[list[Path]] = []
    current: list[Path] = []
    nodes: set[Path] = set()
    for cot in schedule:
        new = {cot[:k] for k in range(1, len(cot) + 1)} - nodes
        if current and (capacity is None or len(nodes) + len(new) > capacity):
            batches.append(current)
            current, nodes = [], set()
            new = {cot[:k] for k in range(1, len(cot) + 1)}
        current.append(cot)
        nodes |= new
    if current:
        batches.append(current)
    return batches


def eviction_cost(schedule: Sequence[Path], capacity: int | None = None) -> int:
    """Cost = Σ_i (Nodes(T_i) − P(T_i, T_{i+1})) over the batches T_1..T_k of `schedule` (§4.2), with
    T_{k+1} empty: the last batch is evicted too, when the next iteration's work arrives.

    So a node costs one per maximal run of consecutive batches that hold it, the cost is at least the
    number of distinct nodes, and it equals that when every subtree is contiguous in the schedule, as
    in the greedy order. (Dropping the last term instead would reward ending on a large batch.)
    """
    tries = [trie_nodes(batch) for batch in partition_batches(schedule, capacity)]
    return sum(len(a) - len(a & b) for a, b in zip(tries, [*tries[1:], frozenset()]))


def prefix_score(schedule: Sequence[Path]) -> int:
    """Score(S) = Σ_i P(c_i, c_{i+1}) of Appendix A.2 (single-CoT batches)."""
    return sum(shared_prefix(a, b) for a, b in zip(schedule, schedule[1:]))


def greedy_schedule(cots: Sequence[Path], first: int = 0) -> list[Path]:
    """The paper's greedy schedule: start at `cots[first]`, then repeatedly take the remaining CoT
    sharing the most with the last one (earliest on ties). O(n²): a reference, not the scheduler."""
    assert 0 <= first < len(cots) or not cots, f"first={first} out of range for {len(cots)} CoTs"
    if not cots:
        return []
    remaining = list(cots)
    schedule = [remaining.pop(first)]
    while remaining:
        best = max(range(len(remaining)), key=lambda i: (shared_prefix(schedule[-1], remaining[i]), -i))
        schedule.append(remaining.pop(best))
    return schedule
