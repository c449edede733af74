"""Integration tests on real SGLang CPU runtimes (tiny random-weight model)."""

import math

import pytest

from sgl_tts.problems import Problem
from sgl_tts.search.programs import load_program
from sgl_tts.search.api import SearchConfig

pytestmark = pytest.mark.runtime

PROBLEM = Problem(id="apples", question="Tom has 3 apples and buys 4 more. How many apples does he have?", gold="7")


def test_fork_branches_report_cached_prefix(tiny_runtime):
    import sglang as sgl

    from sgl_tts.frontend.backend import TTSEndpoint

    prompt = "The quick brown fox jumps over the lazy dog. " * 8

    @sgl.function
    def fork_program(s):
        s += prompt
        s.text()
        forks = s.fork(4)
        for fork in forks:
            fork += sgl.gen("out", max_tokens=4, temperature=1.0)
        return [fork.get_meta_info("out") for fork in forks]

    metas = fork_program.run(backend=TTSEndpoint(tiny_runtime)).ret_value
    assert len(metas) == 4
    for meta in metas:
        assert meta["prompt_tokens"] > 40
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 2, "the committed prefix is served from cache"


@pytest.mark.parametrize("program", ["best_of_n", "beam_search"])
def test_programs_return_well_formed_results(program, tiny_search_runtimes):
    config = SearchConfig(program=program, n=4, beam_width=2, max_steps=3, max_step_tokens=12, max_tokens=30)
    result = load_program(program)(PROBLEM, config, tiny_search_runtimes)
    assert result.program == program and result.problem_id == "apples"
    assert len(result.candidates) >= 1
    assert result.generated_tokens > 0 and result.prompt_tokens > 0
    assert result.cached_tokens > 0, "forked branches share the prompt through the radix cache"
    assert result.verifier_calls >= 1 and result.verifier_time_s > 0 and result.generator_time_s > 0
    for candidate in result.candidates:
        assert 1 <= len(candidate.steps) <= 3
        assert candidate.tokens <= 30
        assert len(candidate.step_scores) == len(candidate.steps)
        assert all(0.0 <= s <= 1.0 for s in candidate.step_scores)
        assert candidate.completion_time_s <= result.total_time_s + 1e-6
    assert result.precise_goodput > 0


def test_likelihood_scorer_matches_transformers(tiny_runtime, tiny_search_runtimes):
    import torch
    from transformers import AutoModelForCausalLM

    scorer = tiny_search_runtimes.scorer
    prompt = tiny_search_runtimes.prompt("What is 2 + 2?")
    steps = ["First add two and two.\n\n", "That gives 4.\n\n", "The answer is 4."]
    (scores,) = scorer.score(prompt, [steps])
    ids, starts = scorer._tokenize(prompt, steps)
    model = AutoModelForCausalLM.from_pretrained(tiny_runtime.model_path, dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    bounds = starts + [len(ids)]
    for i, score in enumerate(scores):
        token_logprobs = [logprobs[t - 1, ids[t]].item() for t in range(bounds[i], bounds[i + 1])]
        expected = math.exp(sum(token_logprobs) / len(token_logprobs))
        assert score == pytest.approx(expected, rel=1e-3), f"step {i}"


def test_colocated_runtimes_with_own_budgets_shut_down_cleanly(tmp_path):
    from sgl_tts.runtime.server import RuntimeConfig, group_members, http_json
    from sgl_tts.app.session import RunConfig, ScorerConfig, Session

    config = RunConfig(
        generator=RuntimeConfig(model="tiny-random", max_total_tokens=4096),
        scorer=ScorerConfig(runtime=RuntimeConfig(model="tiny-random", max_total_tokens=2048)),
        search=SearchConfig(n=2, beam_width=1, max_steps=2, max_step_tokens=8, max_tokens=16),
        log_dir=str(tmp_path),
    )
    with Session(config) as session:
        assert set(session.runtimes) == {"generator", "scorer"}
        budgets = {name: http_json(rt.url + "/server_info")["max_total_num_tokens"]
                   for name, rt in session.runtimes.items()}
        assert budgets["generator"] == 4096 and budgets["scorer"] == 2048
        result = session.solve(PROBLEM)
        assert result.candidates and result.verifier_calls >= 1
        groups = [rt.process.pid for rt in session.runtimes.values()]
        assert all(len(group_members(pgid)) >= 2 for pgid in groups), "server, scheduler and detokenizer run"
    for pgid in groups:
        assert group_members(pgid) == [], "no child process survives shutdown (zombies aside)"


ORPHAN_OWNER = """
import sys, time
from pathlib import Path
from sgl_tts.runtime.server import Runtime, RuntimeConfig
config = RuntimeConfig(model="tiny-random", max_total_tokens=2048, startup_timeout_s=300)
runtime = Runtime.start(config, name="orphan", log_dir=Path(sys.argv[1]))
print(runtime.process.pid, flush=True)
time.sleep(600)
"""


def test_a_runtime_does_not_outlive_the_process_that_started_it(tmp_path):
    """The owner is SIGKILLed (no `stop`, no exit hooks): the runtime's watchdog stops the server group."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from sgl_tts.runtime.server import group_members

    owner = subprocess.Popen([sys.executable, "-c", ORPHAN_OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        pgid = int(owner.stdout.readline())
        assert group_members(pgid), "the runtime is up"
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_members(pgid), "the server group outlived its owner"


def test_bad_model_path_is_a_clear_error(tmp_path):
    from sgl_tts.runtime.models import ModelNotFoundError
    from sgl_tts.runtime.server import Runtime, RuntimeConfig, RuntimeStartError

    with pytest.raises(ModelNotFoundError, match="no/such/model"):
        Runtime.start(RuntimeConfig(model="no/such/model"))
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Runtime.start(RuntimeConfig(model=str(empty)))
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with pytest.raises(RuntimeStartError) as info:
        Runtime.start(RuntimeConfig(model=str(broken), startup_timeout_s=300), log_dir=tmp_path)
    message = str(info.value)
    assert "exited with code" in message and str(broken) in message
    assert "no_such_architecture" in message, "the error carries the tail of the runtime log"
