"""DeepConf's confidence math: confidence-guided self-consistency ("Deep Think with Confidence", Fu et al. 2025).

A trace's confidence is read from the top-k log-probabilities SGLang returns for each output token: a peaked
distribution (the model is sure) has very negative log-probabilities for its runner-up tokens, so their
negative mean is large. Offline, every finished trace gets a confidence, the most confident fraction η is kept
and votes with confidence as its weight. Online, a warm-up of finished traces sets a threshold; a running
trace whose recent confidence falls below it is stopped, and sampling stops once the vote is settled.

Pure functions of numbers and answer strings; answers are compared as given (normalise them first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _check_fraction(name: str, fraction: float) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name}: expected a fraction in (0, 1], got {fraction}")


def _kept_count(fraction: float, total: int) -> int:
    """⌈fraction · total⌉, at least 1; rounded first so that 0.1 · 30 counts 3, not 4."""
    return max(1, math.ceil(round(fraction * total, 9)))


def token_confidence(top_logprobs: Sequence[float]) -> float:
    """The confidence at one position from its k most likely tokens' log-probabilities:

        C_i = −(1/k) Σ_{j=1..k} log P_i(j)
    """
    if not top_logprobs:
        raise ValueError("top_logprobs: expected at least one log-probability, got none")
    return -_mean(top_logprobs)


def group_confidences(token_confidences: Sequence[float], window: int) -> list[float]:
    """The mean token confidence of every window of `window` consecutive tokens, sliding one token at a time:

        C_G(i) = (1/w) Σ_{t=i−w+1..i} C_t   for i = w−1 .. n−1   (n − w + 1 groups)

    A trace shorter than the window is one group, its mean over all n tokens; an empty trace has none.
    Computed from prefix sums: C_G(i) = (S_{i+1} − S_{i+1−w}) / w with S_j = Σ_{t<j} C_t.
    """
    if window < 1:
        raise ValueError(f"window: expected >= 1 tokens, got {window}")
    if not token_confidences:
        return []
    if len(token_confidences) <= window:
        return [_mean(token_confidences)]
    prefix = [0.0, *accumulate(token_confidences)]
    return [(prefix[end] - prefix[end - window]) / window for end in range(window, len(prefix))]


def _groups_of_trace(token_confidences: Sequence[float], window: int) -> list[float]:
    groups = group_confidences(token_confidences, window)
    if not groups:
        raise ValueError("token_confidences: expected a trace of at least one token, got none")
    return groups


def lowest_group_confidence(token_confidences: Sequence[float], window: int) -> float:
    """A trace's confidence as its weakest stretch: min_G C_G (DeepConf's lowest group confidence)."""
    return min(_groups_of_trace(token_confidences, window))


def bottom_group_confidence(token_confidences: Sequence[float], window: int, fraction: float = 0.1) -> float:
    """A trace's confidence as the mean of its lowest ⌈fraction · |G|⌉ group confidences (DeepConf's bottom 10%
    group confidence at the default fraction)."""
    _check_fraction("fraction", fraction)
    groups = sorted(_groups_of_trace(token_confidences, window))
    return _mean(groups[: _kept_count(fraction, len(groups))])


def tail_confidence(token_confidences: Sequence[float], tail: int) -> float:
    """A trace's confidence as the mean token confidence of its last `tail` tokens (all of them when shorter),
    where the answer is written."""
    if tail < 1:
        raise ValueError(f"tail: expected >= 1 tokens, got {tail}")
    if not token_confidences:
        raise ValueError("token_confidences: expected a trace of at least one token, got none")
    return _mean(token_confidences[-tail:])


def filter_top(confidences: Sequence[float], keep_fraction: float) -> list[int]:
    """Indices (ascending) of the ⌈keep_fraction · n⌉ most confident traces, at least one; at equal confidence
    the earlier trace is kept."""
    _check_fraction("keep_fraction", keep_fraction)
    if not confidences:
        return []
    by_confidence = sorted(range(len(confidences)), key=lambda index: (-confidences[index], index))
    return sorted(by_confidence[: _kept_count(keep_fraction, len(confidences))])


def _tally(answers: Sequence[str | None], weights: Sequence[float]) -> dict[str, float]:
    """V(a) = Σ_{t : answer_t = a} w_t over the traces with an answer."""
    if len(answers) != len(weights):
        raise ValueError(f"weights: expected one per answer ({len(answers)}), got {len(weights)}")
    votes: dict[str, list[float]] = {}
    for answer, weight in zip(answers, weights):
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"weights: expected finite values >= 0, got {weight}")
        if answer is not None:
            votes.setdefault(answer, []).append(weight)
    return {answer: math.fsum(answer_weights) for answer, answer_weights in votes.items()}


def _leader(tally: dict[str, float]) -> str | None:
    """argmax_a V(a); at equal weight the answer first in text order."""
    return min(tally, key=lambda answer: (-tally[answer], answer)) if tally else None


def weighted_vote(answers: Sequence[str | None], weights: Sequence[float]) -> str | None:
    """The answer with the largest summed weight, argmax_a V(a) (None answers are ignored; None when no trace
    has an answer). Ties go to the answer first in text order."""
    return _leader(_tally(answers, weights))


def vote_settled(answers: Sequence[str | None], weights: Sequence[float], remaining_traces: int,
                 consensus: float) -> bool:
    """Whether sampling may stop: no trace remains, or the leading answer holds at least `consensus` of the
    weight cast (DeepConf's adaptive sampling stops at β ≥ τ):

        β = V(â) / Σ_a V(a),   â = argmax_a V(a)

    With no weight cast yet (no answers, or only zero weights) the vote is settled only when no trace remains.
    """
    _check_fraction("consensus", consensus)
    if remaining_traces < 0:
        raise ValueError(f"remaining_traces: expected >= 0, got {remaining_traces}")
    tally = _tally(answers, weights)
    if remaining_traces == 0:
        return True
    total = math.fsum(tally.values())
    if total == 0:
        return False
    return tally[_leader(tally)] / total >= consensus


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default): for sorted x and
    h = (n − 1) · q, x[⌊h⌋] + (h − ⌊h⌋) · (x[⌊h⌋ + 1] − x[⌊h⌋])."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


@dataclass(frozen=True)
class OnlineThreshold:
    """DeepConf's online stop rule: a running trace stops when a window's confidence falls below `threshold`."""

    threshold: float
    keep_fraction: float  # η: the share of warm-up traces that would have passed

    @classmethod
    def from_warmup(cls, warmup_confidences: Sequence[float], keep_fraction: float) -> OnlineThreshold:
        """s = the (1 − η) quantile of the warm-up traces' lowest group confidences, so that about the most
        confident η of them stay above it (DeepConf: s = Percentile_{100−η}, keeping the top η%)."""
        _check_fraction("keep_fraction", keep_fraction)
        if not warmup_confidences:
            raise ValueError("warmup_confidences: expected at least one warm-up trace, got none")
        return cls(_quantile(warmup_confidences, 1 - keep_fraction), keep_fraction)

    def should_stop(self, current_group_confidence: float) -> bool:
        """C_G < s for the running trace's latest window."""
        return current_group_confidence < self.threshold
