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
                  = argmin_r requests(r), otherwise                    (running + waiting, SGLang's own load counts)

The run is the `problem_id` of the request's `BeamTag` (a program run's id, unique per run:
`sgl_tts/frontend/lineage.py`); untagged requests (a verifier's, a user's plain request) go to the least busy rank.
The controller's load counts come from the ranks' load snapshots (`--load-balance-method total_requests`, which
refreshes them on every dispatch) plus one per request dispatched since. The placement remembers the last
`REMEMBERED` runs (least recently used first out).

The plugin (`policies/plugin.py`) installs it with $SGLTTS_DP_PLACEMENT=search on `total_requests_scheduler`, and
`sgl_tts/runtime/server.py` starts every multi-rank CPU runtime that way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

from policies.base import decode_rid

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.total_requests_scheduler"
SEARCH = "search"  # the value of $SGLTTS_DP_PLACEMENT that installs it
LOAD_BALANCE_ARGS = ("--load-balance-method", "total_requests")  # the dispatcher the hook wraps
REMEMBERED = 4096


class SearchPlacement:
    """Places runs on ranks: sticky per run, least busy rank for a run's first request. Pure: no I/O."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self.remembered = remembered
        self._rank_of: OrderedDict[str, int] = OrderedDict()

    def place(self, run: str | None, loads: Sequence[int], active: Sequence[int] | None = None) -> int:
        """The rank for a request of `run` (None: untagged), given each rank's requests (`loads`) and the ranks
        that take requests (`active`, default all)."""
        active = list(range(len(loads))) if active is None else list(active)
        if not active:
            raise ValueError("no active rank to place a request on")
        if run is not None and self._rank_of.get(run) in active:
            self._rank_of.move_to_end(run)
            return self._rank_of[run]
        rank = min(active, key=lambda r: (loads[r], r))
        if run is not None:
            self._rank_of[run] = rank
            self._rank_of.move_to_end(run)
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
