"""The result record every search program returns.

One `SearchResult` per problem: the selected answer, every finished or pruned-at-the-end candidate with its
per-step scores, and the token and timing counts the metrics are computed from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

COMPLETE = "complete"  # SearchResult.finish_reason of a search that ran to its end



@dataclass
class Candidate:
    """One reasoning path (beam) as it stood when the search ended."""

    steps: list[str]
    step_scores: list[float]
    score: float  # step_scores aggregated with the configured strategy
    answer: str | None  # extracted final answer, None when the path never gave one
    tokens: int  # generated tokens along this path (all its steps)
    completion_time_s: float  # seconds from search start until this path ended
    finish_reason: str  # "answer", "eos", "max_steps", "max_tokens", "pruned"
    parent: int | None = None  # index of the candidate this one forked from, when a program tracks it
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "".join(self.steps)


@dataclass
class SearchResult:
    """What a search program returns for one problem."""

    problem_id: str
    program: str
    answer: str | None  # the selected final answer; None means "no answer"
    candidates: list[Candidate]
    generated_tokens: int = 0  # every token the generator produced, pruned paths included
    prompt_tokens: int = 0  # prompt tokens sent to the generator
    cached_tokens: int = 0  # of those, served from the radix cache
    generator_time_s: float = 0.0
    verifier_time_s: float = 0.0
    total_time_s: float = 0.0
    iterations: int = 0
    verifier_calls: int = 0
    error: str | None = None  # set when the search stopped early; finished candidates are kept
    # how the search ended: "complete"; "deadline" or "token_budget" (its budget, sgl_tts.search.budget) or
    # "settled" or "ranked" (the stopping rules, sgl_tts.search.stopping) when it stopped early and answered
    finish_reason: str = COMPLETE
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_beam_tokens(self) -> float:
        return sum(c.tokens for c in self.candidates) / len(self.candidates) if self.candidates else 0.0

    @property
    def mean_beam_completion_s(self) -> float:
        if not self.candidates:
            return 0.0
        return sum(c.completion_time_s for c in self.candidates) / len(self.candidates)

    @property
    def precise_goodput(self) -> float | None:
        """FastTTS §6.1: average token length per beam / average beam completion time (tokens/s); None (no
        goodput) when the search generated no tokens, its beams hold none, or they took no time."""
        t = self.mean_beam_completion_s
        if self.generated_tokens <= 0 or self.mean_beam_tokens <= 0 or t <= 0:
            return None
        return self.mean_beam_tokens / t

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["precise_goodput"] = self.precise_goodput
        out["cache_hit_rate"] = self.cache_hit_rate
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SearchResult":
        data = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}}
        data["candidates"] = [Candidate(**c) for c in data.get("candidates", [])]
        return cls(**data)
