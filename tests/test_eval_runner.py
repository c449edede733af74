"""The eval harness on the scripted backend: rows against a direct reference, resume, runtime restarts,
failures, bad input before anything starts, and per-request timing windows."""

import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from sgl_tts.problems import DatasetError, Problem
from eval.experiment import load_experiment, plain
from eval.report import row_key
from eval.results import ResultStore, config_hash
from eval.runner import SCRIPTED_PROMPT, EvalRun, request_windows
from sgl_tts.config import ConfigError
from sgl_tts.measure.metrics import problem_metrics
from sgl_tts.runtime.models import ModelNotFoundError
from sgl_tts.search.programs import load_program
from sgl_tts.runtime.server import RuntimeDiedError
from sgl_tts.search.api import Runtimes
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

GOLDS = [0, 1, 1, 0, 1, 0]  # the scripted model answers 0 or 1 (scripted.answers: 2): some are solved
COMPARED = ("answer", "majority_answer", "weighted_answer", "best_answer", "correct", "majority_correct",
            "weighted_correct", "best_correct", "n_candidates", "generated_tokens", "mean_beam_tokens", "iterations")


def write_dataset(tmp_path, golds=GOLDS):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "question": f"What is toy number {i}?", "answer": g}) + "\n"
                            for i, g in enumerate(golds)))
    return path


def write_experiment(tmp_path, dataset, **changes):
    data = {
        "name": "toy", "backend": "scripted", "scripted": {"delay_s": 0.0, "answers": 2},
        "base": {"search": {"program": "beam_search", "beam_width": 2, "max_steps": 5, "max_tokens": 10000},
                 "concurrency": 3},
        "datasets": [{"name": str(dataset)}],
        "arms": [{"name": "bon", "baseline": True, "overrides": {"search": {"program": "best_of_n", "max_steps": 50}}},
                 {"name": "beam"}],
        "n_values": [2, 4],
    }
    for key, value in changes.items():
        data[key] = value
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_experiment(path)


def run(experiment, run_dir, messages=None):
    return EvalRun(experiment, run_dir, progress=False, log=(messages if messages is not None else []).append).run()


def reference_rows(experiment, problems):
    """Each unit solved directly with a fresh scripted model, as the harness does after flushing."""
    expected = {}
    options = experiment.config.scripted
    for unit in experiment.units():
        runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel(answer_depth=options.answer_depth,
                                                                    answers=options.answers)),
                            scorer=ScriptedScorer(), prompt=lambda q: SCRIPTED_PROMPT.format(question=q))
        program = load_program(unit.config.search.program)
        for problem in problems:
            result = program(problem, unit.config.search, runtimes)
            expected[unit.key + (problem.id,)] = (problem_metrics(result, problem.gold, None, pass_ns=[unit.n]),
                                                  candidate_set(result.to_dict()))
    return expected


def candidate_set(result):
    """The candidates regardless of the order their requests finished in."""
    return sorted((c["steps"], c["score"], c["answer"], c["tokens"]) for c in result["candidates"])


def toy_problems():
    return [Problem(id=f"p{i}", question=f"What is toy number {i}?", gold=str(g)) for i, g in enumerate(GOLDS)]


def assert_rows_match_reference(rows, experiment):
    expected = reference_rows(experiment, toy_problems())
    assert sorted(row_key(r) for r in rows) == sorted(expected), "every (unit, problem) exactly once"
    for row in rows:
        metrics, candidates = expected[row_key(row)]
        assert candidate_set(row["result"]) == candidates, row_key(row)
        # the row's metrics are those of its own result (answers chosen from its candidates as recorded)
        own = problem_metrics(row["result"], row["metrics"]["gold"], None, pass_ns=[row["n"]])
        assert {k: row["metrics"][k] for k in COMPARED} == {k: own[k] for k in COMPARED}, row_key(row)
        assert row["metrics"][f"pass@{row['n']}"] == own[f"pass@{row['n']}"] == metrics[f"pass@{row['n']}"]
        assert row["metrics"]["generated_tokens"] == metrics["generated_tokens"]


def non_daemon_threads():
    return sum(1 for thread in threading.enumerate() if not thread.daemon)


def wait_for_threads(at_most, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while non_daemon_threads() > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return non_daemon_threads()


def test_complete_run_matches_direct_reference_and_carries_provenance(tmp_path):
    experiment = write_experiment(tmp_path, write_dataset(tmp_path))
    threads_before = non_daemon_threads()
    outcome = run(experiment, tmp_path / "run")
    assert wait_for_threads(threads_before) <= threads_before, "no SGLang worker thread outlives the run"
    assert outcome.complete and not outcome.interrupted and outcome.written == 2 * 2 * len(GOLDS)
    store = ResultStore(tmp_path / "run" / "results.jsonl")
    rows = store.records()
    assert_rows_match_reference(rows, experiment)
    assert any(r["metrics"]["majority_correct"] for r in rows) and not all(r["metrics"]["majority_correct"] for r in rows)
    (header,) = store.runs()
    units = {u.key: u for u in experiment.units()}
    for row in rows:
        prov = row["provenance"]
        unit = units[row_key(row)[:5]]
        assert prov["run_id"] == header["run_id"] and prov["seed"] == unit.seed == 0
        assert prov["config"] == plain(unit.config) and prov["config_sha256"] == config_hash(plain(unit.config))
        assert prov["config"]["search"]["n"] == row["n"]
        assert prov["packages"]["sglang"] and prov["hardware"]["cpu_count"] >= 1
        assert prov["models"]["generator"]["model"] == "scripted"
        timing = row["timing"]
        assert timing["requests"]["requests"] >= 1 and timing["requests"]["server_e2e_s"] is None
        assert timing["total_s"] == row["result"]["total_time_s"] <= timing["solve_wall_s"]
    # the saved experiment reads back to the same experiment
    again = load_experiment(tmp_path / "run" / "experiment.yaml")
    assert config_hash(again.fingerprint()) == header["experiment_sha256"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cell = next(c for c in summary["cells"] if c["arm"] == "beam" and c["n"] == 4)
    flags = [r["metrics"]["majority_correct"] for r in rows if r["arm"] == "beam" and r["n"] == 4]
    assert cell["stats"]["accuracy.majority_correct"]["median"] == pytest.approx(sum(flags) / len(flags))
    assert not summary["partial"] and "complete" in outcome.summary


def test_rows_carry_the_problem_level_and_the_report_pairs_arms_with_their_own_n(tmp_path):
    graded_ids = ["L1-01", "L1-02", "L2-01", "L3-01"]
    experiment = write_experiment(
        tmp_path, write_dataset(tmp_path), n_values=[], seeds=[0, 1], reference="greedy",
        datasets=[{"name": "graded", "ids": graded_ids}, {"name": str(tmp_path / "toy.jsonl")}],
        arms=[{"name": "greedy", "n_values": [1],
               "overrides": {"search": {"program": "self_consistency", "temperature": 0.0}}},
              {"name": "beam", "n_values": [2]}])
    outcome = run(experiment, tmp_path / "run")
    assert outcome.complete and outcome.written == 2 * 2 * (len(graded_ids) + len(GOLDS))
    rows = ResultStore(tmp_path / "run" / "results.jsonl").records()
    assert {(r["arm"], r["n"]) for r in rows} == {("greedy", 1), ("beam", 2)}
    for row in rows:
        if row["dataset"] == "graded":
            assert row["level"] == int(row["problem_id"][1]), row_key(row)
        else:
            assert "level" not in row, row_key(row)
    budget = json.loads((tmp_path / "run" / "summary.json").read_text())["budget"]
    datasets = {d["dataset"]: d for d in budget["datasets"]}
    assert set(datasets) == {"graded", "toy"}
    for name, problems in (("graded", len(graded_ids)), ("toy", len(GOLDS))):
        cells = {c["arm"]: c for c in datasets[name]["cells"]}
        assert datasets[name]["reference"] == {"arm": "greedy", "n": 1}
        assert cells["greedy"]["trials"] == cells["beam"]["trials"] == 2 * problems
        assert cells["beam"]["vs_reference"]["pairs"] == 2 * problems
        assert cells["beam"]["vs_reference"]["only_reference"] == cells["beam"]["vs_reference"]["only_cell"] == 0
    assert [(lv["level"], lv["trials"]) for lv in datasets["graded"]["cells"][1]["levels"]] == [(1, 4), (2, 2), (3, 2)]
    assert datasets["toy"]["cells"][0]["levels"] == []
    assert (tmp_path / "run" / "plots" / "accuracy_vs_tokens-graded.png").is_file()
    assert "## Accuracy vs budget — graded" in outcome.summary and "### Accuracy by level — graded" in outcome.summary


def test_resume_solves_only_the_missing_problems_and_keeps_the_others(tmp_path):
    experiment = write_experiment(tmp_path, write_dataset(tmp_path))
    run(experiment, tmp_path / "run")
    path = tmp_path / "run" / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    kept = lines[:-5]  # as if the last five problems were in flight when the process was killed
    path.write_text("".join(kept) + lines[-5][:40])  # ... and the last write was torn
    outcome = run(experiment, tmp_path / "run")
    assert outcome.written == 5 and outcome.complete
    text = path.read_text()
    assert text.startswith("".join(kept)), "lines written before the crash are untouched"
    store = ResultStore(path)
    assert_rows_match_reference(store.records(), experiment)
    assert store.skipped_lines == 1 and len(store.runs()) == 2 and store.runs()[1]["resumed"]
    # a third start has nothing to do
    assert run(experiment, tmp_path / "run").written == 0


def test_a_runtime_that_dies_is_restarted_and_no_problem_is_lost(tmp_path):
    experiment = write_experiment(tmp_path, write_dataset(tmp_path), scripted={"die_on": ["p3"], "answers": 2})
    messages = []
    outcome = run(experiment, tmp_path / "run", messages)
    assert outcome.complete and outcome.restarts == 1
    assert any("a runtime died" in m and "restarting" in m for m in messages)
    rows = ResultStore(tmp_path / "run" / "results.jsonl").records()
    assert_rows_match_reference(rows, experiment)
    first_unit = [r for r in rows if row_key(r)[:5] == ("bon", "toy", 2, 0, 0)]
    assert next(r for r in first_unit if r["problem_id"] == "p3")["session"] == 1, "solved after the restart"
    assert all(r["session"] == 1 for r in rows if r["arm"] == "bon" and r["n"] == 4)
    assert all(r["session"] == 0 for r in rows if r["arm"] == "beam"), "each arm starts its own runtimes"


def test_giving_up_after_max_restarts_keeps_results_and_writes_a_partial_summary(tmp_path):
    experiment = write_experiment(tmp_path, write_dataset(tmp_path), scripted={"die_on": ["p3", "p4"], "answers": 2},
                                  max_restarts=1, base={"concurrency": 1, "search": {"program": "best_of_n"}})
    with pytest.raises(RuntimeDiedError, match=r"max_restarts 1.*--resume"):
        run(experiment, tmp_path / "run")
    rows = ResultStore(tmp_path / "run" / "results.jsonl").records()
    assert sorted(r["problem_id"] for r in rows) == ["p0", "p1", "p2", "p3"], "p3 after one restart, then p4 died"
    assert "PARTIAL" in (tmp_path / "run" / "summary.md").read_text()


def test_a_failing_search_gets_a_failed_line_and_is_retried_on_resume(tmp_path):
    program = tmp_path / "flaky.py"
    program.write_text(
        "from programs import best_of_n\n"
        "def run(problem, config, runtimes):\n"
        "    if problem.id == 'p2':\n"
        "        raise ValueError('cannot solve p2')\n"
        "    return best_of_n.run(problem, config, runtimes)\n")
    experiment = write_experiment(tmp_path, write_dataset(tmp_path), n_values=[2],
                                  arms=[{"name": "flaky", "overrides": {"search": {"program": str(program)}}}])
    outcome = run(experiment, tmp_path / "run")
    assert outcome.failed == 1 and outcome.written == len(GOLDS) - 1 and not outcome.complete
    store = ResultStore(tmp_path / "run" / "results.jsonl")
    (failed,) = [r for r in store.records() if r["failed"]]
    assert failed["problem_id"] == "p2" and failed["error"] == "ValueError: cannot solve p2"
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "PARTIAL" in summary and "`p2`: ValueError: cannot solve p2" in summary
    again = run(experiment, tmp_path / "run")
    assert again.failed == 1 and again.written == 0, "only the failed problem is tried again"
    report = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [f["problem_id"] for f in report["failed"]] == ["p2"], "a problem counts once however often it failed"


def test_bad_input_is_reported_before_anything_starts(tmp_path):
    dataset = write_dataset(tmp_path)
    unknown_dataset = write_experiment(tmp_path, dataset, datasets=[{"name": "gsm9k"}])
    with pytest.raises(DatasetError, match=r"unknown dataset 'gsm9k'; choices: aime24, amc23, gsm8k"):
        run(unknown_dataset, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"arms\[0\] \('x'\): unknown program 'beem_search'; known programs: .*"
                                          r"beam_search"):
        write_experiment(tmp_path, dataset, backend="sglang",
                         arms=[{"name": "x", "overrides": {"search": {"program": "beem_search"}}}])
    unknown_model = write_experiment(tmp_path, dataset, backend="sglang", base={"generator": {"model": "no-such-model"}})
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        run(unknown_model, tmp_path / "run")
    bad_field = write_experiment(tmp_path, dataset, datasets=[{"name": str(dataset), "question_field": "prompt"}])
    with pytest.raises(DatasetError, match=r"toy\.jsonl:1: question field 'prompt' not found"):
        run(bad_field, tmp_path / "run")
    assert not (tmp_path / "run" / "results.jsonl").exists(), "nothing was started or written"


def test_malformed_dataset_line_fails_with_file_and_line_or_is_skipped_when_configured(tmp_path):
    dataset = write_dataset(tmp_path)
    with open(dataset, "a") as file:
        file.write('{"id": "p9", "question": "broken\n')
    strict = write_experiment(tmp_path, dataset)
    with pytest.raises(DatasetError, match=rf"{dataset}:{len(GOLDS) + 1}: malformed line"):
        run(strict, tmp_path / "run")
    lenient = write_experiment(tmp_path, dataset, n_values=[2],
                               datasets=[{"name": str(dataset), "skip_malformed": True}])
    messages = []
    outcome = run(lenient, tmp_path / "run", messages)
    assert outcome.complete and outcome.written == 2 * len(GOLDS)
    assert any("skipped 1 malformed line" in m for m in messages)


def test_a_folder_holding_another_experiment_is_refused(tmp_path):
    dataset = write_dataset(tmp_path)
    run(write_experiment(tmp_path, dataset, n_values=[2]), tmp_path / "run")
    with pytest.raises(ConfigError, match="different experiment"):
        run(write_experiment(tmp_path, dataset, n_values=[2, 4]), tmp_path / "run")


def test_each_search_ledger_holds_exactly_its_own_requests_even_with_the_same_prompt():
    """Eight searches of one question at once on one shared backend: each search's requests are told apart by
    its context, not by prompt text (which is the same for all of them)."""
    from programs import best_of_n

    backend = ScriptedBackend(ScriptedModel(answer_depth=1))
    runtimes = Runtimes(generator=backend, scorer=None, prompt=lambda q: SCRIPTED_PROMPT.format(question=q))
    from sgl_tts.search.api import SearchConfig

    search = SearchConfig(program="self_consistency", n=3, max_tokens=40)
    problem = Problem(id="same", question="1 + 1?", gold="2")
    contexts = [runtimes.new_search(search, f"s{i}") for i in range(8)]
    results = [None] * 8

    def solve(i):
        results[i] = best_of_n.run(problem, search, runtimes, contexts[i])

    threads = [threading.Thread(target=solve, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for context, result in zip(contexts, results):
        requests = context.ledger.answered_requests()
        assert len(requests) == 3, "one request per sample of this search"
        assert sum(r.completion_tokens for r in requests) == result.generated_tokens == context.ledger.completion_tokens
        assert all(r.runtime == "generator" and r.client_s >= 0 for r in requests)
    assert sum(len(c.ledger.answered_requests()) for c in contexts) == len(backend.requests), "each in one ledger"
    from policies.base import decode_rid

    runs = {decode_rid(r["fields"]["rid"]).problem_id for r in backend.requests}
    assert len(runs) == 8 and {run.split("/")[0] for run in runs} == {f"s{i}" for i in range(8)}, (
        "each search labels its requests with its own lineage run")


def test_request_windows_summarise_the_ledger_requests():
    from sgl_tts.frontend.ledger import Request

    timed = Request("generator", "Q", "out", 7, 0.0, 0.5, e2e_latency=1.0, first_token_latency=0.4, queue_time=0.1)
    windows = request_windows([timed] * 3)
    assert windows["requests"] == 3
    assert windows["server_e2e_s"]["p50"] == 1.0 and windows["first_token_s"]["mean"] == pytest.approx(0.4)
    assert windows["prompt_processing_s"]["mean"] == pytest.approx(0.3)
    assert windows["decode_s_per_token"]["mean"] == pytest.approx(0.6 / 6)
    bare = request_windows([Request("generator", "Q", "out", 3, 0.0, 0.2)])
    assert bare["client_s"]["max"] == 0.2 and bare["server_e2e_s"] is None and bare["decode_s_per_token"] is None


def test_objects_json_cannot_hold_are_stored_as_their_repr(tmp_path):
    program = tmp_path / "odd_extra.py"
    program.write_text(
        "from programs import best_of_n\n"
        "def run(problem, config, runtimes):\n"
        "    result = best_of_n.run(problem, config, runtimes)\n"
        "    result.extra['seen'] = {problem.id}\n"
        "    return result\n")
    experiment = write_experiment(tmp_path, write_dataset(tmp_path), n_values=[2],
                                  arms=[{"name": "odd", "overrides": {"search": {"program": str(program)}}}])
    assert run(experiment, tmp_path / "run").complete
    rows = ResultStore(tmp_path / "run" / "results.jsonl").records()
    assert sorted(r["result"]["extra"]["seen"] for r in rows) == [f"{{'p{i}'}}" for i in range(len(GOLDS))]


def test_timelines_are_drawn_per_draw_and_kept_out_of_the_results(tmp_path):
    experiment = write_experiment(tmp_path, write_dataset(tmp_path), n_values=[2])
    outcome = EvalRun(experiment, tmp_path / "run", progress=False, log=[].append, timeline=tmp_path / "tl").run()
    assert outcome.complete and outcome.written == 2 * len(GOLDS)
    pictures = sorted(p.name for p in (tmp_path / "tl").iterdir())
    assert pictures == sorted(f"{arm}-n2-seed0-rep0-p{i}.png" for arm in ("bon", "beam") for i in range(len(GOLDS)))
    rows = ResultStore(tmp_path / "run" / "results.jsonl").records()
    assert not any("timeline" in json.dumps(row.get("extra", {})) for row in rows)
    assert_rows_match_reference(rows, experiment)  # the same draws as without the timeline
