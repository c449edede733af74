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
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from sgl_tts.runtime.hardware import GIB, HARDWARE, KNOWN_HARDWARE, THIS_MACHINE, Hardware, get_hardware
from sgl_tts.runtime.roofline import (BUILTIN_CONFIGS, DTYPE_BYTES, Allocation, ModelSpec, StepCosts, Workload,
                                      load_model_spec, search_offload, search_shared, search_static)

DEVICE_UTILIZATION = 0.9
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
                target: ModelSpec | None = None, min_tokens: int | None = None) -> MemoryPlan:
    """Plan the KV split of the generator, verifier and (optional) target runtimes.

    `budget`: the KV memory M in bytes (default: `kv_budget`, the device after all weights). `min_tokens`: the
    longest request every runtime must hold (default: the workload's sequence length)."""
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
    tokens = split_budget({role: batches[role] * work.seq_len for role in models}, kv_per_token, budget,
                          work.seq_len if min_tokens is None else min_tokens)
    kv = {role: float(tokens[role] * kv_per_token[role]) for role in models}
    try:
        fractions = start_order_safe_fractions(hw, {role: models[role].weight_bytes + kv[role] for role in models})
    except ValueError:  # a budget given beyond the device: the token budgets stand, no fraction fits
        fractions = {}
    budgets = {role: RuntimeBudget(tokens[role], kv[role], fractions.get(role)) for role in models}
    return MemoryPlan(hw, work, budget, shared, offload, search_static(costs, budget), budgets)


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


def _handle_plan_memory(args: argparse.Namespace) -> int:
    try:
        hw = get_hardware(args.hardware)
        dtype = args.dtype or ("float32" if hw.name == THIS_MACHINE else None)  # SGLang on CPU runs fp32
        gen = load_model_spec(args.generator_config, dtype)
        ver = load_model_spec(args.verifier_config, dtype)
        target = load_model_spec(args.target_config, dtype) if args.target_config else None
        share = args.target_share if target is not None else 0.0
        work = Workload(args.n, args.prompt_len, args.decode_len, share)
        budget = args.memory_gb * GIB if args.memory_gb is not None else None
        plan = plan_memory(gen, ver, hw, work, budget, target, args.min_tokens)
        planner_us = math.inf
        for _ in range(20):
            began = time.perf_counter()
            plan_memory(gen, ver, hw, work, budget, target, args.min_tokens)
            planner_us = min(planner_us, (time.perf_counter() - began) * 1e6)
    except (KeyError, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}")
        return 2
    gpu = hw.name != THIS_MACHINE
    print(f"hardware  {hw.name}: {hw.peak_flops / 1e12:.2f} TFLOP/s, {hw.mem_bandwidth / 1e9:.1f} GB/s, "
          f"{hw.mem_bytes / GIB:.1f} GiB, link {hw.link_bandwidth / 1e9:.1f} GB/s"
          + ("  (times below are roofline projections, not measurements)" if gpu else ""))
    models = {"generator": gen, "verifier": ver, **({"target": target} if target else {})}
    for role, m in models.items():
        print(f"{role:<9} {m.name}: {m.weight_bytes / GIB:.2f} GiB weights, {m.kv_bytes_per_token} KV bytes/token")
    print(f"workload  n={work.n} prompt_len={work.prompt_len} decode_len={work.decode_len}"
          + (f" target rewrites {work.target_n} of {work.n} steps" if target else "")
          + f"; KV budget {plan.kv_budget / GIB:.3f} GiB")
    for label, a in (("shared", plan.shared), ("offload", plan.offload), ("static", plan.static)):
        print(f"{label:<9} {describe_allocation(a)}")
    print(f"fastest   {plan.chosen.mode}; co-located SGLang runtimes allocate their KV pools at start and cannot "
          f"offload, so they get the shared split" + ("" if plan.budgets else ", which does not fit"))
    for role, b in plan.budgets.items():
        fraction = ""
        if gpu:
            fraction = (f", --mem-fraction-static {b.mem_fraction_static:.3f}" if b.mem_fraction_static is not None
                        else f" (weights + KV exceed {DEVICE_UTILIZATION:.0%} of the device)")
        print(f"{role:<9} --max-total-tokens {b.max_total_tokens}{fraction} (KV {b.kv_bytes / GIB:.3f} GiB)")
    print(f"planner   {planner_us:.0f} µs for this plan (best of 20 calls)")
    if args.bench:
        for n, us in bench_planner().items():
            print(f"bench     n={n:<5d} {us:8.1f} µs per plan (generator + verifier + target, rtx4090)")
    return 0


def add_plan_memory_parser(plan_subparsers: Any) -> argparse.ArgumentParser:
    """Add `memory` to the `plan` command's subparsers; its handler returns an exit code."""
    p = plan_subparsers.add_parser("memory", help="split KV memory between co-located runtimes (roofline)")
    p.add_argument("--hardware", default=THIS_MACHINE,
                   help=f"one of {', '.join(KNOWN_HARDWARE)} (default: probe this machine)")
    p.add_argument("--generator-config", default="smollm2-135m",
                   help=f"config.json path, model folder, or one of {', '.join(BUILTIN_CONFIGS)}")
    p.add_argument("--verifier-config", default="smollm2-135m", help="as --generator-config")
    p.add_argument("--target-config", default=None, help="RSD's target model, as --generator-config (optional)")
    p.add_argument("--target-share", type=float, default=0.35,
                   help="fraction of steps the target rewrites (default 0.35)")
    p.add_argument("--n", type=int, default=16, help="beams per step (N)")
    p.add_argument("--prompt-len", type=int, default=256, help="context tokens per beam before the step")
    p.add_argument("--decode-len", type=int, default=128, help="tokens generated per beam per step")
    p.add_argument("--min-tokens", type=int, default=None,
                   help="longest request every runtime must hold (default: prompt-len + decode-len)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="KV-cache budget M in GiB (default: 90%% of device memory minus all models' weights)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="weights and KV dtype (default: float32 on this-machine, else each config's torch_dtype)")
    p.add_argument("--bench", action="store_true", help="also time the planner at n = 16 ... 1024")
    p.set_defaults(func=_handle_plan_memory)
    return p
