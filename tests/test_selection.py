import math
import random

import pytest

from sgl_tts.search.selection import best_score, group_answers, majority_vote, pass_at_n, select, weighted_vote


def same(a, b):
    return a.strip() == b.strip()


def test_majority_vote():
    assert majority_vote(["3", "4", "3"], same) == "3"
    assert majority_vote([None, None, "5"], same) == "5"
    assert majority_vote([None, None], same) is None
    assert majority_vote([], same) is None


def test_majority_tie_goes_to_earliest_first_occurrence():
    assert majority_vote(["4", "3", "3", "4"], same) == "4"
    assert majority_vote(["3", "4", "4", "3"], same) == "3"
    assert majority_vote([None, "b", "a"], same) == "b"


def test_groups_keep_first_occurrence_order_and_skip_none():
    assert group_answers(["a", None, "b", "a ", "b", "c"], same) == [[0, 3], [2, 4], [5]]


def test_majority_groups_equivalent_answers_with_math_verify():
    assert majority_vote(["1", "0.5", "\\frac{1}{2}"]) == "0.5"
    assert majority_vote(["1,000", "999", "1000"]) == "1,000"


def test_weighted_vote():
    answers = ["3", "4", "4"]
    assert weighted_vote(answers, [0.9, 0.5, 0.5], same) == "4"
    assert weighted_vote(answers, [0.9, 0.4, 0.4], same) == "3"
    assert weighted_vote(answers, [0.5, 0.25, 0.25], same) == "3", "a tie goes to the earliest group"
    assert weighted_vote(["4", "4", "3"], [0.25, 0.25, 0.5], same) == "4", "a tie goes to the earliest group"
    assert weighted_vote([None, "2"], [100.0, 0.1], same) == "2", "None never wins"
    assert weighted_vote(["1", "2"], [math.nan, 0.1], same) == "2", "NaN counts as 0"
    assert weighted_vote([None], [1.0], same) is None
    with pytest.raises(ValueError, match="2 answers but 1 scores"):
        weighted_vote(["1", "2"], [1.0], same)


def test_best_score():
    assert best_score(["1", "2", "3"], [0.2, 0.9, 0.5]) == "2"
    assert best_score(["1", "2", "3"], [0.9, 0.9, 0.5]) == "1", "a tie goes to the earliest candidate"
    assert best_score([None, "2"], [1.0, 0.1]) == "2"
    assert best_score(["1", "2"], [math.nan, -5.0]) == "2", "NaN ranks lowest"
    assert best_score([None, None], [1.0, 2.0]) is None


def test_pass_at_n():
    flags, scores = [False, True, False], [0.9, 0.1, 0.5]
    assert [pass_at_n(flags, scores, n) for n in (1, 2, 3, 10)] == [False, False, True, True]
    assert pass_at_n([False, True], [0.5, 0.5], 1) is False, "ties keep input order"
    with pytest.raises(ValueError, match="n >= 1"):
        pass_at_n(flags, scores, 0)


def test_pass_at_n_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        size = rng.randint(1, 8)
        flags = [rng.random() < 0.3 for _ in range(size)]
        scores = [rng.choice([0.1, 0.5, 0.9, rng.random()]) for _ in range(size)]
        n = rng.randint(1, size + 1)
        top = sorted(range(size), key=lambda i: (-scores[i], i))[:n]
        assert pass_at_n(flags, scores, n) == any(flags[i] for i in top)


def test_select_by_name():
    assert select("best", ["1", "2"], [0.1, 0.2]) == "2"
    assert select("majority", ["1", "2", "2"], [0.9, 0.1, 0.1]) == "2"
    assert select("weighted", ["1", "2", "2"], [0.9, 0.1, 0.1]) == "1"
    with pytest.raises(ValueError, match="known: majority, weighted, best"):
        select("median", ["1"], [0.0])
