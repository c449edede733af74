"""Scheduler policies: the rid codec, prefix-aware ordering against the paper's cost model (checked by
brute force), and speculative beam extension."""

import itertools
import random
import statistics

import pytest

from policies import POLICIES, make_policy
from policies.base import BeamTag, FcfsOrder, decode_rid, encode_rid
from policies.prefix_order import (
    PrefixAwareOrder,
    eviction_cost,
    greedy_schedule,
    partition_batches,
    prefix_score,
    shared_prefix,
    trie_nodes,
)
from policies.speculative import (
    SpeculativeSelector,
    SpeculativeSlot,
    TruncationSampler,
    lookahead_split,
    score_bins,
    speculative_potential,
    speculative_slots,
)


class Req:
    """Stands in for a scheduler request: only the rid matters to the policy."""

    def __init__(self, rid):
        self.rid = rid

    def __repr__(self):
        return f"Req({self.rid!r})"


def req(problem="p", iteration=0, beam=0, parent=None, speculative=False, bin_index=0):
    return Req(encode_rid(BeamTag(problem, iteration, beam, parent, speculative, bin_index)))


def tag(r):
    return decode_rid(r.rid)


def order(policy, queue):
    return policy.order(queue, tag)


# ---- rid codec ----

@pytest.mark.parametrize("t", [
    BeamTag("gsm8k/12", 0, 3),
    BeamTag("a:b c%d/é", 7, 12, 4),
    BeamTag("p", 2, 0, 0, speculative=True, priority_bin=3),
])
def test_rid_round_trip(t):
    rid = encode_rid(t)
    assert rid.startswith("tts:")
    assert decode_rid(rid) == t


def test_rids_are_unique_and_survive_sglang_batch_suffix():
    t = BeamTag("p", 1, 2, 0)
    rids = {encode_rid(t) for _ in range(100)}
    assert len(rids) == 100
    # A string rid for a batch request becomes f"{rid}_{i}" in SGLang; the suffix lands in the nonce.
    assert decode_rid(encode_rid(t, nonce="abc") + "_3") == t


@pytest.mark.parametrize("rid", [None, 17, "", "9f8e7d6c5b4a", "tts:p:0:0:-:n:0", "tts:p:x:0:-:n:0:n",
                                 "tts:p:0:0:-:q:0:n", "tts:p:-1:0:-:n:0:n", "tts:p:0:0:-:s:0:n"])
def test_untagged_or_malformed_rids_decode_to_none(rid):
    assert decode_rid(rid) is None


@pytest.mark.parametrize("kwargs", [
    dict(problem_id="", iteration=0, beam_id=0),
    dict(problem_id="p", iteration=-1, beam_id=0),
    dict(problem_id="p", iteration=0, beam_id=0, parent_id=-2),
    dict(problem_id="p", iteration=0, beam_id=0, speculative=True),
])
def test_bad_tags_are_rejected(kwargs):
    with pytest.raises(ValueError):
        BeamTag(**kwargs)


def test_policy_registry_lists_known_names():
    assert set(POLICIES) == {"fcfs", "prefix"}
    assert isinstance(make_policy("prefix"), PrefixAwareOrder)
    with pytest.raises(KeyError, match="fcfs, prefix"):
        make_policy("lpm")


def test_fcfs_keeps_the_queue():
    queue = [req(beam=i, parent=i % 2, iteration=1) for i in range(6)] + [Req("plain")]
    assert FcfsOrder().order(queue, tag) == queue


# ---- prefix-aware ordering ----

def test_forks_of_a_parent_stay_together_in_parent_order():
    queue = [req(iteration=1, beam=b, parent=p) for b, p in [(0, 2), (1, 0), (2, 1), (3, 0), (4, 2), (5, 1)]]
    out = order(PrefixAwareOrder(), queue)
    assert [tag(r).parent_id for r in out] == [0, 0, 1, 1, 2, 2]
    # Within a group: queue order.
    assert [tag(r).beam_id for r in out] == [1, 3, 2, 5, 0, 4]


def search_tree_iterations(rng, iterations, width, keep, branching):
    """(beam id, parent id) per iteration as a search keeping its beam list in parent order assigns
    them: the kept parents' children, listed parent by parent, numbered by position."""
    levels = [[(b, None) for b in range(width)]]
    for _ in range(iterations - 1):
        kept = sorted(rng.sample(range(len(levels[-1])), min(keep, len(levels[-1]))))
        children = [p for p in kept for _ in range(branching)]
        levels.append([(b, p) for b, p in enumerate(children)])
    return levels


def test_parents_keep_their_order_across_iterations_even_when_requests_trickle_in():
    rng = random.Random(0)
    policy = PrefixAwareOrder()
    for it, level in enumerate(search_tree_iterations(rng, 4, 8, 4, 2)):
        arrivals = [req("p", it, b, p) for b, p in level]
        rng.shuffle(arrivals)
        # SGLang keeps the reordered queue, admits some requests, appends new arrivals.
        queue, seen = [], []
        while arrivals or queue:
            queue.extend(arrivals[:3])
            del arrivals[:3]
            queue = order(policy, queue)
            parents = [tag(r).parent_id for r in queue]
            assert parents == sorted(parents, key=lambda p: -1 if p is None else p), parents
            seen.extend(queue[:2])
            del queue[:2]
        assert len(seen) == len(level)


def test_problems_are_first_come_first_served_and_untagged_requests_keep_their_place():
    policy = PrefixAwareOrder()
    a0, u1, b0 = req("A", 0, 0), Req("plain-1"), req("B", 0, 0)
    assert order(policy, [a0, u1, b0]) == [a0, u1, b0]
    # Later work of problem A still goes before the untagged request, which goes before B's work.
    a1, u2 = req("A", 1, 0, 0), Req("plain-2")
    b1 = req("B", 1, 0, 0)
    assert order(policy, [u1, b1, u2, a1]) == [a1, u1, b1, u2]
    # An untagged request that left the queue and a new one are new arrivals.
    u3 = Req("plain-3")
    assert order(policy, [u3, b1, u2]) == [b1, u2, u3]


def test_speculative_work_goes_last_by_score_bin():
    policy = PrefixAwareOrder()
    std = [req("p", 1, b, b // 2) for b in range(4)]
    spec = [req("p", 2, 0, 3, True, 2), req("p", 2, 1, 1, True, 1), req("p", 2, 2, 0, True, 2),
            req("p", 2, 3, 1, True, 1)]
    plain = Req("plain")
    queue = [spec[0], std[3], spec[1], plain, std[0], spec[2], std[1], std[2], spec[3]]
    out = order(policy, queue)
    assert out[:5] == [std[0], std[1], std[3], std[2], plain]  # queue order within a group
    assert out[5:] == [spec[1], spec[3], spec[2], spec[0]]  # bin 1 (parent 1), then bin 2 (parents 0, 3)


def test_large_queue_is_ordered_in_one_pass():
    rng = random.Random(3)
    queue = [req(f"p{rng.randrange(5)}", 3, b, rng.randrange(40)) for b in range(1000)]
    queue += [Req(f"plain-{i}") for i in range(20)]
    rng.shuffle(queue)
    calls = []

    def counting_tag(r):
        calls.append(r)
        return decode_rid(r.rid)

    out = PrefixAwareOrder().order(queue, counting_tag)
    assert len(calls) == len(queue), "one tag lookup per request"
    assert sorted(map(id, out)) == sorted(map(id, queue)), "a permutation"
    keys = [(tag(r).problem_id, tag(r).parent_id) if tag(r) else r.rid for r in out]
    runs = [k for k, _ in itertools.groupby(keys)]
    assert len(runs) == len(set(runs)), "each (problem, parent) group is contiguous"


def reference_order(queue):
    """The order by its definition, one full key per request and a stable sort: problems (and each untagged
    request) ranked by first appearance, standard work by (rank, iteration, parent), then speculative work by
    (bin, rank, iteration, parent); ties keep the queue order."""
    ranks, keys = {}, []
    for position, r in enumerate(queue):
        t = tag(r)
        rank = ranks.setdefault(t.problem_id if t else ("untagged", position), len(ranks))
        if t is None:
            keys.append((0, 0, rank, -1, -1))
        else:
            parent = -1 if t.parent_id is None else t.parent_id
            keys.append((1 if t.speculative else 0, t.priority_bin, rank, t.iteration, parent))
    return [r for _, r in sorted(zip(keys, queue), key=lambda pair: pair[0])]


@pytest.mark.parametrize("seed", range(8))
def test_prefix_aware_order_equals_the_reference_on_random_trees(seed):
    rng = random.Random(seed)
    queue = []
    for problem in range(rng.randint(1, 3)):
        levels = search_tree_iterations(rng, rng.randint(2, 4), rng.randint(2, 6), rng.randint(1, 3),
                                        rng.randint(1, 3))
        for it, level in enumerate(levels):
            queue += [req(f"p{problem}", it, b, parent) for b, parent in level]
            queue += [req(f"p{problem}", it, b, parent, True, rng.randint(1, 3))
                      for b, parent in level if rng.random() < 0.3]
    queue += [Req(f"plain-{i}") for i in range(rng.randint(0, 3))]
    rng.shuffle(queue)
    assert order(PrefixAwareOrder(), queue) == reference_order(queue)


def test_policy_micro_bench_times_every_size_in_every_round():
    from sgl_tts.bench.policy import summarize, tag_of, time_order, waiting_queue

    queue = waiting_queue(64, 4, random.Random(0))
    tags = [tag_of(r) for r in queue]
    assert len(queue) == 64 and len({r.rid for r in queue}) == 64, "unique rids"
    assert sum(t.speculative for t in tags) == 64 // 8 and {t.iteration for t in tags} == {0, 1, 2, 3}
    assert all(t.parent_id is None if t.iteration == 0 else t.parent_id == t.beam_id // 4 for t in tags)
    timings = time_order([32, 64], repeats=3)
    assert sorted(timings) == [32, 64] and all(len(runs) == 3 and min(runs) > 0 for runs in timings.values())
    rows = summarize(timings)
    assert [r["size"] for r in rows] == [32, 64] and rows[0]["ratio_to_previous"] is None
    assert rows[1]["ratio_to_previous"] == rows[1]["median_call_s"] / rows[0]["median_call_s"]
    assert rows[1]["us_per_request"] == [t * 1e6 / 64 for t in timings[64]]


# ---- cost model and its brute-force checks ----

def random_tree_cots(rng, depth, max_children):
    """Root-to-leaf paths of a random search tree whose leaves all sit at `depth` (Appendix A.1's
    homogeneous generation: every CoT of an iteration has the same number of steps)."""
    paths = [()]
    for _ in range(depth):
        paths = [p + (c,) for p in paths for c in range(rng.randint(1, max_children))]
    return paths


def small_trees(seed, count=25, max_cots=6):
    rng = random.Random(seed)
    trees = []
    while len(trees) < count:
        cots = random_tree_cots(rng, rng.randint(2, 4), 3)
        if 3 <= len(cots) <= max_cots:
            rng.shuffle(cots)
            trees.append(cots)
    return trees


def test_cost_model_by_hand():
    a, b, c = (0, 0), (0, 1), (1, 0)
    assert trie_nodes([a, b]) == {(0,), (0, 0), (0, 1)}
    assert shared_prefix(a, b) == 1 and shared_prefix(a, c) == 0 and shared_prefix(a, a) == 2
    assert partition_batches([a, b, c]) == [[a], [b], [c]]
    assert partition_batches([a, b, c], capacity=3) == [[a, b], [c]]
    # Single CoTs: (2 − 1) + (2 − 0) + (2 − 0) = 5 loaded nodes; the 5 distinct nodes are the minimum.
    assert eviction_cost([a, b, c]) == 5
    assert eviction_cost([a, c, b]) == 6
    assert prefix_score([a, b, c]) == 1


@pytest.mark.parametrize("capacity", [None, 3, 4, 6, 9])
def test_greedy_schedule_matches_brute_force_minimum_cost(capacity):
    for cots in small_trees(seed=capacity or 0):
        best = min(eviction_cost(p, capacity) for p in itertools.permutations(cots))
        assert eviction_cost(greedy_schedule(cots), capacity) == best, cots
        assert best == len(trie_nodes(cots)), "minimum: every node loaded once"


def test_greedy_invariant():
    for cots in small_trees(seed=11):
        s = greedy_schedule(cots, first=len(cots) - 1)
        for k in range(1, len(s)):
            assert shared_prefix(s[k - 1], s[k]) == max(shared_prefix(s[k - 1], m) for m in s[k:])


def test_no_pairwise_interchange_improves_the_greedy_schedule():
    # Appendix A.2's setting: single-CoT batches (capacity None), a fixed node set per iteration and
    # homogeneous CoT lengths (A.1); CoTs are the root-to-leaf paths of one search tree. Every swap,
    # adjacent ones included, is tried.
    for cots in small_trees(seed=5):
        for first in range(len(cots)):
            s = greedy_schedule(cots, first)
            score = prefix_score(s)
            for i, j in itertools.combinations(range(len(s)), 2):
                swapped = list(s)
                swapped[i], swapped[j] = swapped[j], swapped[i]
                assert prefix_score(swapped) <= score, (s, i, j)


@pytest.mark.parametrize("capacity", [None, 4, 7])
def test_prefix_aware_order_reaches_the_brute_force_optimum(capacity):
    rng = random.Random(capacity or 1)
    for _ in range(15):
        policy = PrefixAwareOrder()
        levels = search_tree_iterations(rng, 3, 3, 2, rng.randint(2, 3))
        paths = {b: (b,) for b, _ in levels[0]}
        for level in levels[1:]:
            paths = {b: paths[p] + (b,) for b, p in level}
        queue = [req("p", 2, b, p) for b, p in levels[-1]]
        rng.shuffle(queue)
        schedule = [paths[tag(r).beam_id] for r in order(policy, queue)]
        best = min(eviction_cost(p, capacity) for p in itertools.permutations(schedule))
        assert eviction_cost(schedule, capacity) == best == len(trie_nodes(schedule))


# ---- speculative beam extension ----

def test_score_bins_by_rank():
    assert score_bins([0.9, 0.1, 0.5, 0.7, 0.3, 0.8, 0.2, 0.6], 4) == [1, 4, 3, 2, 3, 1, 4, 2]
    assert score_bins([0.5, 0.5, 0.1], 3) == [1, 1, 3]  # ties share the better bin
    assert score_bins([0.2], 4) == [1]
    assert score_bins([-3.0, -1.0], 4) == [3, 1]  # scale-free: log-probs work too


def test_speculative_potential_is_b_minus_j_plus_1():
    assert [speculative_potential(j, 4) for j in range(1, 5)] == [4, 3, 2, 1]
    with pytest.raises(AssertionError):
        speculative_potential(5, 4)


def test_select_speculative_fills_highest_bin_first_up_to_each_potential():
    scores = {10: 0.9, 11: 0.8, 12: 0.5, 13: 0.4, 14: 0.2, 15: 0.1}
    sel = SpeculativeSelector(scores, num_bins=3)
    assert sel.bin_of == {10: 1, 11: 1, 12: 2, 13: 2, 14: 3, 15: 3}
    assert sel.potential[10] == 3 and sel.potential[14] == 1
    # Finished beams in finish order: a bin-3 beam first, then bin 2, then bin 1.
    slots = sel.select_speculative([14, 12, 11], free_slots=5)
    assert slots == [SpeculativeSlot(11, 1)] * 3 + [SpeculativeSlot(12, 2)] * 2
    slots = sel.select_speculative([14, 12, 11], free_slots=20, launched={11: 2})
    assert [s.beam_id for s in slots] == [11, 12, 12, 14]
    assert sel.select_speculative([14, 12, 11], free_slots=0) == []
    with pytest.raises(AssertionError, match="without a previous score"):
        sel.select_speculative([99], free_slots=1)


def test_standard_work_comes_first():
    assert speculative_slots(batch_size=8, standard_in_flight=5) == 3
    assert speculative_slots(batch_size=8, standard_in_flight=9) == 0


def test_truncation_is_seeded_clipped_and_centred_on_r():
    a = TruncationSampler(0.85, 0.1, seed=7).duplicate_lengths(100, 50)
    assert a == TruncationSampler(0.85, 0.1, seed=7).duplicate_lengths(100, 50)
    assert a[0] == 100, "the original keeps all its speculative tokens"
    assert all(0 <= n <= 100 for n in a)
    sampler = TruncationSampler(0.85, 0.1, seed=1)
    fractions = [sampler.keep_fraction() for _ in range(4000)]
    assert abs(statistics.mean(fractions) - 0.85) < 0.01
    wide = TruncationSampler(0.9, 1.0, seed=2)
    assert all(0.0 <= wide.keep_fraction() <= 1.0 for _ in range(1000))
    assert TruncationSampler(1.0, 0.0).duplicate_lengths(40, 3) == [40, 40, 40]


@pytest.mark.parametrize("text,ended,expected", [
    ("so x = 4.\n\nThen y", False, ("so x = 4.", "Then y")),
    ("\n\nso x = 4.\n\n", False, ("so x = 4.", "")),
    ("so x = 4", False, None),
    ("so x = 4", True, ("so x = 4", "")),
    ("\n\n", True, None),
    ("", False, None),
])
def test_lookahead_split(text, ended, expected):
    assert lookahead_split(text, "\n\n", ended) == expected

