"""Diverse verifier tree search (DVTS): n / M independent subtrees, each searched greedily, candidates pooled.

The prompt is forked n times; the n first steps are dealt into n / M subtrees of M = beam_width (in text
order, so a search does not depend on which request the server finished first). From then on each subtree
keeps only its best-scoring child and forks it M times for the next step; a subtree ends when its best
child has finished. Where the search gets fewer children than it asked for (a budget's narrowing, or
`stopping.enough` beneath it), the first steps are dealt evenly into at most that many subtrees and each
subtree picks from the children its beam got. Nothing is compared across subtrees until the end, which keeps
them diverse (Beeching et al., search-and-learn; FastTTS §3.1 "diverse selection"). The candidates are the n / M
subtree paths.
"""

from __future__ import annotations

import sglang as sgl

from sgl_tts.search import (expand, extract_answer, finish, ReasoningPath, rank_key, run_search, Runtimes, SearchConfig,
                            SearchResult, SearchContext)


def subtree_count(config: SearchConfig) -> int:
    return max(1, config.n // config.beam_width)


@sgl.function
def dvts_program(s, prompt: str, config: SearchConfig, runtimes: Runtimes, tracker: SearchContext,
                 finished: list[ReasoningPath]):
    s += prompt
    width = config.beam_width
    firsts = sorted(expand([(ReasoningPath(state=s), subtree_count(config) * width)], config, tracker,
                           extract_answer), key=lambda path: path.text)
    subtrees = min(subtree_count(config), len(firsts))
    children_of = {i: firsts[i * len(firsts) // subtrees:(i + 1) * len(firsts) // subtrees] for i in range(subtrees)}
    beams: list[ReasoningPath | None] = [None] * subtrees
    for iteration in range(config.max_steps):
        if iteration > 0:
            growing = [i for i, beam in enumerate(beams) if beam.active]
            if not growing:
                break
            children = expand([(beams[i], width) for i in growing], config, tracker, extract_answer)
            children_of = {i: [child for child in children if child.parent == k] for k, i in enumerate(growing)}
        tracker.score(runtimes.scorer, prompt, [child for group in children_of.values() for child in group])
        for i, group in children_of.items():
            beams[i] = min(group, key=lambda child: rank_key(child, config.aggregation))  # greedy: best child
            beams[i].extra["subtree"] = i
            if not beams[i].active:
                finished.append(beams[i])
    for beam in beams:
        finish(beam, "max_steps", tracker)
    return beams


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    return run_search(dvts_program, problem, "dvts", config, runtimes, context=context)
