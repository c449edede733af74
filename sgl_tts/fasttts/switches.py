"""The FastTTS switches (FastTTS §4, the P/M/S ablation of Fig. 16) and where each one takes effect.

- P `prefix_order`: the generator runtime's scheduler orders its waiting queue with `PrefixAwareOrder`
  (plugin env `SGL_TTS_POLICY=prefix`), reading the lineage tag the backend puts on every request.
- M `memory_plan`: the KV budget is split between the generator and verifier runtimes by the roofline
  planner (`sgl_tts.runtime.roofline.plan_memory`, §4.3) instead of 50/50.
- S `speculative`: speculative beam extension (`sgl_tts.fasttts.speculation`, §4.1); the generator runs with
  priority scheduling so that standard requests preempt speculative ones.
All off is the baseline: FCFS, no speculation, a static 50/50 split of the KV budget.

`configure_runtimes` turns the switches into runtime settings (the Session starts runtimes with them); the
Session gives the generator backend S's step extension (`sgl_tts.fasttts.speculation`). Programs never see
any of this: every request is tagged with its fork lineage by the backend (`sgl_tts.frontend.lineage`)
whatever the switches, and `expand` speculates when the backend carries an extension.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policies import POLICIES
from policies.plugin import ENV_POLICY
from sgl_tts.runtime.roofline import (BUILTIN_CONFIGS, DTYPE_BYTES, GIB, HARDWARE, THIS_MACHINE, MemoryPlan, ModelSpec,
                              Workload, get_hardware, load_model_spec, plan_memory)
from sgl_tts.config import ConfigError
from sgl_tts.runtime.server import RuntimeConfig
from sgl_tts.search.api import SearchConfig

MIB = 2**20
PRIORITY_FLAG = "--enable-priority-scheduling"
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
        has idle below it (running + waiting requests from `GET /v1/loads`, all searches together). None:
        no engine limit, only the search's own free slots.
    standard_priority, speculative_priority: request priorities under priority scheduling (larger runs
        first); the gap must exceed SGLang's preemption threshold (10) so standard work preempts.
    hardware: roofline profile for M (`sgl_tts.runtime.roofline.HARDWARE` or `this-machine`, probed).
    kv_budget_mib: KV-cache memory shared by the generator and verifier runtimes. None: without M the
        runtimes keep their configured `max_total_tokens`; with M the configured budgets of both are
        pooled and re-split (or, when one is unset, the hardware's default budget is split).
    prompt_tokens: expected prompt length in tokens, for the plan's workload and the budget floors.
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
    hardware: str = THIS_MACHINE
    kv_budget_mib: float | None = None
    prompt_tokens: int = 128
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
        if self.hardware not in (*HARDWARE, THIS_MACHINE):
            raise ValueError(f"unknown hardware {self.hardware!r}; known: {', '.join([*HARDWARE, THIS_MACHINE])}")
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
    """The generator and verifier runtime configs with the switches applied, and how KV was split."""

    generator: RuntimeConfig
    verifier: RuntimeConfig | None
    split: str  # "as configured", "whole budget", "static 50/50" or "roofline"
    plan: MemoryPlan | None = None


def model_spec_for(config: RuntimeConfig) -> ModelSpec:
    """The roofline's view of a runtime's model, in the dtype the runtime will use (fp32 on CPU)."""
    from sgl_tts.runtime.models import resolve_model

    if config.dtype != "auto":
        dtype = config.dtype if config.dtype in DTYPE_BYTES else None
    else:
        dtype = "float32" if config.device == "cpu" else None
    source = config.model if config.model in BUILTIN_CONFIGS else resolve_model(config.model)
    return load_model_spec(source, dtype)


def longest_request_tokens(fast: FastTTSConfig, search: SearchConfig) -> int:
    """Tokens of the longest request either runtime must hold: a whole path plus a LookAhead step."""
    return fast.prompt_tokens + search.max_tokens + search.max_step_tokens


def plan_workload(fast: FastTTSConfig, search: SearchConfig) -> Workload:
    """One search step for the roofline: n beams whose context averages the prompt plus half a path."""
    return Workload(search.n, fast.prompt_tokens + search.max_tokens // 2, search.max_step_tokens)


def configure_runtimes(fast: FastTTSConfig, search: SearchConfig, generator: RuntimeConfig,
                       verifier: RuntimeConfig | None) -> RuntimeSettings:
    """Apply P (plugin env), S (priority scheduling) and the KV split (M's plan or 50/50) to the configs.

    `verifier` is the scorer's own runtime, or None when the scorer reads from the generator's runtime
    (then the generator gets the whole budget). Budgets in tokens follow each model's KV bytes per token;
    neither runtime gets less than the longest request (`longest_request_tokens`): the roofline would give
    the verifier a single sequence of the average length, which SGLang could not serve the longest path with.
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

    budget = None if fast.kv_budget_mib is None else fast.kv_budget_mib * MIB
    gen_spec = model_spec_for(generator) if budget is not None or fast.memory_plan else None
    if verifier is None:
        if budget is None:
            return RuntimeSettings(generator, None, "as configured")
        tokens = _tokens(budget, gen_spec, "generator", fast, search)
        return RuntimeSettings(dataclasses.replace(generator, max_total_tokens=tokens), None, "whole budget")
    if budget is None and not fast.memory_plan:
        return RuntimeSettings(generator, verifier, "as configured")

    ver_spec = model_spec_for(verifier)
    if budget is None and generator.max_total_tokens and verifier.max_total_tokens:
        budget = float(generator.max_total_tokens * gen_spec.kv_bytes_per_token
                       + verifier.max_total_tokens * ver_spec.kv_bytes_per_token)
    plan = None
    if fast.memory_plan:
        plan = plan_memory(gen_spec, ver_spec, get_hardware(fast.hardware), plan_workload(fast, search), budget)
        budget = plan.kv_budget
        # Co-located SGLang runtimes allocate their KV pools at start, so the offload alternative (§4.3.2)
        # cannot be carried out: take the shared-memory optimum. The verifier gets its B_pre sequences, but
        # at least the longest request; the generator gets the rest.
        b_pre = plan.shared.b_pre if plan.shared is not None else 1
        floor = longest_request_tokens(fast, search)
        ver_tokens = max(b_pre * plan.workload.seq_len, floor)
        ver_bytes = ver_tokens * ver_spec.kv_bytes_per_token
        gen_tokens = _tokens(budget - ver_bytes, gen_spec, "generator", fast, search)
        split = "roofline"
    else:
        ver_tokens = _tokens(budget / 2, ver_spec, "verifier", fast, search)
        gen_tokens = _tokens(budget / 2, gen_spec, "generator", fast, search)
        split = "static 50/50"
    return RuntimeSettings(dataclasses.replace(generator, max_total_tokens=gen_tokens),
                           dataclasses.replace(verifier, max_total_tokens=ver_tokens), split, plan)


def _tokens(kv_bytes: float, spec: ModelSpec, role: str, fast: FastTTSConfig, search: SearchConfig) -> int:
    tokens = int(kv_bytes // spec.kv_bytes_per_token)
    floor = longest_request_tokens(fast, search)
    if tokens < floor:
        raise ConfigError(f"fasttts.kv_budget_mib: the {role} runtime's share holds {tokens} tokens, fewer than "
                         f"the longest request ({floor} = prompt_tokens + max_tokens + max_step_tokens); "
                         f"raise the budget (now {kv_bytes / MIB:.1f} MiB for the {role}, "
                         f"{spec.kv_bytes_per_token} KV bytes per token)")
    return tokens


def describe_settings(settings: RuntimeSettings) -> str:
    """One line: the KV token budgets and how they were chosen."""
    parts = [f"generator {settings.generator.max_total_tokens or 'default'} tokens"]
    if settings.verifier is not None:
        parts.append(f"verifier {settings.verifier.max_total_tokens or 'default'} tokens")
    line = f"KV split {settings.split}: " + ", ".join(parts)
    if settings.plan is not None and settings.plan.shared is not None:
        line += (f" (roofline on {settings.plan.hardware.name}: B_pre={settings.plan.shared.b_pre}, "
                 f"B_dec={settings.plan.shared.b_dec}, budget {settings.plan.kv_budget / GIB:.3f} GiB)")
    return line
