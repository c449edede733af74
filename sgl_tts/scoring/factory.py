"""Scorers by kind: the registry `make_scorer` builds a run's scorer from."""

from __future__ import annotations

from typing import Any, Callable

from sgl_tts.registry import Registry
from sgl_tts.scoring.base import StepScorer
from sgl_tts.scoring.scorer_config import KINDS, ScorerConfig
from sgl_tts.scoring.likelihood import LikelihoodScorer
from sgl_tts.scoring.prm import ClassifierPRMScorer, MathShepherdScorer, RLHFlowScorer, SkyworkPRMScorer
from sgl_tts.scoring.probe import ProbeScorer

ScorerFactory = Callable[[ScorerConfig, Any, Any], StepScorer]  # (config, runtime, tokenizer) -> scorer

SCORERS: Registry[ScorerFactory] = Registry("scorer kind", {
    "likelihood": lambda config, runtime, tokenizer: LikelihoodScorer(runtime, tokenizer),
    "math_shepherd": MathShepherdScorer,
    "rlhflow": RLHFlowScorer,
    "classifier": ClassifierPRMScorer,
    "probe": ProbeScorer,  # a trained head on SmolLM2's hidden state (sgl_tts.scoring.probe)
    "skywork": SkyworkPRMScorer,  # Skywork-o1-Open-PRM's value head (sgl_tts.scoring.prm_models.qwen2_prm)
})
assert tuple(SCORERS) == KINDS, "ScorerConfig's KINDS and the SCORERS registry must list the same kinds"


def make_scorer(config: ScorerConfig, runtime: Any, tokenizer: Any) -> StepScorer:
    """The configured scorer, reading from `runtime` (a started Runtime) with `tokenizer`."""
    scorer = SCORERS[config.kind](config, runtime, tokenizer)
    scorer.set_incremental(config.incremental, config.memo_paths)
    return scorer
