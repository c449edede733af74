"""Reward-guided speculative decoding (RSD): the draft writes each step, the PRM decides whether the target rewrites it.

RSD Algorithm 1. Per step: the draft model (`runtimes.generator`) writes a step after the prompt and the
solution so far; the scorer scores it in context; the acceptance criterion A_omega (Algorithm 2,
`sgl_tts.rsd.acceptance.accept_draft_step`) keeps it, or else the target model (`runtimes.target`) writes the
step from the same context, and the target's step is always kept. The loop stops at an answer, end of
sequence, the token budget or `search.max_steps`.

Steps pass between the models as text, so draft and target may use different tokenizers: each model gets
its own prompt (`runtimes.prompt` for the draft, `runtimes.target_prompt` for the target, which defaults to
the draft's) followed by the solution text so far.

Settings: `Settings` (the run config's `search.settings:`) gives the weighting and its parameters; the rest
of `config` (the run's `search:` section) gives the step loop: step delimiter, step limit (max_steps),
sampling (temperature, top_p; the paper decodes greedily), token budgets (max_step_tokens, max_tokens), and
the seed of Algorithm 2's draws. `params` may give the parameter counts used for FLOPs ({"draft", "target",
"prm"}); by default they are read from each runtime's model config.

Result: one candidate (the solution). `step_scores[i]` is the PRM score of step i's draft proposal, the
score that decided the step; `SearchResult.extra["rsd"]` holds one `StepRecord` per step (who wrote it,
its score, tokens and seconds per model, rejected draft tokens included) and the problem's statistics.

`step_cache` (a `StepCache`) memoises each context's draft step, score and target step;
the delta sweep (`sgl_tts.rsd.sweep`) shares one across its runs. Records then carry the seconds measured
when the entry was computed.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, TypeVar

import sglang as sgl

from sgl_tts.search import (build_result, extract_answer, finish_reason_of, ReasoningPath, Runtimes, SearchConfig,
                            SearchContext, SearchResult, settings_of, settle_step, start_search, wait_meta)
from sgl_tts.rsd.acceptance import (StepRecord, accept_draft_step, check_weighting_settings, summarize_run,
                                    weight)
from sgl_tts.rsd.step_cache import StepCache

T = TypeVar("T")

RUNTIMES = ("scorer", "target")  # the PRM and the target model, besides the draft (the generator)


@dataclass(frozen=True)
class Settings:
    """RSD's acceptance settings (`search.settings`); defaults are the paper's (§3 default setting, Fig. 6 for
    constant and logistic). The step loop's settings are the search config's."""

    weighting: str = "binary"  # omega, one of sgl_tts.rsd.acceptance.WEIGHTINGS
    delta: float = 0.7  # threshold of `binary`, centre of `logistic`
    constant: float = 0.6  # p of `constant`
    logistic_alpha: float = 1.0  # steepness of `logistic`

    def __post_init__(self) -> None:
        check_weighting_settings(self)

    def weight(self, reward: float) -> float:
        """omega(r) for this weighting."""
        return weight(reward, self)


def decoded_paths(config: SearchConfig, concurrency: int) -> int:
    """Sequences one step decodes when `concurrency` problems run at once: one path per problem, whatever n."""
    return concurrency


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
def write_step(s, context: str, budget: int, config: SearchConfig):
    """One reasoning step after `context` (a model's prompt plus the solution so far), on either model."""
    s += context
    s += sgl.gen("step", max_tokens=budget, stop=config.step_delimiter,
                 temperature=config.temperature, top_p=config.top_p)


def generate_step(backend: Any, context: str, budget: int, config: SearchConfig, search: SearchContext) -> StepOutput:
    began = time.monotonic()
    with search.running():
        state = write_step.run(context=context, budget=budget, config=config, backend=backend)
    meta = wait_meta(state, "step")
    elapsed = time.monotonic() - began
    ending = finish_reason_of(meta, config.step_delimiter)
    text = state["step"]
    if ending == "step":
        text += config.step_delimiter  # the server trims the matched stop string
    return StepOutput(text=text, ending=ending, tokens=int(meta.get("completion_tokens", 0)),
                      prompt_tokens=int(meta.get("prompt_tokens", 0)),
                      cached_tokens=int(meta.get("cached_tokens", 0) or 0), time_s=elapsed)


def score_step(scorer: Any, prompt: str, steps: list[str], proposal: str, search: SearchContext) -> ScoreOutput:
    """The PRM score of `proposal` after `steps`, r(y_i | x, y_1:i-1) of Algorithm 1."""
    began = time.monotonic()
    scored = scorer.score_counted(prompt, [steps + [proposal]])
    elapsed = time.monotonic() - began
    scores = scored.scores
    assert len(scores) == 1 and len(scores[0]) == len(steps) + 1, "scorer must return one score per step"
    search.scored(scores)
    return ScoreOutput(score=float(scores[0][-1]), tokens=scored.counts.input_tokens, time_s=elapsed)


def rsd_settings(config: SearchConfig) -> Settings:
    return settings_of(config, Settings, "rsd")


def check_runtimes(runtimes: Runtimes) -> None:
    if runtimes.target is None:
        raise ValueError("rsd needs a target runtime: set 'target' in the run config (a runtime config, "
                         "or 'generator' to let the draft's runtime serve as the target)")
    if runtimes.scorer is None:
        raise ValueError("rsd needs a scorer (the PRM): set 'scorer' in the run config")


def problem_rng(config: SearchConfig, problem_id: str) -> random.Random:
    """Algorithm 2's uniform draws for one problem: seeded by (search seed, problem), so independent of run order."""
    return random.Random(f"{config.seed}/{problem_id}")


def settings_record(settings: Settings, config: SearchConfig) -> dict[str, Any]:
    """The settings that decided a result: the acceptance settings and the step loop's."""
    return {**dataclasses.asdict(settings), "seed": config.seed, "step_delimiter": config.step_delimiter,
            "max_steps": config.max_steps, "temperature": config.temperature, "top_p": config.top_p}


def _model_path(component: Any) -> str | None:
    return getattr(getattr(component, "runtime", None), "model_path", None)


@lru_cache(maxsize=None)
def _matmul_params(model_path: str) -> int | None:
    from sgl_tts.runtime.roofline import load_model_spec

    try:
        return int(load_model_spec(model_path).matmul_params)
    except (KeyError, OSError, ValueError):
        return None


def parameter_counts(runtimes: Runtimes, params: dict[str, int | None] | None = None) -> dict[str, int | None]:
    """N of each model for the 2N-FLOPs-per-token rule: `params` when given, else the weights used in matrix
    products per token (`roofline.ModelSpec.matmul_params`, counted from the model's config). None when unknown."""
    if params is not None:
        return dict(params)
    parts = {"draft": runtimes.generator, "target": runtimes.target, "prm": runtimes.scorer}
    return {name: (_matmul_params(path) if (path := _model_path(part)) else None) for name, part in parts.items()}


def target_is_draft_model(runtimes: Runtimes) -> bool:
    if runtimes.target is runtimes.generator:
        return True
    draft, target = _model_path(runtimes.generator), _model_path(runtimes.target)
    return draft is not None and draft == target


def keep_step(path: ReasoningPath, step: StepOutput, score: float, config: SearchConfig,
              tracker: SearchContext) -> None:
    """Append the kept step and decide whether the solution is finished (answer, eos, or a limit)."""
    path.steps.append(step.text)
    path.step_scores.append(score)
    path.tokens += step.tokens
    settle_step(path, step.ending, config, tracker, extract_answer)


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


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None, *,
        step_cache: StepCache | None = None, params: dict[str, int | None] | None = None) -> SearchResult:
    """`step_cache`: shared by runs that should reuse each other's steps (the delta sweep); `params`: the
    parameter counts for FLOPs, when the runtimes' model configs do not give them."""
    check_runtimes(runtimes)
    settings = rsd_settings(config)
    tracker = start_search(runtimes, config, problem.id, context)
    draft_prompt = runtimes.prompt(problem.question)
    target_prompt = (runtimes.target_prompt or runtimes.prompt)(problem.question)
    scorer = runtimes.scorer
    rng = problem_rng(config, problem.id)
    path = ReasoningPath(state=None)
    records: list[StepRecord] = []
    cache_hits = 0
    while path.active:
        budget = max(1, min(config.max_step_tokens, config.max_tokens - path.tokens))
        key = (draft_prompt, target_prompt, tuple(path.steps), budget)
        steps = list(path.steps)
        draft, hit_draft = _fetch(step_cache, "draft", key, lambda: generate_step(
            runtimes.generator, draft_prompt + path.text, budget, config, tracker))
        scored, hit_score = _fetch(step_cache, "score", key, lambda: score_step(
            scorer, draft_prompt, steps, draft.text, tracker))
        accepted = accept_draft_step(scored.score, settings, rng)
        target, hit_target = None, False
        if not accepted:
            target, hit_target = _fetch(step_cache, "target", key, lambda: generate_step(
                runtimes.target, target_prompt + path.text, budget, config, tracker))
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
    params = parameter_counts(runtimes, params)
    extra = {"rsd": {
        "settings": settings_record(settings, config),
        "params": params,
        "target_is_draft_model": target_is_draft_model(runtimes),
        "cache_hits": cache_hits,
        "steps": [dataclasses.asdict(record) for record in records],
        "stats": problem_statistics(records, params),
    }}
    return build_result(problem.id, "rsd", [path], config, tracker, extra=extra)
