"""Which data-parallel rank serves a request: a search's requests on one rank, a new search on the least busy.

A CPU generator runs one single-threaded SGLang rank per core (`share_cpu_cores`), and SGLang's data-parallel
controller deals requests to the ranks in turn (`round_robin`). Requests of one program run (a best-of-N's n
samples, a step's forks) are then split over both ranks: the run's prompt is prefilled once per rank, and a run
finishes only when its slower half does. With a client that keeps a fixed number of searches in flight (`sgl-tts
run`'s `concurrency`), a rank that finished its halves idles until some search's other half ends: in `make run` on a
2-core AMD EPYC one rank sat idle for over a minute at a time while the other decoded 63 requests (45% of the
machine idle, from `top`).

`SearchPlacement` keeps a run together and balances whole runs instead:

    rank(request) = rank of its run, if the run has sent before       (its prefixes are in that rank's radix cache)
                  = argmin_r requests(r) + reserved(r), otherwise      (running + waiting, SGLang's own load counts)

    reserved(r)   = sum over runs placed on r in the last SETTLE_S seconds of max(0, E - requests the run sent)
    E             = median requests a run sent in its first SETTLE_S seconds, over the last runs (1 before any)

A run announces itself with one small request (its prompt, which SGLang pre-sends before a fork) and sends its
real load, a best-of-N's n samples, a moment later. Counted in requests alone, a burst of new runs (a wave of
`sgl-tts run`'s problems) saw the ranks' loads from snapshots that lag the dispatches, and went 7 and 9, or worse,
to two ranks, where a search's wave ends with its slower rank: in a 16-problem run on 2 cores the ranks worked 70 s
and 94 s of a 93 s search. The reservation counts each young run at the load it will have.

The run is the `problem_id` of the request's `BeamTag` (a program run's id, unique per run:
`sgl_tts/frontend/lineage.py`); untagged requests (a verifier's, a user's plain request) go to the least busy rank.
The controller's load counts come from the ranks' load snapshots (`--load-balance-method total_requests`, which
refreshes them on every dispatch) plus one per request dispatched since. The placement remembers the last
`REMEMBERED` runs (least recently used first out).

The plugin (`policies/plugin.py`) installs it with $SGLTTS_DP_PLACEMENT=search on `total_requests_scheduler`, and
`sgl_tts/runtime/server.py` starts every multi-rank CPU runtime that way.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from policies.base import decode_rid

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.total_requests_scheduler"
SEARCH = "search"  # the value of $SGLTTS_DP_PLACEMENT that installs it
LOAD_BALANCE_ARGS = ("--load-balance-method", "total_requests")  # the dispatcher the hook wraps
REMEMBERED = 4096
SETTLE_S = 5.0  # a new run's first seconds, in which its load is reserved (a few steps of a busy CPU rank)
RUNS_OBSERVED = 32  # E is the median over this many of the last runs


@dataclass
class YoungRun:
    rank: int
    placed_at: float
    sent: int = 1


class SearchPlacement:
    """Places runs on ranks: sticky per run, least busy rank for a run's first request, a young run counted at the
    load runs reach (`reserved`). Pure: no I/O; time comes from `clock`."""

    def __init__(self, remembered: int = REMEMBERED, settle_s: float = SETTLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remembered, self.settle_s, self.clock = remembered, settle_s, clock
        self._rank_of: OrderedDict[str, int] = OrderedDict()
        self._young: OrderedDict[str, YoungRun] = OrderedDict()  # in the order placed
        self._first_sends: deque[int] = deque(maxlen=RUNS_OBSERVED)

    def expected_sends(self) -> int:
        """E: what a run sends in its first `settle_s`, as the last runs did."""
        return round(statistics.median(self._first_sends)) if self._first_sends else 1

    def settle(self) -> None:
        """Runs placed `settle_s` ago or more stop being young; what they sent by then teaches E."""
        now = self.clock()
        while self._young and now - next(iter(self._young.values())).placed_at >= self.settle_s:
            self._first_sends.append(self._young.popitem(last=False)[1].sent)

    def reserved(self, ranks: int) -> list[int]:
        """reserved(r) for each of `ranks` ranks."""
        self.settle()
        expected = self.expected_sends()
        reserved = [0] * ranks
        for young in self._young.values():
            if young.rank < ranks:
                reserved[young.rank] += max(0, expected - young.sent)
        return reserved

    def place(self, run: str | None, loads: Sequence[int], active: Sequence[int] | None = None) -> int:
        """The rank for a request of `run` (None: untagged), given each rank's requests (`loads`) and the ranks
        that take requests (`active`, default all)."""
        active = list(range(len(loads))) if active is None else list(active)
        if not active:
            raise ValueError("no active rank to place a request on")
        self.settle()
        if run is not None and self._rank_of.get(run) in active:
            self._rank_of.move_to_end(run)
            if run in self._young:
                self._young[run].sent += 1
            return self._rank_of[run]
        reserved = self.reserved(len(loads))
        rank = min(active, key=lambda r: (loads[r] + reserved[r], r))
        if run is not None:
            self._rank_of[run] = rank
            self._rank_of.move_to_end(run)
            self._young.pop(run, None)
            self._young[run] = YoungRun(rank, self.clock())
            while len(self._rank_of) > self.remembered:
                self._rank_of.popitem(last=False)
        return rank


def make_dispatch_hook(placement: SearchPlacement | None = None) -> Callable[..., Any]:
    """An AROUND hook for `DataParallelController.total_requests_scheduler(self, req)`."""
    placement = placement or SearchPlacement()

    def dispatch(original: Callable[..., Any], controller: Any, req: Any) -> Any:
        if getattr(req, "routed_dp_rank", None) is not None:  # the client named a rank: SGLang routes it
            return original(controller, req)
        from sglang.srt.managers.io_struct import sock_send

        tag = decode_rid(getattr(req, "rid", None))
        loads = controller.dp_budget.total_requests
        rank = placement.place(tag.problem_id if tag else None, loads, controller._active_workers)
        loads[rank] += 1  # as SGLang's own dispatch does, until the rank's next load snapshot
        sock_send(controller.workers[rank], req)

    return dispatch
