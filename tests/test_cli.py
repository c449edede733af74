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
    (["bench", "policy"], "sgl_tts.bench.policy", "run_bench"),
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


def test_bench_fasttts_runs_the_papers_protocol_by_default(monkeypatch):
    from sgl_tts.bench import fasttts

    calls = capture(monkeypatch, fasttts, "run_bench")
    assert main(["bench", "fasttts"]) == 0
    options = calls[-1][0][0]
    assert options.concurrency == 1 and options.kv_budget_mib is None and options.engine_batch is None
    _, programs, ns, fractions, arms, repeats = fasttts.resolved(options)
    assert programs == ["beam_search", "dvts", "dynamic_branching", "varying_granularity"]
    assert ns == [16, 64, 256] and fractions == [0.5] and repeats == 3
    assert [a.label for a in arms] == ["baseline", "P", "P+M", "P+M+S", "all"]
    assert "concurrency 1" in fasttts.protocol_of(options, ns, fractions)
    main(["bench", "fasttts", "--ns", "16,64", "--concurrency", "3", "--budget-fraction", "0.5,1.0"])
    _, _, ns, fractions, _, _ = fasttts.resolved(calls[-1][0][0])
    assert ns == [16, 64] and fractions == [0.5, 1.0] and calls[-1][0][0].concurrency == 3
    main(["bench", "fasttts", "--kv-budget-mib", "24"])
    assert "fixed KV budget of 24 MiB" in fasttts.protocol_of(calls[-1][0][0], [16], [0.5])


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
    main(["eval", "--resume", "runs/x", "--timeline", "tl"])
    assert runs == [(("e.yaml",), {"out": None, "resume": None, "progress": False, "timeline": None}),
                    ((None,), {"out": None, "resume": "runs/x", "progress": None, "timeline": "tl"})]
    defaults = library_defaults(eval.verifier.evaluate_verifiers)
    verifiers = capture(monkeypatch, eval.verifier, "evaluate_verifiers")
    main(["eval", "verifier", "--config", "a.yaml", "b.yaml"])
    assert verifiers == [((["a.yaml", "b.yaml"],), defaults)]


def test_run_serve_and_eval_prestart_the_cpu_zygote_and_a_cuda_run_does_not(monkeypatch, tmp_path):
    import eval.runner
    from sgl_tts.runtime import server
    from sgl_tts.serve import main as serve_main

    prestarted = []
    monkeypatch.setattr(server, "prestart_cpu_zygote", lambda: prestarted.append(True))
    capture(monkeypatch, eval.runner, "run_eval")
    capture(monkeypatch, serve_main, "serve")
    missing = str(tmp_path / "missing.yaml")
    assert main(["run", "--config", missing]) == 2 and prestarted == [True]
    assert main(["run", "--config", missing, "--device", "cuda"]) == 2 and prestarted == [True]
    main(["eval", "--config", "e.yaml"])
    main(["serve", "--port", "0"])
    assert prestarted == [True] * 3


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


def test_version_prints_the_package_version(capsys):
    import tomllib

    import sgl_tts

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"sgl-tts {sgl_tts.__version__}"
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert sgl_tts.__version__ == pyproject["project"]["version"], "one version, in both places"


def test_run_out_appends_each_problems_eval_record_as_it_finishes(tmp_path):
    """`sgl-tts run --out DIR`: a header, then one line per problem in `eval`'s record format, written as each
    problem finishes, so a run that crashes keeps the problems it finished."""
    from eval.results import ResultStore
    from sgl_tts.app.session import RunConfig
    from sgl_tts.cli.run import _save_results, start_results
    from sgl_tts.measure.metrics import problem_metrics
    from sgl_tts.problems import Problem
    from sgl_tts.search.api import Runtimes, SearchConfig
    from sgl_tts.search.programs import load_program
    from sgl_tts.testing import ScriptedBackend, ScriptedScorer

    config = RunConfig(search=SearchConfig(program="best_of_n", n=3, max_steps=6, max_tokens=10_000, seed=2))
    runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: f"Q: {q}\n\n")
    problems = [Problem(id=f"p{i}", question=f"What is {i} + 1?", gold=str(i + 1)) for i in range(2)]
    solved = [(p, load_program("best_of_n")(p, config.search, runtimes)) for p in problems]

    def crashing():
        yield solved[0]
        raise RuntimeError("the runtime died")

    store = start_results(str(tmp_path), config)
    with pytest.raises(RuntimeError, match="died"):
        list(_save_results(crashing(), store, config))
    (first,) = ResultStore(tmp_path / "results.jsonl").records()
    problem, result = solved[0]
    assert first["problem_id"] == "p0" and first["arm"] == "run" and first["n"] == 3 and first["seed"] == 2
    assert first["failed"] is False and first["result"]["answer"] == result.answer
    assert first["metrics"] == problem_metrics(result, problem.gold, None, pass_ns=[3])
    assert len(ResultStore(tmp_path / "results.jsonl").runs()) == 1, "the run header"
    list(_save_results(iter(solved[1:]), store, config))
    assert [r["problem_id"] for r in ResultStore(tmp_path / "results.jsonl").records()] == ["p0", "p1"]
