"""RSD (programs/rsd.py) on the scripted backend against a brute-force replay of Algorithm 1, its statistics,
the delta sweep, the session's target runtime, and bad input; one run on the real CPU runtime."""

import dataclasses
import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_tts.problems import Problem
from sgl_tts.config import ConfigError
from sgl_tts.search.programs import load_program
from programs.rsd import Settings
from sgl_tts.rsd.acceptance import StepRecord
from sgl_tts.measure.rsd_sweep import format_sweep_table, write_sweep_outputs
from sgl_tts.rsd.sweep import run_statistics, run_sweep, step_records
from sgl_tts.scoring.base import StepScorer
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.app.session import RunConfig, load_run_config
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

DRAFT_MODEL = ScriptedModel(answer_depth=2, answer_chance=0.3, eos_chance=0.1, answers=4)
TARGET_MODEL = ScriptedModel(answer_depth=1, answer_chance=0.6, eos_chance=0.0, answers=7)
PROBLEMS = [Problem(id=f"p{i}", question=f"question number {i}?", gold=str(i % 4)) for i in range(6)]
PARAMS = {"draft": 135, "target": 1700, "prm": 70}
rsd = load_program("rsd")


def rsd_search(settings=Settings(), max_steps=64, seed=0):
    """RSD's search config, greedy as in the paper. Long budgets: steps are never cut, so the reference need not
    model truncation."""
    return SearchConfig(program="rsd", settings=settings, max_steps=max_steps, seed=seed, temperature=0.0,
                        max_step_tokens=1000, max_tokens=100_000)


def run_rsd(problem, search, runtimes, **options):
    """The rsd program with the parameter counts the scripted backends lack."""
    return rsd(problem, search, runtimes, params=PARAMS, **options)


def draft_prompt(question):
    return f"Draft format. Q: {question}\n\n"


def target_prompt(question):
    return f"<target format> {question} </target>\n"


def make_runtimes(scorer=None):
    draft, target = ScriptedBackend(DRAFT_MODEL), ScriptedBackend(TARGET_MODEL)
    runtimes = Runtimes(generator=draft, scorer=scorer or ScriptedScorer(), prompt=draft_prompt, target=target,
                        target_prompt=target_prompt)
    return runtimes, draft, target


def scripted_step(model, text, seed=0):
    """What a scripted backend returns for the first request with `text` in a search of `seed`, stopping at the
    delimiter."""
    step, ending = model.step(text, f"{seed}:0" if seed else 0)
    return (step if ending == "eos" else step + model.delimiter), ending, len(step.split(" "))


def reference_rsd(problem, search, score_fn):
    """Algorithm 1 replayed directly on the scripted models: (steps, writers, scores, draft proposals)."""
    rng = random.Random(f"{search.seed}/{problem.id}")
    steps, writers, scores, proposals = [], [], [], []
    while True:
        context = "".join(steps)
        proposal, ending, _ = scripted_step(DRAFT_MODEL, draft_prompt(problem.question) + context, search.seed)
        reward = score_fn(draft_prompt(problem.question), steps + [proposal])
        weight = search.settings.weight(reward)
        accepted = weight == 1.0 or (weight > 0.0 and rng.random() < weight)  # Algorithm 2
        if not accepted:
            kept, ending, _ = scripted_step(TARGET_MODEL, target_prompt(problem.question) + context, search.seed)
        else:
            kept = proposal
        steps.append(kept)
        writers.append("draft" if accepted else "target")
        scores.append(reward)
        proposals.append(proposal)
        if "\\boxed" in kept or ending == "eos" or len(steps) >= search.max_steps:
            return steps, writers, scores, proposals


@pytest.mark.parametrize("delta", [0.0, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_rsd_matches_brute_force_replay(delta):
    search = rsd_search(Settings(delta=delta), max_steps=6)
    for problem in PROBLEMS:
        runtimes, _, _ = make_runtimes()
        result = run_rsd(problem, search, runtimes)
        steps, writers, scores, _ = reference_rsd(problem, search, ScriptedScorer().step_score)
        (candidate,) = result.candidates
        assert candidate.steps == steps
        assert [s["writer"] for s in result.extra["rsd"]["steps"]] == writers
        assert candidate.step_scores == pytest.approx(scores)
        assert result.answer == candidate.answer
        assert result.extra["rsd"]["target_is_draft_model"] is False


def test_every_step_below_delta_is_the_targets_step_for_the_same_context():
    search = rsd_search(Settings(delta=0.6), max_steps=8)
    rejected = 0
    for problem in PROBLEMS:
        runtimes, draft, target = make_runtimes()
        result = run_rsd(problem, search, runtimes)
        steps = result.candidates[0].steps
        records = step_records(result)
        target_contexts = [request["text"] for request in target.requests]
        assert [request["text"] for request in draft.requests] == [
            draft_prompt(problem.question) + "".join(steps[:i]) for i in range(len(steps))], "one proposal per step"
        for i, record in enumerate(records):
            context = "".join(steps[:i])
            if record.score < search.settings.delta:
                rejected += 1
                assert record.writer == "target" and not record.accepted
                assert target_prompt(problem.question) + context in target_contexts
                assert steps[i] == scripted_step(TARGET_MODEL, target_prompt(problem.question) + context)[0]
            else:
                assert record.writer == "draft"
                assert steps[i] == scripted_step(DRAFT_MODEL, draft_prompt(problem.question) + context)[0]
        assert len(target_contexts) == sum(r.writer == "target" for r in records), "target only on rejection"
    assert rejected >= 3, "the test must see rejections"


def test_delta_zero_is_all_draft_and_delta_one_all_target():
    for delta, writer in ((0.0, "draft"), (1.0, "target")):
        results = []
        for problem in PROBLEMS:
            runtimes, _, target = make_runtimes()
            results.append(run_rsd(problem, rsd_search(Settings(delta=delta), max_steps=6), runtimes))
            assert (len(target.requests) == 0) == (writer == "draft")
        assert {r.writer for res in results for r in step_records(res)} == {writer}
        stats = run_statistics(results)
        assert stats["draft_only_fraction"] == (1.0 if writer == "draft" else 0.0)
        assert stats["target_invocation_rate"] == (0.0 if writer == "draft" else 1.0)


class FixedScorer(StepScorer):
    """Every step scores `value`; counts one token per character of the path."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def score(self, prompt, paths):
        for steps in paths:
            self._count(sum(len(s) for s in steps))
        return [[self.value] * len(steps) for steps in paths]


@pytest.mark.parametrize("settings,score,writer", [
    (Settings(delta=0.7), 0.7, "draft"),  # binary: r >= delta is accepted, the boundary included
    (Settings(delta=0.7), math.nextafter(0.7, 0.0), "target"),
    (Settings(delta=0.0), 0.0, "draft"),
    (Settings(delta=1.0), 1.0, "draft"),
    (Settings(delta=1.0), math.nextafter(1.0, 0.0), "target"),
    (Settings(weighting="constant", constant=0.0), 1.0, "target"),  # omega = 0 rejects whatever the score
    (Settings(weighting="constant", constant=1.0), 0.0, "draft"),
    (Settings(weighting="clipping"), 1.0, "draft"),
    (Settings(weighting="clipping"), 0.0, "target"),
    (Settings(weighting="sigmoidal"), 0.0, "target"),
])
def test_weighting_boundaries_through_the_program(settings, score, writer):
    runtimes, _, _ = make_runtimes(scorer=FixedScorer(score))
    records = step_records(run_rsd(PROBLEMS[0], rsd_search(settings, max_steps=5), runtimes))
    assert {r.writer for r in records} == {writer}


@pytest.mark.parametrize("settings,seed", [(Settings(weighting="constant", constant=0.5), 3),
                                           (Settings(weighting="logistic", delta=0.5, logistic_alpha=4.0), 1),
                                           (Settings(weighting="sigmoidal"), 2)])
def test_stochastic_weightings_draw_from_the_problem_seed(settings, seed):
    search = rsd_search(settings, max_steps=8, seed=seed)
    writers = []
    for problem in PROBLEMS:
        runtimes, _, _ = make_runtimes()
        result = run_rsd(problem, search, runtimes)
        expected = reference_rsd(problem, search, ScriptedScorer().step_score)
        assert result.candidates[0].steps == expected[0]
        writers += [r.writer for r in step_records(result)]
    assert {"draft", "target"} <= set(writers), "both outcomes occur"


def test_token_and_time_accounting_includes_rejected_draft_tokens():
    search = rsd_search(Settings(delta=0.5), max_steps=8)
    problems = PROBLEMS[:4]
    results = []
    for problem in problems:
        runtimes, _, _ = make_runtimes()
        result = run_rsd(problem, search, runtimes)
        results.append(result)
        _, writers, _, proposals = reference_rsd(problem, search, ScriptedScorer().step_score)
        records = step_records(result)
        kept = result.candidates[0].steps
        assert [r.draft_tokens for r in records] == [len(p.rstrip("\n").split(" ")) for p in proposals]
        assert [r.target_tokens for r in records] == [
            len(s.rstrip("\n").split(" ")) if w == "target" else 0 for s, w in zip(kept, writers)]
        # The scripted scorer reads the characters of the path up to the proposal.
        assert [r.prm_tokens for r in records] == [
            sum(map(len, kept[:i])) + len(proposals[i]) for i in range(len(records))]
        assert result.generated_tokens == sum(r.draft_tokens + r.target_tokens for r in records)
        assert result.candidates[0].tokens == sum(
            r.draft_tokens if r.accepted else r.target_tokens for r in records)
        assert all(r.draft_time_s > 0 and r.prm_time_s > 0 for r in records)
        assert all((r.target_time_s > 0) == (not r.accepted) for r in records)
        stats = result.extra["rsd"]["stats"]
        assert stats["solved_by_draft_alone"] == all(w == "draft" for w in writers)
        assert stats["rejected_draft_tokens"] == sum(r.draft_tokens for r in records if not r.accepted)
    stats = run_statistics(results)
    alone = [all(r.accepted for r in step_records(res)) for res in results]
    assert stats["draft_only_fraction"] == sum(alone) / len(alone)
    assert 0 < sum(alone) < len(alone), "the test needs both kinds of problems"
    steps = [r for res in results for r in step_records(res)]
    assert stats["target_invocation_rate"] == sum(not r.accepted for r in steps) / len(steps)
    assert stats["steps"] == len(steps) and stats["problems"] == len(problems)


def test_flops_follow_two_n_per_token():
    search = rsd_search(Settings(delta=0.5), max_steps=6)
    results = [run_rsd(p, search, make_runtimes()[0]) for p in PROBLEMS]
    for result in results:
        tokens = {"draft": 0, "target": 0, "prm": 0}
        for step in result.extra["rsd"]["steps"]:
            for model in tokens:
                tokens[model] += step[f"{model}_tokens"]
        stats = result.extra["rsd"]["stats"]
        assert stats["flops"] == {m: 2 * PARAMS[m] * tokens[m] for m in tokens}
        assert stats["total_flops"] == sum(2 * PARAMS[m] * tokens[m] for m in tokens)
    run = run_statistics(results)
    assert run["total_flops"] == sum(r.extra["rsd"]["stats"]["total_flops"] for r in results)
    assert run["flops_per_problem"] == pytest.approx(run["total_flops"] / len(results))
    json.dumps([r.to_dict() for r in results])  # records are plain data


def test_flops_are_unknown_without_parameter_counts():
    runtimes, _, _ = make_runtimes()
    # without `params`: scripted backends have no model config to count from
    result = rsd(PROBLEMS[0], rsd_search(Settings(delta=0.5), max_steps=3), runtimes)
    assert result.extra["rsd"]["params"] == {"draft": None, "target": None, "prm": None}
    assert result.extra["rsd"]["stats"]["total_flops"] is None
    assert run_statistics([result])["flops_per_problem"] is None


class SlowScorer(ScriptedScorer):
    """Takes a while after counting, so that concurrent problems' counts interleave."""

    def score_new_steps(self, prompt, paths, first_new, counts):
        scores = super().score_new_steps(prompt, paths, first_new, counts)
        time.sleep(0.005)
        return scores


def test_prm_tokens_are_per_problem_when_problems_run_concurrently():
    search = rsd_search(Settings(delta=0.5), max_steps=8)
    scorer = SlowScorer()
    runtimes, _, _ = make_runtimes(scorer=scorer)
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda p: run_rsd(p, search, runtimes), PROBLEMS))
    for problem, result in zip(PROBLEMS, results):
        alone = run_rsd(problem, search, make_runtimes()[0])
        assert [r.prm_tokens for r in step_records(result)] == [r.prm_tokens for r in step_records(alone)]


def test_step_limit_and_token_budget_end_the_solution():
    runtimes, _, _ = make_runtimes()
    endless = ScriptedModel(answer_depth=100)
    runtimes.generator, runtimes.target = ScriptedBackend(endless), ScriptedBackend(endless)
    result = run_rsd(PROBLEMS[0], rsd_search(Settings(delta=0.5), max_steps=3), runtimes)
    assert len(result.candidates[0].steps) == 3 and result.candidates[0].finish_reason == "max_steps"
    runtimes.generator, runtimes.target = ScriptedBackend(endless), ScriptedBackend(endless)
    budget = SearchConfig(program="rsd", max_step_tokens=3, max_tokens=7)
    result = rsd(PROBLEMS[0], budget, runtimes)
    candidate = result.candidates[0]
    assert candidate.tokens <= 7 and candidate.finish_reason in ("max_tokens", "max_steps")
    assert all(r.draft_tokens <= 3 for r in step_records(result))


def test_run_report_prints_rsd_statistics_and_the_same_model_note(capsys):
    from sgl_tts.app.run_report import print_run

    search = rsd_search(Settings(delta=0.5), max_steps=6)
    runtimes, draft, _ = make_runtimes()
    runtimes.target = draft  # one model as draft and target, as on the CPU default
    results = [(p, run_rsd(p, search, runtimes)) for p in PROBLEMS[:3]]
    assert print_run(results, None) == 0
    out = capsys.readouterr().out
    stats = run_statistics([r for _, r in results])
    assert f"solved by draft alone {stats['draft_only_fraction']:.0%}" in out
    assert f"target invocation rate {stats['target_invocation_rate']:.0%}" in out
    assert f"rejected {stats['rejected_draft_tokens']})" in out and "FLOPs (2N per token)" in out
    assert "the target is the draft model itself" in out


# --- the sweep ---------------------------------------------------------------------------------------------


def untimed(result):
    return [{k: v for k, v in step.items() if not k.endswith("time_s")} for step in result.extra["rsd"]["steps"]]


def test_cached_sweep_equals_independent_reruns():
    search = rsd_search(Settings(delta=0.7), max_steps=6)
    deltas = [0.0, 0.3, 0.6, 0.9, 1.0]
    runtimes, _, _ = make_runtimes()
    rows, results = run_sweep(PROBLEMS, deltas, runtimes, search, concurrency=3, params=PARAMS)
    assert [row.delta for row in rows] == deltas
    assert sum(row.cache_hits for row in rows) > 0, "deltas share work"
    for row in rows:
        fresh = [run_rsd(p, rsd_search(Settings(delta=row.delta), max_steps=6), make_runtimes()[0]) for p in PROBLEMS]
        swept = results[row.delta]
        assert [r.candidates[0].steps for r in swept] == [r.candidates[0].steps for r in fresh]
        assert [untimed(r) for r in swept] == [untimed(r) for r in fresh], "same records but measured seconds"
        accuracy = sum(r.answer == p.gold for p, r in zip(PROBLEMS, fresh)) / len(PROBLEMS)
        assert row.accuracy == pytest.approx(accuracy)
        stats = run_statistics(fresh)
        assert row.draft_only_fraction == stats["draft_only_fraction"]
        assert row.flops_per_problem == stats["flops_per_problem"]
    assert rows[0].draft_only_fraction == 1.0 and rows[-1].target_invocation_rate == 1.0


def test_sweep_breaks_down_by_level_and_writes_table_and_plots(tmp_path):
    problems = [Problem(id=p.id, question=p.question, gold=p.gold, meta={"level": 1 + i % 3})
                for i, p in enumerate(PROBLEMS)]
    search = rsd_search(Settings(delta=0.7), max_steps=5)
    rows, results = run_sweep(problems, [0.0, 0.5, 1.0], make_runtimes()[0], search, params=PARAMS)
    for row in rows:
        assert sorted(row.by_level) == ["1", "2", "3"]
        assert sum(level["problems"] for level in row.by_level.values()) == len(problems)
        weighted = sum(level["accuracy"] * level["problems"] for level in row.by_level.values()) / len(problems)
        assert weighted == pytest.approx(row.accuracy)
    table = format_sweep_table(rows)
    assert table.splitlines()[0].startswith("| delta | accuracy | draft only")
    assert "level 3" in table and len([line for line in table.splitlines() if line.startswith("| 0.50")]) == 2
    written = write_sweep_outputs(rows, results, tmp_path, "test sweep")
    for name in ("sweep.png", "sweep_levels.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert json.loads((tmp_path / "sweep.json").read_text())[1]["delta"] == 0.5
    assert len((tmp_path / "results-delta-1.00.jsonl").read_text().splitlines()) == len(problems)
    assert tmp_path / "sweep.csv" in written


def test_sweep_rejects_weightings_that_ignore_delta():
    search = rsd_search(Settings(weighting="constant"))
    with pytest.raises(ValueError, match="ignores"):
        run_sweep(PROBLEMS, [0.5], make_runtimes()[0], search)


# --- bad input ---------------------------------------------------------------------------------------------


def write_config(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("body,message", [
    ("target: generator\nsearch: {program: rsd, settings: {delta: 1.5}}",
     r"search.settings: delta must be in \[0, 1\], got 1.5"),
    ("target: generator\nsearch: {program: rsd, settings: {delta: -0.1}}",
     r"search.settings: delta must be in \[0, 1\]"),
    ("target: generator\nsearch: {program: rsd, settings: {weighting: step}}",
     "search.settings: unknown weighting 'step'; known: binary"),
    ("target: generator\nsearch: {program: rsd, settings: {delta: high}}", "'search.settings.delta' must be float"),
    ("target: generator\nsearch: {program: rsd, settings: {omega: binary}}",
     "unknown key 'search.settings.omega'; known keys here: constant, delta, logistic_alpha, weighting"),
    ("target: generator\nsearch: {program: rsd, settings: [binary]}", "'search.settings' must be a mapping"),
    ("target: generator\nsearch: {program: rsd, settings: {seed: 3}}", "unknown key 'search.settings.seed'"),
    ("search: {program: rsd}\nscorer: {kind: likelihood}", "program 'rsd' needs 'target': a runtime config"),
    ("search: {program: rsd}\ntarget: draft", "'target' must be a mapping"),
    ("search: {program: beam_search, settings: {delta: 0.5}}", "program 'beam_search' takes no settings"),
])
def test_bad_program_settings_name_the_setting_and_the_file(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_run_config(write_config(tmp_path, body))
    assert "run.yaml" in str(info.value)


def test_settings_load_as_the_programs_settings_and_the_step_loop_is_the_searchs(tmp_path):
    path = write_config(tmp_path, "target: generator\nsearch: {program: rsd, max_steps: 2, temperature: 0.0, seed: 5, "
                                  "settings: {weighting: logistic, delta: 0.4}}\n")
    search = load_run_config(path).search
    assert search.settings == Settings(weighting="logistic", delta=0.4)
    assert load_run_config(write_config(tmp_path, "target: generator\nsearch: {program: rsd}\n")).search.settings == \
        Settings()
    assert load_run_config(write_config(tmp_path, "search: {program: beam_search}\n")).search.settings is None
    result = run_rsd(PROBLEMS[0], dataclasses.replace(search, max_step_tokens=1000, max_tokens=100_000),
                     make_runtimes()[0])
    assert len(result.candidates[0].steps) <= 2
    assert result.extra["rsd"]["settings"] == {"weighting": "logistic", "delta": 0.4, "constant": 0.6,
                                               "logistic_alpha": 1.0, "seed": 5, "step_delimiter": "\n\n",
                                               "max_steps": 2, "temperature": 0.0, "top_p": 1.0}
    assert result.candidates[0].steps == reference_rsd(PROBLEMS[0], search, ScriptedScorer().step_score)[0]


def test_program_without_target_or_scorer_is_a_clear_error():
    runtimes, _, _ = make_runtimes()
    runtimes.target = None
    with pytest.raises(ValueError, match="target"):
        rsd(PROBLEMS[0], rsd_search(), runtimes)
    runtimes, _, _ = make_runtimes()
    runtimes.scorer = None
    with pytest.raises(ValueError, match="scorer"):
        rsd(PROBLEMS[0], rsd_search(), runtimes)


def test_cli_errors_name_the_setting(tmp_path, capsys):
    from sgl_tts.cli import main
    from sgl_tts.cli.rsd import parse_deltas

    assert parse_deltas("0.9,0,0.5,0.5") == [0.0, 0.5, 0.9]
    with pytest.raises(SystemExit) as exit_info:
        main(["rsd-sweep", "--deltas", "0.5,1.2"])
    assert exit_info.value.code == 2 and "--deltas" in capsys.readouterr().err
    assert main(["run", "--config", "configs/cpu-default.yaml", "--program", "rsd"]) == 2
    assert "needs 'target'" in capsys.readouterr().err
    beam = write_config(tmp_path, "search: {program: beam_search}\ntarget: generator\n")
    assert main(["rsd-sweep", "--config", str(beam)]) == 2
    assert "has no such setting (use program rsd)" in capsys.readouterr().err


def test_rsd_cpu_config_loads():
    config = load_run_config("rsd-cpu")
    assert config.search.program == "rsd" and config.target == "generator"
    assert config.generator.model == "smollm2-135m" and config.search.settings == Settings(weighting="binary")
    assert config.search.temperature == 0.0, "the paper decodes greedily"


# --- the session's target runtime (runtimes faked: no server starts) ----------------------------------------


class FakeRuntime:
    started = []

    def __init__(self, config, name):
        from sgl_tts.runtime.models import resolve_model

        self.config, self.name = config, name
        self.model_path = resolve_model(config.model)
        self.url = f"http://127.0.0.1/{name}"

    @classmethod
    def start(cls, config, name, log_dir=None, wait=True):
        cls.started.append((name, config))
        return cls(config, name)

    def wait_ready(self):
        pass

    def stop(self):
        pass


class FakeEndpoint:
    def __init__(self, runtime, **settings):
        self.runtime = runtime


@pytest.mark.parametrize("target", ["own runtime", "generator"])
def test_session_starts_the_target_with_its_own_budget(monkeypatch, target):
    import sgl_tts.app.session as session_module
    from sgl_tts.runtime.server import RuntimeConfig

    monkeypatch.setattr(session_module, "Runtime", FakeRuntime)
    monkeypatch.setattr("sgl_tts.frontend.backend.TTSEndpoint", FakeEndpoint)  # RuntimeEndpoint would call the server
    FakeRuntime.started = []
    target_config = RuntimeConfig(model="tiny-random", max_total_tokens=2048)
    config = RunConfig(generator=RuntimeConfig(model="tiny-random", max_total_tokens=4096),
                       target=target_config if target == "own runtime" else "generator",
                       search=SearchConfig(program="rsd", settings={"delta": 0.4}))
    with session_module.Session(config) as session:
        runtimes = session.search_runtimes
        names = [name for name, _ in FakeRuntime.started]
        if target == "own runtime":
            assert names == ["generator", "target"]
            assert dict(FakeRuntime.started)["target"].max_total_tokens == 2048
            assert runtimes.target.runtime is session.runtimes["target"]
        else:
            assert names == ["generator"]
            assert runtimes.target.runtime is session.runtimes["generator"]
        assert session.config.search.settings == Settings(delta=0.4), "the mapping validated at start"
        assert runtimes.target_prompt("2+2?") == runtimes.prompt("2+2?"), "same tokenizer, same format"
        from programs.rsd import target_is_draft_model

        assert target_is_draft_model(runtimes)


# --- the real CPU runtime ----------------------------------------------------------------------------------


@pytest.mark.runtime
def test_rsd_on_the_cpu_runtime(tiny_search_runtimes, tiny_runtime):
    from sgl_tts.runtime.roofline import load_model_spec

    runtimes = Runtimes(generator=tiny_search_runtimes.generator, scorer=tiny_search_runtimes.scorer,
                        prompt=tiny_search_runtimes.prompt, target=tiny_search_runtimes.generator)
    search = SearchConfig(program="rsd", max_steps=3, temperature=0.0, max_step_tokens=8, max_tokens=24,
                          settings=Settings(delta=0.5))
    result = rsd(Problem(id="apples", question="Tom has 3 apples and buys 4 more. How many?", gold="7"),
                 search, runtimes)
    info = result.extra["rsd"]
    records = [StepRecord(**s) for s in info["steps"]]
    assert 1 <= len(records) <= 3 and len(result.candidates[0].steps) == len(records)
    assert info["target_is_draft_model"] is True
    assert all(0.0 <= r.score <= 1.0 and r.draft_tokens >= 1 and r.prm_tokens > r.draft_tokens for r in records)
    assert all(r.accepted == (r.score >= 0.5) for r in records)
    assert all((r.target_tokens >= 1) == (not r.accepted) for r in records)
    assert result.generated_tokens == sum(r.draft_tokens + r.target_tokens for r in records)
    assert result.candidates[0].tokens <= 24
    n = int(load_model_spec(tiny_runtime.model_path).matmul_params)
    assert info["params"] == {"draft": n, "target": n, "prm": n}
    tokens = sum(r.draft_tokens + r.target_tokens + r.prm_tokens for r in records)
    assert info["stats"]["total_flops"] == 2 * n * tokens
