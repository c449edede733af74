"""Step scorers and score aggregation.

A scorer gives one score in [0, 1] per reasoning step of each path; how the step scores of a path become one
number (last, min, prod, mean) is a separate, named aggregation (STYLE: score per step, aggregate apart).
"""

from __future__ import annotations

import math
import re
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from sgl_tts.runtime import RuntimeConfig

AGGREGATIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "last": lambda scores: scores[-1],
    "min": min,
    "prod": math.prod,
    "mean": lambda scores: sum(scores) / len(scores),
}


def aggregate(step_scores: Sequence[float], strategy: str) -> float:
    """One score for a path from its step scores; a path with no scored step gets 0."""
    if strategy not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {strategy!r}; known: {', '.join(AGGREGATIONS)}")
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


class LikelihoodScorer(StepScorer):
    """Score of a step = exp(mean token log-likelihood of the step under the scorer model).

    The geometric-mean token probability of the step given the prompt and the steps before it. On the CPU
    default it separates right from wrong steps where yes/no prompting does not (DESIGN.md).
    """

    name = "likelihood"

    def __init__(self, runtime, tokenizer, max_parallel: int = 64):
        super().__init__()
        self.runtime = runtime  # sgl_tts.runtime.Runtime (needs .url, .name, .check_alive())
        self.tokenizer = tokenizer
        self.max_parallel = max_parallel

    def _tokenize(self, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """Token ids of prompt+steps and, per step, the index of its first token."""
        ids = list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        starts = []
        for step in steps:
            starts.append(len(ids))
            ids += self.tokenizer(step, add_special_tokens=False).input_ids
        return ids, starts

    def _score_path(self, prompt: str, steps: Sequence[str]) -> list[float]:
        from sgl_tts.runtime import http_json, request_timeout

        ids, starts = self._tokenize(prompt, steps)
        if not steps:
            return []
        first = starts[0]
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": first - 1,
        }
        try:
            answer = http_json(self.runtime.url + "/generate", payload, timeout=request_timeout(self.runtime))
        except OSError as exc:
            self.runtime.check_alive()
            raise ScorerError(f"scorer runtime '{self.runtime.name}' at {self.runtime.url} failed: {exc}") from exc
        # input_token_logprobs[j] is (logprob, token_id, _) of token first-1+j; its logprob is None at j=0
        # only when first-1 == 0; we start one token early so every step token gets a conditional logprob.
        logprobs = [entry[0] for entry in answer["meta_info"]["input_token_logprobs"]]
        offset = first - 1
        self._count(len(ids))
        scores = []
        bounds = list(starts) + [len(ids)]
        for i in range(len(steps)):
            values = [logprobs[t - offset] for t in range(bounds[i], bounds[i + 1])
                      if 0 <= t - offset < len(logprobs) and logprobs[t - offset] is not None]
            scores.append(math.exp(sum(values) / len(values)) if values else 0.0)
        return scores

    def score(self, prompt: str, paths: Sequence[Sequence[str]]) -> list[list[float]]:
        if len(paths) <= 1:
            return [self._score_path(prompt, p) for p in paths]
        with ThreadPoolExecutor(max_workers=min(self.max_parallel, len(paths))) as pool:
            return list(pool.map(lambda p: self._score_path(prompt, p), paths))


def _prm_scorer(class_name: str) -> Callable[..., StepScorer]:
    """Factory for a PRM scorer class in `sgl_tts.prm_scorers` (imported on use: it imports this module)."""
    def make(config: "ScorerConfig", runtime: Any, tokenizer: Any) -> StepScorer:
        from sgl_tts import prm_scorers

        return getattr(prm_scorers, class_name)(config, runtime, tokenizer)
    return make


SCORER_KINDS: dict[str, Callable[..., StepScorer]] = {
    "likelihood": lambda config, runtime, tokenizer: LikelihoodScorer(runtime, tokenizer),
    "math_shepherd": _prm_scorer("MathShepherdScorer"),
    "rlhflow": _prm_scorer("RLHFlowScorer"),
    "classifier": _prm_scorer("ClassifierPRMScorer"),
}


@dataclass(frozen=True)
class ScorerConfig:
    kind: str = "likelihood"  # one of SCORER_KINDS
    runtime: RuntimeConfig | None = None  # None: score on the generator's runtime
    # Logprob-tag PRMs (math_shepherd, rlhflow): step score = P(+) / (P(+) + P(-)) read where the PRM
    # judges the step. The defaults are the published models' strings; the ids override the tokenizer.
    step_tag: str = " ки"  # math_shepherd: written after every step
    positive_token: str = "+"
    negative_token: str = "-"
    positive_token_id: int | None = None  # None: the tokenizer's single token for positive_token
    negative_token_id: int | None = None
    # Classifier PRM (classifier): the token after every step and the system turn of its chat format.
    step_token: str = "<extra_0>"
    system_prompt: str | None = None  # None: the model card's prompt (sgl_tts.prm_models.client)
    # PRMs read the question, not the generator's prompt: the last match of group 1 in the prompt.
    question_pattern: str = r"<\|im_start\|>user\n(.*?)<\|im_end\|>"

    def __post_init__(self) -> None:
        if self.kind not in SCORER_KINDS:
            raise ValueError(f"unknown scorer kind {self.kind!r}; known: {', '.join(SCORER_KINDS)}")
        for name in ("step_tag", "positive_token", "negative_token", "step_token"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        if self.positive_token == self.negative_token:
            raise ValueError(f"positive_token and negative_token must differ, both are {self.positive_token!r}")
        for name in ("positive_token_id", "negative_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a token id (int >= 0) or null, got {value!r}")
        if self.positive_token_id is not None and self.positive_token_id == self.negative_token_id:
            raise ValueError(f"positive_token_id and negative_token_id must differ, both are {self.positive_token_id}")
        try:
            groups = re.compile(self.question_pattern).groups
        except re.error as exc:
            raise ValueError(f"question_pattern is not a valid regular expression: {exc}") from None
        if groups < 1:
            raise ValueError("question_pattern needs a group that captures the question, e.g. 'user\\n(.*?)<'")


def make_scorer(config: ScorerConfig, runtime: Any, tokenizer: Any) -> StepScorer:
    """The configured scorer, reading from `runtime` (a started Runtime) with `tokenizer`."""
    return SCORER_KINDS[config.kind](config, runtime, tokenizer)
