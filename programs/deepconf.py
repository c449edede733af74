"""DeepConf: self-consistency weighted and pruned by the model's own token confidence (no verifier).

Fu et al. 2025, "Deep Think with Confidence" (arXiv:2508.15260); the formulas are in
`sgl_tts.search.confidence`:
    token confidence   C_i = −(1/k) Σ_j log P_i(j) over the k most likely tokens at position i   (§3.1)
    group confidence   C_G = mean C_i over a window of w consecutive tokens, sliding by one       (§3.1)
    trace confidence   the lowest group confidence min_G C_G, its weakest stretch                (§3.1)
    vote               â = argmax_a Σ_{t : answer_t = a} C_t over the voting traces              (§3.2)

Offline (§3.2, Algorithm 1): sample n whole traces with top-k logprobs (one fork of the prompt, as best-of-N);
keep the ⌈η·n⌉ most confident (`filter_top`); the answer is the confidence-weighted vote of the kept.

Online (§4, Algorithm 2):
    warm-up: sample `warmup` whole traces; threshold s = the (1 − η) quantile of their confidences
    if the warm-up vote is settled (β ≥ τ), stop: no trace is sampled past the warm-up
    grow the other n − warmup traces one step at a time, all together; after each step:
        a trace whose lowest group confidence so far is below s is stopped ("low_confidence"; it does not vote)
        if the leading answer holds τ of the vote (`vote_settled`), finish every growing trace ("vote_settled")
    vote: the warm-up traces at or above s and the online traces that were not stopped, weighted by confidence
The paper stops a trace at the token whose window drops below s. Here a trace is checked when a piece of it
ends: the frontend answers a generation only when it is done, so the stop takes effect by not asking for the
trace's next piece (no request, no KV cache held for it). A piece is a reasoning step, or with `check_tokens`
at most that many tokens of one (`in_pieces`): the rules are then checked every `check_tokens` tokens, and a
trace that dips is stopped at most `check_tokens` tokens past the dip, at the cost of one request per piece
(the radix cache keeps the trace's prefix, so each piece prefills only its own tokens). Every window the piece
completed is checked (the lowest group of the trace so far), so a dip inside a piece is caught at its end.

Settings (`search.settings`) are `Settings` below; η = 0.9 is DeepConf-high, η = 0.1 DeepConf-low. The window
defaults to 32 tokens, not the paper's 2048, and the rules are checked every 8 tokens: traces on a CPU runtime
are about a hundred tokens long, and a step of up to 40 of them is too coarse a grain to stop at.
The stop rules are the ones every step program may use by a setting (`search.stopping`): the rule objects of
`sgl_tts.search.stopping` (`TraceConfidenceRule`, `SettledAnswerRule`), here warmed up by the warm-up traces.
Result: `extra["deepconf"]` holds the threshold, every trace's confidence (trace order: warm-up first, as
candidates' extra["trace"]), the voting, stopped and cut traces, and the warm-up's tokens.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import sglang as sgl

from programs.best_of_n import best_of_n_program
from sgl_tts.search import (RUNTIME_FAILURES, build_result, expand, extract_answer, filter_top, finish,
                            normalize_answer, ReasoningPath, Runtimes, search_failed, SearchConfig, SearchContext,
                            SearchResult, settings_of, start_search, weighted_vote)
from sgl_tts.search.stopping import SettledAnswerRule, TraceConfidenceRule

MODES = ("online", "offline")
VOTELESS = ("low_confidence", "vote_settled")  # online traces stopped before their end do not vote


@dataclass(frozen=True)
class Settings:
    """DeepConf's settings (`search.settings`); `search.n` is the trace budget."""

    top_k: int = 5  # k: logprobs per token in the token confidence
    window: int = 32  # w: tokens per group (the paper's 2048 is longer than a CPU trace)
    keep_fraction: float = 0.9  # η: 0.9 DeepConf-high, 0.1 DeepConf-low
    warmup: int = 4  # online: whole traces that set the threshold
    # τ: online sampling stops once the leading answer holds this share of the vote. The paper's 0.95 asks for
    # near unanimity, which a small model's traces rarely reach: on SmolLM2-135M (graded set, n = 16, README) no
    # vote settled at 0.95 once online traces grew (14 of 80 after the warm-up); at 0.6, 29 settled after the
    # warm-up and 60 online traces were cut, for 0.56x self-consistency's tokens at its accuracy (24 vs 25 of 80).
    consensus: float = 0.6
    mode: str = "online"
    check_tokens: int | None = 8  # online: check the stop rules every this many tokens; None: at each step's end

    def __post_init__(self) -> None:
        for name in ("top_k", "window", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.check_tokens is not None and self.check_tokens < 1:
            raise ValueError(f"check_tokens must be at least 1 or null, got {self.check_tokens}")
        for name in ("keep_fraction", "consensus"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")


def deepconf_settings(config: SearchConfig) -> Settings:
    return settings_of(config, Settings, "deepconf")


def in_pieces(config: SearchConfig, check_tokens: int | None) -> SearchConfig:
    """The search config that grows online traces `check_tokens` tokens at a time: a step of up to
    `max_step_tokens` becomes up to ⌈max_step_tokens / check_tokens⌉ pieces, so the step limit grows by that
    factor; the token limit and the step delimiter stay (a piece still ends where its step ends)."""
    if check_tokens is None or check_tokens >= config.max_step_tokens:
        return config
    pieces_per_step = -(-config.max_step_tokens // check_tokens)
    return dataclasses.replace(config, max_step_tokens=check_tokens, max_steps=config.max_steps * pieces_per_step)


def confidence_rule(settings: Settings, warmup: int) -> TraceConfidenceRule:
    """The trace-confidence stop rule, its threshold set by `warmup` traces."""
    return TraceConfidenceRule(settings.window, settings.keep_fraction, warmup)


def settled_rule(settings: Settings) -> SettledAnswerRule:
    return SettledAnswerRule(settings.consensus)


def trace_confidence(trace: ReasoningPath, rule: TraceConfidenceRule) -> float:
    """min_G C_G of the trace's tokens so far."""
    confidences = trace.extra.get("token_confidences")
    if not confidences:
        raise ValueError("deepconf needs per-token top logprobs, and the generator returned none for a trace")
    return rule.confidence(confidences)


def vote(traces: list[ReasoningPath]) -> tuple[list[str | None], list[float]]:
    """The voting traces' normalised answers and confidences, as `weighted_vote` and `vote_settled` take them."""
    answers = [normalize_answer(t.answer) if t.answer is not None else None for t in traces]
    return answers, [t.extra["confidence"] for t in traces]


def voted_answer(traces: list[ReasoningPath]) -> str | None:
    """â as first written by a voting trace."""
    winner = weighted_vote(*vote(traces))
    return next((t.answer for t in traces if t.answer is not None and normalize_answer(t.answer) == winner), None)


def sample_whole_traces(prompt: str, count: int, config: SearchConfig, settings: Settings,
                        tracker: SearchContext, backend: Any) -> list[ReasoningPath]:
    """`count` whole traces from one fork of the prompt, each with its confidence."""
    began = time.monotonic()
    traces = best_of_n_program.run(prompt=prompt, config=dataclasses.replace(config, n=count), tracker=tracker,
                                   logprobs=settings.top_k, backend=backend).ret_value
    tracker.generator_time_s += time.monotonic() - began
    tracker.iterations += 1
    rule = confidence_rule(settings, warmup=len(traces))
    for trace in traces:
        trace.extra["confidence"] = trace_confidence(trace, rule)
    return traces


def stop_if_unsure(trace: ReasoningPath, rule: TraceConfidenceRule, tracker: SearchContext) -> None:
    """Set the trace's confidence so far and stop it when that is below s (C_G < s for a window of its last step)."""
    trace.extra["confidence"] = trace_confidence(trace, rule)
    if rule.should_stop(trace.extra["confidence"]):
        trace.finish_reason = None  # the window fell below s inside this step: before the step's own ending
        finish(trace, "low_confidence", tracker)


@sgl.function
def online_traces(s, prompt: str, count: int, warmup_voters: list[ReasoningPath], rule: TraceConfidenceRule,
                  config: SearchConfig, settings: Settings, tracker: SearchContext, finished: list[ReasoningPath]):
    """Grow `count` traces together, one piece a round, under DeepConf's online stop rules; returns them all."""
    config = in_pieces(config, settings.check_tokens)
    s += prompt
    grown = traces = expand([(ReasoningPath(state=s), count)], config, tracker, extract_answer, logprobs=settings.top_k)
    while True:
        for trace in grown:
            stop_if_unsure(trace, rule, tracker)
        finished += [trace for trace in grown if not trace.active]
        growing = [trace for trace in traces if trace.active]
        voters = warmup_voters + [trace for trace in traces if trace.finish_reason not in (None, *VOTELESS)]
        if settled_rule(settings).settled(*vote(voters), remaining=len(growing)):
            for trace in growing:
                finish(trace, "vote_settled", tracker)
            finished += growing
            return traces
        grown = expand([(trace, 1) for trace in growing], config, tracker, extract_answer, logprobs=settings.top_k)
        child_of = dict(zip(map(id, growing), grown))
        traces = [child_of.get(id(trace), trace) for trace in traces]


def sample_online(prompt: str, config: SearchConfig, settings: Settings, tracker: SearchContext, backend: Any,
                  finished: list[ReasoningPath]) -> tuple[list[ReasoningPath], list[ReasoningPath], dict[str, Any]]:
    """(traces in sampling order, the voting ones, the report) of online DeepConf."""
    warmup = sample_whole_traces(prompt, min(settings.warmup, config.n), config, settings, tracker, backend)
    finished += warmup
    rule = confidence_rule(settings, warmup=len(warmup))
    for trace in warmup:
        rule.warm_up(trace.extra["confidence"])
    voters = [trace for trace in warmup if not rule.should_stop(trace.extra["confidence"])]
    remaining = config.n - len(warmup)
    traces = list(warmup)
    if not settled_rule(settings).settled(*vote(voters), remaining=remaining):
        traces += online_traces.run(prompt=prompt, count=remaining, warmup_voters=voters, rule=rule,
                                    config=config, settings=settings, tracker=tracker, finished=finished,
                                    backend=backend).ret_value
    voters += [trace for trace in traces[len(warmup):] if trace.finish_reason not in VOTELESS]
    report = {"threshold": rule.threshold.threshold, "warmup_tokens": sum(trace.tokens for trace in warmup),
              "unsampled": config.n - len(traces)}
    return traces, voters, report


def run(problem, config: SearchConfig, runtimes: Runtimes, context: SearchContext | None = None) -> SearchResult:
    settings = deepconf_settings(config)
    tracker = start_search(runtimes, config, problem.id, context)
    prompt = runtimes.prompt(problem.question)
    finished: list[ReasoningPath] = []
    try:
        with tracker.running():
            if settings.mode == "offline":
                traces = sample_whole_traces(prompt, config.n, config, settings, tracker, runtimes.generator)
                finished += traces
                kept = filter_top([trace.extra["confidence"] for trace in traces], settings.keep_fraction)
                voters = [traces[index] for index in kept]
                report = {"threshold": None, "warmup_tokens": 0, "unsampled": 0}
            else:
                traces, voters, report = sample_online(prompt, config, settings, tracker, runtimes.generator,
                                                       finished)
    except RUNTIME_FAILURES as exc:
        raise search_failed(problem.id, "deepconf", finished, config, tracker, exc) from exc
    for index, trace in enumerate(traces):
        trace.extra["trace"] = index
        del trace.extra["token_confidences"]  # the record keeps each trace's confidence, not every token's
    voting = {id(trace) for trace in voters}
    report.update(
        mode=settings.mode,
        confidences=[trace.extra["confidence"] for trace in traces],
        voters=[index for index, trace in enumerate(traces) if id(trace) in voting],
        stopped=[index for index, trace in enumerate(traces) if trace.finish_reason == "low_confidence"],
        cut=[index for index, trace in enumerate(traces) if trace.finish_reason == "vote_settled"],
    )
    result = build_result(problem.id, "deepconf", traces, config, tracker, extra={"deepconf": report})
    return dataclasses.replace(result, answer=voted_answer(voters))
