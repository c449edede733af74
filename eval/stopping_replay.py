"""Stopping rules replayed on recorded best-of-N searches: what sending the samples a few at a time and stopping on a
rule would have spent and answered, from `sgl-tts run --out` or `sgl-tts eval` result lines alone.

A best-of-N search's samples are independent draws, so a search that sent them in a random order, `every` at a
time, and stopped once a rule held would have generated the samples it sent and answered by the search's selection
over them (the weighted vote of the CPU default, whose runs these are):

    taken_k = the first k * every samples of the order, less those cut        k = 1, 2, ...
    stop at the first k where rule(taken_k) holds, or once all are sent
    tokens  = the sum of taken_k's tokens, and the first steps of those cut
    answer  = weighted_vote(taken_k's answers, their scores)    (the selection), or where a settled rule
              stopped it, majority_vote(taken_k's answers)        (the settled vote, as `search.stopping` answers)

A run would also spend what the samples in flight had generated when the rule held, so the tokens are a lower
bound. With `prune` τ > 0 (`search.stopping.prune`) a sample whose first step the verifier scored below τ is cut
where that step ends: it spends the step's tokens and is neither heard by the rule nor voted (a sample that ended
within its first step is never cut; a run also keeps the last of a search's samples once the others were cut,
which the replay does not: they differ only where every first step scored below τ). The verifier is causal, so the
score its first step got in the recorded search is the score it gets when scored alone; the step's tokens are the
sample's, shared by its steps' characters (the records keep no tokens per step).

Sent all at once (`every` TOGETHER, as a search without `stopping.stage` sends them), the samples decode in one
batch, a token each a step, so they end in the order of their lengths, and a stop aborts the others where they
stand:

    ending  = the samples not cut, by length (ties in the order drawn)
    stop at the first k where rule(ending[:k]) holds, or once all have ended
    steps   = len(ending[k-1])               the decode steps until the answer (its latency, one search at a time)
    tokens  = sum over the samples of min(len(sample), steps)        (the aborted ones' partial text included; a
                                                                      cut one's length is its first step's)
    answer  = as above, over ending[:k]

Each replay draws one order per search (seeded by the replay, the run's seed and the problem), as one run would, so
a replay's accuracy is paired with the full search's problem by problem (McNemar's exact p, the paired bootstrap's
95% interval: sgl_tts.measure.stats), and several replays show how much the order moves them.

Rules (`RULES`: a family of settings of each), on the taken samples' answers and verifier scores. The first two
are `search.stopping`'s settled rule (its own class, `SettledAnswerRule`, on the answers as the search context
hears them), which a run can use; the others would need each sample's verifier score as it ends, and show what
such a rule could do:

    settled c, min m              m answers cast and the leading answer holds c of them
    agree m                       the leading answer was given by >= m samples (settled with `agree: m`,
                                  consensus 0.1, min_answers 1, as eval/configs/stopping-agree-cpu.yaml runs it;
                                  with `consensus 0.5` it also holds half the answers)
    prune tau                     nothing stops the search; samples whose first step scored below tau are cut
    agree m, prune tau            agree m, over the samples prune tau does not cut
    ended m                       m samples have been taken (sent together: the m shortest have ended), whatever
                                  they answered: what answering from the first samples alone would spend
    top score tau                 some answered sample scores >= tau
    lead tau, min m, share c      the vote's leading answer has >= m samples, >= c of the answered samples'
                                  scores, and one of them scores >= tau

`as_self_consistency` replays the searches as self-consistency: every sample weighs one, so the selection (the
weighted vote) becomes the plain majority of the samples' answers.

A rule's setting is chosen on one half of the problems (the even positions of the sorted problem ids) and reported
on the other, so no setting is judged on the problems it was chosen on: of the settled rules, the setting of the
fewest tokens whose median interval over the replays on the choosing half stays above -FLOOR_PT points.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from sgl_tts.measure.stats import mcnemar_exact, paired_bootstrap
from sgl_tts.search.grading import grade, normalize_answer
from sgl_tts.search.selection import group_answers, majority_vote, weighted_vote
from sgl_tts.search.stopping import SettledAnswerRule

FLOOR_PT = 5.0  # the interval's lower end a chosen setting keeps above -FLOOR_PT points (held out: not worse, shown)
TOGETHER = 0  # `every` of a search that sends all its samples at once
PRUNES = (0.99, 0.995, 0.997)  # `stopping.prune` settings replayed (the probe verifier's first steps: median 0.992)


@dataclass(frozen=True)
class Sample:
    answer: str | None
    score: float
    tokens: int
    first_step_score: float | None = None  # the verifier's score of its first step; None: it ended within it
    first_step_tokens: int = 0

    def cut(self, prune: float) -> bool:
        """Whether `stopping.prune` cuts this sample where its first step ends."""
        return self.first_step_score is not None and self.first_step_score < prune

    def spent(self, prune: float) -> int:
        """The tokens it generates: its first step's where it is cut, else all."""
        return self.first_step_tokens if self.cut(prune) else self.tokens


@dataclass(frozen=True)
class Search:
    seed: int
    problem_id: str
    gold: str
    samples: tuple[Sample, ...]


Rule = Callable[[Sequence[Sample]], bool]


@dataclass(frozen=True)
class Stop:
    """A rule and how a search it stopped answers: by the settled vote (`settled`: `search.stopping`'s settled rule,
    which a run can use) or by the selection."""

    rule: Rule
    settled: bool = False
    prune: float = 0.0  # samples whose first step scored below this are cut there (`search.stopping.prune`)


def searches_from(lines: Iterable[dict[str, Any]], where: str = "results") -> list[Search]:
    """The finished best-of-N searches of result lines (run headers skipped); a line of another program, or one
    without its result, is a ValueError naming the line."""
    searches = []
    for number, line in enumerate(lines, start=1):
        if line.get("kind") == "run" or line.get("failed"):
            continue
        result = line.get("result")
        if not isinstance(result, dict) or "candidates" not in result or "metrics" not in line:
            raise ValueError(f"{where} line {number}: expected a result line with 'metrics' and 'result.candidates'")
        if result.get("program") != "best_of_n":
            raise ValueError(f"{where} line {number}: program {result.get('program')!r}, expected 'best_of_n' "
                             f"(only independent samples can be replayed in another order)")
        samples = tuple(sample_of(c) for c in result["candidates"])
        searches.append(Search(int(line["seed"]), str(line["problem_id"]), str(line["metrics"]["gold"]), samples))
    return searches


def sample_of(candidate: dict[str, Any]) -> Sample:
    """A recorded candidate as a sample: its answer, score and tokens, and, when it went past its first step, that
    step's score and its share of the tokens (by characters)."""
    steps, scores, tokens = candidate.get("steps") or [], candidate.get("step_scores") or [], int(candidate["tokens"])
    if len(steps) < 2 or len(scores) != len(steps):
        return Sample(candidate["answer"], float(candidate["score"]), tokens)
    characters = sum(len(step) for step in steps)
    return Sample(candidate["answer"], float(candidate["score"]), tokens, float(scores[0]),
                  round(tokens * len(steps[0]) / characters) if characters else 0)


def as_self_consistency(searches: Sequence[Search]) -> list[Search]:
    """The searches with every sample weighing one: their selection, the weighted vote, is then the majority vote
    (equal weights sum to the group's size, ties to the earliest group, as `majority_vote` picks)."""
    return [replace(search, samples=tuple(replace(sample, score=1.0) for sample in search.samples))
            for search in searches]


def ended(minimum: int) -> Rule:
    return lambda taken: len(taken) >= minimum


def never(taken: Sequence[Sample]) -> bool:
    """Nothing stops the search (what a cut alone is replayed with)."""
    return False


def top_score(tau: float) -> Rule:
    return lambda taken: any(s.answer is not None and s.score >= tau for s in taken)


def lead(tau: float, minimum: int, share: float) -> Rule:
    def rule(taken: Sequence[Sample]) -> bool:
        scores = [max(s.score, 0.0) if s.answer is not None else 0.0 for s in taken]  # the vote's weights
        groups = group_answers([s.answer for s in taken])
        if not groups or sum(scores) <= 0:
            return False
        leading = max(groups, key=lambda group: sum(scores[i] for i in group))  # the vote's winner (first on ties)
        return (len(leading) >= minimum and max(scores[i] for i in leading) >= tau
                and sum(scores[i] for i in leading) >= share * sum(scores))
    return rule


def settled(consensus: float, min_answers: int, agree: int = 1) -> Rule:
    """`search.stopping`'s settled rule on the answers of the taken samples, as the search context passes them (the
    answered ones, normalized, one vote each, samples still to come)."""
    vote = SettledAnswerRule(consensus, min_answers, agree)

    def rule(taken: Sequence[Sample]) -> bool:
        answers = [normalize_answer(s.answer) for s in taken if s.answer is not None]
        return vote.settled(answers, [1.0] * len(answers), remaining=1)
    return rule


def agree(minimum: int) -> Rule:
    return settled(consensus=0.1, min_answers=1, agree=minimum)


RULES: dict[str, Stop] = {
    **{f"settled {consensus}, min {minimum}": Stop(settled(consensus, minimum), settled=True)
       for consensus in (0.6, 0.75) for minimum in (3, 4)},
    **{f"agree {minimum}": Stop(agree(minimum), settled=True) for minimum in (2, 3, 4)},
    "agree 2, consensus 0.5": Stop(settled(0.5, 1, 2), settled=True),
    **{f"ended {minimum}": Stop(ended(minimum)) for minimum in (2, 4, 8)},
    **{f"top score {tau}": Stop(top_score(tau)) for tau in (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)},
    **{f"lead {tau}, min {minimum}, share {share}": Stop(lead(tau, minimum, share))
       for tau in (0.0, 0.9, 0.99) for minimum in (2, 3) for share in (0.0, 0.5, 0.7)},
    # `stopping.prune` alone (nothing stops the search) and beneath the agreement rules: settings a run can use
    **{f"prune {tau}": Stop(never, settled=True, prune=tau) for tau in PRUNES},
    **{f"agree {minimum}, prune {tau}": Stop(agree(minimum), settled=True, prune=tau)
       for minimum in (2, 3) for tau in PRUNES},
}


def replay(samples: Sequence[Sample], every: int, stop: Stop) -> tuple[int, str | None]:
    """(tokens, answer) of a search that sent `samples` in their order `every` at a time and stopped on `stop`."""
    if every < 1:
        raise ValueError(f"every: expected >= 1, got {every}")
    sent = next((count for count in range(every, len(samples), every)
                 if stop.rule(heard(samples[:count], stop.prune))), len(samples))
    taken = heard(samples[:sent], stop.prune)
    return sum(s.spent(stop.prune) for s in samples[:sent]), answer_of(taken, stop, stopped=sent < len(samples))


def heard(samples: Sequence[Sample], prune: float) -> list[Sample]:
    """The samples `prune` does not cut."""
    return [s for s in samples if not s.cut(prune)]


def replay_together(samples: Sequence[Sample], stop: Stop) -> tuple[int, str | None, int]:
    """(tokens, answer, steps) of a search that sent `samples` all at once and stopped on `stop` as they ended."""
    ending = sorted(heard(samples, stop.prune), key=lambda s: s.tokens)  # stable: ties end in the order drawn
    count = next((k for k in range(1, len(ending)) if stop.rule(ending[:k])), None)
    steps = ending[count - 1].tokens if count is not None else max((s.spent(stop.prune) for s in samples), default=0)
    spent = sum(min(s.spent(stop.prune), steps) for s in samples)
    return spent, answer_of(ending[:count] if count is not None else ending, stop, count is not None), steps


def answer_of(taken: Sequence[Sample], stop: Stop, stopped: bool) -> str | None:
    """A search's answer from the samples it heard: the settled vote where a settled rule stopped it, else the
    selection (the weighted vote)."""
    answers = [s.answer for s in taken]
    if stop.settled and stopped:
        return majority_vote(answers)
    return weighted_vote(answers, [s.score for s in taken])


@lru_cache(maxsize=None)
def correct(answer: str | None, gold: str) -> bool:
    return grade(answer, gold)


@lru_cache(maxsize=None)
def full_search_correct(search: Search) -> bool:
    """Whether the search as it ran (every sample, the weighted vote) answered right: the same for every rule."""
    return correct(weighted_vote([s.answer for s in search.samples], [s.score for s in search.samples]), search.gold)


def replay_all(searches: Sequence[Search], every: int, stop: Stop, replay_seed: int) -> dict[str, Any]:
    """One replay of every search (one order each): tokens against the full searches' and the paired accuracy; sent
    TOGETHER, also the decode steps until the answers against the full searches' (their longest samples')."""
    tokens = full_tokens = steps = full_steps = 0
    stopped, full = [], []
    for search in searches:
        order = list(search.samples)
        random.Random(f"{replay_seed}/{search.seed}/{search.problem_id}").shuffle(order)
        if every == TOGETHER:
            spent, answer, taken_steps = replay_together(order, stop)
            steps += taken_steps
            full_steps += max(s.tokens for s in order)
        else:
            spent, answer = replay(order, every, stop)
        tokens += spent
        full_tokens += sum(s.tokens for s in search.samples)
        stopped.append(correct(answer, search.gold))
        full.append(full_search_correct(search))
    difference, low, high = paired_bootstrap(full, stopped)
    out = {"tokens_ratio": tokens / full_tokens, "delta_pt": 100 * difference, "low_pt": 100 * low,
           "high_pt": 100 * high, "p": mcnemar_exact(full, stopped).p_value, "solved": sum(stopped),
           "solved_full": sum(full), "searches": len(searches)}
    return out | ({"steps_ratio": steps / full_steps} if every == TOGETHER else {})


def halves(searches: Sequence[Search]) -> tuple[list[Search], list[Search]]:
    """(choosing half, reporting half): the searches of the even and the odd positions of the sorted problem ids."""
    ids = sorted({search.problem_id for search in searches})
    even = set(ids[::2])
    return ([s for s in searches if s.problem_id in even], [s for s in searches if s.problem_id not in even])


def medians(replays: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {key: statistics.median(r[key] for r in replays) for key in replays[0]}
    for key in ("tokens_ratio", "delta_pt", "low_pt", "steps_ratio"):
        if key in out:
            out[key + "_range"] = (min(r[key] for r in replays), max(r[key] for r in replays))
    return out


def report(searches: Sequence[Search], every: int = 4, replays: int = 5,
           rules: dict[str, Stop] | None = None) -> dict[str, Any]:
    """Every rule on both halves (medians over `replays` replays, with ranges) and the settled rule's setting chosen
    on the choosing half (None when none keeps the interval above -FLOOR_PT there)."""
    choosing, reporting = halves(searches)
    if not choosing or not reporting:
        raise ValueError("searches: expected problems for both halves, got "
                         f"{len({s.problem_id for s in searches})} problem(s)")
    table = {}
    for name, stop in (rules or RULES).items():
        table[name] = {half: medians([replay_all(part, every, stop, seed) for seed in range(replays)])
                       for half, part in (("choosing", choosing), ("reporting", reporting))}
    kept = [name for name, row in table.items()
            if (rules or RULES)[name].settled and row["choosing"]["low_pt"] > -FLOOR_PT]
    chosen = min(kept, key=lambda name: table[name]["choosing"]["tokens_ratio"]) if kept else None
    return {"every": every, "replays": replays, "table": table, "chosen": chosen}
