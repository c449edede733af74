"""The memo RSD runs share: each context's draft step, its score and the target's step (the delta sweep reuses
it across runs)."""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class StepCache:
    """Memo of the work RSD does at one context: the draft's step, its score and the target's step.

    The key holds everything that work depends on (prompts, the steps so far, the step's token budget), so a
    cached entry is what a rerun would compute whenever generation is deterministic (temperature 0). With
    sampling, runs that share the cache share each context's samples (common random numbers).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def fetch(self, part: str, key: tuple, compute: Callable[[], T]) -> tuple[T, bool]:
        """(value, was cached) for `part` ('draft', 'score' or 'target') at `key`."""
        with self._lock:
            if (part, key) in self._entries:
                self.hits += 1
                return self._entries[(part, key)], True
        value = compute()  # outside the lock: other problems go on meanwhile
        with self._lock:
            self.misses += 1
            self._entries[(part, key)] = value
        return value, False

    def __len__(self) -> int:
        return len(self._entries)
