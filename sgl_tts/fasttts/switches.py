"""The FastTTS switches (FastTTS §4, the P/M/S ablation of Fig. 16) and where each one takes effect.

- P `prefix_order`: the generator runtime's scheduler orders its waiting queue with `PrefixAwareOrder`
  (plugin env `SGLTTS_POLICY=prefix`), reading the lineage tag the backend puts on every request.
- M `memory_plan`: the KV budget is split between the co-located runtimes (generator, verifier and RSD's
  target) by the roofline planner (`sgl_tts.runtime.memory_plan.split_kv` / `plan_memory`, §4.3) instead of
  equally.
- S `speculative`: speculative beam extension (`sgl_tts.fasttts.speculation`, §4.1); the generator runs with
  priority scheduling so that standard requests preempt speculative ones.
All off is the baseline: FCFS, no speculation, a static equal split of the KV budget (50/50 without a target).

`configure_runtimes` turns the switches into runtime settings (the Session starts runtimes with them); the
Session gives the generator backend S's step extension (`sgl_tts.fasttts.speculation`). Programs never see
any of this: every request is tagged with its fork lineage by the backend (`sgl_tts.frontend.lineage`)
whatever the switches, and `expand` speculates when the backend carries an extension.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from policies import POLICIES
from policies.plugin import ENV_POLICY
from sgl_tts.config import ConfigError
from sgl_tts.runtime.hardware import GIB, KNOWN_HARDWARE
from sgl_tts.runtime.memory_plan import (KVSplitError, MemoryPlan, engine_batch_for, plan_workload,
                                         search_working_sets, shared_kv_budget, split_kv)
from sgl_tts.runtime.server import RuntimeConfig
from sgl_tts.search.api import SearchConfig

logger = logging.getLogger(__name__)

PRIORITY_FLAG = "--enable-priority-scheduling"
# On a CPU generator S fills at most this many running requests (unless fasttts.engine_batch is given): extra
# sequences are not free there (decode gives 108 tok/s at 16 requests, 173 at 64). Measured with `bench fasttts`
# (beam search, one search at a time, KV at 0.5x the working set): at n = 64, filling up to the 10 requests the
# KV holds made P+M+S 0.92x P+M's goodput (latency 1.10x); up to 2, 1.06x; at n = 16 (2 by the KV) 1.17x.
CPU_SPECULATION_BATCH = 2
PREEMPTION_THRESHOLD = 10  # SGLang's default --priority-scheduling-preemption-threshold


@dataclass(frozen=True)
class FastTTSConfig:
    """The three FastTTS switches and their settings (YAML section `fasttts`).

    prefix_order (P), memory_plan (M), speculative (S): independent switches; all off is the baseline.
    lookahead: with S, a copy whose speculative head start holds a whole step takes it as its step, with no
        generation (LookAhead, §4.1.3); the program's verifier scores it like any other step.
    truncation_ratio, truncation_std: R and the spread of the fraction of speculative tokens a duplicate
        of a selected beam keeps (Algorithm 1, lines 18-19).
    max_speculative: at most this many speculative requests of one search in flight (None: as many as
        there are free batch slots, as in the paper; on a CPU a smaller number slows stragglers less).
    engine_batch: the running batch the generator engine serves well; speculation fills only what the engine
        has idle below it (running + waiting requests from `GET /v1/loads`, all searches together). None: from
        the generator's KV budget when it is known (`memory_plan.engine_batch_for`: the sequences of one step's
        length it holds; on a CPU at most `CPU_SPECULATION_BATCH`), else no engine limit, only the search's own
        free slots.
    standard_priority, speculative_priority: request priorities under priority scheduling (larger runs
        first); the gap must exceed SGLang's preemption threshold (10) so standard work preempts.
    hardware: roofline profile for M (`sgl_tts.runtime.hardware.HARDWARE` or `this-machine`, probed). None:
        from the runtimes' device: on cuda the GPU's profile (by its name), on cpu this machine, probed.
    kv_budget_mib: KV-cache memory shared by the co-located runtimes (generator, verifier, target). None:
        without M the runtimes keep their configured `max_total_tokens`; with M the configured budgets are
        pooled and re-split, or, when one is unset, the device's memory after all weights is split (logged).
    prompt_tokens: expected prompt length in tokens, for the plan's workload and the budget floors.
    target_share: expected fraction of steps RSD's target rewrites, the target's workload in M's plan (RSD
        reports 65% of tokens written by the draft alone at its default threshold, hence 0.35).
    seed: seed of the truncation sampler.
    """

    prefix_order: bool = False
    memory_plan: bool = False
    speculative: bool = False
    lookahead: bool = True
    truncation_ratio: float = 0.85
    truncation_std: float = 0.1
    max_speculative: int | None = None
    engine_batch: int | None = None
    standard_priority: int = 20
    speculative_priority: int = 0
    hardware: str | None = None
    kv_budget_mib: float | None = None
    prompt_tokens: int = 128
    target_share: float = 0.35
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.truncation_ratio <= 1.0:
            raise ValueError(f"truncation_ratio must be in [0, 1], got {self.truncation_ratio}")
        if self.truncation_std < 0:
            raise ValueError(f"truncation_std must be >= 0, got {self.truncation_std}")
        if self.max_speculative is not None and self.max_speculative < 1:
            raise ValueError(f"max_speculative must be >= 1 or null, got {self.max_speculative}")
        if self.engine_batch is not None and self.engine_batch < 1:
            raise ValueError(f"engine_batch must be >= 1 or null, got {self.engine_batch}")
        if self.standard_priority - self.speculative_priority <= PREEMPTION_THRESHOLD:
            raise ValueError(f"standard_priority must exceed speculative_priority by more than "
                             f"{PREEMPTION_THRESHOLD} (SGLang's preemption threshold), got "
                             f"{self.standard_priority} and {self.speculative_priority}")
        if self.hardware is not None and self.hardware not in KNOWN_HARDWARE:
            raise ValueError(f"unknown hardware {self.hardware!r}; known: {', '.join(KNOWN_HARDWARE)} "
                             f"(or null: from the runtimes' device)")
        if not 0.0 <= self.target_share <= 1.0:
            raise ValueError(f"target_share must be in [0, 1], got {self.target_share}")
        if self.kv_budget_mib is not None and self.kv_budget_mib <= 0:
            raise ValueError(f"kv_budget_mib must be positive or null, got {self.kv_budget_mib}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")

    @property
    def label(self) -> str:
        """'baseline', or the switches that are on: 'P', 'P+M', 'P+M+S', 'S', ..."""
        on = [name for name, flag in (("P", self.prefix_order), ("M", self.memory_plan), ("S", self.speculative))
              if flag]
        return "+".join(on) or "baseline"

    @property
    def policy(self) -> str:
        """The scheduler policy the generator runtime's plugin installs."""
        name = "prefix" if self.prefix_order else "fcfs"
        assert name in POLICIES, f"policy {name!r} is not registered; known: {', '.join(POLICIES)}"
        return name


def from_label(label: str, **settings: Any) -> FastTTSConfig:
    """The config for an ablation arm named like 'baseline', 'P', 'P+M', 'P+M+S'."""
    names = {"P": "prefix_order", "M": "memory_plan", "S": "speculative"}
    parts = [] if label == "baseline" else label.split("+")
    unknown = [p for p in parts if p not in names]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(f"bad arm {label!r}: use 'baseline' or switches P, M, S joined by '+'")
    return FastTTSConfig(**{names[p]: True for p in parts}, **settings)


# ---- Runtime settings: P's plugin env, S's priority scheduling, M's KV split ----

@dataclass(frozen=True)
class RuntimeSettings:
    """The runtime configs with the switches applied, and how KV was split between them.

    verifier: None when the scorer reads from the generator's runtime; target: RSD's target runtime, if any.
    budget_source: where the KV budget came from ("" when the runtimes keep their configured budgets).
    """

    generator: RuntimeConfig
    verifier: RuntimeConfig | None
    split: str  # "as configured", "whole budget", "static", or "roofline"
    plan: MemoryPlan | None = None
    target: RuntimeConfig | None = None
    budget_source: str = ""
    engine_batch: int | None = None  # what S fills up to: fasttts.engine_batch, or from the generator's KV


_SETTING_OF = {"runtimes": "fasttts", "hardware": "fasttts.hardware", "budget_mib": "fasttts.kv_budget_mib"}


def configure_runtimes(fast: FastTTSConfig, search: SearchConfig, generator: RuntimeConfig,
                       verifier: RuntimeConfig | None, target: RuntimeConfig | None = None,
                       paths: int | None = None, searches: int = 1) -> RuntimeSettings:
    """Apply P (plugin env), S (priority scheduling) and the KV split (M's plan, or equal shares) to the configs.

    `verifier` is the scorer's own runtime, or None when the scorer reads from the generator's runtime (which
    then holds the verifier's share too); `target` is RSD's target runtime; `paths` the sequences decoded at
    once (default search.n; RSD: the problems at once). The split is `sgl_tts.runtime.memory_plan.split_kv`'s:
    budgets in tokens follow each model's KV bytes per token, no runtime gets less than the longest request
    (prompt_tokens + max_tokens + max_step_tokens), and on cuda every runtime gets a start-order-safe
    `mem_fraction_static`. Without M and without `kv_budget_mib` the runtimes keep their configured budgets.
    M's plan counts the working sets of `searches` searches at once (`memory_plan.search_working_sets`).
    With S and no `engine_batch`, S fills up to the batch the generator's KV holds (`engine_batch_for`), on a
    CPU generator at most `CPU_SPECULATION_BATCH`.
    """
    env = {**generator.env, ENV_POLICY: fast.policy}
    args = list(generator.extra_args)
    if fast.speculative:
        # Untagged requests (the frontend's prefix pre-send, a scorer sharing the runtime) default to standard
        # priority instead of the lowest; under memory pressure speculative requests are retracted first.
        for flag, *value in ([PRIORITY_FLAG], ["--default-priority-value", str(fast.standard_priority)],
                             ["--retraction-policy", "priority"]):
            if flag not in args:
                args += [flag, *value]
    generator = dataclasses.replace(generator, env=env, extra_args=args)
    work = plan_workload(paths or search.n, fast.prompt_tokens, search.max_tokens, search.max_step_tokens)

    def engine_batch(generator_tokens: int | None) -> int | None:
        if fast.engine_batch is not None or not fast.speculative or generator_tokens is None:
            return fast.engine_batch
        fits = engine_batch_for(generator_tokens, work)
        return min(fits, CPU_SPECULATION_BATCH) if generator.device == "cpu" else fits

    if fast.kv_budget_mib is None and not fast.memory_plan:
        return RuntimeSettings(generator, verifier, "as configured", target=target,
                               engine_batch=engine_batch(generator.max_total_tokens))

    runtimes = {"generator": generator, "verifier": verifier, "target": target}
    runtimes = {role: config for role, config in runtimes.items() if config is not None}
    try:
        budget = shared_kv_budget(runtimes, fast.kv_budget_mib, fast.hardware, fast.memory_plan)
        if budget.origin == "device":
            logger.warning("fasttts M: no kv_budget_mib and not every runtime has max_total_tokens, so the plan "
                           "takes %s = %.2f GiB of KV", budget.source, budget.kv_bytes / GIB)
        kv = split_kv(runtimes, budget, roofline=fast.memory_plan, paths=paths or search.n,
                      prompt_tokens=fast.prompt_tokens, max_tokens=search.max_tokens,
                      max_step_tokens=search.max_step_tokens, target_share=fast.target_share,
                      working_sets=search_working_sets(search.n, search.beam_width, fast.prompt_tokens,
                                                       search.max_tokens, search.max_step_tokens, searches))
    except KVSplitError as exc:
        raise ConfigError(f"{_SETTING_OF[exc.argument]}: {exc}") from None
    source = (f"fasttts.kv_budget_mib ({fast.kv_budget_mib:g} MiB)" if budget.origin == "given"
              else budget.source)
    generator_tokens = (kv.plan.generator.max_total_tokens if kv.plan is not None and kv.plan.budgets
                        else kv.runtimes["generator"].max_total_tokens)
    return RuntimeSettings(kv.runtimes["generator"], kv.runtimes.get("verifier"), kv.split, kv.plan,
                           kv.runtimes.get("target"), source, engine_batch(generator_tokens))


def describe_settings(settings: RuntimeSettings) -> str:
    """One line: the KV token budgets, how they were chosen, and from what budget."""
    parts = [f"{role} {config.max_total_tokens or 'default'} tokens"
             + (f" (mem fraction {config.mem_fraction_static})" if config.mem_fraction_static else "")
             for role, config in (("generator", settings.generator), ("verifier", settings.verifier),
                                  ("target", settings.target)) if config is not None]
    line = f"KV split {settings.split}: " + ", ".join(parts)
    plan = settings.plan
    if plan is not None and plan.shared is not None:
        target = f", B_tgt={plan.shared.b_tgt}" if plan.target is not None else ""
        line += (f" (roofline on {plan.hardware.name}: B_pre={plan.shared.b_pre}, B_dec={plan.shared.b_dec}{target}, "
                 f"budget {plan.kv_budget / GIB:.3f} GiB)")
    if settings.budget_source:
        line += f"; budget from {settings.budget_source}"
    if settings.engine_batch is not None:
        line += f"; speculation fills up to {settings.engine_batch} running requests"
    return line
