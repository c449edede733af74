"""Every program is accounted by the search it runs in (`Session.solve` binds it around the program's run),
whatever the program makes itself; a search without generated tokens shows no goodput."""

from __future__ import annotations

import pytest

from sgl_tts.app.compare import ArmSummary, format_comparison
from sgl_tts.app.run_report import print_run
from sgl_tts.app.session import RunConfig, Session
from sgl_tts.frontend.ledger import Request
from sgl_tts.measure.metrics import aggregate_rows, problem_metrics
from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.context import SearchCancelled, SearchContext
from sgl_tts.search.programs import UnaccountedProgram, load_program
from sgl_tts.search.records import Candidate, SearchResult
from sgl_tts.testing import ScriptedBackend, ScriptedScorer

PROBLEMS = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(2)]

# Written against earlier documentation: run(problem, config, runtimes) makes the search's state itself and runs
# its @sgl.function with .run(...), outside any `running()` block. `SAMPLE_IN` says where its states are made.
OWN_STATE = '''
import concurrent.futures

import sglang as sgl

from sgl_tts.search import ReasoningPath, SearchContext, build_result, finish, split_steps, wait_meta


@sgl.function
def samples(s, prompt, config, tracker):
    s += prompt
    s.text()
    forks = s.fork(config.n)
    for fork in forks:
        fork += sgl.gen("solution", max_tokens=config.max_tokens, temperature=config.temperature)
    paths = []
    for fork in forks:
        meta = wait_meta(fork, "solution")
        path = ReasoningPath(state=fork, steps=split_steps(fork["solution"], config.step_delimiter, config.max_steps),
                             tokens=int(meta["completion_tokens"]))
        finish(path, "eos", tracker)
        paths.append(path)
    return paths


def sample(problem, config, runtimes, tracker):
    return samples.run(prompt=runtimes.prompt(problem.question), config=config, tracker=tracker,
                       backend=runtimes.generator).ret_value


def run(problem, config, runtimes):
    tracker = SearchContext(config)
    if SAMPLE_IN == "own thread":
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            paths = pool.submit(sample, problem, config, runtimes, tracker).result()
    else:
        paths = sample(problem, config, runtimes, tracker)
    return build_result(problem.id, "own_state", paths, config, tracker)
'''

# The same, growing one path with `expand`, which binds the program's own state to the path's requests.
OWN_STATE_EXPANDED = '''
import sglang as sgl

from sgl_tts.search import ReasoningPath, SearchContext, build_result, expand, extract_answer


def run(problem, config, runtimes):
    tracker = SearchContext(config)
    prompt = runtimes.prompt(problem.question)

    @sgl.function
    def greedy(s):
        s += prompt
        path = ReasoningPath(state=s)
        for _ in range(config.max_steps):
            (path,) = expand([(path, 1)], config, tracker, extract_answer)
            if not path.active:
                break
        return [path]

    paths = greedy.run(backend=runtimes.generator).ret_value
    return build_result(problem.id, "own_state_expanded", paths, config, tracker)
'''


class ScriptedSession(Session):
    """A `Session` on the scripted backend and scorer (nothing started)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.program = load_program(config.search.program)
        self.runtimes = {}
        self._reuse = {}
        self.search_runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(),
                                        prompt=lambda q: f"Q: {q}\n\n")

    def close(self) -> None:
        pass


def session_of(tmp_path, source: str, **search) -> ScriptedSession:
    path = tmp_path / "own_state.py"
    path.write_text(source)
    return ScriptedSession(RunConfig(search=SearchConfig(program=str(path), **search)))


def test_a_program_that_makes_its_own_search_state_is_accounted(tmp_path, capsys):
    session = session_of(tmp_path, 'SAMPLE_IN = "run"\n' + OWN_STATE, n=4, max_tokens=40)
    solved = list(session.solve_all(PROBLEMS))
    for _, result in solved:
        # independent samples: every generated token is on exactly one candidate
        assert result.generated_tokens == sum(c.tokens for c in result.candidates) > 0
        assert result.cached_tokens == result.prompt_tokens > 0, "the forks' prompt was pre-sent: served from cache"
        assert result.precise_goodput is not None
    assert print_run(solved, session.config) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert f"generated tokens {sum(r.generated_tokens for _, r in solved)} |" in summary
    assert "prefix cache hit 0%" not in summary and "goodput mean - " not in summary


def test_the_requests_of_a_state_the_program_binds_itself_belong_to_the_search_it_runs_in(tmp_path):
    session = session_of(tmp_path, OWN_STATE_EXPANDED, n=1, max_steps=4, max_tokens=1000)
    context = session.new_search(PROBLEMS[0])
    result = session.solve(PROBLEMS[0], context=context)
    assert context.ledger.requests == len(session.search_runtimes.generator.requests) > 0
    assert result.generated_tokens == context.ledger.completion_tokens == result.candidates[0].tokens > 0


def test_a_program_whose_states_escape_its_search_fails_naming_the_program_and_the_change(tmp_path):
    session = session_of(tmp_path, 'SAMPLE_IN = "own thread"\n' + OWN_STATE, n=2, max_tokens=40)
    program = session.config.search.program
    with pytest.raises(UnaccountedProgram) as failure:
        session.solve(PROBLEMS[0])
    message = str(failure.value)
    assert f"program {program!r} sent requests its search never saw" in message
    assert "def run(problem, config, runtimes, context=None)" in message and "context.running()" in message


def test_a_search_made_inside_another_runs_inside_it():
    config = SearchConfig()
    heard, scored = [], []
    outer = SearchContext(config, observers=[heard.append], scoring_observers=[scored.append])
    with outer.running():
        inner = SearchContext(config)
    assert inner.outer is outer and inner.ledger is outer.ledger
    assert SearchContext(config).outer is None, "outside a running search a context is a search of its own"
    inner.request_sent("r1")
    assert outer.in_flight() == ["r1"]
    request = Request("generator", "Q", "out", 3, 0.0, 0.1)
    inner.request_answered(request, {"completion_tokens": 3, "prompt_tokens": 1})
    inner.request_done("r1")
    inner.scored([[0.5]])
    inner.record(7)
    assert (heard, scored, outer.in_flight(), outer.ledger.completion_tokens) == ([request], [[[0.5]]], [], 3)
    assert outer.generated_tokens == inner.generated_tokens == 7, "hand counts reach the outer search too"
    outer.cancel()
    assert inner.cancelled
    with pytest.raises(SearchCancelled):
        inner.request_sent("r2")


def test_no_goodput_is_shown_for_a_search_without_generated_tokens(capsys):
    problem = Problem(id="p", question="?", gold="4")
    beam = Candidate(steps=["4"], step_scores=[], score=0.0, answer="4", tokens=12, completion_time_s=2.0,
                     finish_reason="answer")
    unaccounted = SearchResult("p", "x", "4", [beam], generated_tokens=0, total_time_s=2.0)
    accounted = SearchResult("p", "x", "4", [beam], generated_tokens=12, total_time_s=2.0)
    assert unaccounted.precise_goodput is None and accounted.precise_goodput == pytest.approx(6.0)
    assert SearchResult("p", "x", None, [], generated_tokens=5).precise_goodput is None, "no beams, no goodput"
    assert problem_metrics(unaccounted)["precise_goodput"] is None
    assert aggregate_rows([unaccounted])["precise_goodput"]["n"] == 0
    assert aggregate_rows([unaccounted, accounted])["precise_goodput"]["mean"] == pytest.approx(6.0)
    print_run([(problem, unaccounted)], None)
    row, summary = (line for line in capsys.readouterr().out.splitlines()[2:] if not line.startswith("---"))
    assert row.split()[-2:] == ["-", "0%"], "the goodput column shows none"
    assert "precise goodput mean - tok/s" in summary
    arm = ArmSummary.of("x", [(problem, unaccounted)])
    assert arm.goodput is None
    assert format_comparison([arm]).splitlines()[-1].split()[-2:] == ["-", "2.0"]
