"""Dynamic branching: each step the budget of children is split among the beams by verifier score.

The prompt is forked n times. After every step the budget B = n - (paths finished so far) is shared among
the unfinished beams in proportion to softmax(score / branching_temperature): beam i gets
B * w_i / sum(w) children, rounded by largest remainder so the counts sum to exactly B (ties to the
higher-ranked beam). Strong beams get several children, weak ones none (pruned). So every step generates
exactly B children and the search ends with exactly n candidates, like beam search's budget, but the
branching factor follows the scores (REBASE, Wu et al. 2024; FastTTS §3.1 "dynamic branching").
"""

from __future__ import annotations

import math
from typing import Sequence

import sglang as sgl

from sgl_tts.search import (aggregate, expand, extract_answer, finish, ReasoningPath, rank_key, run_search, Runtimes,
                            SearchConfig, SearchResult, SearchContext)


def allocate(budget: int, scores: Sequence[float], temperature: float) -> list[int]:
    """Children per beam (beams in rank order): softmax(score / temperature) shares of `budget`, rounded
    by largest remainder; the counts sum to `budget`."""
    if not scores:
        return []
    top = max(scores)
    weights = [math.exp((score - top) / temperature) for score in scores]
    quotas = [budget * w / sum(weights) for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(scores)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: budget - sum(counts)]:
        counts[i] += 1
    return counts


@sgl.function
def dynamic_branching_program(s, prompt: str, config: SearchConfig, runtimes: Runtimes, tracker: SearchContext,
                              finished: list[ReasoningPath]):
    s += prompt
    beams = [(ReasoningPath(state=s), config.n)]
    active: list[ReasoningPath] = []
    for _ in range(config.max_steps):
        children = expand(beams, config, tracker, extract_answer)
        tracker.score(runtimes.scorer, prompt, children)
        finished += [c for c in children if not c.active]
        active = [c for c in children if c.active]
        ranked = sorted(active, key=lambda c: rank_key(c, config.aggregation))
        counts = allocate(config.n - len(finished), [aggregate(c.step_scores, config.aggregation) for c in ranked],
                          config.branching_temperature)
        children_of = {id(path): count for path, count in zip(ranked, counts)}
        beams = [(path, children_of[id(path)]) for path in active if children_of[id(path)] > 0]  # parent order
        if not beams:
            break
    for path in active:
        finish(path, "max_steps", tracker)
    return finished + active


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    return run_search(dynamic_branching_program, problem, "dynamic_branching", config, runtimes, context=context)
