"""One memory plan for all co-located runtimes: generator, verifier and (RSD) target under one KV budget.

`plan_memory` runs the roofline search (`sgl_tts.runtime.roofline`, FastTTS §4.3) and turns the shared-memory
optimum into what each SGLang runtime is started with:

- `max_total_tokens`, an absolute KV-cache size. Each runtime first gets its planned batch (B·S tokens), at
  least its longest request; what the batches leave of the budget is shared in proportion to the planned KV,
  so every runtime keeps the ratio the plan chose (memory beyond a batch still serves the radix cache).
- `mem_fraction_static` for GPUs, chosen so that it never binds: SGLang sizes the KV pool as
  min(max_total_tokens, f·F − weights), F being the memory free when that runtime starts
  (`sglang.srt.mem_cache.kv_cache_configurator`, `_profile_available_bytes`), so with a fraction of the whole
  device the runtime that starts last gets less than planned (SGLang issue #3265). Here f is the fraction that
  still fits the runtime's weights and KV when every other runtime has started first and holds its own
  weights, KV and its share of the activation headroom; in any start order the pool is `max_total_tokens`.

Device memory is planned at `DEVICE_UTILIZATION`: weights and KV of all runtimes within 90% of it, the rest
left to activations, CUDA graphs and contexts, split evenly between the runtimes.

The KV split of runtime configs (what FastTTS's M switch applies, `sgl_tts.fasttts.switches`): `shared_kv_budget`
finds the budget (given, the configured `max_total_tokens` pooled, or the device after all weights) and
`split_kv` divides it by the roofline plan or in equal shares, no runtime below the longest request
(`longest_request_tokens`), and returns the configs with `max_total_tokens` (and on cuda the fraction) set.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Mapping

from sgl_tts.runtime.hardware import GIB, HARDWARE, Hardware, plan_hardware
from sgl_tts.runtime.models import resolve_model
import numpy as np

from sgl_tts.runtime.roofline import (BUILTIN_CONFIGS, DTYPE_BYTES, HUB_IDS, Allocation, ModelSpec, StepCosts,
                                      Workload, _roofline_terms, best_upto, load_model_spec, search_offload,
                                      search_shared, search_static)
from sgl_tts.runtime.server import KV_CACHE_DTYPES, RuntimeConfig, kv_pool_dtype

DEVICE_UTILIZATION = 0.9
MIB = 2**20
# Split times within this fraction of the modelled minimum count as equal (`SplitCost.best`): the roofline does not
# model the step time that finely, and under-sizing the generator costs more than the model says (SGLang retracts
# running requests when their KV runs out: at n = 256, a plan 0.4% faster on paper gave the generator 30% of its
# working set, and it retracted 38 requests).
NEAR_TIE = 0.01
ROLES = ("generator", "verifier", "target")


@dataclass(frozen=True)
class RuntimeBudget:
    """What to start one SGLang runtime with: `max_total_tokens` (KV-cache tokens, `kv_bytes` of memory) and,
    on a GPU, a `mem_fraction_static` that does not cap that pool whatever the start order (None when the
    weights and budget together exceed the device's plannable memory)."""

    max_total_tokens: int
    kv_bytes: float
    mem_fraction_static: float | None


@dataclass(frozen=True)
class MemoryPlan:
    """The shared-memory optimum, the offload alternative, the static equal split, and per-runtime budgets
    (from the shared optimum: co-located runtimes allocate their KV pools at start and cannot offload)."""

    hardware: Hardware
    workload: Workload
    kv_budget: float
    shared: Allocation | None
    offload: Allocation | None
    static: Allocation | None
    budgets: Mapping[str, RuntimeBudget]  # by role: generator, verifier[, target]; empty if only offloading fits
    working_sets: Mapping[str, int] | None = None  # tokens by role, when the split counted them (`SplitCost`)

    @property
    def chosen(self) -> Allocation:
        """The faster of the shared optimum and offloading (the paper's choice; the budgets are the shared one's)."""
        if self.offload is not None and (self.shared is None or self.offload.t_total < self.shared.t_total):
            return self.offload
        assert self.shared is not None, "plan_memory refuses plans without a shared allocation"
        return self.shared

    @property
    def generator(self) -> RuntimeBudget:
        return self.budgets["generator"]

    @property
    def verifier(self) -> RuntimeBudget:
        return self.budgets["verifier"]

    @property
    def target(self) -> RuntimeBudget | None:
        return self.budgets.get("target")


def kv_budget(hw: Hardware, *models: ModelSpec, utilization: float = DEVICE_UTILIZATION) -> float:
    """KV-cache memory left on the device after all models' weights, using `utilization` of it."""
    return utilization * hw.mem_bytes - sum(m.weight_bytes for m in models)


def split_budget(planned_tokens: Mapping[str, int], kv_per_token: Mapping[str, int], budget: float,
                 min_tokens: int) -> dict[str, int]:
    """KV tokens per runtime: shares of `budget` (bytes) in proportion to each runtime's planned KV bytes, none
    below `min_tokens`; a runtime whose share would be below it gets exactly `min_tokens` and the others share
    the rest. Raises ValueError when the floors alone exceed the budget."""
    floor_bytes = {role: min_tokens * kv_per_token[role] for role in planned_tokens}
    if sum(floor_bytes.values()) > budget:
        raise ValueError(f"a KV budget of {budget / GIB:.3f} GiB cannot give each of {', '.join(planned_tokens)} "
                         f"its longest request ({min_tokens} tokens, {sum(floor_bytes.values()) / GIB:.3f} GiB "
                         f"together)")
    pinned: set[str] = set()
    while True:
        free = [role for role in planned_tokens if role not in pinned]
        rest = budget - sum(floor_bytes[role] for role in pinned)
        weights = {role: planned_tokens[role] * kv_per_token[role] for role in free}
        total = sum(weights.values())
        shares = {role: rest * (weights[role] / total if total else 1 / len(free)) for role in free}
        below = {role for role in free if shares[role] < floor_bytes[role]}
        if not below:
            break
        pinned |= below
    tokens = {role: min_tokens for role in pinned}
    tokens.update({role: int(shares[role] // kv_per_token[role]) for role in free})
    return tokens


# ---- Working sets and the split that counts what evicting them costs ----

def working_set_tokens(prompt_tokens: int, paths: int, kept: int, max_tokens: int, own_tokens: int,
                       searches: int = 1) -> int:
    """KV tokens one iteration of `searches` searches keeps resident when nothing is evicted, counted as the
    radix cache holds them (a shared prefix once):

        W = c · (P + k·(L − u) + n·u)

    c searches at once, each: its prompt P once (every path forks from it), the paths of the k parents the
    n live beams fork from (at most L − u tokens each: a whole path, `max_tokens`, less the part written since
    the fork), and each live beam's own u tokens since its fork (`own_tokens`: one step for beam search, DVTS
    and dynamic branching). Parents that share ancestors are still counted whole: an upper bound for k > 1.
    E.g. beam search n = 16, B = 4 (k = 4), P = 80, L = 72, u = 24: 80 + 4·48 + 16·24 = 656 tokens.
    The verifier's working set is the same tree under its own prompt: it scores the same prefixes."""
    if not 1 <= kept <= paths or not 0 < own_tokens <= max_tokens or prompt_tokens < 0 or searches < 1:
        raise ValueError(f"need 1 <= kept <= paths, 0 < own_tokens <= max_tokens, prompt_tokens >= 0 and "
                         f"searches >= 1; got kept={kept}, paths={paths}, own_tokens={own_tokens}, "
                         f"max_tokens={max_tokens}, prompt_tokens={prompt_tokens}, searches={searches}")
    return searches * (prompt_tokens + kept * (max_tokens - own_tokens) + paths * own_tokens)


def search_working_sets(paths: int, beam_width: int, prompt_tokens: int, max_tokens: int, max_step_tokens: int,
                        searches: int = 1) -> dict[str, int]:
    """The generator's and the verifier's working sets (`working_set_tokens`) of a search keeping ⌈n/B⌉ parents
    and forking each into B children per step, as beam search and DVTS do."""
    kept = max(1, math.ceil(paths / beam_width))
    tokens = working_set_tokens(prompt_tokens, paths, kept, max_tokens, min(max_step_tokens, max_tokens), searches)
    return {"generator": tokens, "verifier": tokens}


class SplitCost:
    """The modelled time of one search step when the verifier gets v KV tokens and the generator the rest of the
    budget M (bytes), counting what a cache smaller than its working set costs (FastTTS §4.3's T_tot plus
    re-prefills):

        T(v) = T_verify(B_pre(v)) + T_generate(B_dec(g(v))) + R_ver·(W_ver − v)⁺ + R_gen·(W_gen − g(v))⁺
        g(v) = (M − v·kv_ver) / kv_gen          (the generator's tokens; real, so T is piecewise linear in v)
        B_pre(v) = best batch ≤ min(N, ⌊v/S⌋),  B_dec(g) = best batch ≤ min(N, ⌊g/S⌋)   (`best_upto`)

    T_verify and T_generate are `StepCosts`' roofline terms. A working set W larger than the cache is re-read
    every iteration: its evicted part (W − cache)⁺ is prefilled again, at R per token = the roofline time of
    one prefill token, max(compute, KV write) (the weights are read by the iteration's own batches anyway).
    """

    def __init__(self, costs: StepCosts, gen: ModelSpec, ver: ModelSpec, hw: Hardware, budget: float,
                 working_sets: Mapping[str, int]):
        self.costs, self.budget = costs, budget
        self.kv_gen, self.kv_ver = gen.kv_bytes_per_token, ver.kv_bytes_per_token
        self.w_gen, self.w_ver = working_sets["generator"], working_sets["verifier"]
        seq = costs.work.seq_len
        self.seq_len = seq
        self.best_pre, self.best_dec = best_upto(costs.verify), best_upto(costs.generate)
        self.r_ver = _reprefill_per_token(ver, hw, seq)
        self.r_gen = _reprefill_per_token(gen, hw, seq)

    def generator_tokens(self, v: np.ndarray | int) -> np.ndarray:
        return (self.budget - np.asarray(v, dtype=np.float64) * self.kv_ver) / self.kv_gen

    def __call__(self, v: np.ndarray | int) -> np.ndarray:
        v = np.asarray(v, dtype=np.int64)
        g = self.generator_tokens(v)
        n = self.costs.work.n
        b_pre = self.best_pre[np.minimum(n, v // self.seq_len)]
        b_dec = self.best_dec[np.minimum(n, np.floor(np.maximum(g, 0) / self.seq_len).astype(np.int64))]
        # No batch fits: that stage cannot run, an infinite time.
        verify = np.where(b_pre >= 1, self.costs.verify[b_pre], np.inf)
        generate = np.where(b_dec >= 1, self.costs.generate[b_dec], np.inf)
        return (verify + generate + self.r_ver * np.maximum(self.w_ver - v, 0)
                + self.r_gen * np.maximum(self.w_gen - g, 0))

    def generator_minimum(self, floor: int) -> int:
        """The generator's tokens the verifier's floor leaves it: its longest request (`floor`), or, when larger,
        its share of M in proportion to the working sets' bytes, W_gen·kv_gen / (W_gen·kv_gen + W_ver·kv_ver)
        (capped at W_gen): under pressure both runtimes fall short of their working sets alike, and the cost
        model, not a fixed floor, decides whether the generator gets more."""
        gen_bytes, ver_bytes = self.w_gen * self.kv_gen, self.w_ver * self.kv_ver
        share = int(self.budget * gen_bytes / (gen_bytes + ver_bytes) // self.kv_gen)
        return max(floor, min(self.w_gen, share))

    def bounds(self, floor: int) -> tuple[int, int]:
        """[lo, hi]: the verifier's tokens a plan may choose. Each runtime holds at least `floor` (the longest
        request); the verifier at least min(W_ver, M − `generator_minimum`), so it is never starved below its
        working set when the budget holds it beside the generator's minimum; and when the budget holds both
        working sets, the generator keeps its own. Raises ValueError when the floors alone exceed the budget."""
        most = int((self.budget - floor * self.kv_gen) // self.kv_ver)  # the generator at its floor
        if most < floor:
            raise ValueError(f"a KV budget of {self.budget / GIB:.3f} GiB cannot give the generator and the "
                             f"verifier their longest request ({floor} tokens each)")
        beside_generator = int((self.budget - self.generator_minimum(floor) * self.kv_gen) // self.kv_ver)
        lo = max(floor, min(self.w_ver, beside_generator))
        hi = most
        if self.w_ver * self.kv_ver + self.w_gen * self.kv_gen <= self.budget:
            hi = int((self.budget - self.w_gen * self.kv_gen) // self.kv_ver)
        return lo, hi

    def best(self, floor: int) -> int:
        """The verifier's tokens minimising T within `bounds`, near-ties to the smaller v: the first candidate
        within `NEAR_TIE` of the minimum, so that the generator gets more (FastTTS breaks ties toward B_dec). T
        is linear in v between the points where a batch bound or a (·)⁺ term changes, so only those points and
        their neighbours are evaluated: O(N), not O(M)."""
        lo, hi = self.bounds(floor)
        k = np.arange(1, self.costs.work.n + 1, dtype=np.float64)
        dec_steps = np.floor((self.budget - k * self.seq_len * self.kv_gen) / self.kv_ver)  # last v with ⌊g/S⌋ ≥ k
        gen_kink = (self.budget - self.w_gen * self.kv_gen) / self.kv_ver
        points = np.concatenate([k * self.seq_len, dec_steps, [self.w_ver, math.floor(gen_kink), lo, hi]])
        points = np.concatenate([points - 1, points, points + 1])
        candidates = np.unique(np.clip(points, lo, hi).astype(np.int64))
        times = self(candidates)
        return int(candidates[np.argmax(times <= times.min() * (1 + NEAR_TIE))])  # argmax: the first True


def planned_verifier_hit(cache_tokens: int, prompt_tokens: int, paths: int, kept: int, max_tokens: int,
                         step_tokens: int, searches: int = 1) -> float:
    """The share of the verifier's input tokens its radix cache should serve over a search of K = ⌈L/s⌉
    iterations, when it holds `cache_tokens` (what the measured hit, Σ cached_tokens / Σ input_tokens of the
    scorer's calls, estimates):

        input_k    = c·n·(Q + k·s)                    every path is read whole at iteration k
        computed_k = c·n·s + [k = 1]·c·Q + min((W_k − C)⁺, W_k − c·n·s)
        hit        = 1 − Σ_k computed_k / Σ_k input_k

    with W_k = `working_set_tokens`(Q, n, kept, k·s, s, c): new steps are never cached, the question is
    computed once, and the evicted part of the working set is prefilled again."""
    iterations = max(1, math.ceil(max_tokens / step_tokens))
    read = computed = 0
    for k in range(1, iterations + 1):
        new = searches * paths * step_tokens
        working = working_set_tokens(prompt_tokens, paths, kept, k * step_tokens, step_tokens, searches)
        read += searches * paths * (prompt_tokens + k * step_tokens)
        computed += new + (searches * prompt_tokens if k == 1 else 0) + min(max(working - cache_tokens, 0),
                                                                            working - new)
    return max(0.0, 1 - computed / read)


def engine_batch_for(generator_tokens: int, work: Workload) -> int:
    """The running batch the generator's KV holds: ⌊tokens / S⌋ sequences of one step's length S (the plan's
    `Workload.seq_len`: prompt, half a path, a step; prefix sharing ignored, as in the roofline), at least 1.
    What speculation may fill (`FastTTSConfig.engine_batch`) when it is not given."""
    return max(1, generator_tokens // work.seq_len)


def _reprefill_per_token(model: ModelSpec, hw: Hardware, seq_len: int) -> float:
    compute, _weights, kv = _roofline_terms(model, hw, 1, seq_len / 2, 1)
    return max(compute, kv)


def start_order_safe_fractions(hw: Hardware, needs: Mapping[str, float],
                               utilization: float = DEVICE_UTILIZATION) -> dict[str, float]:
    """mem_fraction_static per runtime from its static need (weights + KV bytes): need_i / F_i, where F_i is
    what is free when runtime i starts last, after every other runtime took its need and its share of the
    activation headroom (1 - utilization)·device / k. Raises ValueError if the needs exceed the plannable memory
    (`utilization` of the device)."""
    usable = utilization * hw.mem_bytes
    if sum(needs.values()) > usable:
        raise ValueError(f"weights and KV of {', '.join(needs)} take {sum(needs.values()) / GIB:.2f} GiB, more "
                         f"than {utilization:.0%} of {hw.name}'s {hw.mem_bytes / GIB:.1f} GiB")
    headroom = (1 - utilization) * hw.mem_bytes / len(needs)
    # Rounded up to 3 decimals: a larger fraction only lets the profile exceed max_total_tokens, which caps it.
    return {role: math.ceil(1000 * need / (hw.mem_bytes - sum(needs[o] + headroom for o in needs if o != role))) / 1000
            for role, need in needs.items()}


def plan_memory(gen: ModelSpec, ver: ModelSpec, hw: Hardware, work: Workload, budget: float | None = None,
                target: ModelSpec | None = None, min_tokens: int | None = None,
                working_sets: Mapping[str, int] | None = None) -> MemoryPlan:
    """Plan the KV split of the generator, verifier and (optional) target runtimes.

    `budget`: the KV memory M in bytes (default: `kv_budget`, the device after all weights). `min_tokens`: the
    longest request every runtime must hold (default: the workload's sequence length). `working_sets`: the
    generator's and verifier's working sets in tokens (`search_working_sets`); with them (and no target) the
    split is `SplitCost.best`'s, which counts re-prefilling what a too-small cache evicts and never plans the
    verifier below min(its working set, M − the generator's floor); without them each runtime gets its planned
    batch and the rest is shared in proportion (`split_budget`)."""
    models = {"generator": gen, "verifier": ver, **({"target": target} if target is not None else {})}
    budget = kv_budget(hw, *models.values()) if budget is None else budget
    if budget <= 0:
        weights = sum(m.weight_bytes for m in models.values()) / GIB
        raise ValueError(f"no KV memory left: the models' weights take {weights:.2f} GiB of "
                         f"{hw.name}'s {hw.mem_bytes / GIB:.2f} GiB")
    costs = StepCosts(gen, ver, hw, work, target)
    shared, offload = search_shared(costs, budget), search_offload(costs, budget, hw)
    if shared is None and offload is None:
        raise ValueError(f"a KV budget of {budget / GIB:.3f} GiB holds not even one sequence of {work.seq_len} "
                         f"tokens per model")
    if shared is None:  # only offloading fits: no budgets for co-located runtimes
        return MemoryPlan(hw, work, budget, None, offload, search_static(costs, budget), {})
    batches = {"generator": shared.b_dec, "verifier": shared.b_pre, "target": shared.b_tgt}
    kv_per_token = {role: m.kv_bytes_per_token for role, m in models.items()}
    floor = work.seq_len if min_tokens is None else min_tokens
    if working_sets is not None and target is None:
        cost = SplitCost(costs, gen, ver, hw, budget, working_sets)
        verifier_tokens = cost.best(floor)
        tokens = {"generator": int(cost.generator_tokens(verifier_tokens)), "verifier": verifier_tokens}
    else:
        tokens = split_budget({role: batches[role] * work.seq_len for role in models}, kv_per_token, budget, floor)
    kv = {role: float(tokens[role] * kv_per_token[role]) for role in models}
    try:
        fractions = start_order_safe_fractions(hw, {role: models[role].weight_bytes + kv[role] for role in models})
    except ValueError:  # a budget given beyond the device: the token budgets stand, no fraction fits
        fractions = {}
    budgets = {role: RuntimeBudget(tokens[role], kv[role], fractions.get(role)) for role in models}
    return MemoryPlan(hw, work, budget, shared, offload, search_static(costs, budget), budgets,
                      working_sets if working_sets is not None and target is None else None)


# ---- The KV split of co-located runtimes: budget, floors, workload, and the split itself ----

class KVSplitError(ValueError):
    """A KV split that cannot be made. `argument` names the input at fault, by the parameter names of
    `shared_kv_budget` and `split_kv`: "runtimes" (not on one device), "hardware" (no profile) or "budget_mib"
    (the budget, given or derived, is too small), so that a caller can name its own setting."""

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


def model_spec_for(config: RuntimeConfig) -> ModelSpec:
    """The roofline's view of a runtime's model, in the dtypes the runtime will use: its weights' (fp32 on CPU) and
    its KV pool's (`kv_pool_dtype`: bf16 on a CPU with the paged kernel)."""
    if config.dtype != "auto":
        dtype = config.dtype if config.dtype in DTYPE_BYTES else None
    else:
        dtype = "float32" if config.device == "cpu" else None
    known = config.model in BUILTIN_CONFIGS or config.model in HUB_IDS
    source = config.model if known else resolve_model(config.model)
    spec = load_model_spec(source, dtype)
    return replace(spec, kv_dtype_bytes=KV_CACHE_DTYPES.get(kv_pool_dtype(config) or ""))


def longest_request_tokens(prompt_tokens: int, max_tokens: int, max_step_tokens: int) -> int:
    """Tokens of the longest request any runtime must hold: the prompt, a whole path (`max_tokens`) plus a
    LookAhead step (`max_step_tokens`)."""
    return prompt_tokens + max_tokens + max_step_tokens


def plan_workload(paths: int, prompt_tokens: int, max_tokens: int, max_step_tokens: int,
                  target_share: float = 0.0) -> Workload:
    """One search step for the roofline: `paths` beams whose context averages the prompt plus half a path
    (`max_tokens`), each decoding a step of `max_step_tokens`; `target_share` of the steps are rewritten by RSD's
    target (0 without one)."""
    return Workload(paths, prompt_tokens + max_tokens // 2, max_step_tokens, target_share)


@dataclass(frozen=True)
class SharedBudget:
    """The KV memory co-located runtimes share (`shared_kv_budget`), with what the split needs besides.

    origin: "given" (`budget_mib`), "pooled" (the runtimes' configured `max_total_tokens`) or "device" (the
    device's memory after all weights); source: the same in words, for logs and reports.
    specs: each runtime's model, by role, in the dtype it runs in; hardware: the roofline profile, None when
    neither a roofline plan nor a GPU's memory fractions need one.
    """

    kv_bytes: float
    origin: str
    source: str
    device: str
    specs: Mapping[str, ModelSpec]
    hardware: Hardware | None


def shared_kv_budget(runtimes: Mapping[str, RuntimeConfig], budget_mib: float | None, hardware: str | None,
                     roofline: bool) -> SharedBudget:
    """The KV bytes the co-located `runtimes` (by role: generator[, verifier][, target], all on one device)
    share: `budget_mib`; else their configured `max_total_tokens`, pooled; else the device's memory after all
    weights (`kv_budget`). `hardware` names the roofline profile (None: from the device, `plan_hardware`); it is
    resolved for a `roofline` plan, on cuda and for the device's memory. Raises KVSplitError."""
    devices = {config.device for config in runtimes.values()}
    if len(devices) > 1:
        raise KVSplitError("runtimes", "the KV split needs all runtimes on one device, got "
                           + ", ".join(f"{role} on {config.device}" for role, config in runtimes.items()))
    device = devices.pop()
    specs = {role: model_spec_for(config) for role, config in runtimes.items()}
    pooled = all(config.max_total_tokens for config in runtimes.values())
    profile: Hardware | None = None
    if roofline or device == "cuda" or (budget_mib is None and not pooled):
        try:
            profile = plan_hardware(device, hardware)
        except (KeyError, ValueError) as exc:
            raise KVSplitError("hardware", exc.args[0]) from None

    if budget_mib is not None:
        return SharedBudget(budget_mib * MIB, "given", f"{budget_mib:g} MiB given", device, specs, profile)
    if pooled:
        kv = sum(runtimes[role].max_total_tokens * specs[role].kv_bytes_per_token for role in runtimes)
        return SharedBudget(float(kv), "pooled", "the runtimes' max_total_tokens, pooled", device, specs, profile)
    assert profile is not None
    weights = sum(m.weight_bytes for m in specs.values())
    source = (f"{profile.name}'s memory: {DEVICE_UTILIZATION:.0%} of {profile.mem_bytes / GIB:.1f} GiB "
              f"minus {weights / GIB:.2f} GiB of weights")
    return SharedBudget(kv_budget(profile, *specs.values()), "device", source, device, specs, profile)


def tokens_in_share(kv_bytes: float, spec: ModelSpec, role: str, min_tokens: int) -> int:
    """The KV tokens `kv_bytes` hold for `spec`'s model; KVSplitError when fewer than `min_tokens`, the longest
    request (`longest_request_tokens`)."""
    tokens = int(kv_bytes // spec.kv_bytes_per_token)
    if tokens < min_tokens:
        raise KVSplitError("budget_mib", f"the {role} runtime's share holds {tokens} tokens, fewer than the longest "
                           f"request ({min_tokens} = prompt_tokens + max_tokens + max_step_tokens); raise the budget "
                           f"(now {kv_bytes / MIB:.1f} MiB for the {role}, {spec.kv_bytes_per_token} KV bytes per "
                           f"token)")
    return tokens


@dataclass(frozen=True)
class KVSplit:
    """The runtimes' configs with their KV budgets (`split_kv`), by role, and how the budgets were chosen:
    split "whole budget" (one runtime), "static" (equal shares) or "roofline" (`plan`)."""

    runtimes: Mapping[str, RuntimeConfig]
    split: str
    plan: MemoryPlan | None = None


def split_kv(runtimes: Mapping[str, RuntimeConfig], budget: SharedBudget, *, roofline: bool, paths: int,
             prompt_tokens: int, max_tokens: int, max_step_tokens: int, target_share: float = 0.0,
             working_sets: Mapping[str, int] | None = None) -> KVSplit:
    """Split `budget` between the co-located `runtimes` (by role; no verifier: the scorer reads from the
    generator's runtime, which then holds the verifier's share too): by the `roofline` plan (`plan_memory`) of
    one search step (`plan_workload`: `paths` sequences at once; `target_share` counts only with a target), or
    in equal shares. Budgets in tokens follow each model's KV bytes per token; none is below the longest request
    (`longest_request_tokens`). `working_sets` (tokens by role, `search_working_sets`): the roofline split
    counts re-prefilling what does not fit and keeps the verifier at its working set when the budget allows
    (`SplitCost`). On cuda each runtime also gets a start-order-safe `mem_fraction_static`.
    Raises KVSplitError."""
    specs, hardware = budget.specs, budget.hardware
    floor = longest_request_tokens(prompt_tokens, max_tokens, max_step_tokens)
    plan = None
    if roofline:
        assert hardware is not None, "shared_kv_budget resolves the hardware for a roofline plan"
        # The scorer on the generator's runtime: plan a verifier of the generator's model, the runtime holds both.
        ver_spec = specs.get("verifier", specs["generator"])
        work = plan_workload(paths, prompt_tokens, max_tokens, max_step_tokens,
                             target_share if "target" in runtimes else 0.0)
        try:
            plan = plan_memory(specs["generator"], ver_spec, hardware, work, budget.kv_bytes, specs.get("target"),
                               floor, working_sets)
        except ValueError as exc:
            raise KVSplitError("budget_mib", f"{exc.args[0]} (longest request {floor} = prompt_tokens + max_tokens "
                               f"+ max_step_tokens)") from None
        if plan.shared is None:
            raise KVSplitError("budget_mib", f"{budget.kv_bytes / MIB:.1f} MiB holds no sequence of every model at "
                               f"once; only offloading (which co-located runtimes cannot do) would fit")
        tokens = {role: b.max_total_tokens for role, b in plan.budgets.items()}
        if "verifier" not in runtimes:
            tokens["generator"] += tokens.pop("verifier")
        split = "roofline"
    elif len(runtimes) == 1:
        tokens = {"generator": tokens_in_share(budget.kv_bytes, specs["generator"], "generator", floor)}
        split = "whole budget"
    else:
        tokens = {role: tokens_in_share(budget.kv_bytes / len(runtimes), specs[role], role, floor)
                  for role in runtimes}
        split = "static"

    fractions: dict[str, float] = {}
    if budget.device == "cuda":
        assert hardware is not None, "shared_kv_budget resolves the hardware on cuda"
        needs = {role: specs[role].weight_bytes + tokens[role] * specs[role].kv_bytes_per_token for role in runtimes}
        try:
            fractions = start_order_safe_fractions(hardware, needs)
        except ValueError as exc:
            raise KVSplitError("budget_mib", exc.args[0]) from None
    configured = {role: replace(config, max_total_tokens=tokens[role],
                                mem_fraction_static=fractions.get(role, config.mem_fraction_static))
                  for role, config in runtimes.items()}
    return KVSplit(configured, split, plan)


def bench_planner(ns: tuple[int, ...] = (16, 64, 256, 1024), repeats: int = 20,
                  with_target: bool = True) -> dict[int, float]:
    """Microseconds per `plan_memory` call (best of `repeats`) for each n, on the RTX 4090 profile: Qwen2.5-Math
    1.5B generator, Skywork 1.5B PRM and (`with_target`) the 7B target rewriting half the steps."""
    gen, ver = load_model_spec("qwen2.5-math-1.5b"), load_model_spec("skywork-prm-1.5b")
    target = load_model_spec("qwen2.5-math-7b") if with_target else None
    timings: dict[int, float] = {}
    for n in ns:
        work = Workload(n, 512, 256, 0.5 if with_target else 0.0)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan_memory(gen, ver, HARDWARE["rtx4090"], work, target=target)
            best = min(best, time.perf_counter() - t0)
        timings[n] = best * 1e6
    return timings


def describe_allocation(a: Allocation | None) -> str:
    if a is None:
        return "infeasible"
    target = f" B_tgt={a.b_tgt:<4d}" if a.b_tgt else ""
    parts = f"verify {a.t_verify * 1e3:.2f} + generate {a.t_generate * 1e3:.2f}"
    parts += f" + target {a.t_target * 1e3:.2f}" if a.b_tgt else ""
    parts += f" + offload {a.overhead * 1e3:.2f}" if a.overhead else ""
    return f"B_pre={a.b_pre:<4d} B_dec={a.b_dec:<4d}{target} T_tot={a.t_total * 1e3:9.2f} ms ({parts})"
