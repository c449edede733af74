"""Token-level speculative decoding: the acceptance contracts and the serial speed planner.

Two contracts decide what a verification round emits for a draft token x ~ q:
- `distribution_preserving`: accept x with probability min(1, p(x)/q(x)), else resample from the residual
  max(0, p - q) renormalised. The emitted token then follows the target p exactly (edge-inference eval §IV).
- `greedy`: accept x iff it is argmax p, else emit argmax p. It follows the deterministic target path, not p.

The planner is the serial round-cost model of edge-inference eval eqs. (6)-(7); `sgl-tts plan spec` prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

_PROB_TOLERANCE = 1e-6


def _check_distribution(name: str, dist: np.ndarray) -> None:
    if dist.ndim != 1 or dist.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D probability array, got shape {dist.shape}")
    if np.any(dist < 0) or not np.all(np.isfinite(dist)):
        raise ValueError(f"{name} must hold finite non-negative probabilities, got {dist}")
    if abs(dist.sum() - 1.0) > _PROB_TOLERANCE:
        raise ValueError(f"{name} must sum to 1, sums to {dist.sum()}")


def _as_distributions(p, q) -> tuple[np.ndarray, np.ndarray]:
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    _check_distribution("p", p)
    _check_distribution("q", q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must cover the same vocabulary, got sizes {p.size} and {q.size}")
    return p, q


def acceptance_probability(p, q, draft_tokens) -> np.ndarray:
    """a(x) = min(1, p(x)/q(x)) for each draft token x (edge-inference eval eq. 5)."""
    p, q = _as_distributions(p, q)
    tokens = np.asarray(draft_tokens)
    if np.any(q[tokens] <= 0):
        raise ValueError("a draft token has q(x) = 0: it cannot have been drawn from q")
    return np.minimum(1.0, p[tokens] / q[tokens])


def residual_distribution(p, q) -> np.ndarray:
    """max(0, p - q) normalised: where a rejected round resamples from."""
    p, q = _as_distributions(p, q)
    residual = np.maximum(0.0, p - q)
    total = residual.sum()
    # total = 0 means p == q, where a(x) = 1 and no round is ever rejected; p is then the right answer anyway.
    return residual / total if total > 0 else p


def distribution_preserving_round(p, q, draft_tokens, rng: np.random.Generator):
    """Verify draft token(s) x ~ q against target p; return the emitted token(s), distributed as p.

    `draft_tokens` is one token id (returns an int) or an array of independent rounds (returns an array).
    """
    accept_prob = acceptance_probability(p, q, draft_tokens)
    tokens = np.asarray(draft_tokens)
    rejected = rng.random(tokens.shape) >= accept_prob
    emitted = np.array(tokens, copy=True)
    n_rejected = int(rejected.sum())
    if n_rejected:
        residual = residual_distribution(p, q)
        emitted[rejected] = rng.choice(residual.size, size=n_rejected, p=residual)
    return int(emitted) if emitted.ndim == 0 else emitted


def greedy_round(p, q, draft_tokens, rng: np.random.Generator | None = None):
    """Accept draft token(s) iff equal to argmax p, else emit argmax p. `rng` is unused (same signature)."""
    p, q = _as_distributions(p, q)
    tokens = np.asarray(draft_tokens)
    target_token = int(np.argmax(p))
    emitted = np.where(tokens == target_token, tokens, target_token)
    return int(emitted) if emitted.ndim == 0 else emitted


Contract = Callable[..., "int | np.ndarray"]
CONTRACTS: dict[str, Contract] = {
    "distribution_preserving": distribution_preserving_round,
    "greedy": greedy_round,
}


def get_contract(name: str) -> Contract:
    if name not in CONTRACTS:
        raise ValueError(f"unknown acceptance contract {name!r}; known: {', '.join(sorted(CONTRACTS))}")
    return CONTRACTS[name]


def speculative_round(p, q, rng: np.random.Generator, contract: str = "distribution_preserving", size=None):
    """Draw draft token(s) x ~ q and verify them under `contract`; `size=None` gives one int token."""
    p, q = _as_distributions(p, q)
    draft_tokens = rng.choice(q.size, size=size, p=q)
    return get_contract(contract)(p, q, draft_tokens, rng)


# --- planner -----------------------------------------------------------------------------------------------


def expected_emitted_tokens(alpha: float, k: int) -> float:
    """E[N] = sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha), k+1 at alpha = 1 (edge-inference eq. 6)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def round_cost(k: int, t_draft: float, t_verify: float, t_handle: float) -> float:
    """Serial cost of one round: k*T_D + T_V(k+1) + T_H, with no overlap between the terms."""
    if min(t_draft, t_verify, t_handle) < 0:
        raise ValueError(f"times must be >= 0, got T_D={t_draft}, T_V={t_verify}, T_H={t_handle}")
    return k * t_draft + t_verify + t_handle


def speed_ratio(alpha: float, k: int, t_draft: float, t_verify: float, t_handle: float, t1: float = 1.0) -> float:
    """S(k) = E[N]*T1 / (k*T_D + T_V(k+1) + T_H): speed over plain decoding (edge-inference eq. 7)."""
    if t1 <= 0:
        raise ValueError(f"t1 must be > 0, got {t1}")
    cost = round_cost(k, t_draft, t_verify, t_handle)
    if cost <= 0:
        raise ValueError("round cost k*T_D + T_V + T_H must be > 0")
    return expected_emitted_tokens(alpha, k) * t1 / cost


@dataclass(frozen=True)
class SpecPlanRow:
    alpha: float
    expected_tokens: float
    round_cost: float
    speed_ratio: float


def plan_spec(alphas, k: int, t_draft: float, t_verify: float, t_handle: float, t1: float = 1.0) -> list[SpecPlanRow]:
    """One planner row per acceptance rate."""
    cost = round_cost(k, t_draft, t_verify, t_handle)
    return [
        SpecPlanRow(
            alpha=alpha,
            expected_tokens=expected_emitted_tokens(alpha, k),
            round_cost=cost,
            speed_ratio=speed_ratio(alpha, k, t_draft, t_verify, t_handle, t1),
        )
        for alpha in alphas
    ]


def format_plan(rows: list[SpecPlanRow], k: int, t_draft: float, t_verify: float, t_handle: float, t1: float) -> str:
    header = (
        f"serial speculative-decoding model (edge-inference eval eq. 7): "
        f"k={k} T1={t1:g} TD={t_draft:g} TV(k+1)={t_verify:g} TH={t_handle:g}"
    )
    lines = [header, f"{'alpha':>6}  {'E[N]':>8}  {'round cost':>10}  {'speed ratio':>11}"]
    for row in rows:
        lines.append(
            f"{row.alpha:>6.3g}  {row.expected_tokens:>8.4f}  {row.round_cost:>10.4f}  {row.speed_ratio:>11.4f}"
        )
    return "\n".join(lines)
