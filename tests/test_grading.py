import threading
import time

import pytest

from sgl_tts.search import grading
from sgl_tts.search.grading import GradingError, answers_equal, extract_answer, grade, normalize_answer


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
