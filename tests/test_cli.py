"""The command line maps its arguments onto the library: each command's defaults reach the library function as
that function's own defaults, and given flags arrive by name (no runtime starts)."""

import dataclasses
import inspect
from pathlib import Path

import pytest

from sgl_tts.cli import build_parser, main


def plain(value):
    """Tuples as lists and paths as text: the forms argparse gives."""
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def library_defaults(function):
    return {name: plain(p.default) for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def capture(monkeypatch, module, name):
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return 0

    monkeypatch.setattr(module, name, fake)
    return calls


@pytest.mark.parametrize("argv, module, name", [
    (["bench", "runtime"], "sgl_tts.bench.runtime", "run_bench"),
    (["bench", "serve"], "sgl_tts.bench.serve", "run_bench"),
    (["train", "prm"], "sgl_tts.scoring.probe_train", "train_prm"),
])
def test_keyword_commands_pass_the_library_defaults(argv, module, name, monkeypatch):
    import importlib

    target = importlib.import_module(module)
    defaults = library_defaults(getattr(target, name))
    calls = capture(monkeypatch, target, name)
    assert main(argv) == 0
    (args, kwargs), = calls
    assert args == () and {key: plain(value) for key, value in kwargs.items()} == defaults


@pytest.mark.parametrize("bench, module", [("fasttts", "fasttts"), ("verifier", "verifier_scoring")])
def test_options_commands_pass_the_library_defaults(bench, module, monkeypatch):
    import importlib

    target = importlib.import_module(f"sgl_tts.bench.{module}")
    calls = capture(monkeypatch, target, "run_bench")
    assert main(["bench", bench]) == 0
    assert calls == [((target.BenchOptions(),), {})]
    main(["bench", bench, "--config", "other.yaml", "--step-delimiter", "\\n\\n", "--out", "x"])
    assert calls[-1][0][0] == dataclasses.replace(target.BenchOptions(), config="other.yaml",
                                                  step_delimiter="\\n\\n", out="x")


def test_bench_runtime_parses_counts_and_arms(monkeypatch):
    from sgl_tts.bench import runtime
    from sgl_tts.bench.runtime import RuntimeArm

    calls = capture(monkeypatch, runtime, "run_bench")
    main(["bench", "runtime", "--parallel", "2,8", "--arm", "t1=OMP_NUM_THREADS=1 --x 1", "--arm", "d="])
    kwargs = calls[0][1]
    assert kwargs["parallel"] == [2, 8]
    assert kwargs["arms"] == [RuntimeArm("t1", ("--x", "1"), (("OMP_NUM_THREADS", "1"),)), RuntimeArm("d", ())]


def test_eval_commands_map_their_flags(monkeypatch):
    import eval.runner
    import eval.verifier

    runs = capture(monkeypatch, eval.runner, "run_eval")
    main(["eval", "--config", "e.yaml", "--no-progress"])
    main(["eval", "--resume", "runs/x"])
    assert runs == [(("e.yaml",), {"out": None, "resume": None, "progress": False}),
                    ((None,), {"out": None, "resume": "runs/x", "progress": None})]
    defaults = library_defaults(eval.verifier.evaluate_verifiers)
    verifiers = capture(monkeypatch, eval.verifier, "evaluate_verifiers")
    main(["eval", "verifier", "--config", "a.yaml", "b.yaml"])
    assert verifiers == [((["a.yaml", "b.yaml"],), defaults)]


def test_serve_takes_the_api_key_from_the_environment(monkeypatch):
    from sgl_tts.serve import main as serve_main

    calls = capture(monkeypatch, serve_main, "serve")
    monkeypatch.setenv(serve_main.API_KEY_ENV, "secret")
    main(["serve", "--port", "0"])
    (config_path, serve_config), _ = calls[0]
    assert config_path == "configs/cpu-default.yaml"
    assert serve_config == serve_main.ServeConfig(port=0, api_key="secret")


def test_every_command_has_a_handler():
    parser = build_parser()
    for argv in (["programs"], ["run"], ["plan", "memory"], ["rsd-sweep"], ["serve"], ["eval"],
                 ["plan", "spec", "--alpha", "1", "--k", "1", "--td", "0", "--tv", "1", "--th", "0"]):
        assert callable(parser.parse_args(argv).func), argv
