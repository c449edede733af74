"""`sgl-tts bench policy`: the cost of P's ordering (`PrefixAwareOrder.order`) as the waiting queue grows.

Each size is a waiting queue of realistic lineage tags: one search of n beams over `ITERATIONS` iterations
(n = 7/8 of the size / iterations), beam b of an iteration forked from parent b // B of the one before (the first
from the prompt), and an eighth of the queue speculative extensions of every eighth beam (score bins 1..B),
arriving in a shuffled order (the forks' requests are sent from threads). Each round times one `order` call per size on a fresh policy, the
sizes interleaved (the order rotates by one each round), after one warm-up call per size. Reported: the median
[min-max] over rounds of microseconds per request, and the ratio of median call times between consecutive
sizes: O(n) ordering gives the ratio of the sizes (4x from 256 to 1,024), O(n log n) a little more.
"""

from __future__ import annotations

import random
import time
from typing import Any, Sequence

from policies.base import BeamTag, decode_rid, encode_rid
from policies.prefix_order import PrefixAwareOrder
from sgl_tts.measure.summary import median_min_max, median_range
from sgl_tts.measure.tables import Column, console_table

SIZES = (256, 1024, 4096)
ITERATIONS = 4


class WaitingRequest:
    """Stands in for a scheduler request: the policy reads its rid only (`policies.plugin.tag_of_request`)."""

    __slots__ = ("rid",)

    def __init__(self, rid: str):
        self.rid = rid


def tag_of(request: WaitingRequest) -> BeamTag | None:
    return decode_rid(request.rid)


def waiting_queue(size: int, beam_width: int, rng: random.Random) -> list[WaitingRequest]:
    """`size` requests of one search: ITERATIONS iterations of (7/8 of size) / ITERATIONS beams, forks of their
    parents, the rest speculative extensions of every eighth beam, shuffled."""
    beams = max(1, (size - size // 8) // ITERATIONS)  # an eighth of the queue left for speculative requests
    tags = []
    for iteration in range(ITERATIONS):
        for beam in range(beams):
            parent = None if iteration == 0 else beam // beam_width
            tags.append(BeamTag("p0", iteration, beam, parent))
    for index in range(len(tags), size):  # the rest of `size`: speculative extensions of every eighth beam
        base = tags[(index * 8) % len(tags)]
        tags.append(BeamTag("p0", base.iteration, base.beam_id, base.parent_id, True, 1 + index % beam_width))
    rng.shuffle(tags)
    return [WaitingRequest(encode_rid(tag, nonce=f"{index:x}")) for index, tag in enumerate(tags[:size])]


def time_order(sizes: Sequence[int], repeats: int, beam_width: int = 4, seed: int = 0) -> dict[int, list[float]]:
    """Seconds of one `PrefixAwareOrder().order` call per size, one per round, the sizes interleaved."""
    rng = random.Random(seed)
    queues = {size: waiting_queue(size, beam_width, rng) for size in sizes}
    for queue in queues.values():  # warm-up: the rids' tags decoded and cached, as after a scheduler's first pass
        PrefixAwareOrder().order(queue, tag_of)
    timings: dict[int, list[float]] = {size: [] for size in sizes}
    for round_index in range(repeats):
        shift = round_index % len(sizes)
        for size in [*sizes[shift:], *sizes[:shift]]:
            policy = PrefixAwareOrder()
            began = time.perf_counter()
            ordered = policy.order(queues[size], tag_of)
            timings[size].append(time.perf_counter() - began)
            assert len(ordered) == size, f"the order lost requests: {len(ordered)} of {size}"
    return timings


def summarize(timings: dict[int, list[float]]) -> list[dict[str, Any]]:
    """Per size: µs per request (median, min, max) and the ratio of the median call time to the previous size's."""
    rows, previous = [], None
    for size in sorted(timings):
        median, low, high = median_min_max(timings[size])
        rows.append({"size": size, "us_per_request": [t * 1e6 / size for t in timings[size]],
                     "median_call_s": median, "ratio_to_previous": median / previous if previous else None,
                     "range_s": (low, high)})
        previous = median
    return rows


def run_bench(sizes: Sequence[int] = SIZES, repeats: int = 15, beam_width: int = 4, seed: int = 0) -> int:
    rows = summarize(time_order(list(sizes), repeats, beam_width, seed))
    columns = (Column("waiting requests", 16), Column("us per request", 22), Column("call ms", 8),
               Column("x previous size", 15))
    print(f"PrefixAwareOrder.order, {repeats} interleaved rounds, B = {beam_width}, {ITERATIONS} iterations of "
          f"lineage tags, shuffled; median [min-max]")
    print(console_table(columns, [[str(r["size"]), median_range(r["us_per_request"], ".3f"),
                                   f"{r['median_call_s'] * 1e3:.3f}",
                                   "-" if r["ratio_to_previous"] is None else f"{r['ratio_to_previous']:.2f}x"]
                                  for r in rows]))
    return 0
