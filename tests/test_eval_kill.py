"""Results are never lost: a real `sgl-tts eval` process is killed (SIGKILL) or interrupted (SIGINT) mid-run
and started again on the same folder. Runs on the scripted backend with a per-problem delay, so the signal
lands while problems are still being solved."""

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eval.experiment import load_experiment
from eval.report import row_key
from eval.results import ResultStore
from eval.runner import EvalRun

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = 6


def write_config(tmp_path, delay_s):
    dataset = tmp_path / "toy.jsonl"
    dataset.write_text("".join(json.dumps({"id": f"p{i}", "question": f"Toy question {i}?", "answer": i % 2}) + "\n"
                               for i in range(PROBLEMS)))
    config = {
        "name": "kill", "backend": "scripted", "scripted": {"delay_s": delay_s, "answers": 2},
        "base": {"search": {"program": "best_of_n", "max_steps": 50, "max_tokens": 10000}, "concurrency": 1},
        "datasets": [{"name": str(dataset)}],
        "arms": [{"name": "majority", "baseline": True, "overrides": {"search": {"selection": "majority"}}},
                 {"name": "weighted", "overrides": {"search": {"selection": "weighted"}}}],
        "n_values": [3],
    }
    path = tmp_path / f"kill-{delay_s}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def default_sigint():
    """Ctrl-C's default in the child even when this test runs as a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(config, out, command=(sys.executable, "-m", "sgl_tts.cli", "eval")):
    return subprocess.Popen([*command, "--config", str(config), "--out", str(out), "--no-progress"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)


def wait_for_results(process, path, at_least=1, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count('"kind":"result"') >= at_least:
            return
        assert process.poll() is None, f"eval exited early ({process.returncode}):\n{process.stdout.read()}"
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"no result line after {timeout_s} s")


def candidates_by_key(records):
    return {row_key(r): sorted((c["steps"], c["answer"]) for c in r["result"]["candidates"]) for r in records}


def reference(tmp_path):
    """The same experiment without delay, uninterrupted, in this process."""
    experiment = load_experiment(write_config(tmp_path, 0.0))
    EvalRun(experiment, tmp_path / "reference", progress=False, log=lambda m: None).run()
    return candidates_by_key(ResultStore(tmp_path / "reference" / "results.jsonl").records())


def test_sigkill_mid_run_then_restart_loses_nothing_and_duplicates_nothing(tmp_path):
    config = write_config(tmp_path, 0.3)
    out = tmp_path / "run"
    results = out / "results.jsonl"
    process = start(config, out)
    wait_for_results(process, results)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    before = results.read_bytes()
    intact = before[: before.rfind(b"\n") + 1]
    first = ResultStore(results).records()
    assert 1 <= len(first) < 2 * PROBLEMS, "killed mid-run"

    again = start(config, out, command=(str(Path(sys.executable).parent / "sgl-tts"), "eval"))
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output
    assert "complete" in output and "| majority (baseline) | weighted |" in output

    assert results.read_bytes().startswith(intact), "lines written before the kill are unchanged"
    store = ResultStore(results)
    records = store.records()
    counts = collections.Counter(row_key(r) for r in records)
    assert len(counts) == 2 * PROBLEMS and set(counts.values()) == {1}, "every problem exactly once"
    assert not any(r["failed"] for r in records)
    assert [r for r in records[: len(first)]] == first
    assert candidates_by_key(records) == reference(tmp_path), "the resumed run equals an uninterrupted one"
    runs = store.runs()
    assert len(runs) == 2 and not runs[0]["resumed"] and runs[1]["resumed"]
    assert {r["provenance"]["run_id"] for r in records} == {runs[0]["run_id"], runs[1]["run_id"]}


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_keeps_what_is_done_and_writes_a_partial_summary(tmp_path, stop_signal):
    config = write_config(tmp_path, 0.3)
    out = tmp_path / "run"
    process = start(config, out)
    wait_for_results(process, out / "results.jsonl", at_least=2)
    process.send_signal(stop_signal)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 130, output
    assert "interrupted" in output and "PARTIAL" in output
    summary = (out / "summary.md").read_text()
    assert "PARTIAL" in summary and "| majority (baseline) |" in summary
    done = ResultStore(out / "results.jsonl").records()
    assert 2 <= len(done) < 2 * PROBLEMS and not any(r["failed"] for r in done)
    # resuming finishes the rest
    outcome = EvalRun(load_experiment(config), out, progress=False, log=lambda m: None).run()
    assert outcome.complete and outcome.written == 2 * PROBLEMS - len(done)
    assert "PARTIAL" not in (out / "summary.md").read_text()
    assert (out / "plots" / "goodput_vs_n-toy.png").stat().st_size > 1000
