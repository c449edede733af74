"""Reports from result lines: medians over repetitions, ratios to the baseline, failures, plots; accuracy vs
budget (Wilson intervals, paired comparisons with the reference, levels) against sgl_tts.measure.stats."""

import json
import statistics

import pytest

from eval.experiment import ExperimentConfig, resolve
from eval.report import latest_rows, markdown, plot_run, summarize_experiment, write_report
from eval.results import ResultStore
from sgl_tts.config import load_dataclass
from sgl_tts.measure.metrics import problem_metrics
from sgl_tts.measure.stats import mcnemar_exact, paired_bootstrap, pool_seeds, wilson_interval
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
    summary = summarize_experiment(exp, rows_for())
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
    summary = summarize_experiment(exp, rows_for(2) + rows_for(4))
    paths = plot_run(exp, summary, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["accuracy_vs_n-builtin.png", "accuracy_vs_tokens-builtin.png",
                                             "goodput_vs_n-builtin.png", "latency_breakdown-builtin.png"]
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


# ---------------------------------------------------------------------------------------------------------
# Accuracy vs budget (eval/budget.py)

# problem -> (greedy correct, self-consistency correct) per seed; discordant pairs in both directions.
OUTCOMES = {
    0: {"q0": (True, True), "q1": (False, True), "q2": (False, True), "q3": (True, False), "q4": (False, False),
        "q5": (False, True)},
    1: {"q0": (True, True), "q1": (False, False), "q2": (False, True), "q3": (True, True), "q4": (False, True),
        "q5": (True, True)},
}
LEVELS = {"q0": 1, "q1": 1, "q2": 2, "q3": 2, "q4": 2, "q5": 3}


def budget_experiment():
    data = {"name": "b", "backend": "scripted", "n_values": [4], "seeds": [0, 1], "reference": "greedy",
            "arms": [{"name": "greedy", "n_values": [1]}, {"name": "sc", "baseline": True}],
            "datasets": [{"name": "builtin"}]}
    return resolve(load_dataclass(ExperimentConfig, data, "<test>"), "<test>")


def budget_row(arm, n, seed, problem, correct, tokens, level=None):
    row = make_row(arm, n, 0, problem, ["7" if correct else "1"], "7", tokens, 1.0, 1.0, 0.0)
    row["seed"] = seed
    if level is not None:
        row["level"] = level
    return row


def budget_rows(levels=False):
    rows = []
    for seed, problems in OUTCOMES.items():
        for problem, (greedy, sc) in problems.items():
            level = LEVELS[problem] if levels else None
            rows.append(budget_row("greedy", 1, seed, problem, greedy, 30, level))
            rows.append(budget_row("sc", 4, seed, problem, sc, 120, level))
    return rows


def write_results(tmp_path, rows):
    store = ResultStore(tmp_path / "results.jsonl")
    store.append_run({"run_id": "r1", "experiment_sha256": "ab" * 32,
                      "hardware": {"cpu_model": "cpu", "usable_cpus": 2, "gpus": []}})
    for row in rows:
        store.append(row)


def test_budget_intervals_and_paired_tests_equal_the_stats_module_on_the_same_pairs(tmp_path):
    write_results(tmp_path, budget_rows())
    text = write_report(tmp_path, budget_experiment())
    budget = json.loads((tmp_path / "summary.json").read_text())["budget"]
    [dataset] = budget["datasets"]
    assert dataset["reference"] == {"arm": "greedy", "n": 1}
    cells = {(c["arm"], c["n"]): c for c in dataset["cells"]}
    greedy, sc = cells[("greedy", 1)], cells[("sc", 4)]
    # By hand: 12 trials each (6 problems x 2 seeds); greedy solves 5, self-consistency 9.
    assert (greedy["trials"], greedy["solved"], sc["trials"], sc["solved"]) == (12, 5, 12, 9)
    assert greedy["interval"] == pytest.approx(list(wilson_interval(5, 12)))
    assert sc["interval"] == pytest.approx(list(wilson_interval(9, 12)))
    assert sc["tokens_per_problem"] == pytest.approx(120) and sc["tokens_per_solved"] == pytest.approx(120 * 12 / 9)
    assert greedy["is_reference"] and "vs_reference" not in greedy
    pairs = pool_seeds({seed: {p: o[0] for p, o in problems.items()} for seed, problems in OUTCOMES.items()},
                       {seed: {p: o[1] for p, o in problems.items()} for seed, problems in OUTCOMES.items()})
    expected_test = mcnemar_exact(pairs.a_correct, pairs.b_correct)
    expected_difference = paired_bootstrap(pairs.a_correct, pairs.b_correct)
    comparison = sc["vs_reference"]
    assert (expected_test.b01, expected_test.b10) == (5, 1), "the constructed pairs are discordant both ways"
    assert comparison["pairs"] == 12 and comparison["only_reference"] == comparison["only_cell"] == 0
    assert comparison["p_value"] == pytest.approx(expected_test.p_value) and comparison["p_value"] < 1
    assert (comparison["cell_only_correct"], comparison["reference_only_correct"]) == (5, 1)
    assert [comparison["difference"], *comparison["interval"]] == pytest.approx(list(expected_difference))
    assert comparison["difference"] == pytest.approx(4 / 12)
    low, high = sc["interval"]
    assert (f"| sc | 4 | 120 | 160 | 75.0% [{100 * low:.1f}, {100 * high:.1f}] (9/12) | "
            f"+33.3 pt [{100 * expected_difference[1]:+.1f}, {100 * expected_difference[2]:+.1f}], "
            f"p={expected_test.p_value:.3g} |") in text
    assert "| greedy | 1 | 30 | 72 | 41.7% " in text and "| reference |" in text
    assert "‡" not in text
    assert dataset["trial_groups"] == 2 and "counted as separate trials" in text


def test_budget_reports_a_cell_whose_pairs_do_not_match_the_reference(tmp_path):
    rows = [r for r in budget_rows() if not (r["arm"] == "sc" and r["seed"] == 1 and r["problem_id"] == "q4")]
    rows.append(budget_row("sc", 4, 1, "q9", True, 120))  # a problem the reference never ran
    summary = summarize_experiment(budget_experiment(), rows)
    sc = next(c for c in summary["budget"]["datasets"][0]["cells"] if c["arm"] == "sc")
    comparison = sc["vs_reference"]
    assert (comparison["pairs"], comparison["only_reference"], comparison["only_cell"]) == (11, 1, 1)
    assert comparison["only_reference_keys"] == [[1, 0, "q4"]] and comparison["only_cell_keys"] == [[1, 0, "q9"]]
    shared = [(r, c) for seed, problems in OUTCOMES.items() for p, (r, c) in sorted(problems.items())
              if (seed, p) != (1, "q4")]
    assert comparison["p_value"] == pytest.approx(mcnemar_exact([r for r, _ in shared], [c for _, c in shared]).p_value)
    text = markdown(budget_experiment(), summary, tmp_path, [], [], partial=False, skipped_lines=0)
    row = next(line for line in text.splitlines() if line.startswith("| sc | 4 |"))
    assert row.endswith(" ‡ |")
    assert ("‡ sc n=4: its (seed, repetition, problem) pairs do not match the reference's; compared on the 11 "
            "shared pair(s), left out: 1 only in greedy n=1 (seed 1 rep 0 `q4`); 1 only in this cell "
            "(seed 1 rep 0 `q9`)") in text


def test_budget_table_by_level_counts_each_level(tmp_path):
    summary = summarize_experiment(budget_experiment(), budget_rows(levels=True))
    cells = {c["arm"]: c for c in summary["budget"]["datasets"][0]["cells"]}
    counts = {arm: [(lv["level"], lv["solved"], lv["trials"]) for lv in cell["levels"]] for arm, cell in cells.items()}
    # greedy: level 1 q0 x2 right, q1 x2 wrong; level 2 q3 x2 right; level 3 q5 right in seed 1 only.
    assert counts == {"greedy": [(1, 2, 4), (2, 2, 6), (3, 1, 2)], "sc": [(1, 3, 4), (2, 4, 6), (3, 2, 2)]}
    assert cells["sc"]["levels"][0]["interval"] == pytest.approx(list(wilson_interval(3, 4)))
    text = markdown(budget_experiment(), summary, tmp_path, [], [], partial=False, skipped_lines=0)
    assert "| arm | n | level 1 | level 2 | level 3 |" in text
    assert "| sc | 4 | 75.0% [30.1, 95.4] (3/4) | 66.7% [30.0, 90.3] (4/6) | 100.0% [34.2, 100.0] (2/2) |" in text
    assert summarize_experiment(budget_experiment(), budget_rows())["budget"]["datasets"][0]["cells"][0]["levels"] == []


def test_accuracy_vs_tokens_plot_is_written_per_dataset(tmp_path):
    exp = budget_experiment()
    summary = summarize_experiment(exp, budget_rows())
    paths = plot_run(exp, summary, tmp_path / "plots")
    path = tmp_path / "plots" / "accuracy_vs_tokens-builtin.png"
    assert path in paths
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_paired_arm_is_compared_with_its_partner_at_the_same_n(tmp_path):
    data = {"name": "p", "backend": "scripted", "n_values": [4], "seeds": [0, 1],
            "arms": [{"name": "plain", "baseline": True}, {"name": "stopped", "paired_with": "plain"}],
            "datasets": [{"name": "builtin"}]}
    paired = resolve(load_dataclass(ExperimentConfig, data, "<test>"), "<test>")
    rows = []
    for seed, problems in OUTCOMES.items():
        for problem, (plain, stopped) in problems.items():
            rows.append(budget_row("plain", 4, seed, problem, plain, 120))
            rows.append(budget_row("stopped", 4, seed, problem, stopped, 40))
    write_results(tmp_path, rows)
    text = write_report(tmp_path, paired)
    [dataset] = json.loads((tmp_path / "summary.json").read_text())["budget"]["datasets"]
    cells = {c["arm"]: c for c in dataset["cells"]}
    assert "vs_paired" not in cells["plain"] and cells["stopped"]["vs_paired"]["arm"] == "plain"
    pairs = pool_seeds({seed: {p: o[0] for p, o in problems.items()} for seed, problems in OUTCOMES.items()},
                       {seed: {p: o[1] for p, o in problems.items()} for seed, problems in OUTCOMES.items()})
    difference, low, high = paired_bootstrap(pairs.a_correct, pairs.b_correct)
    comparison = cells["stopped"]["vs_paired"]
    assert [comparison["difference"], *comparison["interval"]] == pytest.approx([difference, low, high])
    assert comparison["p_value"] == pytest.approx(mcnemar_exact(pairs.a_correct, pairs.b_correct).p_value)
    assert "### Paired arms — builtin" in text
    assert f"| stopped | plain | 4 | 40 | 120 | +33.3 pt [{100 * low:+.1f}, {100 * high:+.1f}]" in text


def test_paired_with_must_name_another_arm():
    from sgl_tts.config import ConfigError

    for partner in ("nobody", "solo"):
        with pytest.raises(ConfigError, match=r"arms\[0\].paired_with"):
            load_dataclass(ExperimentConfig, {"name": "x", "arms": [{"name": "solo", "paired_with": partner}]},
                           "<test>")


def test_a_dataset_half_keeps_the_even_or_odd_positions():
    from eval.experiment import DatasetSelection, half_of

    problems = list("abcde")
    assert half_of(problems, "even") == ["a", "c", "e"] and half_of(problems, "odd") == ["b", "d"]
    assert half_of(problems, None) == problems
    assert sorted(half_of(problems, "even") + half_of(problems, "odd")) == problems
    assert load_dataclass(DatasetSelection, {"name": "graded", "half": "odd"}).half == "odd"
    from sgl_tts.config import ConfigError

    with pytest.raises(ConfigError, match="'half' must be"):
        load_dataclass(DatasetSelection, {"name": "graded", "half": "first"})
