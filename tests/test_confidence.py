"""DeepConf's confidence math against hand-computed values and brute-force references."""

import math
import random

import numpy as np
import pytest

from sgl_tts.search.confidence import (OnlineThreshold, bottom_group_confidence, filter_top, group_confidences,
                                       lowest_group_confidence, tail_confidence, token_confidence, vote_settled,
                                       weighted_vote)


def test_token_confidence_is_the_negative_mean_top_logprob():
    assert token_confidence([-0.1, -2.3, -4.6]) == pytest.approx(7.0 / 3)
    assert token_confidence([math.log(0.5)]) == pytest.approx(math.log(2))
    sure, unsure = token_confidence([-0.01, -6.0, -7.0]), token_confidence([-0.7, -0.8, -1.0])
    assert sure > unsure, "a peaked distribution is the confident one"
    with pytest.raises(ValueError, match="top_logprobs: expected at least one"):
        token_confidence([])


def test_group_confidences_by_hand():
    assert group_confidences([1.0, 2.0, 3.0, 4.0, 5.0], 2) == pytest.approx([1.5, 2.5, 3.5, 4.5])
    assert group_confidences([1.0, 2.0, 3.0, 4.0, 5.0], 5) == pytest.approx([3.0])
    assert group_confidences([1.0, 2.0, 3.0], 10) == pytest.approx([2.0]), "shorter than the window: one mean"
    assert group_confidences([], 4) == []
    with pytest.raises(ValueError, match="window: expected >= 1"):
        group_confidences([1.0], 0)


def test_group_confidences_against_direct_window_means():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.uniform(0, 20) for _ in range(rng.randint(1, 60))]
        window = rng.randint(1, 70)
        direct = [sum(tokens[i - window + 1: i + 1]) / window for i in range(window - 1, len(tokens))]
        expected = direct or [sum(tokens) / len(tokens)]
        assert group_confidences(tokens, window) == pytest.approx(expected, rel=1e-12)
        assert lowest_group_confidence(tokens, window) == pytest.approx(min(expected), rel=1e-12)


def test_trace_confidences_by_hand():
    tokens = [4.0, 1.0, 3.0, 6.0, 2.0, 5.0]
    # Windows of 2: 2.5, 2.0, 4.5, 4.0, 3.5
    assert lowest_group_confidence(tokens, 2) == pytest.approx(2.0)
    assert bottom_group_confidence(tokens, 2, fraction=0.4) == pytest.approx((2.0 + 2.5) / 2)
    assert bottom_group_confidence(tokens, 2, fraction=0.1) == pytest.approx(2.0), "at least one group"
    assert tail_confidence(tokens, 2) == pytest.approx(3.5)
    assert tail_confidence(tokens, 100) == pytest.approx(21.0 / 6)
    with pytest.raises(ValueError, match="token_confidences: expected a trace of at least one token"):
        lowest_group_confidence([], 2)
    with pytest.raises(ValueError, match="token_confidences: expected a trace of at least one token"):
        tail_confidence([], 2)
    with pytest.raises(ValueError, match="tail: expected >= 1"):
        tail_confidence(tokens, 0)


def test_filter_top():
    assert filter_top([0.5, 2.0, 1.0, 2.0], 0.5) == [1, 3]
    assert filter_top([0.5, 2.0, 1.0, 3.0], 0.1) == [3], "at least one"
    assert filter_top([1.0, 1.0, 1.0], 0.5) == [0, 1], "ties keep the earlier trace"
    assert filter_top([float(i % 7) for i in range(30)], 0.1) == [6, 13, 20], "0.1 of 30 is 3"
    assert filter_top([], 0.5) == []
    with pytest.raises(ValueError, match=r"keep_fraction: expected a fraction in \(0, 1\]"):
        filter_top([1.0], 0.0)


def test_filter_top_against_brute_force():
    rng = random.Random(1)
    for _ in range(200):
        confidences = [float(rng.randint(0, 5)) for _ in range(rng.randint(1, 12))]
        fraction = rng.choice([0.1, 0.25, 0.5, 0.9, 1.0])
        kept = filter_top(confidences, fraction)
        assert len(kept) == max(1, math.ceil(round(fraction * len(confidences), 9)))
        dropped = [i for i in range(len(confidences)) if i not in kept]
        assert all(confidences[k] >= confidences[d] for k in kept for d in dropped)


def test_weighted_vote_by_hand():
    assert weighted_vote(["12", "13"], [0.4, 0.6]) == "13"
    assert weighted_vote(["12", "13", "12"], [0.4, 0.6, 0.3]) == "12"
    assert weighted_vote(["8", "7", None, "8", "7"], [1.0, 1.5, 9.0, 1.0, 0.5]) == "7", "a tie goes to text order"
    assert weighted_vote([None, None], [1.0, 2.0]) is None
    assert weighted_vote([], []) is None
    with pytest.raises(ValueError, match=r"weights: expected one per answer \(2\), got 1"):
        weighted_vote(["1", "2"], [1.0])
    with pytest.raises(ValueError, match="weights: expected finite values >= 0"):
        weighted_vote(["1"], [-1.0])


def test_weighted_vote_against_brute_force():
    rng = random.Random(2)
    for _ in range(300):
        answers = [rng.choice(["3", "4", "5", None]) for _ in range(rng.randint(0, 8))]
        weights = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in answers]
        totals = {a: sum(w for x, w in zip(answers, weights) if x == a) for a in answers if a is not None}
        best = max(totals.values(), default=None)
        expected = min((a for a, total in totals.items() if total == best), default=None)
        assert weighted_vote(answers, weights) == expected


def test_online_threshold_is_the_warmup_percentile():
    threshold = OnlineThreshold.from_warmup([3.0, 1.0, 5.0, 2.0, 4.0], keep_fraction=0.1)
    assert threshold.threshold == pytest.approx(4.6)  # h = 4 · 0.9 = 3.6 → 4 + 0.6 · (5 − 4)
    assert threshold.should_stop(4.5) and not threshold.should_stop(4.6) and not threshold.should_stop(5.0)
    assert OnlineThreshold.from_warmup([2.0, 7.0], keep_fraction=1.0).threshold == 2.0, "keep all: the minimum"
    assert OnlineThreshold.from_warmup([2.0], keep_fraction=0.9).threshold == 2.0
    with pytest.raises(ValueError, match="warmup_confidences: expected at least one"):
        OnlineThreshold.from_warmup([], 0.1)
    with pytest.raises(ValueError, match="keep_fraction: expected a fraction"):
        OnlineThreshold.from_warmup([1.0], 1.5)


def test_online_threshold_matches_numpy_percentile():
    rng = random.Random(3)
    for _ in range(100):
        warmup = [rng.uniform(5, 15) for _ in range(rng.randint(1, 40))]
        keep = rng.choice([0.1, 0.3, 0.5, 0.9])
        threshold = OnlineThreshold.from_warmup(warmup, keep).threshold
        assert threshold == pytest.approx(np.percentile(warmup, 100 * (1 - keep)), rel=1e-12)
        kept = sum(1 for c in warmup if not OnlineThreshold(threshold, keep).should_stop(c))
        assert kept >= 1 and kept <= math.ceil(keep * len(warmup)) + 1


def test_vote_settled():
    answers, weights = ["5", "5", "5", "6"], [1.0, 1.0, 1.0, 0.1]  # β = 3 / 3.1 ≈ 0.968
    assert vote_settled(answers, weights, remaining_traces=4, consensus=0.95)
    assert not vote_settled(answers, weights, remaining_traces=4, consensus=0.97)
    assert vote_settled(answers, weights, remaining_traces=0, consensus=0.97), "nothing left to sample"
    assert not vote_settled([None, None], [1.0, 1.0], remaining_traces=1, consensus=0.5)
    assert not vote_settled(["5"], [0.0], remaining_traces=1, consensus=0.5), "no weight cast yet"
    assert vote_settled(["5", None], [1.0, 5.0], remaining_traces=3, consensus=1.0), "None answers cast nothing"
    with pytest.raises(ValueError, match="remaining_traces: expected >= 0"):
        vote_settled(answers, weights, remaining_traces=-1, consensus=0.9)
    with pytest.raises(ValueError, match="consensus: expected a fraction"):
        vote_settled(answers, weights, remaining_traces=1, consensus=0.0)
