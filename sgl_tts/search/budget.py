"""A search's budget (`search.budget`): a deadline and a token budget, its slack, and how the search narrows.

    slack = min(time left / deadline_s, tokens left / max_tokens)     (1 for a budget that is not set)

The search context reads the budget after every request (`sgl_tts.search.context.SearchContext`); `expand`
and `SearchContext.score` narrow the search while the slack is below `narrow_below` (`Narrowing`), and at the
deadline or the token budget the search stops: no new request is sent, the ones in flight are aborted, and
the program answers with what it has (`SearchResult.finish_reason` "deadline" or "token_budget").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sgl_tts.config import FieldValueError

DEADLINE, TOKEN_BUDGET = "deadline", "token_budget"  # SearchResult.finish_reason of a search its budget stopped


@dataclass(frozen=True)
class Budget:
    deadline_s: float | None = None  # seconds from the search's start (a served request's arrival); None: none
    max_tokens: int | None = None  # generated tokens of the whole search, every path; None: none
    narrow_below: float = 0.5  # below this slack: fewer children per path, no speculation, a smaller verifier batch

    def __post_init__(self) -> None:
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise FieldValueError("deadline_s", "budget.deadline_s must be a number of seconds > 0 or null, "
                                                f"got {self.deadline_s}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise FieldValueError("max_tokens", f"budget.max_tokens must be at least 1 or null, "
                                                f"got {self.max_tokens}")
        if not 0 <= self.narrow_below <= 1:
            raise FieldValueError("narrow_below", f"budget.narrow_below must be in [0, 1], "
                                                  f"got {self.narrow_below}")

    @property
    def active(self) -> bool:
        return self.deadline_s is not None or self.max_tokens is not None

    def slack(self, elapsed_s: float, tokens: int) -> float:
        """The fraction of the budget left, the smaller of time and tokens; 0 once either is spent."""
        shares = [1.0]
        if self.deadline_s is not None:
            shares.append(1 - elapsed_s / self.deadline_s)
        if self.max_tokens is not None:
            shares.append(1 - tokens / self.max_tokens)
        return max(0.0, min(shares))

    def exhausted(self, elapsed_s: float, tokens: int) -> str | None:
        """DEADLINE or TOKEN_BUDGET once that part of the budget is spent (the deadline first), else None."""
        if self.deadline_s is not None and elapsed_s >= self.deadline_s:
            return DEADLINE
        if self.max_tokens is not None and tokens >= self.max_tokens:
            return TOKEN_BUDGET
        return None

    def narrowing(self, elapsed_s: float, tokens: int) -> bool:
        return self.slack(elapsed_s, tokens) < self.narrow_below


class Narrowing:
    """How a search narrows below the slack threshold: half the children per path (at least one) and a
    verifier call that scores at most half of its paths (at least one)."""

    @staticmethod
    def children(count: int) -> int:
        return max(1, count // 2) if count > 0 else 0

    @staticmethod
    def verifier_batch(paths: int) -> int:
        return max(1, math.ceil(paths / 2)) if paths > 0 else 0
