"""Reports from result lines: medians over repetitions, ratios to the baseline, failures, plots."""

import statistics

import pytest

from eval.experiment import ExperimentConfig, resolve
from eval.report import latest_rows, markdown, plot_run, summarize_run, write_report
from eval.results import ResultStore
from sgl_tts.config import load_dataclass
from sgl_tts.app.metrics import problem_metrics
from sgl_tts.search.records import Candidate, SearchResult


def experiment(n_values=(4,), repetitions=2):
    data = {"name": "r", "backend": "scripted", "n_values": list(n_values), "repetitions": repetitions,
            "arms": [{"name": "base", "baseline": True}, {"name": "fast"}], "datasets": [{"name": "builtin"}]}
    return resolve(load_dataclass(ExperimentConfig, data, "<test>"), "<test>")


def make_row(arm, n, repetition, problem, answers, gold, beam_tokens, beam_time_s, generator_s, verifier_s,
             e2e=None):
    candidates = [Candidate(steps=["x"], step_scores=[0.5], score=0.5, answer=a, tokens=beam_tokens,
                            completion_time_s=beam_time_s, finish_reason="answer") for a in answers]
    total = generator_s + verifier_s + 0.1
    result = SearchResult(problem_id=problem, program="p", answer=answers[0], candidates=candidates,
                          generated_tokens=beam_tokens * len(answers), prompt_tokens=100, cached_tokens=25,
                          generator_time_s=generator_s, verifier_time_s=verifier_s, total_time_s=total)
    window = None if e2e is None else {"n": 1, "mean": e2e, "p50": e2e, "p90": e2e, "max": e2e}
    return {"kind": "result", "problem_id": problem, "arm": arm, "dataset": "builtin", "n": n, "seed": 0,
            "repetition": repetition, "failed": False,
            "metrics": problem_metrics(result, gold, None, pass_ns=[n]),
            "timing": {"runtime_start_s": 50.0, "solve_wall_s": total, "total_s": total, "generator_s": generator_s,
                       "verifier_s": verifier_s, "requests": {"requests": 3, "server_e2e_s": window}},
            "result": result.to_dict()}


def rows_for(n=4):
    rows = []
    # base: rep 0 solves 1 of 2 problems, rep 1 both; fast: rep 0 none, rep 1 one.
    for rep, solved in ((0, [True, False]), (1, [True, True])):
        for i, ok in enumerate(solved):
            rows.append(make_row("base", n, rep, f"q{i}", ["7" if ok else "1"] * 2, "7", 40, 4.0, 3.0, 1.0, e2e=2.0))
    for rep, solved in ((0, [False, False]), (1, [True, False])):
        for i, ok in enumerate(solved):
            rows.append(make_row("fast", n, rep, f"q{i}", ["7" if ok else "1"] * 2, "7", 40, 2.0, 1.5, 0.5, e2e=1.0))
    return rows


def test_medians_over_repetitions_and_ratios_to_the_baseline(tmp_path):
    exp = experiment()
    summary = summarize_run(exp, rows_for())
    cells = {c["arm"]: c for c in summary["cells"]}
    base, fast = cells["base"]["stats"], cells["fast"]["stats"]
    assert base["accuracy.majority_correct"]["median"] == pytest.approx(0.75)
    assert base["accuracy.majority_correct"]["std"] == pytest.approx(statistics.stdev([0.5, 1.0]))
    assert fast["accuracy.majority_correct"]["median"] == pytest.approx(0.25)
    assert base["precise_goodput.mean"]["median"] == pytest.approx(40 / 4.0)
    assert fast["precise_goodput.mean"]["median"] == pytest.approx(40 / 2.0)
    assert base["cache_hit_rate"]["median"] == pytest.approx(0.25)
    assert fast["timing.server_e2e_s.p50"]["median"] == pytest.approx(1.0)
    assert base["tokens_per_problem"]["median"] == pytest.approx(80)
    text = markdown(exp, summary, tmp_path, [], [], partial=False, skipped_lines=0)
    assert "| metric | base (baseline) | fast | fast ÷ baseline |" in text
    assert "| top-1 accuracy (majority vote) | 75% ±35% | 25% ±35% | 0.33x |" in text
    assert "| precise goodput, tok/s (mean) | 10 | 20 | 2.00x |" in text
    assert "| verifier time / problem, s | 1 | 0.5 | 0.50x |" in text
    assert "| request latency p50, s (server e2e) | 2 | 1 | 0.50x |" in text
    assert "median over 2 seed×repetition unit(s) (± std)" in text


def test_latest_rows_prefers_success_and_counts_a_failing_problem_once():
    ok = make_row("base", 4, 0, "q0", ["7"], "7", 10, 1.0, 1.0, 0.0)
    failure = {**ok, "failed": True, "error": "ValueError: boom"}
    del failure["metrics"]
    later_ok = {**ok, "session": 1}
    other_failure = {**make_row("base", 4, 0, "q1", ["7"], "7", 10, 1.0, 1.0, 0.0), "failed": True, "error": "x"}
    rows, failed = latest_rows([failure, later_ok, other_failure, other_failure])
    assert rows == [later_ok]
    assert failed == [other_failure]
    rows, failed = latest_rows([ok, failure])
    assert rows == [ok] and failed == []


def test_plots_are_written_as_png_for_each_dataset(tmp_path):
    exp = experiment(n_values=(2, 4), repetitions=2)
    summary = summarize_run(exp, rows_for(2) + rows_for(4))
    paths = plot_run(exp, summary, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["accuracy_vs_n-builtin.png", "goodput_vs_n-builtin.png",
                                             "latency_breakdown-builtin.png"]
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path


def test_write_report_reads_the_result_file_and_marks_partial_runs(tmp_path):
    exp = experiment()
    store = ResultStore(tmp_path / "results.jsonl")
    store.append_run({"run_id": "r1", "experiment_sha256": "ab" * 32,
                      "hardware": {"cpu_model": "cpu", "usable_cpus": 2, "gpus": []}})
    for row in rows_for()[:5]:
        store.append(row)
    text = write_report(tmp_path, exp, partial=True)
    assert text.startswith("# Evaluation `r` — PARTIAL")
    assert (tmp_path / "summary.md").read_text() == text
    assert "problem lines: 5" in text and "first run id `r1`" in text
    assert (tmp_path / "plots" / "goodput_vs_n-builtin.png").is_file()
