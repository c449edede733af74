"""Best-of-N: N independent whole solutions from one forked prompt, every step scored, one answer picked.

Selection (config.selection): `best` takes the highest-scoring path, `weighted` sums path scores per answer,
`majority` counts answers.
"""

from __future__ import annotations

import sglang as sgl

from sgl_tts.search import (RUNTIME_FAILURES, answer_at_end, as_generated, build_result, extract_answer, finish,
                            ReasoningPath, record_token_confidences, Runtimes, search_failed, SearchConfig,
                            SearchResult, SearchContext, start_search, split_steps, top_logprobs_request)


@sgl.function
def best_of_n_program(s, prompt: str, config: SearchConfig, tracker: SearchContext, logprobs: int = 0):
    """config.n whole solutions; with `logprobs` > 0 each path carries its token confidences (extra)."""
    s += prompt
    s.text()  # commit the prompt so the fork pre-caches it (docs/sglang.md)
    forks = s.fork(config.n)
    for fork in forks:
        fork += sgl.gen("solution", max_tokens=config.max_tokens, temperature=config.temperature,
                        top_p=config.top_p, **top_logprobs_request(logprobs))
    paths: list[ReasoningPath] = [None] * config.n  # in fork order; each ends as its sample does
    for index, meta in as_generated(list(forks), "solution"):  # first done first: the stopping rules hear it at once
        fork = forks[index]
        text = fork["solution"]
        path = ReasoningPath(state=fork, steps=split_steps(text, config.step_delimiter, config.max_steps),
                             tokens=int(meta.get("completion_tokens", 0)))
        record_token_confidences(path, meta)
        reason = (meta.get("finish_reason") or {}).get("type")
        marked = extract_answer(text)
        paths[index] = path
        if reason == "abort":  # the engine aborted it (the search stopped early): an unfinished path
            continue
        # a solution the model ended may state its answer unmarked at the end; one cut at max_tokens has none
        path.answer = marked if marked is not None or reason == "length" else answer_at_end(text)
        finish(path, "answer" if marked else ("max_tokens" if reason == "length" else "eos"), tracker)
    forks.join()
    return paths


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    tracker = start_search(runtimes, config, problem.id, context)
    prompt = runtimes.prompt(problem.question)
    try:
        with tracker.running():
            paths = best_of_n_program.run(prompt=prompt, config=config, tracker=tracker,
                                          backend=runtimes.generator).ret_value
    except RUNTIME_FAILURES as exc:
        raise search_failed(problem.id, "best_of_n", [], config, tracker, exc) from exc
    tracker.generator_time_s = tracker.elapsed()
    tracker.iterations = 1
    if runtimes.scorer is not None:
        try:
            tracker.score(runtimes.scorer, prompt, paths)
        except RUNTIME_FAILURES as exc:  # the samples are finished: keep them, unscored
            raise search_failed(problem.id, "best_of_n", paths, config, tracker, exc) from exc
    return build_result(problem.id, "best_of_n", paths, config, tracker)
