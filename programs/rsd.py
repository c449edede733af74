"""Reward-guided speculative decoding (RSD): the draft writes each step, the PRM decides whether the target rewrites it.

RSD Algorithm 1. Per step: the draft model (`runtimes.generator`) writes a step after the prompt and the
solution so far; the scorer scores it in context; the acceptance criterion A_omega (Algorithm 2,
`sgl_tts.rsd.acceptance.accept_draft_step`) keeps it, or else the target model (`runtimes.target`) writes the
step from the same context, and the target's step is always kept. The loop stops at an answer, end of
sequence, the token budget or `rsd.max_steps`.

Steps pass between the models as text, so draft and target may use different tokenizers: each model gets
its own prompt (`runtimes.prompt` for the draft, `runtimes.extras["target_prompt"]` for the target, which
defaults to the draft's) followed by the solution text so far.

Settings: `runtimes.extras["rsd"]` (an `RSDConfig`; the run config's `rsd:` section) gives the weighting,
delta, seed, step delimiter, step limit and sampling; `config` (the run's `search:` section) gives the token
budgets (max_step_tokens, max_tokens). `runtimes.extras["params"]` may give the parameter counts used for
FLOPs ({"draft", "target", "prm"}); by default they are read from each runtime's model config.

Result: one candidate (the solution). `step_scores[i]` is the PRM score of step i's draft proposal, the
score that decided the step; `SearchResult.extra["rsd"]` holds one `StepRecord` per step (who wrote it,
its score, tokens and seconds per model, rejected draft tokens included) and the problem's statistics.

`runtimes.extras["rsd_cache"]` (a `StepCache`) memoises each context's draft step, score and target step;
the delta sweep (`sgl_tts.rsd.sweep`) shares one across its runs. Records then carry the seconds measured
when the entry was computed.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, TypeVar

import sglang as sgl

from sgl_tts.search import (build_result, extract_answer, finish, finish_reason_of, Path, Runtimes,
                            SearchConfig, SearchResult, SearchTracker, wait_meta)
from sgl_tts.rsd.acceptance import RSDConfig, StepRecord, accept_draft_step, summarize_run
from sgl_tts.rsd.step_cache import StepCache

T = TypeVar("T")


@dataclass(frozen=True)
class StepOutput:
    """One step written by a model. `text` ends with the delimiter when the model stopped there."""

    text: str
    ending: str  # 'step' (delimiter), 'eos' or 'length' (search.finish_reason_of)
    tokens: int  # generated tokens
    prompt_tokens: int
    cached_tokens: int
    time_s: float


@dataclass(frozen=True)
class ScoreOutput:
    score: float
    tokens: int  # tokens the scorer read for this score (its tokens_processed counter)
    time_s: float


@sgl.function
def write_step(s, context: str, budget: int, settings: RSDConfig):
    """One reasoning step after `context` (a model's prompt plus the solution so far), on either model."""
    s += context
    s += sgl.gen("step", max_tokens=budget, stop=settings.step_delimiter,
                 temperature=settings.temperature, top_p=settings.top_p)


def generate_step(backend: Any, context: str, budget: int, settings: RSDConfig) -> StepOutput:
    began = time.monotonic()
    state = write_step.run(context=context, budget=budget, settings=settings, backend=backend)
    meta = wait_meta(state, "step")
    elapsed = time.monotonic() - began
    ending = finish_reason_of(meta, settings.step_delimiter)
    text = state["step"]
    if ending == "step":
        text += settings.step_delimiter  # the server trims the matched stop string
    return StepOutput(text=text, ending=ending, tokens=int(meta.get("completion_tokens", 0)),
                      prompt_tokens=int(meta.get("prompt_tokens", 0)),
                      cached_tokens=int(meta.get("cached_tokens", 0) or 0), time_s=elapsed)


def score_step(scorer: Any, prompt: str, steps: list[str], proposal: str) -> ScoreOutput:
    """The PRM score of `proposal` after `steps`, r(y_i | x, y_1:i-1) of Algorithm 1."""
    before = scorer.tokens_processed
    began = time.monotonic()
    scores = scorer.score(prompt, [steps + [proposal]])
    elapsed = time.monotonic() - began
    assert len(scores) == 1 and len(scores[0]) == len(steps) + 1, "scorer must return one score per step"
    return ScoreOutput(score=float(scores[0][-1]), tokens=scorer.tokens_processed - before, time_s=elapsed)


def rsd_settings(runtimes: Runtimes) -> RSDConfig:
    settings = runtimes.extras.get("rsd", RSDConfig())
    if not isinstance(settings, RSDConfig):
        raise ValueError(f"runtimes.extras['rsd'] must be an RSDConfig, got {type(settings).__name__}")
    return settings


def check_runtimes(runtimes: Runtimes) -> None:
    if runtimes.target is None:
        raise ValueError("rsd needs a target runtime: set 'target' in the run config (a runtime config, "
                         "or 'generator' to let the draft's runtime serve as the target)")
    if runtimes.scorer is None:
        raise ValueError("rsd needs a scorer (the PRM): set 'scorer' in the run config")


def step_config(config: SearchConfig, settings: RSDConfig) -> SearchConfig:
    """The search config with RSD's own step loop settings (delimiter, step limit, sampling)."""
    return dataclasses.replace(config, max_steps=settings.max_steps, temperature=settings.temperature,
                               top_p=settings.top_p, step_delimiter=settings.step_delimiter)


def problem_rng(settings: RSDConfig, problem_id: str) -> random.Random:
    """Algorithm 2's uniform draws for one problem: seeded by (seed, problem), so independent of run order."""
    return random.Random(f"{settings.seed}/{problem_id}")


def _model_path(component: Any) -> str | None:
    return getattr(getattr(component, "runtime", None), "model_path", None)


@lru_cache(maxsize=None)
def _matmul_params(model_path: str) -> int | None:
    from sgl_tts.runtime.roofline import load_model_spec

    try:
        return int(load_model_spec(model_path).matmul_params)
    except (KeyError, OSError, ValueError):
        return None


def parameter_counts(runtimes: Runtimes) -> dict[str, int | None]:
    """N of each model for the 2N-FLOPs-per-token rule: the weights used in matrix products per token
    (`roofline.ModelSpec.matmul_params`, counted from the model's config). None when unknown."""
    if "params" in runtimes.extras:
        return dict(runtimes.extras["params"])
    parts = {"draft": runtimes.generator, "target": runtimes.target, "prm": runtimes.scorer}
    return {name: (_matmul_params(path) if (path := _model_path(part)) else None) for name, part in parts.items()}


def target_is_draft_model(runtimes: Runtimes) -> bool:
    if runtimes.target is runtimes.generator:
        return True
    draft, target = _model_path(runtimes.generator), _model_path(runtimes.target)
    return draft is not None and draft == target


def keep_step(path: Path, step: StepOutput, score: float, config: SearchConfig, tracker: SearchTracker) -> None:
    """Append the kept step and decide whether the solution is finished (answer, eos, or a limit)."""
    path.steps.append(step.text)
    path.step_scores.append(score)
    path.tokens += step.tokens
    answer = extract_answer(step.text)
    if answer is not None:
        path.answer = answer
        finish(path, "answer", tracker)
    elif step.ending == "eos":
        finish(path, "eos", tracker)
    elif path.tokens >= config.max_tokens:
        finish(path, "max_tokens", tracker)
    elif len(path.steps) >= config.max_steps:
        finish(path, "max_steps", tracker)


def problem_statistics(records: list[StepRecord], params: dict[str, int | None]) -> dict[str, Any]:
    """The problem's RSD statistics (rsd_math.summarize_run over one problem); FLOPs None if a count is unknown."""
    known = all(params.get(name) is not None for name in ("draft", "target", "prm"))
    stats = dataclasses.asdict(summarize_run([records], params["draft"] or 0, params["target"] or 0,
                                             params["prm"] or 0))
    if not known:
        stats["flops"] = stats["total_flops"] = None
    stats["solved_by_draft_alone"] = stats.pop("draft_only_fraction") == 1.0
    return stats


def _fetch(cache: StepCache | None, part: str, key: tuple, compute: Callable[[], T]) -> tuple[T, bool]:
    return cache.fetch(part, key, compute) if cache is not None else (compute(), False)


def run(problem, config: SearchConfig, runtimes: Runtimes) -> SearchResult:
    check_runtimes(runtimes)
    settings = rsd_settings(runtimes)
    config = step_config(config, settings)
    tracker = SearchTracker(config)
    draft_prompt = runtimes.prompt(problem.question)
    target_prompt = runtimes.extras.get("target_prompt", runtimes.prompt)(problem.question)
    # A private copy of the scorer, so that its tokens_processed counter counts this problem's tokens only
    # while other problems score through the same scorer concurrently.
    scorer = copy.copy(runtimes.scorer)
    cache: StepCache | None = runtimes.extras.get("rsd_cache")
    rng = problem_rng(settings, problem.id)
    path = Path(state=None)
    records: list[StepRecord] = []
    cache_hits = 0
    while path.active:
        budget = max(1, min(config.max_step_tokens, config.max_tokens - path.tokens))
        key = (draft_prompt, target_prompt, tuple(path.steps), budget)
        steps = list(path.steps)
        draft, hit_draft = _fetch(cache, "draft", key, lambda: generate_step(
            runtimes.generator, draft_prompt + path.text, budget, settings))
        scored, hit_score = _fetch(cache, "score", key, lambda: score_step(scorer, draft_prompt, steps, draft.text))
        accepted = accept_draft_step(scored.score, settings, rng)
        target, hit_target = None, False
        if not accepted:
            target, hit_target = _fetch(cache, "target", key, lambda: generate_step(
                runtimes.target, target_prompt + path.text, budget, settings))
        cache_hits += hit_draft + hit_score + hit_target
        kept = draft if accepted else target
        records.append(StepRecord(
            writer="draft" if accepted else "target", score=scored.score, accepted=accepted,
            draft_tokens=draft.tokens, target_tokens=target.tokens if target else 0, prm_tokens=scored.tokens,
            draft_time_s=draft.time_s, target_time_s=target.time_s if target else 0.0, prm_time_s=scored.time_s))
        for written in (draft, target):
            if written is not None:
                tracker.record(written.tokens, written.prompt_tokens, written.cached_tokens)
                tracker.generator_time_s += written.time_s
        tracker.verifier_time_s += scored.time_s
        tracker.verifier_calls += 1
        tracker.iterations += 1
        keep_step(path, kept, scored.score, config, tracker)
    params = parameter_counts(runtimes)
    extra = {"rsd": {
        "settings": dataclasses.asdict(settings),
        "params": params,
        "target_is_draft_model": target_is_draft_model(runtimes),
        "cache_hits": cache_hits,
        "steps": [dataclasses.asdict(record) for record in records],
        "stats": problem_statistics(records, params),
    }}
    return build_result(problem.id, "rsd", [path], config, tracker, extra=extra)
