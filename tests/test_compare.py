"""`sgl-tts run --compare`: self-consistency cut to the search's tokens, on the scripted backend."""

import dataclasses

from collections import Counter

from sgl_tts.app.compare import (SC_MAX_SAMPLES, format_comparison, matched_vote, one_sample, print_comparison,
                                 run_comparison, samples_to_match)
from sgl_tts.app.session import RunConfig, Session
from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.programs import load_program
from sgl_tts.search.records import Candidate, SearchResult
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer


def candidate(answer, tokens):
    return Candidate(steps=[], step_scores=[], score=0.0, answer=answer, tokens=tokens, completion_time_s=1.0,
                     finish_reason="answer")


def test_matched_vote_counts_the_first_samples_within_the_budget():
    result = SearchResult("p", "self_consistency", "9", [candidate("1", 10), candidate("2", 20), candidate("2", 30),
                                                          candidate("9", 5), candidate("9", 5), candidate("9", 5)],
                          generated_tokens=75)
    cut = matched_vote(result, budget=60)
    assert [c.tokens for c in cut.candidates] == [10, 20, 30]
    assert (cut.answer, cut.generated_tokens, cut.extra["samples_drawn"]) == ("2", 60, 6)
    # The vote stops at the first sample that would overrun, even when later ones are short.
    assert [c.tokens for c in matched_vote(result, budget=59).candidates] == [10, 20]
    # A budget below the first sample still counts that one sample.
    one = matched_vote(result, budget=3)
    assert (len(one.candidates), one.answer, one.generated_tokens) == (1, "1", 10)


def test_one_sample_is_drawn_uniformly_not_the_verifiers_pick():
    """Candidates come best-scored first: the first of them is the verifier's choice, not a sample."""
    picks = Counter()
    for k in range(400):
        ranked = [dataclasses.replace(candidate(str(i), 10 + i), score=1.0 - i / 8) for i in range(8)]
        result = SearchResult(f"problem-{k}", "best_of_n", "0", ranked, generated_tokens=sum(c.tokens for c in ranked))
        cut = one_sample(result)
        assert len(cut.candidates) == 1 and cut.answer == cut.candidates[0].answer
        assert cut.generated_tokens == cut.candidates[0].tokens and cut == one_sample(result), "the same pick each time"
        picks[cut.answer] += 1
    assert set(picks) == {str(i) for i in range(8)}
    assert max(picks.values()) < 2 * 400 / 8, picks  # uniform: 50 each expected, 100 is far out (binomial sd 6.6)
    assert one_sample(SearchResult("p", "best_of_n", None, [], generated_tokens=0)).generated_tokens == 0


def test_samples_to_match_spends_the_search_tokens_in_whole_solutions():
    def result(tokens, lengths, pruned=()):
        cands = [candidate("1", t) for t in lengths] + [dataclasses.replace(candidate("1", t), finish_reason="pruned")
                                                          for t in pruned]
        return SearchResult("p", "beam_search", "1", cands, generated_tokens=tokens)

    assert samples_to_match(result(400, [100, 100], pruned=[20, 20]), 192) == 5  # 400 / 100, plus one
    assert samples_to_match(result(410, [100, 100]), 192) == 6  # a part of a solution rounds up
    assert samples_to_match(result(50, [100]), 192) == 2  # never fewer than two
    assert samples_to_match(result(10_000, [10]), 192) == SC_MAX_SAMPLES
    assert samples_to_match(result(384, [], pruned=[30]), 192) == 3  # no finished path: max_tokens each


class ScriptedSession(Session):
    """A `Session` whose runtimes are the scripted backend and scorer (nothing started)."""

    def __init__(self, config):
        self.config = config
        self.program = load_program(config.search.program)
        self.runtimes = {}
        self._reuse = {}
        self.search_runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel()), scorer=ScriptedScorer(),
                                        prompt=lambda q: f"Q: {q}\n\n")
        self.closed = False
        self.solved = []  # (program, problem, result) of every search, as they finish (threads)

    def solve(self, problem, search=None):
        result = super().solve(problem, search)
        self.solved.append(((search or self.config.search).program, problem, result))
        return result

    def close(self):
        self.closed = True


def test_self_consistency_votes_with_no_more_tokens_than_the_search_spent():
    config = RunConfig(search=SearchConfig(program="beam_search", n=4, beam_width=2, max_steps=3, max_step_tokens=16,
                                           max_tokens=48))
    session = ScriptedSession(config)
    problems = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(4)]
    searched = list(session.solve_all(problems))
    lines = []
    arms = run_comparison(session, problems, searched, log=lines.append)
    assert session.closed and len(arms) == 4  # FastTTS is off in this config: no FastTTS-off arm, runtimes closed
    greedy, sample, search_arm, sc_arm = arms
    references = [(problem, result) for program, problem, result in session.solved
                  if program == "self_consistency" and len(result.candidates) == 1]
    assert greedy.problems == sample.problems == 4 and len(references) >= 8, "greedy and one sample: n = 1 each"
    assert search_arm.tokens_per_problem == sum(r.generated_tokens for _, r in searched) / len(problems)
    # Recompute the matched vote by brute force: the longest prefix of the samples within the search's tokens.
    drawn = {problem.id: result for program, problem, result in session.solved  # the vote draws 2 or more
             if program == "self_consistency" and len(result.candidates) >= 2}
    assert len(drawn) == len(problems) and all(r.program == "self_consistency" for r in drawn.values())
    counted, solved = 0, 0
    drawn_total = 0
    for problem, result in searched:
        sc = drawn[problem.id]
        assert len(sc.candidates) == samples_to_match(result, config.search.max_tokens)
        drawn_total += len(sc.candidates)
        best = max(k for k in range(1, len(sc.candidates) + 1)
                   if k == 1 or sum(c.tokens for c in sc.candidates[:k]) <= result.generated_tokens)
        counted += best
        votes = Counter(c.answer for c in sc.candidates[:best] if c.answer is not None)
        solved += bool(votes) and votes.most_common(1)[0][0] == problem.gold
    assert sc_arm.samples == f"{counted}/{drawn_total} samples"
    assert sc_arm.solved == solved
    assert sc_arm.tokens_per_problem <= search_arm.tokens_per_problem or counted == len(problems)
    table = format_comparison(arms, reference=greedy)
    assert "self-consistency, matched tokens" in table and f"{search_arm.solved}/4" in table
    assert "p vs greedy" in table and "95% interval" in table


def test_best_of_n_is_compared_with_the_majority_of_its_own_samples():
    """No new draws: self-consistency's vote is over the search's candidates, at the search's very tokens."""
    config = RunConfig(search=SearchConfig(program="best_of_n", n=4, max_steps=2, max_step_tokens=16, max_tokens=32))
    session = ScriptedSession(config)
    problems = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(4)]
    searched = list(session.solve_all(problems))
    arms = run_comparison(session, problems, searched, log=lambda line: None)
    greedy, sample, search_arm, sc_arm = arms
    assert [p for p, _, r in session.solved if p == "self_consistency" and len(r.candidates) > 1] == []
    solved = 0
    for problem, result in searched:
        votes = Counter(c.answer for c in result.candidates if c.answer is not None)
        solved += bool(votes) and votes.most_common(1)[0][0] == problem.gold
    assert sc_arm.solved == solved and sc_arm.tokens_per_problem == search_arm.tokens_per_problem
    assert sc_arm.samples == f"{sum(len(r.candidates) for _, r in searched)} samples"
    assert sc_arm.label == "self-consistency, the same samples"
    # One sample at the search's temperature: one of each search's samples, not a new draw.
    picked = [one_sample(r).candidates[0] for _, r in searched]
    assert all(c in r.candidates for c, (_, r) in zip(picked, searched))
    assert sample.solved == sum(c.answer == p.gold for c, (p, _) in zip(picked, searched))
    assert sample.tokens_per_problem == sum(c.tokens for c in picked) / len(problems)
    drawn = [r for p, _, r in session.solved if p == "self_consistency"]
    assert len(drawn) == len(problems), "greedy is the only arm drawn anew"


def test_a_best_of_n_that_may_stop_early_draws_its_one_sample_anew():
    """The samples a stopped search kept are the ones that ended first (the short ones), not a uniform draw: the
    one-sample arm draws anew at the search's temperature; self-consistency is still the majority of its samples."""
    from sgl_tts.app.compare import keeps_every_sample
    from sgl_tts.search.budget import Budget
    from sgl_tts.search.stopping import Stopping

    agree = Stopping(rule="settled", consensus=0.1, min_answers=1, agree=2, programs=("best_of_n",))
    search = SearchConfig(program="best_of_n", n=4, max_steps=2, max_step_tokens=16, max_tokens=32, temperature=0.7,
                          stopping=agree)
    assert not keeps_every_sample(search) and keeps_every_sample(dataclasses.replace(search, stopping=Stopping()))
    assert keeps_every_sample(dataclasses.replace(search, stopping=dataclasses.replace(agree, programs=("dvts",))))
    assert not keeps_every_sample(dataclasses.replace(search, stopping=Stopping(), budget=Budget(max_tokens=100)))
    assert not keeps_every_sample(dataclasses.replace(search, program="beam_search", stopping=Stopping()))
    assert not keeps_every_sample(dataclasses.replace(search, stopping=Stopping(prune=0.99))), "cut samples: no draw"
    alone = dataclasses.replace(search, n=1, stopping=Stopping(prune=0.99))
    assert keeps_every_sample(alone) and not alone.cuts_samples, "a search of one sample is never cut"
    session = ScriptedSession(RunConfig(search=search))
    problems = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(4)]
    searched = list(session.solve_all(problems))
    lines = []
    greedy, sample, search_arm, sc_arm = run_comparison(session, problems, searched, log=lines.append)
    drawn = [(r.problem_id, len(r.candidates)) for p, _, r in session.solved if p == "self_consistency"]
    assert sorted(drawn) == sorted([(p.id, 1) for p in problems] * 2), "greedy and one sample, each problem once"
    assert "one of each search's samples" not in lines[0] and sc_arm.label == "self-consistency, the same samples"
    assert sc_arm.tokens_per_problem == search_arm.tokens_per_problem


def test_the_table_gives_wilson_intervals_tokens_per_solved_and_the_paired_test_against_greedy():
    from sgl_tts.app.compare import ArmSummary
    from sgl_tts.measure.stats import mcnemar_exact

    greedy = ArmSummary("greedy", (True,) * 2 + (False,) * 18, 50.0, 1.0, 1.0, generated_tokens=1000)
    search = ArmSummary("search", (True,) * 12 + (False,) * 8, 300.0, 1.0, 2.0, generated_tokens=6000)
    none = ArmSummary("none", (False,) * 20, 10.0, 1.0, 1.0, generated_tokens=200)
    lines = format_comparison([greedy, search, none], reference=greedy).splitlines()
    assert "0.03-0.30" in lines[2] and lines[2].rstrip().endswith("-"), "greedy 2/20: Wilson 0.028-0.301"
    p = mcnemar_exact(greedy.correct, search.correct).p_value
    assert p < 0.01 and f"{p:.3f}" in lines[3] and "500" in lines[3], "10 discordant pairs all for the search"
    assert search.tokens_per_solved == 500 and none.tokens_per_solved is None


def test_fasttts_on_is_not_compared_with_off_unless_asked(monkeypatch, capsys):
    """`--compare` keeps its runtimes (no restart without P, M, S); the table says FastTTS was not compared."""
    from sgl_tts.app import session as session_module
    from sgl_tts.fasttts.switches import FastTTSConfig

    restarted = []
    monkeypatch.setattr(session_module, "Session", lambda *a, **k: restarted.append(a) or None)
    config = RunConfig(search=SearchConfig(program="best_of_n", n=2, max_steps=2, max_step_tokens=8, max_tokens=16),
                       fasttts=FastTTSConfig(prefix_order=True, speculative=True))
    session = ScriptedSession(config)
    problems = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(2)]
    arms = run_comparison(session, problems, list(session.solve_all(problems)), log=lambda line: None)
    assert len(arms) == 4 and not restarted and session.closed
    print_comparison(arms)
    assert "FastTTS on/off: not compared" in capsys.readouterr().out


def test_greedy_starts_beside_the_search_once_its_last_problems_are_in_flight():
    from sgl_tts.app.compare import GreedyReference

    config = RunConfig(search=SearchConfig(program="best_of_n", n=2, max_steps=2, max_step_tokens=8, max_tokens=16,
                                           temperature=0.7))
    session = ScriptedSession(config)
    problems = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(5)]
    greedy = GreedyReference(session, problems)
    followed = greedy.follow(session.solve_all(problems, concurrency=2), start_after=3)
    searched = []
    for passed in range(1, 6):
        searched.append(next(followed))
        assert greedy.started_after == (3 if passed >= 3 else None), passed
    assert next(followed, None) is None
    pairs = greedy.results()
    assert [p.id for p, _ in pairs] == [p.id for p in problems]
    greedy_solves = [(program, problem) for program, problem, r in session.solved
                     if program == "self_consistency"]
    assert sorted(p.id for _, p in greedy_solves) == sorted(p.id for p in problems), "each problem once"
    lines = []
    arms = run_comparison(session, problems, searched, log=lines.append, greedy=greedy)
    assert arms[0].problems == 5 and "solved beside the search's last 2 problems" in lines[0]
    assert len([1 for program, _, _ in session.solved if program == "self_consistency"]) == 5, "not solved again"


def test_greedy_started_by_no_search_runs_after_it_and_says_nothing_of_a_load():
    from sgl_tts.app.compare import GreedyReference

    config = RunConfig(search=SearchConfig(program="best_of_n", n=2, max_steps=2, max_step_tokens=8, max_tokens=16))
    session = ScriptedSession(config)
    problems = [Problem(id=f"q{i}", question=f"what is {i} plus {i}?", gold=str(2 * i)) for i in range(2)]
    greedy = GreedyReference(session, problems)
    assert list(greedy.follow([], start_after=0)) == [] and greedy.started_after == 0, "all in flight at once"
    lines = []
    later = GreedyReference(session, problems)
    run_comparison(session, problems, list(session.solve_all(problems)), log=lines.append, greedy=later)
    assert later.started_after is None and "beside" not in lines[0]
