"""`sgl-tts plan spec` (`sgl_tts.rsd.specdec`'s speed model) and `sgl-tts plan memory`
(`sgl_tts.runtime.memory_plan`'s KV split)."""

from __future__ import annotations

import argparse
import math
import time

from sgl_tts.runtime.hardware import KNOWN_HARDWARE, THIS_MACHINE
from sgl_tts.runtime.roofline import BUILTIN_CONFIGS, DTYPE_BYTES


def add_parsers(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="planners: speculative decoding speed, memory split")
    plan_commands = plan.add_subparsers(dest="plan", required=True)

    parser = plan_commands.add_parser(
        "spec",
        help="speed model of token-level speculative decoding",
        description="Expected tokens per round and speed ratio S(k) = E[N]*T1 / (k*TD + TV(k+1) + TH) "
        "for each acceptance rate alpha (serial model, no overlap). Times share one unit.",
    )
    parser.add_argument("--alpha", type=_acceptance_rate, action="append", required=True,
                        help="mean per-token acceptance rate in [0, 1]; repeat for several rows")
    parser.add_argument("--k", type=_draft_length, required=True, help="draft tokens per round (>= 1)")
    parser.add_argument("--td", type=_non_negative_time, required=True, help="draft time per token")
    parser.add_argument("--tv", type=_positive_time, required=True, help="verification time for k+1 tokens")
    parser.add_argument("--th", type=_non_negative_time, required=True, help="acceptance and state handling time")
    parser.add_argument("--t1", type=_positive_time, default=1.0, help="baseline time per token (default 1)")
    parser.set_defaults(func=plan_spec_command)

    p = plan_commands.add_parser("memory", help="split KV memory between co-located runtimes (roofline)")
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
    p.set_defaults(func=plan_memory_command)


# --- plan spec ---------------------------------------------------------------------------------------------


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def _acceptance_rate(text: str) -> float:
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _draft_length(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_time(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_time(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def plan_spec_command(args: argparse.Namespace) -> int:
    from sgl_tts.rsd.specdec import format_plan, plan_spec

    rows = plan_spec(args.alpha, args.k, args.td, args.tv, args.th, args.t1)
    print(format_plan(rows, args.k, args.td, args.tv, args.th, args.t1))
    return 0


# --- plan memory -------------------------------------------------------------------------------------------


def plan_memory_command(args: argparse.Namespace) -> int:
    from sgl_tts.runtime.hardware import GIB, get_hardware
    from sgl_tts.runtime.memory_plan import DEVICE_UTILIZATION, bench_planner, describe_allocation, plan_memory
    from sgl_tts.runtime.roofline import Workload, load_model_spec

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
