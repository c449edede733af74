"""A search's timeline: slot assignment against brute force, slot states from hand-built ledgers, the recording
(on only with `record_timeline`) on the scripted backend, and the drawings."""

import random

import pytest

from sgl_tts.app.timeline import (Busy, Segment, assign_slots, lanes, latency_points, plot_latency_vs_context,
                                  plot_timeline, slot_segments, state_seconds)
from sgl_tts.frontend.ledger import Request, RequestLedger
from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.programs import load_program
from sgl_tts.testing import ScriptedBackend, ScriptedScorer


def max_overlap(intervals):
    """Brute force: the most intervals holding one instant (half-open [began, ended))."""
    points = {b for b, _ in intervals}
    return max((sum(b <= t < e for b, e in intervals) for t in points), default=0)


@pytest.mark.parametrize("seed", range(20))
def test_slots_never_overlap_and_are_as_few_as_the_overlap_allows(seed):
    rng = random.Random(seed)
    intervals = []
    for _ in range(rng.randint(1, 40)):
        began = rng.choice([rng.uniform(0, 10), float(rng.randint(0, 10))])  # some exact touches
        intervals.append((began, began + rng.choice([rng.uniform(0.1, 3), 1.0])))
    slots = assign_slots(intervals)
    for i, (b1, e1) in enumerate(intervals):
        for j, (b2, e2) in enumerate(intervals):
            if i < j and slots[i] == slots[j]:
                assert e1 <= b2 or e2 <= b1, f"{intervals[i]} and {intervals[j]} share slot {slots[i]}"
    assert len(set(slots)) == max_overlap(intervals)
    assert set(slots) == set(range(len(set(slots))))  # numbered from 0 without gaps


def test_an_interval_takes_the_lowest_free_slot():
    # by start (ties: earlier end first): (0,4)->0, (0,7)->1, (0,10)->2, (4,6)->0 (free at 4), (5,8)->3
    assert assign_slots([(0, 4), (0, 10), (0, 7), (5, 8), (4, 6)]) == [0, 2, 1, 3, 0]
    assert assign_slots([]) == []


# A hand-built search: iteration 1 sends A, B, C at 0 (answered at 4, 10, 7) and S speculates 5-8 in A's freed
# slot; the verifier scores 10-11; iteration 2 sends D and E at 11 (answered at 15 and 13): E, the shorter, takes
# the lowest free slot.
HAND = {
    "label": "hand",
    "requests": [{"runtime": "generator", "began": b, "ended": e, "tokens": 8, "prompt_tokens": p, "queue_s": None,
                  "e2e_s": None} for b, e, p in ((0, 4, 50), (0, 10, 50), (0, 7, 50), (11, 15, 70), (11, 13, 70))],
    "windows": [{"kind": "iteration", "runtime": "generator", "began": 0, "ended": 10, "index": 1},
                {"kind": "speculative", "runtime": "generator", "began": 5, "ended": 8, "tokens": 3,
                 "prompt_tokens": 58, "aborted": 1},
                {"kind": "verify", "runtime": "scorer", "began": 10, "ended": 11, "paths": 3, "steps": 3,
                 "input_tokens": 180, "cached_tokens": 150},
                {"kind": "iteration", "runtime": "generator", "began": 11, "ended": 15, "index": 2}],
}


def test_slot_states_of_a_hand_built_search():
    rows = lanes(HAND)
    got = {(role, slot): [(s.state, s.began, s.ended) for s in segments] for role, slot, segments in rows}
    assert got == {
        ("generator", 0): [("generate", 0, 4), ("tail", 4, 5), ("speculative", 5, 8), ("tail", 8, 10),
                           ("idle", 10, 11), ("generate", 11, 13), ("tail", 13, 15)],
        ("generator", 1): [("generate", 0, 7), ("tail", 7, 10), ("idle", 10, 11), ("generate", 11, 15)],
        ("generator", 2): [("generate", 0, 10), ("idle", 10, 15)],
        ("verifier", 0): [("idle", 0, 10), ("verify", 10, 11), ("idle", 11, 15)],
    }
    assert [(role, slot) for role, slot, _ in rows] == [("generator", 0), ("generator", 1), ("generator", 2),
                                                        ("verifier", 0)]
    seconds = state_seconds(rows)
    assert seconds["generator"] == {"generate": 4 + 2 + 7 + 4 + 10, "verify": 0.0, "speculative": 3,
                                    "tail": 1 + 2 + 2 + 3, "idle": 1 + 1 + 5}
    assert sum(seconds["verifier"].values()) == 15


def test_a_request_outside_every_iteration_leaves_no_tail():
    work = [Busy("generator", "generate", 0, 2)]
    assert slot_segments(work, [0], [], 5) == {0: [Segment("generate", 0, 2), Segment("idle", 2, 5)]}
    # the iteration ended before the next request came: tail to its end, idle after
    assert slot_segments(work, [0], [(0, 3)], 5) == {0: [Segment("generate", 0, 2), Segment("tail", 2, 3),
                                                         Segment("idle", 3, 5)]}


def test_latency_points_per_role():
    points = latency_points([HAND])
    assert points["generator"] == [(50, 4), (50, 10), (50, 7), (70, 4), (70, 2)]
    assert points["verifier"] == [(60, 1)]


def test_the_ledger_keeps_windows_only_when_asked():
    for record, expected in ((False, 0), (True, 1)):
        ledger = RequestLedger(record_windows=record)
        ledger.window("verify", "scorer", 1.0, 2.0, paths=2)
        assert len(ledger.recorded_windows()) == expected
    request = Request("generator", "q", "a", 3, answered_at=10.0, client_s=0.25, prompt_tokens=7)
    assert request.sent_at == 9.75


PROBLEM = Problem(id="p", question="what is 2 plus 2?", gold="4")


def scripted_search(record_timeline):
    runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: f"Q: {q}\n\n")
    config = SearchConfig(program="beam_search", n=4, beam_width=2, max_steps=4, max_step_tokens=16, max_tokens=64,
                          record_timeline=record_timeline)
    context = runtimes.new_search(config, PROBLEM.id)
    return load_program("beam_search")(PROBLEM, config, runtimes, context), context


def test_a_scripted_search_records_its_timeline_only_when_asked(tmp_path):
    plain, context = scripted_search(False)
    assert "timeline" not in plain.extra and context.ledger.recorded_windows() == []
    result, context = scripted_search(True)
    timeline = result.extra["timeline"]
    kinds = [w["kind"] for w in timeline["windows"]]
    assert kinds.count("iteration") == result.iterations > 0
    assert kinds.count("verify") == result.verifier_calls > 0
    assert len(timeline["requests"]) == context.ledger.answered_count() > 0
    for request in timeline["requests"]:
        assert 0 <= request["began"] <= request["ended"] and request["runtime"] == "generator"
    # every request lies inside one iteration, and each lane's segments tile the search's time
    iterations = [(w["began"], w["ended"]) for w in timeline["windows"] if w["kind"] == "iteration"]
    assert all(any(b <= r["began"] and r["ended"] <= e for b, e in iterations) for r in timeline["requests"])
    rows = lanes(timeline)
    horizon = rows[0][2][-1].ended
    for _, _, segments in rows:
        assert segments[0].began == 0 and segments[-1].ended == horizon
        assert all(a.ended == b.began for a, b in zip(segments, segments[1:]))
    generated = sum(s.ended - s.began for _, _, segs in rows for s in segs if s.state == "generate")
    assert generated == pytest.approx(sum(r["ended"] - r["began"] for r in timeline["requests"]))
    picture, graph = tmp_path / "t.png", tmp_path / "l.svg"
    plot_timeline(timeline, picture, "beam search")
    plot_latency_vs_context([timeline, HAND], graph, "latency")
    assert picture.read_bytes()[:4] == b"\x89PNG" and picture.stat().st_size < 200_000
    assert b"<svg" in graph.read_bytes()[:500]
