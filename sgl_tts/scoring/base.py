"""Step scorers, incremental scoring, and score aggregation.

A scorer gives one score in [0, 1] per reasoning step of each path; how the step scores of a path become one
number (last, min, prod, mean) is a separate, named aggregation (STYLE: score per step, aggregate apart).

Incremental scoring: the score of step k depends only on the prompt and steps 1..k, so a search that scores
its paths every iteration re-scores nothing it has scored before. `StepScorer.score` looks each path up in a
bounded memo keyed by (prompt, steps); the longest memoized prefix gives the scores of the first steps, and
the subclass hook `score_new_steps` scores only the rest, so a child pays for its own step only and the
verifier runtime can serve the question and the earlier steps from its radix cache.

A scorer that reads from the generator's own runtime (`sgl_tts.scoring.probe`, a head on the generator's hidden
state) finds the paths' tokens in that runtime's radix cache only on the data-parallel rank that generated them.
`scoring_run(run_id)` names the program run a scoring call serves (`SearchContext.score` sets it), and such a
scorer tags its requests with it, so the rank placement (`policies/search_placement.py`) sends them there.
"""

from __future__ import annotations

import math
import threading
from abc import ABC
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from sgl_tts.registry import Registry

AGGREGATIONS: Registry[Callable[[Sequence[float]], float]] = Registry("aggregation", {
    "last": lambda scores: scores[-1],
    "min": min,
    "prod": math.prod,
    "mean": lambda scores: sum(scores) / len(scores),
})

DEFAULT_MEMO_PATHS = 4096

_scored_run: ContextVar[str | None] = ContextVar("scored_run", default=None)


@contextmanager
def scoring_run(run_id: str | None) -> Iterator[None]:
    """Within the block, scoring calls of this thread serve program run `run_id` (None: no run)."""
    token = _scored_run.set(run_id)
    try:
        yield
    finally:
        _scored_run.reset(token)


def scored_run() -> str | None:
    """The program run the current scoring call serves (`scoring_run`), or None."""
    return _scored_run.get()


def aggregate(step_scores: Sequence[float], strategy: str) -> float:
    """One score for a path from its step scores; a path with no scored step gets 0."""
    AGGREGATIONS.check(strategy)
    return AGGREGATIONS[strategy](step_scores) if step_scores else 0.0


def rank_key(path: Any, aggregation: str) -> tuple[float, str]:
    """Sort key of a scored path (anything with `step_scores` and `steps`): higher aggregated score first, then
    the path text (deterministic ties)."""
    return (-aggregate(path.step_scores, aggregation), "".join(path.steps))


class ScorerError(RuntimeError):
    """The scorer's runtime failed; the message names the runtime."""


@dataclass
class ScoreCounts:
    """What one `score` call cost. Filled from several threads (the request threads of one call)."""

    paths: int = 0
    steps: int = 0  # steps of all paths in the call
    scored_steps: int = 0  # steps the verifier model scored (the rest came from the memo)
    requests: int = 0  # prompts sent to the verifier runtime
    input_tokens: int = 0  # prompt tokens of those requests (SGLang meta_info prompt_tokens)
    cached_tokens: int = 0  # of which the runtime served from its radix cache (meta_info cached_tokens)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_request(self, input_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self.requests += 1
            self.input_tokens += input_tokens
            self.cached_tokens += cached_tokens

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in
                ("paths", "steps", "scored_steps", "requests", "input_tokens", "cached_tokens")}


@dataclass
class ScoredPaths:
    scores: list[list[float]]  # one list per path, one score per step
    counts: ScoreCounts


class StepMemo:
    """Thread-safe LRU map (prompt, steps) -> the path's step scores, holding at most `max_paths` paths."""

    def __init__(self, max_paths: int = DEFAULT_MEMO_PATHS):
        if max_paths < 1:
            raise ValueError(f"memo size must be at least 1 path, got {max_paths}")
        self.max_paths = max_paths
        self._entries: OrderedDict[tuple[str, tuple[str, ...]], tuple[float, ...]] = OrderedDict()
        # every proper prefix of a memoized path -> that path's key: a prefix's scores are the path's first ones
        self._extends: dict[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, prompt: str, steps: tuple[str, ...]) -> tuple[float, ...]:
        """The scores of the longest memoized prefix of `steps` (empty when none is memoized); a prefix of a
        memoized path counts too."""
        with self._lock:
            for end in range(len(steps), 0, -1):
                key = (prompt, steps[:end])
                stored = key if key in self._entries else self._extends.get(key)
                if stored is not None:
                    self._entries.move_to_end(stored)
                    return self._entries[stored][:end]
        return ()

    def put(self, prompt: str, steps: tuple[str, ...], scores: Sequence[float]) -> None:
        assert len(scores) == len(steps), f"memo entry with {len(steps)} steps got {len(scores)} scores"
        with self._lock:
            key = (prompt, steps)
            self._entries[key] = tuple(scores)
            self._entries.move_to_end(key)
            for end in range(1, len(steps)):
                self._extends[(prompt, steps[:end])] = key
            while len(self._entries) > self.max_paths:
                (old_prompt, old_steps), _ = self._entries.popitem(last=False)
                for end in range(1, len(old_steps)):
                    prefix = (old_prompt, old_steps[:end])
                    if self._extends.get(prefix) == (old_prompt, old_steps):
                        del self._extends[prefix]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._extends.clear()

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._entries) <= self.max_paths, f"memo holds {len(self._entries)} > {self.max_paths} paths"
            for (_, steps), scores in self._entries.items():
                assert len(scores) == len(steps), f"memo entry of {len(steps)} steps holds {len(scores)} scores"
            for (prompt, prefix), stored in self._extends.items():
                assert stored in self._entries and stored[1][:len(prefix)] == prefix, "a prefix points to its path"


def shared_prefix_length(id_lists: Sequence[Sequence[int]]) -> int:
    """How many leading token ids every list shares."""
    shortest = min(len(ids) for ids in id_lists)
    for position in range(shortest):
        token = id_lists[0][position]
        if any(ids[position] != token for ids in id_lists):
            return position
    return shortest


class StepScorer(ABC):
    """Scores every step of each path. `prompt` is the formatted prompt the generator saw.

    A scorer kind implements `score_new_steps` and gets incremental scoring (memo, dedup, counts) from
    `score`. A scorer that overrides `score` itself scores whole paths every call (test doubles do).
    """

    name = "scorer"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens_processed = 0  # prompt tokens the scorer's model read (for FLOPs accounting)
        self.tokens_cached = 0  # of which its runtime served from the radix cache
        self.requests = 0
        self.incremental = True
        self.memo = StepMemo()

    def set_incremental(self, incremental: bool, memo_paths: int = DEFAULT_MEMO_PATHS) -> None:
        """Off: every call scores every step from the first (the naive baseline). On: a fresh memo."""
        self.incremental = incremental
        self.memo = StepMemo(memo_paths)

    def score(self, prompt: str, paths: Sequence[Sequence[str]]) -> list[list[float]]:
        """Per-step scores in [0, 1]: one list per path, one score per step."""
        return self.score_into(prompt, paths, ScoreCounts())

    def score_counted(self, prompt: str, paths: Sequence[Sequence[str]]) -> ScoredPaths:
        """`score` and what it cost: verifier requests, input and cached tokens, steps scored. For a scorer
        that overrides `score` only the paths and steps are counted."""
        counts = ScoreCounts()
        if type(self).score is not StepScorer.score:
            counts.paths, counts.steps = len(paths), sum(len(p) for p in paths)
            return ScoredPaths([list(s) for s in self.score(prompt, paths)], counts)
        return ScoredPaths(self.score_into(prompt, paths, counts), counts)

    def score_into(self, prompt: str, paths: Sequence[Sequence[str]], counts: ScoreCounts) -> list[list[float]]:
        """`score`, adding its cost to `counts`: memoized steps are looked up, the rest scored."""
        counts.paths += len(paths)
        counts.steps += sum(len(p) for p in paths)
        keys = [tuple(p) for p in paths]
        if not self.incremental:  # the baseline: every path, duplicates included, from its first step
            return self._score_new(prompt, keys, [0] * len(keys), counts)
        known = {key: self.memo.longest_prefix(prompt, key) for key in keys}
        todo = [key for key in dict.fromkeys(keys) if len(known[key]) < len(key)]  # unique, in order
        new = self._score_new(prompt, todo, [len(known[key]) for key in todo], counts)
        for key, new_scores in zip(todo, new):
            known[key] = (*known[key], *new_scores)
            self.memo.put(prompt, key, known[key])
        return [list(known[key]) for key in keys]

    def _score_new(self, prompt: str, paths: Sequence[tuple[str, ...]], first_new: Sequence[int],
                   counts: ScoreCounts) -> list[list[float]]:
        """`score_new_steps`, checked: one list per path of exactly its new steps' scores."""
        counts.scored_steps += sum(len(p) - first for p, first in zip(paths, first_new))
        if not paths:
            return []
        new = self.score_new_steps(prompt, paths, first_new, counts)
        if len(new) != len(paths):
            raise ScorerError(f"scorer '{self.name}' returned {len(new)} paths for {len(paths)}")
        for steps, first, scores in zip(paths, first_new, new):
            if len(scores) != len(steps) - first:
                raise ScorerError(f"scorer '{self.name}' returned {len(scores)} scores for "
                                  f"{len(steps) - first} new steps")
        return [list(scores) for scores in new]

    def score_new_steps(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        """Scores of steps first_new[i]: of each path i, the earlier steps being known; report every
        runtime request with `self._count(input_tokens, cached_tokens, counts)`."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_new_steps (or override score)")

    def _prefill_shared_prefix(self, id_lists: Sequence[Sequence[int]], first_new: Sequence[int],
                               generate: Callable[[dict[str, Any]], Any], counts: ScoreCounts) -> None:
        """Before a batch of several requests some of which are read from their start, send the token ids they
        all start with (the question, at least) alone through `generate` (a runtime's /generate), so that its
        radix cache holds them when the batch arrives. SGLang matches a request's prefix when it schedules it,
        and the requests of one batch are scheduled together: without this, each of the n paths computes the
        shared Q tokens again, n·Q where Q would do. At n = 256 (Q = 53 tokens, three steps of up to 24) that
        held the probe verifier's measured hit at 0.59-0.65, where the plan's model allows 0.76
        (`memory_plan.planned_verifier_hit`)."""
        if len(id_lists) < 2 or min(first_new) > 0:
            return
        shared = shared_prefix_length(id_lists)
        if shared == 0:
            return
        answer = generate({"input_ids": list(id_lists[0][:shared]),
                           "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        self._count_answer(answer["meta_info"], shared, counts)

    def _count_answer(self, meta: dict[str, Any], sent_tokens: int, counts: ScoreCounts | None = None) -> None:
        """`_count` one runtime answer from its SGLang `meta_info` (`sent_tokens` when it reports no prompt tokens)."""
        self._count(int(meta.get("prompt_tokens", sent_tokens)), int(meta.get("cached_tokens") or 0), counts)

    def _count(self, tokens: int, cached: int = 0, counts: ScoreCounts | None = None) -> None:
        with self._lock:
            self.tokens_processed += tokens
            self.tokens_cached += cached
            self.requests += 1
        if counts is not None:
            counts.add_request(tokens, cached)
