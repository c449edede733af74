"""Beam search over reasoning steps (search-and-learn style).

Each iteration every kept beam is forked into M = beam_width children that each write one step; the
scorer scores the new steps and the n / M best unfinished children are kept. Finished paths (an answer,
end of sequence, or a limit) leave the beam and become candidates. The first iteration forks the prompt n
times. The search ends when no beam is left or max_steps is reached.

With `lookahead` k > 0 each unfinished child is rolled out k more steps greedily (temperature 0) and ranked
by the rollout's score; the child keeps only its own step (search-and-learn's lookahead search).
"""

from __future__ import annotations

import dataclasses

import sglang as sgl

from sgl_tts.search import (aggregate, expand, extract_answer, finish, ReasoningPath, rank_key, run_search, Runtimes,
                            SearchConfig, SearchResult, SearchContext)


def keep_count(config: SearchConfig) -> int:
    return max(1, config.n // config.beam_width)


@sgl.function
def beam_search_program(s, prompt: str, config: SearchConfig, runtimes: Runtimes, tracker: SearchContext,
                        finished: list[ReasoningPath]):
    s += prompt
    beams = [ReasoningPath(state=s)]
    for iteration in range(config.max_steps):
        fan_out = config.n if iteration == 0 else config.beam_width
        children = expand([(beam, fan_out) for beam in beams], config, tracker, extract_answer)
        tracker.score(runtimes.scorer, prompt, children)
        finished += [c for c in children if not c.active]
        active = [c for c in children if c.active]
        if config.lookahead and active:
            score_lookahead(active, prompt, config, runtimes, tracker)
        key = lookahead_rank_key if config.lookahead else (lambda c: rank_key(c, config.aggregation))
        kept = {id(c) for c in sorted(active, key=key)[: keep_count(config)]}
        beams = [c for c in active if id(c) in kept]  # in parent order, as the prefix-aware policy needs
        if not beams:
            break
    for beam in beams:
        finish(beam, "max_steps", tracker)
    return finished + beams


def score_lookahead(paths: list[ReasoningPath], prompt: str, config: SearchConfig, runtimes: Runtimes,
                    tracker: SearchContext) -> None:
    """Sets extra["lookahead_score"] of each path: the score of its greedy rollout `lookahead` steps on."""
    greedy = dataclasses.replace(config, temperature=0.0)
    rollouts = list(paths)
    for _ in range(config.lookahead):
        growing = [r for r in rollouts if r.active]
        if not growing:
            break
        grown = iter(expand([(r, 1) for r in growing], greedy, tracker, extract_answer))
        rollouts = [next(grown) if r.active else r for r in rollouts]
    tracker.score(runtimes.scorer, prompt, [r for r, p in zip(rollouts, paths) if r is not p])
    for path, rollout in zip(paths, rollouts):
        path.extra["lookahead_score"] = aggregate(rollout.step_scores, config.aggregation)


def lookahead_rank_key(path: ReasoningPath) -> tuple[float, str]:
    return (-path.extra["lookahead_score"], path.text)


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    return run_search(beam_search_program, problem, "beam_search", config, runtimes, context=context)
