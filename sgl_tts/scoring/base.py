"""Step scorers and score aggregation.

A scorer gives one score in [0, 1] per reasoning step of each path; how the step scores of a path become one
number (last, min, prod, mean) is a separate, named aggregation (STYLE: score per step, aggregate apart).
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from typing import Callable, Sequence

from sgl_tts.registry import Registry

AGGREGATIONS: Registry[Callable[[Sequence[float]], float]] = Registry("aggregation", {
    "last": lambda scores: scores[-1],
    "min": min,
    "prod": math.prod,
    "mean": lambda scores: sum(scores) / len(scores),
})


def aggregate(step_scores: Sequence[float], strategy: str) -> float:
    """One score for a path from its step scores; a path with no scored step gets 0."""
    AGGREGATIONS.check(strategy)
    return AGGREGATIONS[strategy](step_scores) if step_scores else 0.0


class ScorerError(RuntimeError):
    """The scorer's runtime failed; the message names the runtime."""


class StepScorer(ABC):
    """Scores every step of each path. `prompt` is the formatted prompt the generator saw."""

    name = "scorer"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tokens_processed = 0  # prompt tokens the scorer's model read (for FLOPs accounting)
        self.requests = 0

    @abstractmethod
    def score(self, prompt: str, paths: Sequence[Sequence[str]]) -> list[list[float]]:
        """Per-step scores in [0, 1]: one list per path, one score per step."""

    def _count(self, tokens: int) -> None:
        with self._lock:
            self.tokens_processed += tokens
            self.requests += 1
