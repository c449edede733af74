import math
import random

import numpy as np
import pytest

from sgl_tts.measure.metrics import aggregate_rows, over_repetitions, percentile, problem_metrics, summarize
from sgl_tts.search.records import Candidate, SearchResult


def exact_grade(predicted, gold, dataset):
    return predicted == gold


def candidate(answer, score, tokens, seconds):
    return Candidate(steps=["step"], step_scores=[score], score=score, answer=answer, tokens=tokens,
                     completion_time_s=seconds, finish_reason="answer")


def search_result(**overrides):
    fields = dict(
        problem_id="p1",
        program="beam_search",
        answer="4",
        candidates=[candidate("4", 0.1, 10, 1.0), candidate("5", 0.9, 20, 2.0), candidate("4", 0.2, 30, 3.0),
                    candidate(None, 0.95, 40, 4.0)],
        generated_tokens=150, prompt_tokens=200, cached_tokens=50,
        generator_time_s=3.0, verifier_time_s=1.0, total_time_s=4.5,
    )
    fields.update(overrides)
    return SearchResult(**fields)


@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 75, 90, 99, 99.9, 100])
def test_percentile_matches_numpy(q):
    rng = random.Random(q)
    for size in (1, 2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(size)]
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-12)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within"):
        percentile([1.0], 101)


def test_summarize_matches_numpy():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    summary = summarize(values)
    assert summary["n"] == 8
    assert summary["median"] == pytest.approx(np.median(values))
    assert summary["std"] == pytest.approx(np.std(values, ddof=1))
    assert summary["p90"] == pytest.approx(np.percentile(values, 90))
    assert (summary["min"], summary["max"]) == (1.0, 9.0)
    assert summarize([])["n"] == 0 and summarize([])["median"] is None
    assert summarize([2.0])["std"] == 0.0


def test_problem_metrics():
    row = problem_metrics(search_result(), gold="4", pass_ns=[1, 2, 3], grade_fn=exact_grade)
    assert row["majority_answer"] == "4" and row["majority_correct"] is True
    assert row["weighted_answer"] == "5" and row["weighted_correct"] is False  # 0.9 beats 0.1 + 0.2
    assert row["best_answer"] == "5" and row["best_correct"] is False  # the None answer's 0.95 does not count
    assert row["correct"] is True
    # ranked by score: None (0.95), "5" (0.9), "4" (0.2): the first correct one is third
    assert (row["pass@1"], row["pass@2"], row["pass@3"]) == (False, False, True)
    assert row["precise_goodput"] == pytest.approx(25 / 2.5)  # mean tokens / mean completion time
    assert row["cache_hit_rate"] == pytest.approx(0.25)
    assert (row["generator_time_s"], row["verifier_time_s"], row["total_time_s"]) == (3.0, 1.0, 4.5)


def test_problem_metrics_store_the_graded_value_and_keep_the_extracted_text():
    result = search_result(answer="7 + 2 = 9", candidates=[candidate("7 + 2 = 9", 0.5, 10, 1.0)])
    row = problem_metrics(result, gold="9")
    assert row["answer"] == "9" and row["answer_text"] == "7 + 2 = 9" and row["correct"] is True
    assert row["majority_answer"] == row["weighted_answer"] == row["best_answer"] == "9"


def test_problem_metrics_default_pass_at_candidate_count_and_no_gold():
    row = problem_metrics(search_result(), gold="4", grade_fn=exact_grade)
    assert row["pass@4"] is True
    ungraded = problem_metrics(search_result(), gold=None, grade_fn=exact_grade)
    assert ungraded["correct"] is None and ungraded["pass@4"] is None and ungraded["majority_answer"] == "4"


def test_problem_metrics_from_dict_equals_from_result():
    result = search_result()
    assert problem_metrics(result.to_dict(), "4", grade_fn=exact_grade) == problem_metrics(result, "4",
                                                                                          grade_fn=exact_grade)


def test_aggregate_rows():
    rows = [
        problem_metrics(search_result(), gold="4", pass_ns=[1, 4], grade_fn=exact_grade),
        problem_metrics(search_result(problem_id="p2", answer="5", prompt_tokens=300, cached_tokens=0,
                                      total_time_s=10.0, generator_time_s=5.0, verifier_time_s=5.0),
                        gold="5", pass_ns=[1, 4], grade_fn=exact_grade),
    ]
    result = aggregate_rows(rows)
    assert result["problems"] == 2 and result["graded"] == 2 and result["errors"] == 0
    assert result["accuracy"] == {"correct": 1.0, "majority_correct": 0.5, "weighted_correct": 0.5,
                                  "best_correct": 0.5, "pass@1": 0.0, "pass@4": 1.0}
    assert result["cache_hit_rate"] == pytest.approx(50 / 500), "token-weighted, not a mean of rates"
    assert result["verifier_share"] == pytest.approx(6 / 14)
    assert result["completion_latency_s"]["p50"] == pytest.approx(7.25)
    assert result["completion_latency_s"]["p90"] == pytest.approx(np.percentile([4.5, 10.0], 90))
    assert result["precise_goodput"]["mean"] == pytest.approx(10.0)


def test_aggregate_rows_of_bare_results_is_ungraded():
    result = aggregate_rows([search_result(candidates=[]), search_result(problem_id="p2", error="boom")])
    assert result["graded"] == 0 and result["errors"] == 1
    assert result["accuracy"]["correct"] is None
    assert result["precise_goodput"]["n"] == 1, "a problem without candidates has no goodput"


def test_over_repetitions_median_and_spread():
    repetitions = [{"precise_goodput": {"mean": g}, "accuracy": {"correct": 0.5}, "errors": 0}
                   for g in (10.0, 30.0, 12.0)]
    summary = over_repetitions(repetitions)
    assert summary["precise_goodput.mean"]["median"] == 12.0
    assert summary["precise_goodput.mean"]["std"] == pytest.approx(np.std([10, 30, 12], ddof=1))
    assert summary["accuracy.correct"]["mean"] == 0.5
    assert over_repetitions([]) == {}
    assert not math.isnan(summary["errors"]["std"])
