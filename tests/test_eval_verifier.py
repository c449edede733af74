"""`sgl-tts eval verifier` with scripted scorers: records, resume, the summary against the metric functions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eval import verifier
from eval.results import ResultStore
from sgl_tts.cli import build_parser
from sgl_tts.cli import eval as eval_cli
from sgl_tts.problems import DatasetError
from sgl_tts.scoring.step_labels import fold_of, load_labelled
from sgl_tts.scoring.verifier_metrics import cross_fitted_f1, step_auroc

REPO = Path(__file__).resolve().parents[1]


class LengthScorer:
    """Scores a step by a fixed function of its text; counts its calls."""

    def __init__(self, offset: float):
        self.offset, self.calls, self.tokens_processed = offset, 0, 0

    def score(self, prompt, paths):
        self.calls += 1
        self.tokens_processed += 10
        return [[(len(step) * 7 % 10) / 10 + self.offset for step in steps] for steps in paths]


@pytest.fixture
def data(tmp_path):
    rows = []
    for i in range(24):
        steps = [f"step {i} {'x' * (i % 5 + k)}" for k in range(i % 4 + 1)]
        label = -1 if i % 3 == 0 else min(i % 5, len(steps) - 1)
        rows.append({"id": f"s{i}", "problem": f"problem {i // 2}", "steps": steps, "label": label})
    path = tmp_path / "pb.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def configs(tmp_path):
    paths = []
    for name in ("likelihood-arm", "other-arm"):
        shutil.copy(REPO / "sgl_tts" / "configs" / "cpu-likelihood.yaml", tmp_path / f"{name}.yaml")
        paths.append(str(tmp_path / f"{name}.yaml"))
    return paths


def run(argv, monkeypatch, scorers):
    started = []

    def start_scorer(config, log_dir):
        started.append(config.scorer.kind)
        return scorers[len(started) - 1], (lambda q: f"<q>{q}</q>"), []

    monkeypatch.setattr(verifier, "start_scorer", start_scorer)
    args = build_parser().parse_args(argv)
    assert args.func is eval_cli.eval_verifier_command
    assert args.func(args) == 0
    return started


def test_scores_every_solution_once_and_summarises_with_the_metric_functions(data, configs, tmp_path, monkeypatch):
    out = tmp_path / "run"
    argv = ["eval", "verifier", "--config", *configs, "--data", str(data), "--part", "all", "--out", str(out)]
    scorers = [LengthScorer(0.0), LengthScorer(0.05)]
    assert run(argv, monkeypatch, scorers) == ["likelihood", "likelihood"]
    assert [s.calls for s in scorers] == [24, 24]
    records = ResultStore(out / "results.jsonl").records()
    assert len(records) == 48
    # A rerun on the same folder scores nothing again and starts no runtime.
    assert run(argv, monkeypatch, []) == []
    assert len(ResultStore(out / "results.jsonl").records()) == 48

    solutions = {s.id: s for s in load_labelled(data)}
    mine = [r for r in records if r["arm"] == "likelihood-arm"]
    scores = [r["scores"] for r in mine]
    labels = [solutions[r["id"]].label for r in mine]
    assert scores == [LengthScorer(0.0).score("", [solutions[r["id"]].search_steps()])[0] for r in mine]
    f1, _ = cross_fitted_f1(scores, labels, [fold_of(solutions[r["id"]], 2, verifier.FOLD_SALT) for r in mine])
    summary = verifier.summarise(mine, list(solutions.values()), 2)
    assert summary["f1"] == pytest.approx(100 * f1.f1)
    assert summary["auroc"] == pytest.approx(step_auroc(scores, labels))
    assert summary["solutions"] == 24
    sessions = [run for run in ResultStore(out / "results.jsonl").runs() if "arm" in run]
    assert [(run["arm"], run["scored"], run["tokens"]) for run in sessions] == [
        ("likelihood-arm", 24, 240), ("other-arm", 24, 240)]
    text = (out / "summary.md").read_text()
    assert "| likelihood-arm | 24 |" in text and "| other-arm | 24 |" in text


def test_a_folder_with_other_options_is_refused(data, configs, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(["eval", "verifier", "--config", configs[0], "--data", str(data), "--part", "all", "--out", str(out)],
        monkeypatch, [LengthScorer(0.0)])
    from sgl_tts.config import ConfigError

    with pytest.raises(ConfigError, match="other options"):
        run(["eval", "verifier", "--config", configs[0], "--data", str(data), "--part", "all", "--limit", "3",
             "--out", str(out)], monkeypatch, [LengthScorer(0.0)])


def test_eval_without_a_subcommand_still_runs_experiments():
    args = build_parser().parse_args(["eval", "--config", "eval/configs/scripted-demo.yaml"])
    assert args.func is eval_cli.eval_command and args.config == "eval/configs/scripted-demo.yaml"


def test_bad_records_name_the_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "a", "problem": "p", "steps": ["s"], "label": 0}) + "\n"
                    + json.dumps({"id": "b", "problem": "p", "steps": ["s"], "label": 4}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: field 'label'"):
        load_labelled(path)
    path.write_text(json.dumps({"id": "a", "problem": "p", "steps": "s", "label": 0}) + "\n")
    with pytest.raises(DatasetError, match=r":1: field 'steps'"):
        load_labelled(path)


def test_a_probe_without_a_runtime_is_read_inside_a_generator_started_with_its_head(tmp_path, monkeypatch):
    from sgl_tts import env_names
    from sgl_tts.app.session import load_run_config
    from sgl_tts.runtime import server
    from sgl_tts.scoring.probe import DEFAULT_HEAD

    started = []

    class Stopped(Exception):
        pass

    def start(config, name, log_dir):
        started.append((config, name))
        raise Stopped  # what the scorer would read is decided by now

    monkeypatch.setattr(server.Runtime, "start", staticmethod(start))
    config = load_run_config("cpu-default")
    assert config.scorer.kind == "probe" and config.scorer.runtime is None
    with pytest.raises(Stopped):
        verifier.start_scorer(config, tmp_path)
    (runtime_config, name), = started
    assert name == "scorer" and runtime_config.model == config.generator.model
    assert runtime_config.env[env_names.PROBE_HEAD] == str(DEFAULT_HEAD.resolve())
