"""Beam search over reasoning steps (search-and-learn style).

Each iteration every kept beam is forked into M = beam_width children that each write one step; the
scorer scores the new steps and the n / M best unfinished children are kept. Finished paths (an answer,
end of sequence, or a limit) leave the beam and become candidates. The first iteration forks the prompt n
times. The search ends when no beam is left or max_steps is reached.
"""

from __future__ import annotations

import sglang as sgl

from sgl_tts.grading import extract_answer
from sgl_tts.records import SearchResult
from sgl_tts.search import Path, Runtimes, SearchConfig, SearchTracker, build_result, expand, finish, rank_key


def keep_count(config: SearchConfig) -> int:
    return max(1, config.n // config.beam_width)


@sgl.function
def beam_search_program(s, prompt: str, config: SearchConfig, runtimes: Runtimes, tracker: SearchTracker):
    s += prompt
    beams = [Path(state=s)]
    finished: list[Path] = []
    for iteration in range(config.max_steps):
        fan_out = config.n if iteration == 0 else config.beam_width
        children = expand([(beam, fan_out) for beam in beams], config, tracker, extract_answer)
        tracker.score(runtimes.scorer, prompt, children)
        finished += [c for c in children if not c.active]
        ranked = sorted((c for c in children if c.active), key=lambda c: rank_key(c, config.aggregation))
        beams = ranked[: keep_count(config)]
        if not beams:
            break
    for beam in beams:
        finish(beam, "max_steps", tracker)
    return finished + beams


def run(problem, config: SearchConfig, runtimes: Runtimes) -> SearchResult:
    if runtimes.scorer is None:
        raise ValueError("beam_search needs a scorer: set 'scorer' in the config")
    tracker = SearchTracker(config)
    prompt = runtimes.prompt(problem.question)
    state = beam_search_program.run(prompt=prompt, config=config, runtimes=runtimes, tracker=tracker,
                                    backend=runtimes.generator)
    return build_result(problem.id, "beam_search", state.ret_value, config, tracker)
