"""Varying-granularity search (VG-Search): beam search that verifies every g steps instead of every step.

Each round forks every kept beam into M = beam_width children (the prompt into n), lets each child write g
steps (fewer if it finishes or reaches max_steps), then scores all children in one verification and keeps
the n / M best unfinished ones (Chen et al. 2025; FastTTS §3.1). g = 1 is beam search; a larger g means
fewer verifications and longer unverified stretches. A search of S steps makes ceil(S / g) verifications.

Adaptive rule (`adaptive_granularity`): after a verification, margin = mean score of the kept children -
mean score of the pruned ones. If margin < `granularity_margin` the verifier hardly told them apart, so the
next round writes twice as many steps before verifying (g doubles, at most max_steps); as soon as a
verification separates them again, g returns to the configured `granularity`.
"""

from __future__ import annotations

import statistics

import sglang as sgl

from sgl_tts.search import (aggregate, expand, extract_answer, finish, ReasoningPath, rank_key, run_search, Runtimes,
                            SearchConfig, SearchResult, SearchContext)


def next_granularity(g: int, kept: list[ReasoningPath], pruned: list[ReasoningPath], config: SearchConfig) -> int:
    if not config.adaptive_granularity or not kept or not pruned:
        return g
    margin = (statistics.fmean(aggregate(p.step_scores, config.aggregation) for p in kept)
              - statistics.fmean(aggregate(p.step_scores, config.aggregation) for p in pruned))
    return min(2 * g, config.max_steps) if margin < config.granularity_margin else config.granularity


def write_one_more_step(paths: list[ReasoningPath], config: SearchConfig,
                        tracker: SearchContext) -> list[ReasoningPath]:
    """Each unfinished path one step further (one child each, no verification); finished ones unchanged."""
    growing = [(p, 1) for p in paths if p.active]
    if not growing:
        return paths
    grown = iter(expand(growing, config, tracker, extract_answer))
    return [next(grown) if p.active else p for p in paths]


@sgl.function
def varying_granularity_program(s, prompt: str, config: SearchConfig, runtimes: Runtimes,
                                tracker: SearchContext, finished: list[ReasoningPath]):
    s += prompt
    beams = [ReasoningPath(state=s)]
    g, steps_done = config.granularity, 0
    keep = max(1, config.n // config.beam_width)
    while beams and steps_done < config.max_steps:
        round_steps = min(g, config.max_steps - steps_done)
        children = expand([(b, config.n if steps_done == 0 else config.beam_width) for b in beams],
                          config, tracker, extract_answer)
        for _ in range(round_steps - 1):
            children = write_one_more_step(children, config, tracker)
        steps_done += round_steps
        tracker.score(runtimes.scorer, prompt, children)
        finished += [c for c in children if not c.active]
        ranked = sorted((c for c in children if c.active), key=lambda c: rank_key(c, config.aggregation))
        kept = {id(c) for c in ranked[:keep]}
        beams = [c for c in children if id(c) in kept]  # in parent order, as the prefix-aware policy needs
        g = next_granularity(g, ranked[:keep], ranked[keep:], config)
    for beam in beams:
        finish(beam, "max_steps", tracker)
    return finished + beams


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    return run_search(varying_granularity_program, problem, "varying_granularity", config, runtimes, context=context)
