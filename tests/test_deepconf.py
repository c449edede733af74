"""DeepConf (programs/deepconf.py) on the scripted backend, against brute-force references of its confidences."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import pytest
import sglang as sgl

from sgl_tts.config import ConfigError
from sgl_tts.problems import Problem
from sgl_tts.search.api import ReasoningPath, Runtimes, SearchConfig, expand
from sgl_tts.search.context import SearchContext
from sgl_tts.search.grading import extract_answer
from sgl_tts.search.programs import load_program, program_settings
from sgl_tts.testing import ScriptedBackend, ScriptedModel

PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")
DELIMITER = "\n\n"
SURE, DOUBT = 8.0, 1.0  # token confidences of PlannedModel's words (top 5: 0, -4, ..., -16 and all -1)


def solve(model: ScriptedModel, n: int = 8, **settings) -> tuple:
    backend = ScriptedBackend(model)
    config = SearchConfig(program="deepconf", n=n, max_steps=8, max_tokens=10_000,
                          settings=program_settings("deepconf", settings))
    result = load_program("deepconf")(PROBLEM, config, Runtimes(generator=backend, scorer=None,
                                                                 prompt=lambda q: PROMPT))
    return result, backend


# --- brute-force references ------------------------------------------------------------------------------

def word_confidence(model: ScriptedModel, word: str, k: int) -> float:
    return -sum(logprob for logprob, _, _ in model.top_logprobs(word, k)) / k


def lowest_window_mean(values: list[float], window: int) -> float:
    if len(values) <= window:
        return sum(values) / len(values)
    return min(sum(values[i:i + window]) / window for i in range(len(values) - window + 1))


def whole_trace(model: ScriptedModel, variant: int) -> str:
    """The k-th whole sample of the prompt: its first step is variant k, every later step variant 0."""
    text, pieces = PROMPT, []
    while True:
        step, ending = model.step(text, variant)
        pieces.append(step)
        if ending != "step":
            return "".join(pieces)
        pieces[-1] += DELIMITER
        text, variant = text + pieces[-1], 0


# --- offline ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep_fraction,window", [(0.9, 8), (0.5, 4), (0.1, 16), (1.0, 8)])
def test_offline_keeps_the_top_fraction_by_lowest_group_confidence_and_votes_by_confidence(keep_fraction, window):
    model, n, k = ScriptedModel(), 12, 5
    result, backend = solve(model, n=n, mode="offline", keep_fraction=keep_fraction, window=window, top_k=k)
    report = result.extra["deepconf"]

    samples = [whole_trace(model, variant) for variant in range(n)]
    confidence = {text: lowest_window_mean([word_confidence(model, w, k) for w in text.split()], window)
                  for text in samples}
    ranked = sorted(samples, key=lambda text: -confidence[text])
    kept = ranked[:math.ceil(keep_fraction * n)]
    if len(kept) < n:
        assert confidence[kept[-1]] > confidence[ranked[len(kept)]], "no tie at the cut: the kept set is unique"
    votes = defaultdict(float)
    for text in kept:
        if extract_answer(text) is not None:
            votes[extract_answer(text)] += confidence[text]

    assert sorted(c.text for c in result.candidates) == sorted(samples) and len(backend.requests) == n
    text_of = {c.extra["trace"]: c.text for c in result.candidates}
    assert {text_of[index] for index in report["voters"]} == set(kept)
    for c in result.candidates:
        assert c.extra["confidence"] == pytest.approx(confidence[c.text])
        assert report["confidences"][c.extra["trace"]] == pytest.approx(confidence[c.text])
    assert result.answer == max(votes, key=votes.get)
    assert len(set(votes.values())) == len(votes), "no tie: the vote is decided by the weights"
    assert report["threshold"] is None and report["stopped"] == report["cut"] == []


def test_offline_weighting_can_overturn_the_majority():
    """Three unsure traces say 0, two sure ones say 1: the count says 0, the confidence-weighted vote 1."""
    plan = {trace: (1, "0" if trace < 3 else "1", 0 if trace < 3 else None) for trace in range(5)}
    result, _ = solve(PlannedModel(plan=plan), n=5, mode="offline", keep_fraction=1.0, window=2)
    assert sorted(c.answer for c in result.candidates) == ["0", "0", "0", "1", "1"]
    assert result.answer == "1"


# --- online ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlannedModel(ScriptedModel):
    """Trace t (the t-th sample of the prompt) writes "t<t> sure ..." steps, answers `answer` at step
    `answer_at` and writes a step of unsure words at step `doubt_at`: plan[t] = (answer_at, answer, doubt_at)."""

    plan: dict = dataclasses.field(default_factory=dict)

    def step(self, text: str, variant: int) -> tuple[str, str]:
        body = text[len(PROMPT):]
        trace = variant if not body else int(re.match(r"t(\d+)", body).group(1))
        answer_at, answer, doubt_at = self.plan[trace]
        index = body.count(DELIMITER)
        head = f"t{trace} sure" if index == 0 else "sure"
        if index == answer_at:
            return f"{head} The answer is \\boxed{{{answer}}}.", "answer"
        if index == doubt_at:
            return f"{head} " + " ".join(["doubt"] * 6), "step"
        return f"{head} sure", "step"

    def top_logprobs(self, word: str, k: int) -> list[tuple[float, int, None]]:
        if word == "doubt":
            return [(-DOUBT, j, None) for j in range(k)]
        return [(-4.0 * j, j, None) for j in range(k)]


def lineage_requests(backend: ScriptedBackend, steps: list[str]) -> int:
    """Requests that continued the trace after its first step (the first step's request is the prompt's)."""
    return sum(1 for request in backend.requests if request["text"].startswith(PROMPT + steps[0]))


def by_trace(result) -> dict[int, object]:
    return {int(re.match(r"t(\d+)", c.text).group(1)): c for c in result.candidates}


def test_online_stops_a_trace_whose_window_falls_below_the_warmup_threshold():
    # Warm-up (traces 0-3) splits 2-2, so the vote never settles; online trace 5 doubts at its second step.
    plan = {**{t: (3, str(t % 2), None) for t in range(4)}, **{t: (3, "1", 1 if t == 5 else None) for t in range(4, 8)}}
    result, backend = solve(PlannedModel(plan=plan), n=8, warmup=4, window=4, keep_fraction=0.9)
    report, traces = result.extra["deepconf"], by_trace(result)

    assert report["threshold"] == pytest.approx(SURE), "every warm-up trace is sure throughout"
    assert report["warmup_tokens"] == sum(traces[t].tokens for t in range(4))
    stopped = traces[5]
    assert stopped.finish_reason == "low_confidence" and len(stopped.steps) == 2
    assert stopped.extra["confidence"] == pytest.approx(DOUBT) and report["stopped"] == [stopped.extra["trace"]]
    assert lineage_requests(backend, stopped.steps) == 1, "no request after the step that fell below s"
    for t in (4, 6, 7):
        assert traces[t].finish_reason == "answer" and len(traces[t].steps) == 4
        assert lineage_requests(backend, traces[t].steps) == 3, "one request per step after the first"
    assert sorted(traces[t].extra["trace"] for t in (0, 1, 2, 3, 4, 6, 7)) == report["voters"]
    assert len(backend.requests) == 4 + 4 + 4 + 3 + 3 and result.answer == "1"


def test_check_tokens_stops_a_doubting_trace_within_that_many_tokens_of_its_dip():
    # As above, but trace 5's doubting step (7 words: "sure" and six "doubt") is written 5 tokens at a time.
    plan = {**{t: (3, str(t % 2), None) for t in range(4)}, **{t: (3, "1", 1 if t == 5 else None) for t in range(4, 8)}}
    by_step, _ = solve(PlannedModel(plan=plan), n=8, warmup=4, window=2, keep_fraction=0.9)
    by_piece, backend = solve(PlannedModel(plan=plan), n=8, warmup=4, window=2, keep_fraction=0.9, check_tokens=5)
    stepped, pieced = by_trace(by_step), by_trace(by_piece)
    assert stepped[5].finish_reason == pieced[5].finish_reason == "low_confidence"
    first_step = stepped[5].tokens - 7
    assert stepped[5].tokens == first_step + 7, "checked at the step's end: the whole doubting step is written"
    assert pieced[5].tokens == first_step + 5, "checked after 5 tokens: the window of 2 fell below s at token 2"
    assert pieced[5].steps[-1] == "sure doubt doubt doubt doubt"
    for t in (4, 6, 7):  # steps of at most 5 tokens are single pieces: the same traces and answers
        assert pieced[t].text == stepped[t].text and pieced[t].finish_reason == "answer"
    assert by_piece.answer == by_step.answer == "1" and by_piece.generated_tokens == by_step.generated_tokens - 2


def test_a_warmup_trace_below_the_threshold_does_not_vote():
    # Warm-up trace 0 doubts: the only one below s, the 10% quantile of the warm-up's confidences.
    plan = {0: (2, "0", 1), 1: (2, "0", None), **{t: (2, "1", None) for t in range(2, 4)}}
    result, _ = solve(PlannedModel(plan=plan), n=4, warmup=4, window=4, keep_fraction=0.9)
    report, traces = result.extra["deepconf"], by_trace(result)
    assert report["voters"] == sorted(traces[t].extra["trace"] for t in (1, 2, 3)) and result.answer == "1"


def test_a_settled_warmup_vote_samples_no_further_trace():
    plan = {t: (1, "4", None) for t in range(8)}  # every trace answers the same
    result, backend = solve(PlannedModel(plan=plan), n=8, warmup=4)
    offline, offline_backend = solve(PlannedModel(plan=plan), n=8, mode="offline")
    assert len(offline_backend.requests) == 8, "n whole traces are n requests"
    assert len(backend.requests) == 4 < 8 and result.generated_tokens < offline.generated_tokens
    assert result.extra["deepconf"]["unsampled"] == 4 and len(result.candidates) == 4
    assert result.answer == offline.answer == "4"


def test_a_vote_settled_while_traces_grow_finishes_them_without_further_requests():
    # Warm-up splits 2-2; online trace 4 answers 1 at once, which makes 1 hold 3/5 >= 0.55 of the vote.
    plan = {**{t: (2, str(t % 2), None) for t in range(4)}, 4: (0, "1", None),
            **{t: (5, "1", None) for t in range(5, 8)}}
    result, backend = solve(PlannedModel(plan=plan), n=8, warmup=4, consensus=0.55, window=4)
    report, traces = result.extra["deepconf"], by_trace(result)
    assert report["cut"] == sorted(traces[t].extra["trace"] for t in (5, 6, 7))
    for t in (5, 6, 7):
        assert traces[t].finish_reason == "vote_settled" and len(traces[t].steps) == 1
        assert lineage_requests(backend, traces[t].steps) == 0
        assert traces[t].extra["trace"] not in report["voters"]
    assert len(backend.requests) == 8 and result.answer == "1"


# --- the search API's logprobs ---------------------------------------------------------------------------

@sgl.function
def three_steps(s, config: SearchConfig, tracker: SearchContext, logprobs: int):
    s += PROMPT
    path = ReasoningPath(state=s)
    for _ in range(3):
        (path,) = expand([(path, 1)], config, tracker, extract_answer, logprobs=logprobs)
    return path


@pytest.mark.parametrize("logprobs", [0, 3])
def test_expand_with_logprobs_carries_every_tokens_confidence_across_steps(logprobs):
    model = ScriptedModel(answer_depth=10_000)
    config = SearchConfig(n=1, max_steps=8, max_tokens=10_000)
    tracker = SearchContext(config)
    with tracker.running():
        path = three_steps.run(config=config, tracker=tracker, logprobs=logprobs,
                               backend=ScriptedBackend(model)).ret_value
    words = path.text.split()
    assert len(path.steps) == 3 and len(words) == path.tokens
    if logprobs:
        assert path.extra["token_confidences"] == pytest.approx([word_confidence(model, w, logprobs) for w in words])
    else:
        assert "token_confidences" not in path.extra, "a search that asks for no logprobs records none"


def test_settings_are_validated_strictly():
    assert program_settings("deepconf", {"keep_fraction": 1.0, "mode": "offline"}).keep_fraction == 1.0
    known = "check_tokens, consensus, keep_fraction, mode, top_k, warmup, window"
    with pytest.raises(ConfigError, match=rf"yaml: unknown key 'search\.settings\.keep'; known keys here: {known}"):
        program_settings("deepconf", {"keep": 0.5}, "run.yaml")
    for value in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=rf"keep_fraction must be in \(0, 1\], got {value}"):
            program_settings("deepconf", {"keep_fraction": value}, "run.yaml")
    for key, value, message in [("consensus", 0.0, "consensus must be in"), ("window", 0, "window must be at least 1"),
                                ("top_k", 0, "top_k must be at least 1"), ("warmup", 0, "warmup must be at least 1"),
                                ("mode", "greedy", "mode must be one of online, offline")]:
        with pytest.raises(ConfigError, match=message):
            program_settings("deepconf", {key: value}, "run.yaml")
    with pytest.raises(ValueError, match="search.settings must be the deepconf program's Settings, got dict"):
        load_program("deepconf")(PROBLEM, SearchConfig(program="deepconf", settings={"window": 4}),
                                 Runtimes(generator=ScriptedBackend(), scorer=None, prompt=lambda q: PROMPT))
