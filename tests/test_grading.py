import threading
import time

import pytest

from sgl_tts.search import grading
from sgl_tts.search.grading import (GradingError, answers_equal, extract_answer, grade, graded_answer,
                                    normalize_answer)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{\\boxed{2}}}", "\\frac{1}{\\boxed{2}}"),  # a boxed inside a boxed is part of it
        ("first \\boxed{3}, then \\boxed{4}", "4"),
        ("\\boxed{3} and then \\boxed{4", "3"),  # the last one was cut off: use the last complete one
        ("the set is \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the group
        ("$\\boxed 7$", "7"),
        ("The answer is \\boxed{5}. The answer is 6.", "5"),  # boxed wins over the phrase
        ("Adding them up. The answer is 42.", "42"),
        ("The final answer is: $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("the answer is 7 apples. Then we stop", "7"),
        ("The answer is $18.", "18"),
        ("The answer is indeed 12.", "12"),
        ("the answer is: simply 7 apples", "7"),
        ("The answer is Evelyn.", "Evelyn"),
        ("The answer is 9 / 6.", "9 / 6"),
        ("The answer is $\\boxed{1", None),  # cut off inside the box: no answer, not "\\boxed"
        ("The answer is 3.5.", "3.5"),
        ("She makes 9 * 2 = <<9*2=18>>18 dollars.\n#### 1,234\n", "1,234"),
        ("#### 18", "18"),
        ("no final answer here", None),
        ("The answer is", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [("1,000", "1000"), ("025", "25"), ("36.0", "36"), ("\\text{Evelyn}", "evelyn"), ("\\dfrac{1}{2}", "\\frac{1}{2}"),
     ("$5$.", "5"), ("\\boxed{x}", "x")],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    "a, b",
    [
        ("\\frac{1}{2}", "0.5"),  # needs math-verify: no string form makes these equal
        ("1,000", "1000"),
        ("1000", "1,000"),
        ("\\dfrac{14}{3}", "14/3"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"),
        ("\\text{Evelyn}", "Evelyn"),
        ("25", "025"),
        ("36.0", "36"),
        ("\\sqrt{4}", "2"),
    ],
)
def test_equivalent_answers(a, b):
    assert answers_equal(a, b)


@pytest.mark.parametrize("a, b", [("2", "3"), ("x+1", "x+2"), ("\\frac{1}{2}", "0.6"), ("1,000", "100"), ("", ""),
                                  (None, "1"), ("1", None)])
def test_different_answers(a, b):
    assert not answers_equal(a, b)


def test_grade():
    assert grade("025", "25", "aime24")
    assert grade("\\boxed{36}", "36", "amc23")
    assert not grade(None, "25", "aime24")
    assert not grade("24", "25", "aime24")
    with pytest.raises(GradingError, match="humaneval"):
        grade("x", "y", "humaneval")
    with pytest.raises(GradingError, match="no gold"):
        grade("1", None, "math500")


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        ("7 + 2 = 9", "9", "9"),  # the value of the equation is what is graded
        ("x = 5", "5", "5"),
        ("a = b = \\frac{1}{2}", "0.5", "\\frac{1}{2}"),
        ("7 + 2 = 9", None, "9"),
        ("y = 2x + 3", "y = 2x + 3", "y = 2x + 3"),  # a gold equation is compared with the whole equation
        ("x = 1, y = 2", "2", "x = 1, y = 2"),  # a list of equations stays whole
        ("f(x = 1)", "1", "f(x = 1)"),  # `=` inside brackets
        ("1 < x = 2", "2", "1 < x = 2"),  # another relation in the chain
        ("x \\leq 3", "3", "x \\leq 3"),
        ("x =", "5", "x ="),  # an empty side
        ("9", "9", "9"),
        (None, "9", None),
    ],
)
def test_graded_answer(predicted, gold, expected):
    assert graded_answer(predicted, gold) == expected


def test_an_equation_is_graded_by_its_value_without_math_verify(monkeypatch):
    def fail(*args):
        raise AssertionError("the value of the equation compares as a plain number")

    monkeypatch.setattr(grading, "_math_verify_equal", fail)
    assert grade("7 + 2 = 9", "9") and not grade("7 + 2 = 10", "9") and grade("x = 5", "5")


def test_over_long_answers_skip_math_verify(monkeypatch):
    def fail(*args):
        raise AssertionError("math-verify must not see over-long answers")

    monkeypatch.setattr(grading, "_math_verify_equal", fail)
    long_answer = "x+" * grading.MAX_MATH_VERIFY_CHARS
    assert not answers_equal(long_answer, "y")
    assert answers_equal(long_answer, long_answer)


def test_pathological_input_hits_the_hard_deadline():
    restarts = grading._HELPER.restarts
    start = time.monotonic()
    assert not answers_equal("9^{9^{9^{9}}}", "5", timeout_s=0.5)
    assert time.monotonic() - start < 2.0
    assert grading._HELPER.restarts == restarts + 1, "the stuck helper should have been killed"
    assert answers_equal("\\frac{2}{4}", "0.5"), "a fresh helper serves the next comparison"


def test_pathological_input_hits_math_verify_timeout():
    start = time.monotonic()
    assert not answers_equal("9^{9^{9^{9}}}", "7", timeout_s=4)
    assert time.monotonic() - start < 4.5


def test_works_from_worker_threads():
    results = []
    threads = [threading.Thread(target=lambda a=a: results.append(answers_equal(f"\\frac{{{a}}}{{4}}", str(a / 4))))
               for a in (1, 3, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == [True, True, True]


def test_model_output_is_never_executed(tmp_path):
    marker = tmp_path / "executed"
    payload = f"__import__('os').system('touch {marker}')"
    assert not answers_equal(payload, "0")
    assert not answers_equal("0", f"\\boxed{{{payload}}}")
    assert not marker.exists()


def test_normalize_unwraps_only_a_whole_boxed_answer():
    assert normalize_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert normalize_answer("\\boxed{1}+\\boxed{2}") == "\\boxed{1}+\\boxed{2}"


def test_very_long_numbers_compare_as_strings():
    digits = "9" * 5000
    assert answers_equal(digits, digits)
    assert not answers_equal(digits, digits + "1")


class _ScriptedHelper:
    """Stands in for the math-verify helper: answers each compare() with the next scripted reply."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.calls = 0

    def compare(self, gold, predicted, timeout_s):
        self.calls += 1
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def test_a_timed_out_comparison_is_not_cached(monkeypatch):
    helper = _ScriptedHelper(grading.ComparisonTimeout("deadline"), True)
    monkeypatch.setattr(grading, "_HELPER", helper)
    grading._math_verify_equal.cache_clear()
    assert not answers_equal("\\sqrt{4}", "2"), "no verdict in time: not equal for now"
    assert answers_equal("\\sqrt{4}", "2"), "the timeout was not cached: the second call asks again"
    assert answers_equal("\\sqrt{4}", "2")
    assert helper.calls == 2, "a verdict is cached: the third call must not ask the helper"
    grading._math_verify_equal.cache_clear()


def test_a_verdict_of_not_equal_or_unparseable_is_cached(monkeypatch):
    helper = _ScriptedHelper(False, None)
    monkeypatch.setattr(grading, "_HELPER", helper)
    grading._math_verify_equal.cache_clear()
    for _ in range(2):
        assert not answers_equal("\\sqrt{5}", "2")
        assert not answers_equal("2", "}}{{")
    assert helper.calls == 2
    grading._math_verify_equal.cache_clear()


def test_math_verify_own_timeout_is_reported_as_no_verdict():
    # Run in this (main) thread, as in the helper process: math-verify's signal timeout applies.
    reply = grading._verify_request({"gold": "9^{9^{9^{9}}}", "predicted": "7", "inner_timeout_s": 1})
    assert reply == {"equal": None, "timed_out": True}
    assert grading._verify_request({"gold": "x", "predicted": "y", "inner_timeout_s": 1}) == \
        {"equal": False, "timed_out": False}
    assert grading._verify_request({"gold": "2", "predicted": "}}{{", "inner_timeout_s": 1}) == \
        {"equal": None, "timed_out": False}
    assert grading._verify_request({"gold": "1/2", "predicted": "2/4", "inner_timeout_s": 1}) == \
        {"equal": True, "timed_out": False}


def test_timeouts_through_the_real_helper_leave_the_cache_empty():
    grading._math_verify_equal.cache_clear()
    for timeout_s in (4, 0.5):  # math-verify's own timeout (1 s inside 4 s), then the hard deadline
        assert not answers_equal("9^{9^{9^{9}}}", "11", timeout_s=timeout_s)
    assert grading._math_verify_equal.cache_info().currsize == 0
    assert answers_equal("\\frac{3}{6}", "0.5")
    assert grading._math_verify_equal.cache_info().currsize == 1


def test_a_number_stated_as_the_answer_is_extracted():
    # "36 is the answer." is how SmolLM2-135M often ends; before, no answer was extracted from it
    assert extract_answer("6 * 6 = 36\n\n36 is the answer.") == "36"
    assert extract_answer("So 1,200 is the final answer") == "1200"
    assert extract_answer("The answer is 5. Then 36 is the answer") == "5", "a marked 'The answer is' comes first"
    assert extract_answer("36 is the number of eggs") is None


def test_a_solution_the_model_ended_answers_with_its_last_number():
    from sgl_tts.search.grading import answer_at_end

    assert answer_at_end("To find 9 - 1 we subtract.\nSo, 9 - 1 = 8.") == "8"
    assert answer_at_end("The answer is \\boxed{7}. Then 9 more") == "7", "a marked answer wins"
    assert answer_at_end("So the total is 1,250 coins.\n\n") == "1250"
    assert answer_at_end("w12 w7 w40") is None, "digits inside words are not numbers"
    assert answer_at_end("no number at all") is None and answer_at_end("") is None
    assert answer_at_end("2 + 3 = 5", extract=lambda text: "custom") == "custom"
