"""Reward-guided speculative decoding (RSD): the parts that need no model.

- weighting functions omega(r) (RSD Table 1) in a registry by name, and the checks of their settings;
- the acceptance criterion A_omega (RSD Algorithm 2);
- per-step records that the RSD program (Algorithm 1) produces, and the statistics and FLOPs computed from
  them (RSD §3.3: 2N FLOPs per token for a model of N parameters, draft tokens of rejected steps included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from sgl_tts.registry import Registry

WeightingFn = Callable[[float, "WeightingSettings"], float]


def binary_weight(r: float, settings: WeightingSettings) -> float:
    """1(r >= delta): the paper's default and, under a target-call budget, optimal (RSD Prop. 2.3)."""
    return 1.0 if r >= settings.delta else 0.0


def constant_weight(r: float, settings: WeightingSettings) -> float:
    """p, ignoring the reward."""
    return settings.constant


def clipping_weight(r: float, settings: WeightingSettings) -> float:
    """min(1, max(0, r))."""
    return min(1.0, max(0.0, r))


def sigmoidal_weight(r: float, settings: WeightingSettings) -> float:
    """max(0, r/(1+r)); taken as 0 for every r <= 0, where r/(1+r) is negative or (r <= -1) undefined."""
    return r / (1.0 + r) if r > 0 else 0.0


def logistic_weight(r: float, settings: WeightingSettings) -> float:
    """1 / (1 + exp(-alpha (r - delta))), a smooth step centred on delta."""
    z = settings.logistic_alpha * (r - settings.delta)
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    ez = math.exp(z)  # same value, written so that exp cannot overflow for very negative z
    return ez / (1.0 + ez)


WEIGHTINGS: Registry[WeightingFn] = Registry("weighting", {
    "binary": binary_weight,
    "constant": constant_weight,
    "clipping": clipping_weight,
    "sigmoidal": sigmoidal_weight,
    "logistic": logistic_weight,
})


def get_weighting(name: str) -> WeightingFn:
    WEIGHTINGS.check(name)
    return WEIGHTINGS[name]


class WeightingSettings(Protocol):
    """The settings omega reads: which weighting, and its parameters (the rsd program's `Settings`; the paper's
    defaults are RSD §3, Fig. 6 for constant and logistic)."""

    weighting: str
    delta: float  # threshold of `binary`, centre of `logistic`
    constant: float  # p of `constant`
    logistic_alpha: float  # steepness of `logistic`


def check_weighting_settings(settings: WeightingSettings) -> None:
    """Raise ValueError naming the first setting outside its domain."""
    WEIGHTINGS.check(settings.weighting)
    if not 0.0 <= settings.delta <= 1.0:
        raise ValueError(f"delta must be in [0, 1], got {settings.delta}")
    if not 0.0 <= settings.constant <= 1.0:
        raise ValueError(f"constant must be in [0, 1], got {settings.constant}")
    if not settings.logistic_alpha > 0:
        raise ValueError(f"logistic_alpha must be > 0 (omega must not decrease in r), got {settings.logistic_alpha}")


def weight(reward: float, settings: WeightingSettings) -> float:
    """omega(r) for the settings' weighting."""
    return WEIGHTINGS[settings.weighting](reward, settings)


class UniformSource(Protocol):
    """`random.Random` or `numpy.random.Generator`: anything whose random() is uniform on [0, 1)."""

    def random(self) -> float: ...


def accept_with_weight(weight: float, rng: UniformSource) -> bool:
    """RSD Algorithm 2: reject at weight 0, accept at 1, otherwise accept iff u < weight for u ~ U[0, 1).

    At 0 and 1 no number is drawn, so a binary weighting leaves `rng` untouched.
    """
    assert 0.0 <= weight <= 1.0, f"weight must be in [0, 1], got {weight}"
    if weight == 0.0:
        return False
    if weight == 1.0:
        return True
    return rng.random() < weight


def accept_draft_step(reward: float, settings: WeightingSettings, rng: UniformSource) -> bool:
    """A_omega(r): whether the draft step with PRM score `reward` is kept."""
    return accept_with_weight(weight(reward, settings), rng)


# --- per-step records and run statistics -------------------------------------------------------------------

MODELS = ("draft", "target", "prm")


@dataclass(frozen=True)
class StepRecord:
    """One step of Algorithm 1: the draft proposed a step, the PRM scored it, and the target rewrote it
    if it was rejected. Token counts are what each model processed for this step; the draft's count
    includes the tokens of a rejected proposal."""

    writer: Literal["draft", "target"]
    score: float | None  # PRM score of the draft proposal; None if the program did not score it
    accepted: bool  # whether the draft proposal was kept
    draft_tokens: int
    target_tokens: int
    prm_tokens: int
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    prm_time_s: float = 0.0

    def __post_init__(self) -> None:
        if self.writer not in ("draft", "target"):
            raise ValueError(f"writer must be 'draft' or 'target', got {self.writer!r}")
        if self.accepted != (self.writer == "draft"):
            raise ValueError(f"writer {self.writer!r} contradicts accepted={self.accepted}")
        for name in ("draft_tokens", "target_tokens", "prm_tokens", "draft_time_s", "target_time_s", "prm_time_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def _sum_by_model(records: Iterable[StepRecord], quantity: str, zero: float) -> dict[str, Any]:
    """Per model, the sum of the records' `<model>_<quantity>` fields."""
    totals = dict.fromkeys(MODELS, zero)
    for record in records:
        for model in MODELS:
            totals[model] += getattr(record, f"{model}_{quantity}")
    return totals


def tokens_by_model(records: Iterable[StepRecord]) -> dict[str, int]:
    """Tokens processed per model, rejected draft proposals included."""
    return _sum_by_model(records, "tokens", 0)


def time_by_model(records: Iterable[StepRecord]) -> dict[str, float]:
    """Seconds spent per model."""
    return _sum_by_model(records, "time_s", 0.0)


def rejected_draft_tokens(records: Iterable[StepRecord]) -> int:
    """Draft tokens thrown away with rejected proposals."""
    return sum(record.draft_tokens for record in records if not record.accepted)


def target_invocation_rate(records: Sequence[StepRecord]) -> float:
    """Rejected steps / steps: how often the target had to write the step."""
    if not records:
        raise ValueError("target invocation rate of zero steps is undefined")
    return sum(not record.accepted for record in records) / len(records)


def solved_by_draft_alone(records: Iterable[StepRecord]) -> bool:
    """True when the target wrote no step of this problem."""
    return all(record.accepted for record in records)


def draft_only_fraction(problems: Sequence[Sequence[StepRecord]]) -> float:
    """Fraction of problems whose every step the draft wrote (RSD Fig. 5, "solved by draft alone")."""
    if not problems:
        raise ValueError("draft-only fraction of zero problems is undefined")
    return sum(solved_by_draft_alone(records) for records in problems) / len(problems)


@dataclass
class FlopsCounter:
    """FLOPs by the 2N-per-token rule (RSD §3.3), N = parameter count of each model."""

    draft_params: int
    target_params: int
    prm_params: int
    draft_tokens: int = 0
    target_tokens: int = 0
    prm_tokens: int = 0

    def add(self, draft: int = 0, target: int = 0, prm: int = 0) -> None:
        assert min(draft, target, prm) >= 0, f"token counts must be >= 0, got {draft}, {target}, {prm}"
        self.draft_tokens += draft
        self.target_tokens += target
        self.prm_tokens += prm

    def add_records(self, records: Iterable[StepRecord]) -> None:
        tokens = tokens_by_model(records)
        self.add(tokens["draft"], tokens["target"], tokens["prm"])

    def flops_by_model(self) -> dict[str, int]:
        return {
            "draft": 2 * self.draft_params * self.draft_tokens,
            "target": 2 * self.target_params * self.target_tokens,
            "prm": 2 * self.prm_params * self.prm_tokens,
        }

    def total_flops(self) -> int:
        return sum(self.flops_by_model().values())


@dataclass(frozen=True)
class RSDRunStats:
    problems: int
    steps: int
    draft_only_fraction: float
    target_invocation_rate: float
    tokens: dict[str, int]
    rejected_draft_tokens: int
    time_s: dict[str, float]
    flops: dict[str, int]
    total_flops: int


def summarize_run(
    problems: Sequence[Sequence[StepRecord]], draft_params: int, target_params: int, prm_params: int
) -> RSDRunStats:
    """Run-level statistics over the step records of each problem."""
    steps = [record for records in problems for record in records]
    flops = FlopsCounter(draft_params, target_params, prm_params)
    flops.add_records(steps)
    return RSDRunStats(
        problems=len(problems),
        steps=len(steps),
        draft_only_fraction=draft_only_fraction(problems),
        target_invocation_rate=target_invocation_rate(steps),
        tokens=tokens_by_model(steps),
        rejected_draft_tokens=rejected_draft_tokens(steps),
        time_s=time_by_model(steps),
        flops=flops.flops_by_model(),
        total_flops=flops.total_flops(),
    )
