"""The scorer section of a run config."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sgl_tts.runtime.server import RuntimeConfig

KINDS = ("likelihood", "math_shepherd", "rlhflow", "classifier", "probe", "skywork")  # sgl_tts.scoring.factory.SCORERS builds each


@dataclass(frozen=True)
class ScorerConfig:
    kind: str = "likelihood"  # one of KINDS (sgl_tts.scoring.factory builds each)
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
    system_prompt: str | None = None  # None: the model card's prompt (sgl_tts.scoring.prm_models.client)
    # PRMs read the question, not the generator's prompt: the last match of group 1 in the prompt.
    question_pattern: str = r"<\|im_start\|>user\n(.*?)<\|im_end\|>"
    # Score only steps not scored before (sgl_tts.scoring.base); false re-scores every path from its first
    # step each call (the naive baseline). memo_paths bounds the memo of scored paths.
    incremental: bool = True
    memo_paths: int = 4096
    # Probe (kind probe) without a runtime of its own: the head the generator's ranks compute margins of, a file
    # or a committed head's name (sgl_tts/scoring/heads); None: the committed default head.
    probe_head: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown scorer kind {self.kind!r}; known: {', '.join(KINDS)}")
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
        if self.probe_head is not None and (self.kind != "probe" or self.runtime is not None):
            raise ValueError("probe_head applies to kind probe without a runtime (the probe read inside the generator)")
        if self.memo_paths < 1:
            raise ValueError(f"memo_paths must be at least 1, got {self.memo_paths}")
        try:
            groups = re.compile(self.question_pattern).groups
        except re.error as exc:
            raise ValueError(f"question_pattern is not a valid regular expression: {exc}") from None
        if groups < 1:
            raise ValueError("question_pattern needs a group that captures the question, e.g. 'user\\n(.*?)<'")
