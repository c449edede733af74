"""Stopping beneath every step program (sgl_tts/search/stopping.py): the trace-confidence, settled-answer and
ranked-end rules as classes, applied by a setting to programs with no code of their own for it (beam_search, dvts,
best_of_n), and programs/deepconf.py deciding with the same classes. Scripted backend."""

import collections
import dataclasses

import pytest

from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.confidence import OnlineThreshold, lowest_group_confidence, vote_settled
from sgl_tts.search.programs import load_program
from sgl_tts.search.selection import select
from sgl_tts.search.stopping import RankedEndRule, SettledAnswerRule, Stopping, TraceConfidenceRule
from sgl_tts.frontend.sglang_internals import running_program_states, search_of
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer, wait_until

PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="0")


def run(program, config, model=None):
    backend, scorer = ScriptedBackend(model or ScriptedModel()), ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT)
    context = runtimes.new_search(config, PROBLEM.id)
    return load_program(program)(PROBLEM, config, runtimes, context), backend, scorer, context


def test_the_confidence_rule_stops_nothing_before_its_warmup_then_below_the_threshold():
    rule = TraceConfidenceRule(window=2, keep_fraction=0.5, warmup=3)
    assert rule.confidence([3.0, 1.0, 2.0, 4.0]) == pytest.approx(1.5)
    rule.warm_up(1.0)
    rule.warm_up(3.0)
    assert rule.threshold is None and not rule.should_stop(-100.0), "no threshold before the warm-up ends"
    rule.warm_up(2.0)
    assert rule.threshold == OnlineThreshold.from_warmup([1.0, 3.0, 2.0], 0.5)
    rule.warm_up(-50.0)  # past the warm-up: ignored
    assert rule.threshold.threshold == pytest.approx(2.0)
    assert rule.should_stop(1.99) and not rule.should_stop(2.0)


def test_the_settled_rule_waits_for_its_answers_then_asks_for_the_consensus():
    rule = SettledAnswerRule(consensus=0.6, min_answers=2)
    assert not rule.settled(["7"], [1.0], remaining=3), "one answer is not enough"
    assert rule.settled(["7", "7"], [1.0, 1.0], remaining=3)
    assert not rule.settled(["7", "8"], [1.0, 1.0], remaining=3)
    assert rule.settled(["7", "8", "7"], [1.0] * 3, remaining=3)
    assert rule.settled([], [], remaining=0), "nothing left to wait for"
    single = SettledAnswerRule(consensus=0.6)
    for answers, weights, remaining in [(["a", "b"], [0.7, 0.3], 2), (["a", None], [0.0, 1.0], 1), ([], [], 1)]:
        assert single.settled(answers, weights, remaining) == vote_settled(answers, weights, remaining, 0.6)


def test_the_settled_rules_agree_waits_for_that_many_equal_answers_whatever_their_share():
    """`agree`: the leading answer (by weight) must have been given `agree` times before the vote settles; checked
    against that definition on every sequence of up to six answers of three values (and none), one vote each, and
    for a leader by weight that few answers gave."""
    import itertools

    rule = SettledAnswerRule(consensus=0.1, min_answers=1, agree=3)
    for length in range(7):
        for answers in itertools.product(["a", "b", "c", None], repeat=length):
            counts = collections.Counter(answer for answer in answers if answer is not None)
            leader = min(counts, key=lambda answer: (-counts[answer], answer)) if counts else None
            assert rule.settled(list(answers), [1.0] * length, remaining=1) == (counts[leader] >= 3 if counts
                                                                               else False), answers
            assert rule.settled(list(answers), [1.0] * length, remaining=0), "nothing left to wait for"
    weighted = SettledAnswerRule(consensus=0.1, agree=2)
    assert not weighted.settled(["a", "b", "b"], [5.0, 1.0, 1.0], remaining=1), "the leader by weight gave one"
    assert weighted.settled(["a", "b", "b", "a"], [5.0, 1.0, 1.0, 1.0], remaining=1)
    with pytest.raises(ValueError, match="stopping.agree"):
        Stopping(agree=0)


def test_stopping_settings_name_the_field():
    with pytest.raises(ValueError, match="stopping.consensus"):
        Stopping(consensus=1.5)
    with pytest.raises(ValueError, match="stopping.warmup"):
        Stopping(warmup=0)
    assert Stopping().logprobs == 0 and Stopping(rule="both", top_k=3).logprobs == 3


AGREEING = ScriptedModel(answers=1)  # every answer is 0


@pytest.mark.parametrize("program", ["beam_search", "dvts", "best_of_n"])
def test_a_program_with_no_code_for_it_stops_once_its_answer_settles(program):
    base = SearchConfig(program=program, n=8, beam_width=2, max_steps=8, max_tokens=10_000)
    plain, plain_backend, plain_scorer, _ = run(program, base, AGREEING)
    settled, backend, scorer, _ = run(program, dataclasses.replace(
        base, stopping=Stopping(rule="settled", consensus=0.6, min_answers=2)), AGREEING)
    assert plain.finish_reason == "complete" and settled.finish_reason == "settled"
    assert settled.answer == "0" and settled.error is None
    assert sum(c.answer is not None for c in settled.candidates) >= 2
    if program == "best_of_n":  # one whole sample each: sent at once, the verifier is what is saved
        assert plain_scorer.calls and not scorer.calls
    else:
        assert len(backend.requests) < len(plain_backend.requests)


def test_the_ranked_rule_stops_once_the_best_ranked_paths_have_all_ended_as_brute_force_says():
    import itertools
    import random

    rng = random.Random(7)
    for _ in range(300):
        keys = [(rng.choice([-0.9, -0.5, -0.2]), rng.choice("abcd")) for _ in range(rng.randint(0, 7))]
        ended_flags = [rng.random() < 0.5 for _ in keys]
        ended = [k for k, e in zip(keys, ended_flags) if e]
        live = [k for k, e in zip(keys, ended_flags) if not e]
        for top in (1, 2, 3):
            # brute force: some live path is left, and no live path ranks among the best `top` of all
            # (an ended path ranks ahead of a live one with the same key)
            best = sorted(itertools.chain(((k, 0) for k in ended), ((k, 1) for k in live)))[:top]
            expected = bool(ended) and bool(live) and all(flag == 0 for _, flag in best)
            assert RankedEndRule(top).ended(ended, live) == expected
    assert not RankedEndRule(1).ended([(-0.9, "a")], []), "with no live path the search ends by itself"
    assert RankedEndRule(2).ended([(-0.9, "a"), (-0.8, "b")], [(-0.7, "c")])
    assert not RankedEndRule(2).ended([(-0.9, "a")], [(-0.8, "b"), (-0.1, "c")])


@pytest.mark.parametrize("program", ["beam_search", "dvts"])
@pytest.mark.parametrize("top", [1, 2])
def test_a_program_with_no_code_for_it_stops_when_its_best_ranked_paths_have_ended(program, top, monkeypatch):
    base = SearchConfig(program=program, n=8, beam_width=2, max_steps=8, max_tokens=10_000)
    plain, plain_backend, _, _ = run(program, base)
    decisions = []
    decide = RankedEndRule.ended

    def recorded(rule, ended, live):
        decision = decide(rule, ended, live)
        decisions.append((sorted(ended), sorted(live), decision))
        return decision

    monkeypatch.setattr(RankedEndRule, "ended", recorded)
    ranked, backend, _, context = run(program, dataclasses.replace(base, stopping=Stopping(rule="ranked", top=top)))
    assert plain.finish_reason == "complete" and ranked.finish_reason == "ranked"
    assert [decision for _, _, decision in decisions] == [False] * (len(decisions) - 1) + [True], \
        "asked after every scoring round until it held"
    ended_keys, live_keys, _ = decisions[-1]
    assert all(key < min(live_keys) for key in sorted(ended_keys)[:top])
    assert len(backend.requests) < len(plain_backend.requests), "the steps after the stop are not sent"
    sent = collections.Counter((r["text"], r["variant"]) for r in backend.requests)
    assert not sent - collections.Counter((r["text"], r["variant"]) for r in plain_backend.requests), \
        "the same search up to the stop"
    ended = [c for c in ranked.candidates if c.finish_reason != "unfinished"]
    assert ranked.answer == select(base.selection, [c.answer for c in ended], [c.score for c in ended])
    assert context.in_flight() == []


def test_the_settled_rule_does_not_stop_a_search_whose_answers_never_reach_its_count():
    base = SearchConfig(n=4, beam_width=2, max_steps=6, max_tokens=10_000)
    plain, _, _, _ = run("beam_search", base)
    unsettled, _, _, _ = run("beam_search", dataclasses.replace(base, stopping=Stopping(rule="settled",
                                                                                          min_answers=100)))
    assert unsettled.finish_reason == "complete"
    assert [c.text for c in unsettled.candidates] == [c.text for c in plain.candidates]


def test_the_confidence_rule_stops_the_unsure_paths_of_a_beam_search():
    stopping = Stopping(rule="confidence", top_k=3, window=4, keep_fraction=0.5, warmup=2)
    config = SearchConfig(n=8, beam_width=2, max_steps=8, max_tokens=10_000, stopping=stopping)
    result, _, _, context = run("beam_search", config)
    threshold = context.confidence_rule.threshold.threshold
    confidence = {id(c): lowest_group_confidence(c.extra["token_confidences"], 4) for c in result.candidates}
    stopped = [c for c in result.candidates if c.finish_reason == "low_confidence"]
    assert stopped, "some path fell below the threshold"
    assert all(confidence[id(c)] < threshold for c in stopped)
    assert all(len(c.steps) < config.max_steps for c in stopped), "stopped before their end"
    warmup = context.confidence_rule.warmup_confidences
    assert threshold == OnlineThreshold.from_warmup(warmup, 0.5).threshold and len(warmup) == 2
    plain, _, _, _ = run("beam_search", dataclasses.replace(config, stopping=Stopping()))
    assert not any(c.finish_reason == "low_confidence" for c in plain.candidates)
    assert all("token_confidences" not in c.extra for c in plain.candidates), "no logprobs without the rule"


def test_deepconf_decides_with_the_same_rule_objects(monkeypatch):
    from programs import deepconf

    settings = deepconf.Settings(window=8, keep_fraction=0.5, warmup=4, consensus=1.0, check_tokens=None)
    config = SearchConfig(program="deepconf", n=12, max_steps=8, max_step_tokens=16, max_tokens=200,
                          settings=settings)
    result, _, _, _ = run("deepconf", config)
    report = result.extra["deepconf"]
    confidences = report["confidences"]
    replay = TraceConfidenceRule(settings.window, settings.keep_fraction, settings.warmup)
    for confidence in confidences[:settings.warmup]:
        replay.warm_up(confidence)
    assert report["threshold"] == replay.threshold.threshold
    online = range(settings.warmup, len(confidences))
    assert report["stopped"] == [i for i in online if replay.should_stop(confidences[i])]
    assert report["stopped"], "the replay decides something"
    # the program's decisions are the class's: a rule that never stops stops no trace there either
    monkeypatch.setattr(TraceConfidenceRule, "should_stop", lambda self, confidence: False)
    unstopped, _, _, _ = run("deepconf", config)
    assert unstopped.extra["deepconf"]["stopped"] == []


class PacedBackend(ScriptedBackend):
    """The scripted model, answering each request only once the search has heard every earlier answer (as an
    ended path) or has stopped: as on a runtime, where a sample takes far longer than the client's handling of
    one. Without it the scripted answers, which take no time, could all be out before the first is read."""

    def __init__(self, model):
        super().__init__(model)
        self.answers = 0

    def _generate(self, s, sampling_params):
        context = search_of(s)
        with context._changed:
            while not (len(context.finished_paths) >= self.answers or context.stopped):
                context._changed.wait(0.01)  # path_finished does not notify: the state is read again
            self.answers += 1
        return super()._generate(s, sampling_params)


def ended_with_the_search(backend):
    """The program states of the samples refused or aborted by a stopped search were ended with it: their worker
    threads exit by themselves (a thread may still be on its way out when the search answers: waited for, as a
    state; a state left waiting for work would keep its thread and fail here)."""
    wait_until(lambda: not running_program_states([backend]), timeout=30.0)


def test_a_staged_best_of_n_sends_only_the_samples_it_takes_to_settle():
    base = SearchConfig(program="best_of_n", n=16, max_tokens=10_000)
    plain, plain_backend, _, _ = run("best_of_n", base, AGREEING)
    staged = Stopping(rule="settled", consensus=0.6, min_answers=3, stage=4)
    config = dataclasses.replace(base, stopping=staged)
    backend, scorer = PacedBackend(AGREEING), ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT)
    context = runtimes.new_search(config, PROBLEM.id)
    settled = load_program("best_of_n")(PROBLEM, config, runtimes, context)
    assert len(plain_backend.requests) == 16 and plain.finish_reason == "complete"
    assert settled.finish_reason == "settled" and settled.answer == "0"
    # three agreeing answers settle it; at most a stage's worth were on their way besides
    assert 3 <= len(backend.requests) <= 3 + staged.stage < 16
    assert settled.generated_tokens < plain.generated_tokens and not scorer.calls
    assert context.in_flight() == []
    ended_with_the_search(backend)


def test_a_staged_best_of_n_with_agree_stops_at_the_first_answer_given_that_often():
    config = SearchConfig(program="best_of_n", n=16, max_tokens=10_000,
                          stopping=Stopping(rule="settled", consensus=0.1, min_answers=1, agree=3, stage=4))
    backend, scorer = PacedBackend(ScriptedModel(answers=4)), ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT)
    context = runtimes.new_search(config, PROBLEM.id)
    settled = load_program("best_of_n")(PROBLEM, config, runtimes, context)
    assert settled.finish_reason == "settled"
    vote = context.settled_vote
    counts = collections.Counter(vote)
    assert max(counts.values()) == 3 and settled.answer == counts.most_common(1)[0][0]
    assert all(max(collections.Counter(vote[:k]).values()) < 3 for k in range(1, len(vote))), "settled at once"
    assert len(backend.requests) < 16, "the samples past the settled vote and the stage were not sent"


@pytest.mark.parametrize("program", ["beam_search", "best_of_n"])
def test_rules_for_named_programs_stop_those_programs_and_no_other(program):
    base = SearchConfig(program=program, n=8, beam_width=2, max_steps=8, max_tokens=10_000)
    rule = Stopping(rule="settled", consensus=0.6, min_answers=2)
    plain, plain_backend, _, _ = run(program, base, AGREEING)
    named, _, _, _ = run(program, dataclasses.replace(base, stopping=dataclasses.replace(rule, programs=(program,))),
                         AGREEING)
    other_rule = dataclasses.replace(rule, programs=("dvts", "self_consistency"))
    other, other_backend, _, context = run(program, dataclasses.replace(base, stopping=other_rule), AGREEING)
    assert named.finish_reason == "settled" and named.answer == "0"
    assert other.finish_reason == "complete" and context.stopping == Stopping()
    assert other.answer == plain.answer and len(other_backend.requests) == len(plain_backend.requests)
    # a program run without a search of its own starts one for the rules that stop it, and none for the others
    runtimes = Runtimes(generator=ScriptedBackend(AGREEING), scorer=ScriptedScorer(), prompt=lambda q: PROMPT)
    unbound = load_program(program)(PROBLEM, dataclasses.replace(base, stopping=dataclasses.replace(
        rule, programs=(program,))), runtimes)
    assert unbound.finish_reason == "settled"
    unbound_other = load_program(program)(PROBLEM, dataclasses.replace(base, stopping=other_rule), runtimes)
    assert unbound_other.finish_reason == "complete" and unbound_other.answer == plain.answer
    assert Stopping(programs=("best_of_n",)).beneath("best_of_n").programs == ("best_of_n",)
    with pytest.raises(ValueError, match="stopping.programs"):
        Stopping(programs=("best_of_n", " "))


@pytest.mark.parametrize("agree", [1, 2])
def test_best_of_n_sent_at_once_stops_when_samples_agree_and_aborts_the_rest(agree):
    """No stage: the samples go out together, the rule hears them as they end, and once `agree` gave one answer the
    search answers with it, whatever the others would say; the samples still on their way are aborted (the paced
    backend answers one at a time). `agree: 1` is short-1@n: the first sample to end with an answer is the answer."""
    config = SearchConfig(program="best_of_n", n=16, max_tokens=10_000,
                          stopping=Stopping(rule="settled", consensus=0.1, min_answers=1, agree=agree))
    backend, scorer = PacedBackend(ScriptedModel(answers=3)), ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: PROMPT)
    context = runtimes.new_search(config, PROBLEM.id)
    settled = load_program("best_of_n")(PROBLEM, config, runtimes, context)
    vote = context.settled_vote
    assert settled.finish_reason == "settled" and len(vote) <= 3 * (agree - 1) + 1, \
        "three answers, `agree` of them alike, at most"
    assert collections.Counter(vote).most_common(1)[0][1] == agree and settled.answer == vote[-1]
    assert all(max(collections.Counter(vote[:k]).values()) < agree for k in range(1, len(vote))), "settled at once"
    assert {c.answer for c in settled.candidates} - {settled.answer, None}, "the samples after it would have disagreed"
    assert not scorer.calls and context.in_flight() == []
    ended_with_the_search(backend)


def test_a_stage_without_a_rule_changes_no_answer():
    base = SearchConfig(n=6, beam_width=2, max_steps=6, max_tokens=10_000)
    plain, plain_backend, _, _ = run("beam_search", base)
    staged, backend, _, _ = run("beam_search", dataclasses.replace(base, stopping=Stopping(stage=2)))
    assert staged.finish_reason == "complete" and staged.answer == plain.answer
    assert sorted(c.text for c in staged.candidates) == sorted(c.text for c in plain.candidates)
    assert len(backend.requests) == len(plain_backend.requests)


def test_the_stage_sends_at_most_k_at_once_in_the_order_they_came_and_a_stop_refuses_the_rest():
    import threading

    from sgl_tts.search.context import SearchContext, SearchStopped

    context = SearchContext(SearchConfig(stopping=Stopping(stage=2)))
    admitted, refused, lock = [], [], threading.Lock()

    def send(rid):
        try:
            context.request_sent(rid)
        except SearchStopped:
            with lock:
                refused.append(rid)
            return
        with lock:
            admitted.append(rid)

    def wait_until(condition):
        with context._changed:
            assert context._changed.wait_for(condition, timeout=60)

    threads = []
    for i in range(6):  # each thread reaches the stage before the next starts: their order is known
        threads.append(threading.Thread(target=send, args=(f"r{i}",)))
        threads[-1].start()
        wait_until(lambda: context._tickets_issued == i + 1)
    wait_until(lambda: len(context.in_flight()) == 2)
    assert sorted(context.in_flight()) == ["r0", "r1"], "two at once, the first two"
    context.request_done("r1")
    wait_until(lambda: "r2" in context._in_flight)
    context.request_done("r0")
    wait_until(lambda: "r3" in context._in_flight)
    assert context.in_flight() == ["r2", "r3"]
    context.stop("settled")
    for thread in threads:
        thread.join(timeout=60)
    assert admitted == ["r0", "r1", "r2", "r3"] and sorted(refused) == ["r4", "r5"]


def test_a_stage_below_zero_names_the_field():
    with pytest.raises(ValueError, match="stopping.stage"):
        Stopping(stage=-1)


CUE = Stopping().answer_cue


def probes_of(backend):
    return [r for r in backend.requests if r["text"].endswith(CUE)]


@pytest.mark.parametrize("program", ["beam_search", "dvts"])
def test_reading_the_live_paths_settles_a_search_after_its_first_step(program):
    # the scripted model answers from the third step on, and every probe of a path answers 0 (`answers=1`)
    base = SearchConfig(program=program, n=8, beam_width=2, max_steps=8, max_tokens=10_000)
    rule = Stopping(rule="settled", consensus=0.6, min_answers=3)
    ended, ended_backend, _, _ = run(program, dataclasses.replace(base, stopping=rule), AGREEING)
    live, backend, _, context = run(program, dataclasses.replace(
        base, stopping=dataclasses.replace(rule, reads="live")), AGREEING)
    assert ended.finish_reason == live.finish_reason == "settled" and live.answer == "0"
    assert not probes_of(ended_backend) and len(ended_backend.requests) > 8, "ended answers come from step 2 on"
    assert context.iterations == 1 and len(backend.requests) == 8 + 8, "the first step's eight probes settled it"
    assert all(c.answer is None for c in live.candidates), "no path had ended: the vote was the live answers'"
    assert len(probes_of(backend)) == 8 and all(r["text"].endswith("\n\n" + CUE) for r in probes_of(backend))
    assert live.generated_tokens < ended.generated_tokens, "the probes' tokens are counted, and fewer in all"


def test_probes_change_no_path_and_a_vote_that_never_settles_answers_as_before():
    base = SearchConfig(n=6, beam_width=2, max_steps=5, max_tokens=10_000)
    plain, plain_backend, _, _ = run("beam_search", base)
    probed, backend, _, context = run("beam_search", dataclasses.replace(
        base, stopping=Stopping(rule="settled", reads="live", min_answers=1000)))
    assert probed.finish_reason == "complete" and probed.answer == plain.answer
    assert [c.text for c in probed.candidates] == [c.text for c in plain.candidates]
    probes = probes_of(backend)
    assert len(backend.requests) == len(plain_backend.requests) + len(probes) and probes
    assert probed.generated_tokens == plain.generated_tokens + len(probes), "one token per scripted probe"


def test_reading_the_live_paths_sets_the_confidence_threshold_from_every_path_of_the_first_step():
    stopping = Stopping(rule="confidence", reads="live", top_k=3, window=4, keep_fraction=0.5, warmup=2)
    config = SearchConfig(n=8, beam_width=2, max_steps=8, max_tokens=10_000, stopping=stopping)
    result, backend, _, context = run("beam_search", config)
    warmup = context.confidence_rule.warmup_confidences
    first_step = [c for c in result.candidates if len(c.steps) == 1]
    assert len(warmup) == 8, "all eight first steps, not the first two paths to end"
    assert context.confidence_rule.threshold == OnlineThreshold.from_warmup(warmup, 0.5)
    cut = [c for c in result.candidates if c.finish_reason == "low_confidence"]
    assert cut and any(len(c.steps) == 1 for c in cut), "paths cut at their first step"
    assert all(lowest_group_confidence(c.extra["token_confidences"], 4) < context.confidence_rule.threshold.threshold
               for c in cut)
    assert not probes_of(backend), "the confidence rule alone sends no probe"
    assert {round(lowest_group_confidence(c.extra["token_confidences"], 4), 9) for c in first_step} <= {
        round(w, 9) for w in warmup}


def test_reading_settings_name_the_field():
    with pytest.raises(ValueError, match="stopping.reads"):
        Stopping(reads="sometimes")
    with pytest.raises(ValueError, match="stopping.probe_tokens"):
        Stopping(probe_tokens=0)
    with pytest.raises(ValueError, match="stopping.answer_cue"):
        Stopping(answer_cue="  ")
    assert Stopping(rule="both", reads="live").probes and not Stopping(rule="confidence", reads="live").probes


@pytest.mark.parametrize("text, closed, answer", [
    ("12}$.", False, "12"), ("\\frac{1}{2}}.", False, "\\frac{1}{2}"), (" 7 ", True, "7"),
    ("\\frac{1}{2", True, None), ("3 + 4", False, None), ("}", True, None), ("", True, None)])
def test_a_probe_answer_is_what_stands_before_the_brace_that_closes_the_cue(text, closed, answer):
    from sgl_tts.search.api import braced_answer

    assert braced_answer(text, closed) == answer


def test_a_steady_rule_casts_a_live_answer_only_once_a_path_gave_it_twice():
    base = SearchConfig(n=8, beam_width=2, max_steps=8, max_tokens=10_000)
    rule = Stopping(rule="settled", reads="live", consensus=0.6, min_answers=3, steady=2)
    late = ScriptedModel(answers=1, answer_depth=6)  # no path ends before its fifth step
    steady, backend, _, context = run("beam_search", dataclasses.replace(base, stopping=rule), late)
    assert steady.finish_reason == "settled" and steady.answer == "0"
    assert context.iterations == 2 and len(probes_of(backend)) == 16, "one probe per path at each of two steps"
    second = [c for c in steady.candidates if len(c.steps) == 2]
    assert second and all(c.extra["probe_answers"] == ["0", "0"] for c in second), "the parent's probe, then its own"


@pytest.mark.parametrize("history, answer, steady, cast", [
    ([], "3", 1, "3"), ([], "3", 2, None), (["3"], "3", 2, "3"), (["4"], "3", 2, None), ([None], "3", 2, None),
    (["4", "3"], "4", 2, None), (["3", "4"], "4", 2, "4"), (["4", "4"], "4", 3, "4"), (["\\boxed{4}"], "4", 2, "4"),
    (["4"], None, 1, None)])
def test_a_path_casts_its_answer_when_its_last_probes_agree(history, answer, steady, cast):
    from sgl_tts.search.api import ReasoningPath, steady_answers

    parent = ReasoningPath(state=None, extra={"probe_answers": history} if history else {})
    child = ReasoningPath(state=None, parent=0)
    assert steady_answers([child], [answer], [parent], steady) == [cast]
    assert child.extra["probe_answers"] == [*history, answer]


@pytest.mark.parametrize("program", ["best_of_n", "self_consistency"])
def test_prune_cuts_exactly_the_samples_whose_first_step_scores_below_it(program):
    """Brute force: the same search without the cut, its samples split by their first step's score. A kept sample
    is the one the search without the cut wrote (its rest sent as a second request from its first step); a cut one
    is its first step alone, unanswered, one request."""
    base = SearchConfig(program=program, n=12, max_tokens=10_000)
    tau = 0.5
    plain, plain_backend, _, _ = run(program, base)
    pruned, backend, scorer, context = run(program, dataclasses.replace(base, stopping=Stopping(prune=tau)))
    judge = ScriptedScorer()  # the same scores, by hand
    first = {c.text: c.steps[0] for c in plain.candidates}
    kept = sorted(text for text, step in first.items() if judge.step_score(PROMPT, [step]) >= tau)
    cut = sorted(step for text, step in first.items() if judge.step_score(PROMPT, [step]) < tau)
    assert kept and cut, "the test needs samples on both sides of the cut"
    assert sorted(c.text for c in pruned.candidates) == sorted(kept + cut)
    assert all(c.answer is None and len(c.steps) == 1 for c in pruned.candidates if c.text in cut)
    assert len(backend.requests) == len(plain_backend.requests) + len(kept)
    assert context.extra["pruned_samples"] == len(cut)
    assert pruned.generated_tokens == sum(c.tokens for c in pruned.candidates) < plain.generated_tokens
    answered = [c for c in pruned.candidates if c.answer is not None]
    method = "majority" if program == "self_consistency" else base.selection
    assert pruned.answer == select(method, [c.answer for c in answered], [c.score for c in answered])


def test_prune_needs_the_searchs_scorer_and_leaves_step_requests_whole():
    config = SearchConfig(program="best_of_n", n=6, max_tokens=10_000, stopping=Stopping(prune=0.99))
    backend = ScriptedBackend()
    runtimes = Runtimes(generator=backend, scorer=None, prompt=lambda q: PROMPT)
    result = load_program("best_of_n")(PROBLEM, config, runtimes, runtimes.new_search(config, PROBLEM.id))
    assert len(backend.requests) == 6 and all(len(c.steps) > 1 for c in result.candidates), "no scorer: no cut"
    beam = dataclasses.replace(config, program="beam_search", beam_width=2, max_steps=4)
    plain, plain_backend, _, _ = run("beam_search", dataclasses.replace(beam, stopping=Stopping()))
    pruned, pruned_backend, _, context = run("beam_search", beam)
    assert len(pruned_backend.requests) == len(plain_backend.requests) and pruned.answer == plain.answer
    assert "pruned_samples" not in context.extra
    with pytest.raises(ValueError, match="stopping.prune"):
        Stopping(prune=1.0)


def test_prune_keeps_the_last_sample_when_it_would_cut_them_all():
    config = SearchConfig(program="best_of_n", n=6, max_tokens=10_000, stopping=Stopping(prune=0.9999))
    result, backend, _, context = run("best_of_n", config)
    whole = [c for c in result.candidates if len(c.steps) > 1]
    assert context.extra["pruned_samples"] == 5 and len(whole) == 1, "every first step scores below 0.9999"
    assert len(backend.requests) == 6 + 1
    alone, backend, _, context = run("best_of_n", dataclasses.replace(config, n=1))
    assert len(backend.requests) == 1 and context.verifier_calls == 1, "one sample: sent whole, scored once"
    assert len(alone.candidates[0].steps) > 1 and "pruned_samples" not in context.extra


def written_step(text, variant):
    """(the step the scripted model writes after `text` as a path keeps it, how it ends): the delimiter it stopped
    at is put back, as `append_step` does."""
    step, ending = ScriptedModel().step(text, variant)
    return step + ("" if ending == "eos" else "\n\n"), ending


def first_wave_reference(n, waves, tau):
    """Brute force for `enough` on a search's first step: the prompt's children in the order they are sent
    (variant 0, 1, ...), a wave of ceil(n / waves) at a time, up to the first wave with a child whose step the
    verifier scores at least tau; their step texts."""
    judge, size = ScriptedScorer(), -(-n // waves)
    steps = [written_step(PROMPT, variant)[0] for variant in range(n)]
    for end in range(size, n + size, size):
        if any(judge.step_score(PROMPT, [step]) >= tau for step in steps[end - size:end]):
            return steps[:end]
    return steps


@pytest.mark.parametrize("program", ["beam_search", "dvts"])
@pytest.mark.parametrize("tau", [0.5, 0.97, 0.9999])  # content after the first wave, the third, never
def test_enough_sends_a_parents_children_until_the_verifier_is_content_with_one(program, tau):
    config = SearchConfig(program=program, n=8, beam_width=2, max_steps=1, max_tokens=10_000,
                          stopping=Stopping(enough=tau, waves=4))
    result, backend, scorer, context = run(program, config)
    sent = first_wave_reference(8, 4, tau)
    assert len(backend.requests) == len(sent) and context.extra.get("children_not_sent", 0) == 8 - len(sent)
    firsts = sorted(step for c in result.candidates for step in c.steps[:1])
    if program == "beam_search":  # every child of the step is a candidate
        assert firsts == sorted(sent)
    else:  # each subtree's best child, the subtrees dealt from the children sent
        assert set(firsts) <= set(sent) and len(firsts) == min(4, len(sent))
    decided = len(sent) // 2 if len(sent) < 8 else 3  # after each wave but the last of the four
    assert [len(call) for call in scorer.calls] == [2] * decided + [len(sent)], "then the program scores them all"


def test_enough_decides_for_each_parent_on_its_own_children():
    """A beam search's second step, brute force: each beam sends its two children one at a time, the second only
    when the verifier scores the first below tau."""
    tau = 0.85
    config = SearchConfig(program="beam_search", n=8, beam_width=2, max_steps=2, max_tokens=10_000,
                          stopping=Stopping(enough=tau, waves=4))
    result, backend, _, context = run("beam_search", config)
    judge = ScriptedScorer()
    firsts = first_wave_reference(8, 4, tau)
    beams = [step for variant, step in enumerate(firsts) if written_step(PROMPT, variant)[1] == "step"]
    second = [1 if judge.step_score(PROMPT, [beam, written_step(PROMPT + beam, 0)[0]]) >= tau else 2 for beam in beams]
    assert len(beams) == 2 and sorted(second) == [1, 2], "the test needs a beam on each side of tau"
    second = sum(second)
    assert len(backend.requests) == len(firsts) + second
    assert context.extra["children_not_sent"] == (8 - len(firsts)) + (2 * len(beams) - second)


@pytest.mark.parametrize("program", ["beam_search", "dvts"])
def test_enough_that_is_never_met_changes_no_answer(program):
    base = SearchConfig(program=program, n=8, beam_width=2, max_steps=6, max_tokens=10_000)
    plain, plain_backend, _, plain_context = run(program, base)
    waved, backend, scorer, context = run(program, dataclasses.replace(base, stopping=Stopping(enough=1.0)))
    assert [(c.text, c.score) for c in waved.candidates] == [(c.text, c.score) for c in plain.candidates]
    assert waved.answer == plain.answer and len(backend.requests) == len(plain_backend.requests)
    assert context.extra["children_not_sent"] == 0 and context.verifier_calls > plain_context.verifier_calls
    with pytest.raises(ValueError, match="stopping.enough"):
        Stopping(enough=1.5)
    with pytest.raises(ValueError, match="stopping.waves"):
        Stopping(waves=0)
