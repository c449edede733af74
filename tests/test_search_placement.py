"""Search placement over data-parallel ranks: a run's requests stay on one rank, new runs go to the least busy,
against a brute-force replay; the hook's dispatch through a stand-in of SGLang's controller."""

import random
import types

import pytest

from policies.base import BeamTag, encode_rid
from policies.search_placement import SearchPlacement, make_dispatch_hook


def test_a_runs_requests_stay_on_the_rank_its_first_request_went_to():
    placement = SearchPlacement()
    assert placement.place("run/a", [5, 2]) == 1  # least busy
    assert placement.place("run/a", [0, 90]) == 1  # sticky, whatever the loads are now
    assert placement.place("run/b", [0, 90]) == 0
    assert placement.place(None, [7, 3]) == 1  # untagged: least busy, remembered nowhere
    assert placement.place(None, [3, 7]) == 0
    assert placement.place("run/c", [4, 4]) == 0  # a tie: the lower rank


def test_an_inactive_rank_is_never_chosen_and_a_run_on_it_moves():
    placement = SearchPlacement()
    assert placement.place("run/a", [0, 9]) == 0
    assert placement.place("run/a", [0, 9], active=[1]) == 1
    assert placement.place("run/a", [0, 9], active=[0, 1]) == 1  # it now lives on rank 1
    with pytest.raises(ValueError, match="no active rank"):
        placement.place("run/b", [0, 0], active=[])


def test_the_placement_forgets_the_least_recently_used_runs_first():
    placement = SearchPlacement(remembered=2)
    placement.place("run/a", [0, 1])  # rank 0
    placement.place("run/b", [1, 0])  # rank 1
    placement.place("run/a", [9, 0])  # used again: a is now the most recent
    placement.place("run/c", [1, 0])  # rank 1; b is forgotten
    assert placement.place("run/a", [9, 0]) == 0
    assert placement.place("run/b", [9, 0]) == 1  # placed anew, by load


def test_placements_match_a_brute_force_replay():
    """Random runs and loads: each request's rank equals the rank a replay that keeps every run's first rank
    and otherwise takes the first least-loaded rank gives."""
    rng = random.Random(3)
    placement = SearchPlacement(clock=lambda: 0.0)  # no run ever settles: E stays 1, nothing is reserved
    first_rank: dict[str, int] = {}
    for _ in range(2000):
        run = rng.choice([None] + [f"run/{i}" for i in range(40)])
        loads = [rng.randrange(0, 20) for _ in range(3)]
        got = placement.place(run, loads)
        expected = first_rank.get(run) if run is not None else None
        if expected is None:
            expected = loads.index(min(loads))
            if run is not None:
                first_rank[run] = expected
        assert got == expected


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_burst_of_new_runs_is_split_evenly_when_the_loads_lag_behind():
    """SGLang's snapshots lag the dispatches: in a burst every new run sees the same loads. Counted in requests,
    all of them would go to one rank; counted at the load a run reaches, they alternate."""
    clock = FakeClock()
    placement = SearchPlacement(settle_s=5.0, clock=clock)
    for index in range(4):  # earlier runs: a prompt, then 16 samples, within their first seconds
        for _ in range(17):
            placement.place(f"old/{index}", [0, 0])
        clock.now += 0.1
    assert placement.expected_sends() == 1, "no run has settled yet"
    clock.now += 6.0
    placement.settle()
    assert placement.expected_sends() == 17
    ranks = [placement.place(f"new/{index}", [0, 0]) for index in range(16)]
    assert ranks.count(0) == ranks.count(1) == 8, ranks
    assert SearchPlacement(clock=clock).place("fresh", [0, 0]) == 0
    unreserved = SearchPlacement(clock=clock)
    assert [unreserved.place(f"new/{index}", [0, 0]) for index in range(4)] == [0, 0, 0, 0], "requests alone"


def test_a_young_runs_reservation_shrinks_as_it_sends_and_ends_when_it_settles():
    clock = FakeClock()
    placement = SearchPlacement(settle_s=5.0, clock=clock)
    for index in range(3):
        for _ in range(10):
            placement.place(f"old/{index}", [0, 0])
    clock.now = 10.0
    assert placement.place("a", [0, 0]) == 0 and placement.expected_sends() == 10
    assert placement.reserved(2) == [9, 0]
    for _ in range(6):
        assert placement.place("a", [0, 0]) == 0
    assert placement.reserved(2) == [3, 0]
    assert placement.place("b", [3, 0]) == 1, "3 requests and 3 reserved on rank 0"
    assert placement.place("c", [4, 9]) == 0, "4 + 3 against 9 + 9"
    clock.now = 15.0  # a, b and c have settled: their loads are in the snapshots now
    assert placement.reserved(2) == [0, 0] and placement.place("d", [5, 4]) == 1
    assert placement.expected_sends() == 8  # the median of 10, 10, 10, 7, 1 and 1 (8.5, rounded to even)


class FakeController:
    """What the hook reads of SGLang's DataParallelController: its load counts, active ranks and worker sockets."""

    def __init__(self, loads):
        self.dp_budget = types.SimpleNamespace(total_requests=list(loads))
        self._active_workers = list(range(len(loads)))
        self.workers = [f"socket-{rank}" for rank in range(len(loads))]


def test_the_hook_sends_a_runs_requests_to_one_rank_and_counts_them(monkeypatch):
    pytest.importorskip("sglang.srt.managers.io_struct")
    import sglang.srt.managers.io_struct as io_struct

    sent = []
    monkeypatch.setattr(io_struct, "sock_send", lambda socket, request: sent.append((socket, request.rid)))
    original_calls = []

    def original(controller, req):
        original_calls.append(req.rid)

    hook = make_dispatch_hook(SearchPlacement())
    controller = FakeController([3, 1])
    rids = [encode_rid(BeamTag("run/x", 1, beam, 0)) for beam in range(4)]
    for rid in rids:
        hook(original, controller, types.SimpleNamespace(rid=rid, routed_dp_rank=None))
    assert sent == [("socket-1", rid) for rid in rids]  # rank 1 was the least busy; the others follow it
    assert controller.dp_budget.total_requests == [3, 5]
    hook(original, controller, types.SimpleNamespace(rid="plain-request", routed_dp_rank=None))
    assert sent[-1] == ("socket-0", "plain-request")  # untagged: least busy
    hook(original, controller, types.SimpleNamespace(rid=rids[0], routed_dp_rank=0))
    assert original_calls == [rids[0]]  # a rank the client named is SGLang's to route
