"""Search programs on the scripted backend, checked against brute-force references."""

from collections import defaultdict

import pytest

from sgl_tts.problems import Problem
from sgl_tts.search.grading import extract_answer
from sgl_tts.search.programs import load_program
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import Runtimes, SearchConfig, split_steps
from sgl_tts.search.selection import select
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")


def make_runtimes(model=None):
    backend = ScriptedBackend(model or ScriptedModel())
    scorer = ScriptedScorer()
    return Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT), backend, scorer


def reference_beam_search(model, scorer, config):
    """Beam search by direct enumeration of the scripted tree (no SGLang)."""
    variants = defaultdict(int)

    def child(steps):
        text = PROMPT + "".join(steps)
        variant = variants[text]
        variants[text] += 1
        step, ending = model.step(text, variant)
        if ending != "eos":
            step += model.delimiter
        new = steps + [step]
        done = ending in ("answer", "eos") or len(new) >= config.max_steps
        return new, done

    beams, finished = [[]], []
    for iteration in range(config.max_steps):
        fan_out = config.n if iteration == 0 else config.beam_width
        children = [child(beam) for beam in beams for _ in range(fan_out)]
        finished += [steps for steps, done in children if done]
        active = [steps for steps, done in children if not done]
        active.sort(key=lambda s: (-scorer.step_score(PROMPT, s), "".join(s)))
        beams = active[: config.n // config.beam_width]
        if not beams:
            break
    return finished + beams


@pytest.mark.parametrize("n,width,max_steps", [(4, 2, 4), (8, 2, 5), (6, 3, 3), (4, 4, 6)])
def test_beam_search_matches_brute_force(n, width, max_steps):
    config = SearchConfig(n=n, beam_width=width, max_steps=max_steps, max_tokens=10_000, aggregation="last")
    runtimes, backend, scorer = make_runtimes()
    result = load_program("beam_search")(PROBLEM, config, runtimes)
    expected = reference_beam_search(backend.model, ScriptedScorer(), config)
    assert sorted(c.text for c in result.candidates) == sorted("".join(s) for s in expected)
    for candidate in result.candidates:
        assert len(candidate.step_scores) == len(candidate.steps), "one score per step"
        assert candidate.step_scores[-1] == pytest.approx(ScriptedScorer().step_score(PROMPT, candidate.steps))
    answers = [extract_answer(c.text) for c in result.candidates]
    scores = [aggregate(c.step_scores, "last") for c in result.candidates]
    assert result.answer == select("weighted", answers, scores)


def test_beam_search_keeps_top_children_each_iteration():
    config = SearchConfig(n=8, beam_width=2, max_steps=4, max_tokens=10_000)
    runtimes, backend, scorer = make_runtimes(ScriptedModel(answer_depth=10))  # nobody finishes early
    result = load_program("beam_search")(PROBLEM, config, runtimes)
    # Every scorer call after the first sees exactly the children of the n/M kept beams.
    assert [len(call) for call in scorer.calls] == [8, 8, 8, 8]
    for previous, current in zip(scorer.calls, scorer.calls[1:]):
        ranked = sorted(previous, key=lambda s: (-ScriptedScorer().step_score(PROMPT, s), "".join(s)))
        kept = {"".join(s) for s in ranked[:4]}
        assert {"".join(s[:-1]) for s in current} == kept
    # The last iteration's children all end at max_steps and are the candidates.
    assert len(result.candidates) == 8 and all(c.finish_reason == "max_steps" for c in result.candidates)
    assert result.answer is None, "no path gave an answer: the result says so instead of failing"


def test_beam_search_records_cached_prefix_tokens():
    config = SearchConfig(n=4, beam_width=2, max_steps=3, max_tokens=10_000)
    runtimes, backend, _ = make_runtimes()
    result = load_program("beam_search")(PROBLEM, config, runtimes)
    assert result.prompt_tokens > 0
    assert result.cached_tokens >= len(PROMPT) * 4, "each fork of the prompt reuses the committed prefix"


def reference_best_of_n(model, config):
    solutions = []
    for variant in range(config.n):
        text, pieces, current = PROMPT, [], variant
        while True:
            step, ending = model.step(text, current)
            if ending in ("answer", "eos"):
                pieces.append(step)
                break
            pieces.append(step + model.delimiter)
            text, current = text + pieces[-1], 0
        solutions.append("".join(pieces))
    return solutions


@pytest.mark.parametrize("selection", ["best", "weighted", "majority"])
def test_best_of_n_matches_reference(selection):
    config = SearchConfig(program="best_of_n", n=6, max_steps=50, max_tokens=10_000, selection=selection)
    runtimes, backend, _ = make_runtimes()
    result = load_program("best_of_n")(PROBLEM, config, runtimes)
    expected = reference_best_of_n(backend.model, config)
    assert sorted(c.text for c in result.candidates) == sorted(expected)
    for candidate in result.candidates:
        assert candidate.steps == split_steps(candidate.text, "\n\n", 50)
        assert len(candidate.step_scores) == len(candidate.steps)
    answers = [c.answer for c in result.candidates]
    assert result.answer == select(selection, answers, [c.score for c in result.candidates])


def test_best_of_n_stops_at_token_limit():
    config = SearchConfig(program="best_of_n", n=3, max_tokens=5)
    runtimes, _, _ = make_runtimes(ScriptedModel(answer_depth=100))
    result = load_program("best_of_n")(PROBLEM, config, runtimes)
    assert all(c.tokens <= 5 for c in result.candidates)
    assert {c.finish_reason for c in result.candidates} == {"max_tokens"}


def test_beam_search_respects_step_and_token_limits():
    config = SearchConfig(n=4, beam_width=2, max_steps=3, max_step_tokens=3, max_tokens=7)
    runtimes, backend, _ = make_runtimes(ScriptedModel(answer_depth=100))
    result = load_program("beam_search")(PROBLEM, config, runtimes)
    for candidate in result.candidates:
        assert len(candidate.steps) <= 3
        assert candidate.tokens <= 7
    assert all(r["text"].startswith(PROMPT) for r in backend.requests)


def test_beam_search_without_scorer_is_a_clear_error():
    runtimes, _, _ = make_runtimes()
    runtimes.scorer = None
    with pytest.raises(ValueError, match="scorer"):
        load_program("beam_search")(PROBLEM, SearchConfig(), runtimes)


def test_split_steps_keeps_delimiters_and_caps_count():
    assert split_steps("a\n\nb\n\nc", "\n\n", 10) == ["a\n\n", "b\n\n", "c"]
    assert split_steps("a\n\nb\n\nc", "\n\n", 2) == ["a\n\n", "b\n\nc"]
    assert split_steps("", "\n\n", 3) == [""]


def test_an_answer_split_by_the_step_token_limit_is_found_and_an_ended_path_answers_with_its_last_number():
    from sgl_tts.search.api import ReasoningPath, SearchConfig, append_step
    from sgl_tts.search.context import SearchContext
    from sgl_tts.search.grading import extract_answer

    class State:  # what append_step touches of a program state
        def __iadd__(self, text):
            return self

    config = SearchConfig(max_steps=6, max_step_tokens=8, max_tokens=100)
    context = SearchContext(config)
    cut = {"finish_reason": {"type": "length"}, "completion_tokens": 8}
    step = {"finish_reason": {"type": "stop", "matched": "\n\n"}, "completion_tokens": 4}
    eos = {"finish_reason": {"type": "stop", "matched": 2}, "completion_tokens": 4}

    path = ReasoningPath(state=State())
    append_step(path, "First we add. The answer", cut, config, context, extract_answer)
    assert path.active and path.answer is None
    append_step(path, " is 7.", step, config, context, extract_answer)
    assert (path.finish_reason, path.answer) == ("answer", "7"), "the cut phrase is read whole"

    ended = ReasoningPath(state=State())
    append_step(ended, "We add 4 and 3.", step, config, context, extract_answer)
    append_step(ended, "So, 4 + 3 = 7.", eos, config, context, extract_answer)
    assert (ended.finish_reason, ended.answer) == ("eos", "7"), "the model ended with its result unmarked"

    limited = ReasoningPath(state=State())
    config = SearchConfig(max_steps=1, max_step_tokens=8, max_tokens=100)
    append_step(limited, "So, 4 + 3 = 7", step, config, context, extract_answer)
    assert (limited.finish_reason, limited.answer) == ("max_steps", None), "a path cut by a limit has no answer"


def test_best_of_n_takes_the_last_number_of_a_solution_the_model_ended():
    from programs import best_of_n
    from sgl_tts.problems import Problem
    from sgl_tts.search.api import Runtimes, SearchConfig
    from sgl_tts.testing import ScriptedBackend, ScriptedModel

    class EndsWithItsResult(ScriptedModel):
        def step(self, text, variant):
            depth = text.count(self.delimiter)
            return ("We add 4 and 3.", "step") if depth < 2 else ("So, 4 + 3 = 7.", "eos")

    runtimes = Runtimes(generator=ScriptedBackend(EndsWithItsResult()), scorer=None, prompt=lambda q: f"Q: {q}\n\n")
    result = best_of_n.run(Problem("p", "4 + 3?", "7"), SearchConfig(program="best_of_n", n=3, max_tokens=50,
                                                                     selection="majority"), runtimes)
    assert [c.answer for c in result.candidates] == ["7"] * 3 and result.answer == "7"
    assert all(c.finish_reason == "eos" for c in result.candidates)
    cut = best_of_n.run(Problem("p", "4 + 3?", "7"), SearchConfig(program="best_of_n", n=2, max_tokens=6), runtimes)
    assert all(c.answer is None and c.finish_reason == "max_tokens" for c in cut.candidates), "cut: no answer"
