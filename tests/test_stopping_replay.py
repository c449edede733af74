"""Stopping rules replayed on recorded best-of-N searches (eval/stopping_replay.py): the replay of one order against
a brute-force reading of its definition, the halves, the rules, and the result lines it refuses."""

import itertools
import random

import pytest

from eval.stopping_replay import (RULES, TOGETHER, Sample, Search, Stop, agree, as_self_consistency, ended,
                                  full_search_correct, halves, lead, replay, replay_all, replay_together, report,
                                  sample_of, searches_from, settled, top_score)
from sgl_tts.search.selection import majority_vote, weighted_vote


def samples_of(rng, count, first_steps=False):
    """Random samples; with `first_steps`, most went past a first step with a score and a share of the tokens."""
    samples = []
    for _ in range(count):
        answer, score, tokens = rng.choice(["1", "2", "3", None]), round(rng.random(), 2), rng.randint(1, 50)
        first = (round(rng.random(), 2), rng.randint(1, tokens)) if first_steps and rng.random() < 0.8 else (None, 0)
        samples.append(Sample(answer, score, tokens, *first))
    return samples


@pytest.mark.parametrize("every,prune", [(1, 0.0), (3, 0.0), (4, 0.0), (3, 0.5)])
def test_a_replay_stops_at_the_first_stage_its_rule_holds_and_answers_as_the_search_would(every, prune):
    rng = random.Random(every)
    for _ in range(200):
        samples = samples_of(rng, rng.randint(1, 12), first_steps=prune > 0)
        cut = [s.first_step_score is not None and s.first_step_score < prune for s in samples]
        for rule, settles in ((agree(2), True), (top_score(0.8), False), (lambda taken: False, False)):
            stop = Stop(rule, settled=settles, prune=prune)
            tokens, answer = replay(samples, every, stop)
            counts = list(range(every, len(samples), every))  # the stages asked before all are sent

            def heard_of(count):
                return [s for s, c in zip(samples[:count], cut) if not c]
            first = next((k for k in counts if rule(heard_of(k))), None)
            sent = first if first is not None else len(samples)
            assert tokens == sum(s.first_step_tokens if c else s.tokens for s, c in zip(samples[:sent], cut))
            taken = heard_of(sent)
            answers, scores = [s.answer for s in taken], [s.score for s in taken]
            expected = majority_vote(answers) if first is not None and settles else weighted_vote(answers, scores)
            assert answer == expected
    with pytest.raises(ValueError, match="every"):
        replay(samples_of(rng, 3), 0, Stop(agree(2)))


@pytest.mark.parametrize("prune", [0.0, 0.5])
def test_samples_sent_together_end_step_by_step_and_a_stop_aborts_the_others_where_they_stand(prune):
    """replay_together against a step-by-step simulation of one batch: every live sample writes a token a step;
    those whose length is reached end, in the order drawn, the rule asked after each; with `prune`, a sample whose
    first step scored below it stops where that step ends, unheard."""
    rng = random.Random(7)
    for _ in range(300):
        samples = samples_of(rng, rng.randint(1, 10), first_steps=prune > 0)
        cut = [s.first_step_score is not None and s.first_step_score < prune for s in samples]
        length = [s.first_step_tokens if c else s.tokens for s, c in zip(samples, cut)]
        for rule, settles in ((agree(2), True), (settled(0.5, 1, 2), True), (top_score(0.8), False),
                              (ended(2), False), (lambda taken: False, False)):
            stop = Stop(rule, settled=settles, prune=prune)
            heard, written, stopped_at = [], [0] * len(samples), None
            for step in range(1, max(length) + 1):
                for i in range(len(samples)):
                    if length[i] >= step:
                        written[i] += 1
                for i, sample in enumerate(samples):
                    if length[i] == step and not cut[i] and stopped_at is None:
                        heard.append(sample)
                        if len(heard) < cut.count(False) and stop.rule(heard):
                            stopped_at = step
                if stopped_at is not None:
                    break
            tokens, answer, steps = replay_together(samples, stop)
            assert steps == (stopped_at or max(length))
            assert tokens == sum(written)
            answers, scores = [s.answer for s in heard], [s.score for s in heard]
            assert answer == (majority_vote(answers) if stopped_at is not None and stop.settled
                              else weighted_vote(answers, scores))


def test_the_rules_read_the_taken_samples_as_their_definitions_say():
    taken = [Sample("1", 0.2, 5), Sample("2", 0.95, 5), Sample("1", 0.3, 5), Sample(None, 0.99, 5)]
    assert agree(2)(taken) and not agree(3)(taken)
    assert settled(0.6, 3)(taken) and not settled(0.7, 3)(taken) and not settled(0.6, 4)(taken)  # "1" holds 2 of 3
    assert top_score(0.95)(taken) and not top_score(0.96)(taken), "a sample with no answer does not count"
    assert ended(4)(taken) and not ended(5)(taken), "ended counts the samples taken, answered or not"
    # the vote's leader by score is "2" (0.95 against 0.5): one sample
    assert not lead(0.0, 2, 0.0)(taken) and lead(0.9, 1, 0.6)(taken) and not lead(0.9, 1, 0.7)(taken)
    assert all(isinstance(stop, Stop) for stop in RULES.values())


def test_the_halves_split_the_problems_not_the_searches():
    searches = [Search(seed, f"p{i:02d}", "1", (Sample("1", 1.0, 1),)) for seed, i in itertools.product((0, 1),
                                                                                                        range(5))]
    choosing, reporting = halves(searches)
    assert {s.problem_id for s in choosing} == {"p00", "p02", "p04"}
    assert {s.problem_id for s in reporting} == {"p01", "p03"}
    assert len(choosing) + len(reporting) == len(searches)


def test_a_replay_of_every_search_pairs_its_accuracy_with_the_full_searches():
    rng = random.Random(0)
    searches = [Search(0, f"p{i}", "1", tuple(samples_of(rng, 8))) for i in range(30)]
    never = replay_all(searches, 4, Stop(lambda taken: False), replay_seed=0)
    assert never["tokens_ratio"] == 1 and never["delta_pt"] == 0 and never["solved"] == never["solved_full"]
    early = replay_all(searches, 4, Stop(lambda taken: True), replay_seed=0)
    assert early["tokens_ratio"] < 1 and early["searches"] == 30
    rules = {"never": Stop(lambda taken: False, settled=True), "always": Stop(lambda taken: True)}
    out = report(searches, every=4, replays=2, rules=rules)
    assert out["chosen"] == "never", "only a settled rule is chosen (a run can use it)"
    assert out["table"]["never"]["reporting"]["tokens_ratio"] == 1
    together = replay_all(searches, TOGETHER, Stop(agree(2), settled=True), replay_seed=0)
    assert together["tokens_ratio"] < 1 and 0 < together["steps_ratio"] < 1
    assert replay_all(searches, TOGETHER, Stop(lambda taken: False), replay_seed=0)["steps_ratio"] == 1


def test_result_lines_of_another_program_or_without_their_result_are_refused_by_line():
    good = {"seed": 0, "problem_id": "p1", "metrics": {"gold": "2"},
            "result": {"program": "best_of_n", "candidates": [{"answer": "2", "score": 0.5, "tokens": 7}]}}
    header = {"kind": "run"}
    assert searches_from([header, good]) == [Search(0, "p1", "2", (Sample("2", 0.5, 7),))]
    beam = {**good, "result": {**good["result"], "program": "beam_search"}}
    with pytest.raises(ValueError, match="line 2: program 'beam_search', expected 'best_of_n'"):
        searches_from([good, beam])
    with pytest.raises(ValueError, match="line 1: expected a result line"):
        searches_from([{"seed": 0}])


def test_replayed_as_self_consistency_every_search_answers_by_the_plain_majority():
    rng = random.Random(3)
    searches = [Search(0, f"p{i}", rng.choice(["1", "2"]), tuple(samples_of(rng, rng.randint(1, 9))))
                for i in range(200)]
    plain = as_self_consistency(searches)
    assert [[s.tokens for s in search.samples] for search in plain] == [[s.tokens for s in search.samples]
                                                                        for search in searches]
    for search in plain:
        answers = [s.answer for s in search.samples]
        assert full_search_correct(search) == (majority_vote(answers) == search.gold)
        assert replay(search.samples, 3, Stop(ended(3)))[1] == majority_vote(answers[:3] if len(answers) > 3
                                                                             else answers)
    weighed = sum(full_search_correct(s) != full_search_correct(p) for s, p in zip(searches, plain))
    assert weighed > 0, "the scores changed some searches' answers, so the replay did drop them"


def test_a_recorded_candidate_past_its_first_step_carries_that_steps_score_and_its_share_of_the_tokens():
    two_steps = {"answer": "2", "score": 0.5, "tokens": 12, "steps": ["abcde", "fghijklmnopqrst"],
                 "step_scores": [0.9, 0.5]}
    assert sample_of(two_steps) == Sample("2", 0.5, 12, 0.9, 3)  # 5 of 20 characters
    one_step = {**two_steps, "steps": ["abcde"], "step_scores": [0.9]}
    assert sample_of(one_step) == Sample("2", 0.5, 12) and not sample_of(one_step).cut(0.99), "ended in it: kept"
    assert sample_of(two_steps).cut(0.95) and sample_of(two_steps).spent(0.95) == 3
    assert not sample_of(two_steps).cut(0.9) and sample_of(two_steps).spent(0.9) == 12
