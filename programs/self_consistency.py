"""Self-consistency: the majority answer of n independent samples, no verifier (the no-verifier reference).

The samples are best-of-N's (one fork of the prompt, whole solutions split into steps); nothing is scored,
so candidates carry no step scores and the answer is the majority vote (Wang et al. 2022), ties to the
answer seen first.
"""

from __future__ import annotations

import dataclasses

from programs.best_of_n import best_of_n_program
from sgl_tts.search import (RUNTIME_FAILURES, build_result, Runtimes, search_failed, SearchConfig, SearchResult,
                            SearchContext, start_search)


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    tracker = start_search(runtimes, config, problem.id, context)
    try:
        with tracker.running():
            state = best_of_n_program.run(prompt=runtimes.prompt(problem.question), config=config,
                                          tracker=tracker, backend=runtimes.generator)
    except RUNTIME_FAILURES as exc:
        raise search_failed(problem.id, "self_consistency", [], config, tracker, exc) from exc
    tracker.generator_time_s = tracker.elapsed()
    tracker.iterations = 1
    majority = dataclasses.replace(config, selection="majority")
    return build_result(problem.id, "self_consistency", state.ret_value, majority, tracker)
