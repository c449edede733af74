"""A budget per search (sgl_tts/search/budget.py): the deadline and the token budget stop any program on the
search API with its best path, narrowing below the slack threshold, the abort of the requests in flight, and
the budget's settings in the run config, the command line and a served request. Scripted backend, fake clock."""

import argparse
import dataclasses
import threading
from types import SimpleNamespace

import pytest

from sgl_tts.config import ConfigError, load_dataclass
from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig, expand_plainly, rank_key
from sgl_tts.search.budget import Budget, Narrowing
from sgl_tts.search.grading import answer_at_end, extract_answer
from sgl_tts.search.limits import LimitError, Limits, check_limits
from sgl_tts.search.programs import load_program
from sgl_tts.search.records import Candidate, SearchResult
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class TickingScorer(ScriptedScorer):
    """Every scoring call takes one second on the fake clock."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def score_into(self, prompt, paths, counts):
        self.clock.now += 1.0
        return super().score_into(prompt, paths, counts)


class RecordingExtension:
    """A step extension (FastTTS S's place) that grows steps plainly and counts its iterations."""

    def __init__(self):
        self.iterations = 0

    def expand(self, parents, config, tracker, extract):
        self.iterations += 1
        return expand_plainly(parents, config, tracker, extract)


def search(program, config, model=None, extension=None):
    """(result, backend, scorer, context) of `program` on the scripted backend, a fake clock that the scorer
    advances one second per call."""
    clock = FakeClock()
    backend, scorer = ScriptedBackend(model or ScriptedModel()), TickingScorer(clock)
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT,
                        extension_factory=(lambda context: extension) if extension else None)
    context = runtimes.new_search(config, PROBLEM.id, clock=clock)
    return load_program(program)(PROBLEM, config, runtimes, context), backend, scorer, context


def beam_config(**budget):
    return SearchConfig(n=4, beam_width=2, max_steps=20, max_tokens=100_000,
                        budget=Budget(narrow_below=0.0, **budget))


def test_the_deadline_stops_a_beam_search_with_its_best_unfinished_path():
    result, backend, scorer, _ = search("beam_search", beam_config(deadline_s=3.5), ScriptedModel(answer_depth=100))
    assert result.finish_reason == "deadline" and result.error is None
    assert len(scorer.calls) == 4, "scored at t = 0, 1, 2, 3; at t = 4 the deadline has passed"
    assert len(backend.requests) == 4 * 4, "no request after the deadline"
    assert {c.finish_reason for c in result.candidates} == {"unfinished"}
    best = min(result.candidates, key=lambda c: rank_key(c, "last"))
    assert len(best.steps) == 4 and result.candidates[0] is best
    assert result.answer == answer_at_end(best.text, extract_answer)


def test_the_deadline_answers_with_the_best_finished_path():
    result, _, scorer, _ = search("beam_search", beam_config(deadline_s=2.5))
    assert result.finish_reason == "deadline" and len(scorer.calls) == 3
    finished = [c for c in result.candidates if c.finish_reason not in ("unfinished",)]
    assert finished and any(c.finish_reason == "unfinished" for c in result.candidates)
    best = min(finished, key=lambda c: rank_key(c, "last"))
    assert result.answer == best.answer is not None
    unbounded, _, _, _ = search("beam_search", beam_config())
    assert unbounded.finish_reason == "complete" and len(unbounded.candidates) > len(finished)


def test_the_token_budget_stops_a_beam_search():
    model = ScriptedModel(answer_depth=100)
    result, backend, _, context = search("beam_search", beam_config(max_tokens=30), model)
    assert result.finish_reason == "token_budget" and result.error is None
    assert result.generated_tokens == context.generated_tokens >= 30
    # every request but those of the iteration that spent the budget was sent while tokens were left
    answered = context.ledger.answered_requests()
    before_last = sum(r.completion_tokens for r in answered[:-4])
    assert before_last < 30 and len(backend.requests) <= len(answered)
    larger, larger_backend, _, _ = search("beam_search", beam_config(max_tokens=60), model)
    assert larger.finish_reason == "token_budget" and len(larger_backend.requests) > len(backend.requests)
    assert {c.finish_reason for c in result.candidates} == {"unfinished"}


@pytest.mark.parametrize("narrow_below", [0.5, 0.0])
def test_below_the_slack_threshold_the_search_narrows_and_not_above_it(narrow_below):
    config = SearchConfig(n=8, beam_width=2, max_steps=30, max_tokens=100_000,
                          budget=Budget(deadline_s=10.0, narrow_below=narrow_below))
    extension = RecordingExtension()
    result, backend, scorer, _ = search("beam_search", config, ScriptedModel(answer_depth=100), extension)
    assert result.finish_reason == "deadline"
    sizes = [len(call) for call in scorer.calls]
    if narrow_below:
        # slack 1 - t/10 < 0.5 from t = 6: one child per kept beam (4), half of them scored, no speculation
        assert sizes == [8] * 6 + [2] * 4
        assert len(backend.requests) == 8 * 6 + 4 * 4
        assert extension.iterations == 6 and result.extra["narrowed_iterations"] == 4
    else:
        assert sizes == [8] * 10 and len(backend.requests) == 8 * 10 and extension.iterations == 10


def test_narrowing_halves_children_and_the_verifier_batch():
    assert [Narrowing.children(k) for k in (0, 1, 2, 3, 8)] == [0, 1, 1, 1, 4]
    assert [Narrowing.verifier_batch(k) for k in (0, 1, 2, 3, 8)] == [0, 1, 1, 2, 4]
    budget = Budget(deadline_s=10.0, max_tokens=100)
    assert budget.slack(2.0, 50) == pytest.approx(0.5) and budget.slack(6.0, 10) == pytest.approx(0.4)
    assert budget.exhausted(9.9, 99) is None and budget.exhausted(10.0, 0) == "deadline"
    assert budget.exhausted(1.0, 100) == "token_budget" and Budget().slack(1e9, 10**9) == 1.0


class HeldBackend(ScriptedBackend):
    """The first request answers once `hold` requests are in flight; the others wait until they are aborted
    and are answered as the engine answers an aborted request (finish_reason abort, one word)."""

    def __init__(self, hold):
        super().__init__(ScriptedModel(answer_chance=1.0, answer_depth=0))
        self.hold, self.entered, self.aborted = hold, [], threading.Event()
        self.all_in = threading.Event()

    def _generate(self, s, sampling_params):
        with self._lock:
            self.entered.append(s)
            first = len(self.entered) == 1
            if len(self.entered) == self.hold:
                self.all_in.set()
        if first:
            assert self.all_in.wait(timeout=60)
            return super()._generate(s, sampling_params)
        assert self.aborted.wait(timeout=60), "the requests in flight were never aborted"
        meta = {"completion_tokens": 1, "prompt_tokens": len(s.text_), "cached_tokens": 0,
                "finish_reason": {"type": "abort"}}
        self.answered(s, s.text_, 0.0, meta, "w1")
        return "w1", meta


def test_the_stop_aborts_the_requests_in_flight_and_best_of_n_answers(monkeypatch):
    import sgl_tts.runtime.server as server

    backend = HeldBackend(hold=4)
    backend.runtime = engine = object()
    asked = []

    def abort_requests(runtime, rids):
        asked.append((runtime, sorted(rids)))
        backend.aborted.set()

    monkeypatch.setattr(server, "abort_requests", abort_requests)
    scorer = ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT)
    config = SearchConfig(program="best_of_n", n=4, max_tokens=100, budget=Budget(max_tokens=1))
    result = load_program("best_of_n")(PROBLEM, config, runtimes)
    assert result.finish_reason == "token_budget" and result.error is None
    assert asked and asked[0][0] is engine and len(asked[0][1]) >= 3, "the three held requests were aborted"
    assert scorer.calls == [], "no verifier call after the stop"
    (answered,) = [c for c in result.candidates]
    assert answered.finish_reason == "answer" and result.answer == answered.answer is not None


def test_budget_settings_are_checked_and_name_the_field():
    with pytest.raises(ConfigError, match="unknown key 'budget.deadline'") as error:
        load_dataclass(SearchConfig, {"budget": {"deadline": 5}})
    with pytest.raises(ConfigError, match="budget.deadline_s") as error:
        load_dataclass(SearchConfig, {"budget": {"deadline_s": -1}}, "run.yaml", "search.")
    assert error.value.key == "search.budget.deadline_s"
    with pytest.raises(ConfigError, match="budget.max_tokens") as error:
        load_dataclass(SearchConfig, {"budget": {"max_tokens": 0}})
    assert error.value.key == "budget.max_tokens"
    with pytest.raises(ConfigError, match="'stopping.rule' must be one of"):
        load_dataclass(SearchConfig, {"stopping": {"rule": "sometimes"}})
    assert load_dataclass(SearchConfig, {"budget": {"deadline_s": 5}}).budget == Budget(deadline_s=5.0)
    with pytest.raises(LimitError, match="budget.deadline_s") as limit:
        check_limits(SearchConfig(budget=Budget(deadline_s=100.0)), Limits(deadline_s=10.0))
    assert limit.value.field == "budget.deadline_s"
    check_limits(SearchConfig(budget=Budget(deadline_s=5.0)), Limits(deadline_s=10.0))


def test_the_run_command_sets_the_budget_and_names_a_bad_value():
    from sgl_tts.cli import build_parser
    from sgl_tts.cli.run import overridden_search

    args = build_parser().parse_args(["run", "--deadline", "2.5", "--token-budget", "500"])
    base = SearchConfig(budget=Budget(narrow_below=0.3))
    assert overridden_search(base, args).budget == Budget(deadline_s=2.5, max_tokens=500, narrow_below=0.3)
    assert overridden_search(base, build_parser().parse_args(["run"])) == base
    with pytest.raises(ValueError, match="budget.max_tokens"):
        overridden_search(base, build_parser().parse_args(["run", "--token-budget", "0"]))


def test_the_run_report_marks_a_search_stopped_early(capsys):
    from sgl_tts.app.run_report import print_run

    stopped = SearchResult(problem_id="p1", program="beam_search", answer="9", candidates=[], total_time_s=1.0,
                           finish_reason="deadline")
    complete = dataclasses.replace(stopped, problem_id="p2", finish_reason="complete")
    assert print_run([(SimpleNamespace(id="p1", gold="9"), stopped), (SimpleNamespace(id="p2", gold="9"), complete)],
                     None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "end"
    assert lines[2].endswith("deadline") and not lines[3].endswith("deadline")
    assert lines[-1] == "stopped early and answered: 1 of 2 (deadline 1)"


def test_a_served_finish_reason_says_the_search_stopped():
    from sgl_tts.serve.protocol import completion

    candidate = Candidate(steps=["a"], step_scores=[0.5], score=0.5, answer=None, tokens=1, completion_time_s=1.0,
                          finish_reason="unfinished")
    for ours, theirs in (("deadline", "deadline"), ("token_budget", "length"), ("settled", "stop"),
                         ("complete", "stop")):
        result = SearchResult(problem_id="p", program="beam_search", answer=None, candidates=[candidate],
                              finish_reason=ours)
        body = completion("id", result, SearchConfig())
        assert body["choices"][0]["finish_reason"] == theirs and body["sgl_tts"]["finish_reason"] == ours


@pytest.fixture(scope="module")
def served():
    from tests.test_serve import start_server

    service, http = start_server(max_searches=4)
    service.limits = Limits(deadline_s=60.0)
    yield service, http
    http.stop()
    service.close()


@pytest.mark.parametrize("budget,param,words", [
    ({"deadline_s": 0}, "budget.deadline_s", "budget.deadline_s must be a number of seconds > 0"),
    ({"deadline_s": 120}, "budget.deadline_s", "above the limit 60.0 (limits.deadline_s)"),
    ({"max_tokens": -3}, "budget.max_tokens", "budget.max_tokens must be at least 1"),
    ({"deadlin_s": 5}, "budget.deadlin_s", "unknown key 'budget.deadlin_s'"),
    ("soon", "budget", "'budget' must be"),
])
def test_a_served_budget_is_checked_naming_the_field(served, budget, param, words):
    import httpx

    _, http = served
    answer = httpx.post(http.url + "/v1/chat/completions",
                        json={"model": "beam_search", "budget": budget, "messages": [{"role": "user", "content": "q"}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_served_search_past_its_token_budget_answers_with_finish_reason_length(served):
    import openai

    service, http = served
    client = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="beam_search", messages=[{"role": "user", "content": "budget?"}],
                                           extra_body={"budget": {"max_tokens": 5}})
    assert reply.choices[0].finish_reason == "length"
    assert reply.model_extra["sgl_tts"]["finish_reason"] == "token_budget"
    assert reply.usage.completion_tokens >= 5 and reply.choices[0].message.content
    whole = client.chat.completions.create(model="beam_search", messages=[{"role": "user", "content": "budget?"}])
    assert whole.model_extra["sgl_tts"]["finish_reason"] == "complete"
    assert whole.usage.completion_tokens > reply.usage.completion_tokens
    assert service.snapshot()["failed"] == 0


def test_a_narrowed_dvts_keeps_each_subtree_on_its_own_children():
    """Narrowed, each DVTS subtree gets one child a step: every subtree still grows its own path, one step an
    iteration (the children are grouped by their parent, not by the count the program asked for)."""
    config = SearchConfig(n=8, beam_width=2, max_steps=30, max_tokens=100_000,
                          budget=Budget(deadline_s=10.0, narrow_below=0.5))
    result, backend, scorer, _ = search("dvts", config, ScriptedModel(answer_depth=100))
    assert result.finish_reason == "deadline" and result.error is None
    assert [len(call) for call in scorer.calls] == [8] * 6 + [2] * 4
    assert len(backend.requests) == 8 * 6 + 4 * 4
    assert len(result.candidates) == 4 and sorted(c.extra["subtree"] for c in result.candidates) == [0, 1, 2, 3]
    assert {len(c.steps) for c in result.candidates} == {10}
    firsts = {c.steps[0] for c in result.candidates}
    assert len(firsts) == 4, "each subtree keeps a first step of its own"
