"""Roofline memory planner: how to split KV-cache memory between the generator and the verifier.

FastTTS §4.3: pick the verifier (prefill) batch B_pre and generator (decode) batch B_dec minimising
    T_tot = ⌈N/B_pre⌉·T_pre(B_pre, S) + ⌈N/B_dec⌉·S_dec·T_dec(B_dec, S̄_cache)
subject to B_pre·KV_ver(1, S) + B_dec·KV_gen(1, S) ≤ M, with T = max(FLOPs/P, bytes/BW) per batch
(the roofline bound, edge-inference-evaluation §III eq. 3) and KV bytes per token 2·L·H_kv·d_h·s
(eq. 2). Or, with offloading (§4.3.2), each model gets all of M while it runs and the other's KV
cache goes to host memory and back, at the host-link bandwidth.

Workload: N beams per step, each holding `prompt_len` tokens of context (problem and earlier steps)
and generating `decode_len` more. The verifier reads S = prompt_len + decode_len tokens; the generator
holds up to S tokens and S̄_cache = prompt_len + decode_len/2 on average while decoding (the paper's
S_dec/2 when prompt_len = 0). Prefix sharing between beams is ignored (a conservative bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}
_REL_TOL = 1e-12  # totals closer than this are ties


@dataclass(frozen=True)
class Hardware:
    """A device for the roofline model: peak FLOP/s, memory bandwidth and size, host-link bandwidth
    (bytes/s, one direction)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: float
    link_bandwidth: float


GIB = 2**30
# Dense FP16/BF16 tensor throughput with FP32 accumulation (NVIDIA Ampere/Ada whitepapers, H200
# datasheet BF16 without sparsity); PCIe 4.0 x16 ≈ 32 GB/s, PCIe 5.0 x16 ≈ 64 GB/s per direction.
HARDWARE: dict[str, Hardware] = {
    "rtx4090": Hardware("rtx4090", 165.2e12, 1008e9, 24 * GIB, 32e9),
    "rtx4070ti": Hardware("rtx4070ti", 80.2e12, 504e9, 12 * GIB, 32e9),
    "rtx3070ti": Hardware("rtx3070ti", 43.5e12, 608e9, 8 * GIB, 32e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9, 64e9),
}
THIS_MACHINE = "this-machine"


def probe_this_machine(seconds: float = 0.5) -> Hardware:
    """Measure this host: FLOP/s from a float32 matmul, bandwidth from a 64 MiB array copy; the host
    link is the memory itself. Takes about `seconds` (well under 2 s)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    src = np.ones(16 * 2**20, dtype=np.float32)
    dst = np.empty_like(src)
    best_mm, best_copy, deadline = math.inf, math.inf, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ a
        t1 = time.perf_counter()
        np.copyto(dst, src)
        t2 = time.perf_counter()
        best_mm, best_copy = min(best_mm, t1 - t0), min(best_copy, t2 - t1)
    flops = 2 * 512**3 / best_mm
    bandwidth = 2 * src.nbytes / best_copy  # a copy reads and writes every byte
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(THIS_MACHINE, flops, bandwidth, float(mem), bandwidth)


def get_hardware(name: str) -> Hardware:
    """A built-in profile by name, or `this-machine` (probed now)."""
    if name == THIS_MACHINE:
        return probe_this_machine()
    if name not in HARDWARE:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join([*HARDWARE, THIS_MACHINE])}")
    return HARDWARE[name]


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs of a model.

    matmul_params: weights used in matrix products per token (layers plus the output head), so a
    forward pass costs 2·matmul_params FLOPs per token before attention.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: float
    matmul_params: float
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """2·L·H_kv·d_h·s: keys and values of every layer (edge-inference-evaluation eq. 2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# The fields of Hugging Face config.json files the planner reads, for models the project uses.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], num_hidden_layers=30, hidden_size=576,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         vocab_size=49152, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen2.5-math-1.5b": dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=28, hidden_size=1536,
                              num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                              vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "qwen2.5-math-7b": dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=28, hidden_size=3584,
                            num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                            vocab_size=152064, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "qwen2.5-math-prm-7b": dict(architectures=["Qwen2ForProcessRewardModel"], num_hidden_layers=28,
                                hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                                torch_dtype="bfloat16"),
    "skywork-prm-1.5b": dict(architectures=["Qwen2ForPrmModel"], num_hidden_layers=28, hidden_size=1536,
                             num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                             vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16"),
    "math-shepherd-mistral-7b-prm": dict(architectures=["MistralForCausalLM"], num_hidden_layers=32,
                                         hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                         intermediate_size=14336, vocab_size=32000,
                                         tie_word_embeddings=False, torch_dtype="bfloat16"),
}


def model_spec_from_config(config: Mapping[str, Any], name: str = "model", dtype: str | None = None) -> ModelSpec:
    """Read a Hugging Face config dict. Parameters are counted from the shapes (attention, gated MLP,
    embeddings; biases and norms ignored); a reward-model architecture has no vocabulary-sized head."""
    def need(key: str) -> Any:
        if key not in config:
            raise KeyError(f"{name}: config has no {key!r}")
        return config[key]

    layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = need("intermediate_size"), need("vocab_size")
    dtype = dtype or config.get("torch_dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise KeyError(f"{name}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    archs = config.get("architectures") or []
    lm_head = not any(a.endswith(("RewardModel", "PrmModel", "Classification")) for a in archs)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    head = vocab * hidden if lm_head else 0
    untied_head = head if not config.get("tie_word_embeddings", False) else 0
    stored = layers * per_layer + vocab * hidden + untied_head
    return ModelSpec(name, layers, heads, kv_heads, head_dim, float(stored * DTYPE_BYTES[dtype]),
                     float(layers * per_layer + head), DTYPE_BYTES[dtype])


def load_model_spec(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """A built-in model name, a config.json path, or a model folder holding config.json."""
    if name_or_path in BUILTIN_CONFIGS:
        return model_spec_from_config(BUILTIN_CONFIGS[name_or_path], name_or_path, dtype)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise KeyError(f"model {name_or_path!r} is neither a config.json path nor a built-in: "
                       f"{', '.join(BUILTIN_CONFIGS)}")
    return model_spec_from_config(json.loads(path.read_text()), name_or_path, dtype)


def _roofline_terms(model: ModelSpec, hw: Hardware, tokens: float, attended: float,
                    kv_tokens: float) -> tuple[float, float, float]:
    """The time of b sequences is max(b·compute, weights + b·kv); returns (compute, weights, kv) in
    seconds for sequences that each run `tokens` tokens, each attending to `attended` tokens on
    average, and move `kv_tokens` tokens of KV cache to or from memory."""
    attention = 4 * model.num_layers * model.num_heads * model.head_dim * tokens * attended
    flops = 2 * model.matmul_params * tokens + attention
    return (flops / hw.peak_flops, model.weight_bytes / hw.mem_bandwidth,
            kv_tokens * model.kv_bytes_per_token / hw.mem_bandwidth)


def prefill_time(model: ModelSpec, hw: Hardware, batch: int, seq_len: int) -> float:
    """Roofline time of a prefill of `batch` sequences of `seq_len` tokens: weights read once, KV
    written. Causal attention adds 2·L·H·d_h·S² FLOPs per sequence (QKᵀ and PV over S²/2 pairs)."""
    compute, weights, kv = _roofline_terms(model, hw, seq_len, seq_len / 2, seq_len)
    return max(batch * compute, weights + batch * kv)


def decode_step_time(model: ModelSpec, hw: Hardware, batch: int, cache_len: float) -> float:
    """Roofline time of one decode step for `batch` sequences holding `cache_len` tokens: weights and
    the whole KV cache read. Attention adds 4·L·H·d_h·cache_len FLOPs per sequence."""
    compute, weights, kv = _roofline_terms(model, hw, 1, cache_len, cache_len)
    return max(batch * compute, weights + batch * kv)


@dataclass(frozen=True)
class Workload:
    """One search step: `n` beams, each with `prompt_len` tokens of context, generating `decode_len`."""

    n: int
    prompt_len: int
    decode_len: int

    def __post_init__(self) -> None:
        if self.n < 1 or self.prompt_len < 0 or self.decode_len < 1:
            raise ValueError(f"need n >= 1, prompt_len >= 0, decode_len >= 1; got {self}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.decode_len


@dataclass(frozen=True)
class Allocation:
    """Batch sizes and the modelled time of one step, in seconds (`overhead`: offload transfers)."""

    mode: str  # "shared", "offload" or "static"
    b_pre: int
    b_dec: int
    t_verify: float
    t_generate: float
    overhead: float = 0.0

    @property
    def t_total(self) -> float:
        return self.t_verify + self.t_generate + self.overhead


class StepCosts:
    """T_tot's two terms for every batch size up to N, computed once per plan."""

    def __init__(self, gen: ModelSpec, ver: ModelSpec, hw: Hardware, work: Workload) -> None:
        n, s = work.n, work.seq_len
        cache = work.prompt_len + work.decode_len / 2
        self.work = work
        # The same arithmetic as prefill_time and decode_step_time, unrolled over the batch size.
        c, w, k = _roofline_terms(ver, hw, s, s / 2, s)
        self.verify = [0.0] + [-(-n // b) * max(b * c, w + b * k) for b in range(1, n + 1)]
        c, w, k = _roofline_terms(gen, hw, 1, cache, cache)
        c, w, k = c * work.decode_len, w * work.decode_len, k * work.decode_len
        self.generate = [0.0] + [-(-n // b) * max(b * c, w + b * k) for b in range(1, n + 1)]
        self.kv_ver_seq = ver.kv_bytes_per_token * s
        self.kv_gen_seq = gen.kv_bytes_per_token * s

    def best_upto(self, terms: list[float], limit: int) -> list[int]:
        """best[k] = the batch ≤ k with the smallest term; ties go to the larger batch."""
        best = [0] * (limit + 1)
        for b in range(1, limit + 1):
            prev = best[b - 1]
            best[b] = b if prev == 0 or terms[b] <= terms[prev] * (1 + _REL_TOL) else prev
        return best


def _max_batch(budget: float, per_seq: float, n: int) -> int:
    return min(n, int(budget // per_seq)) if budget > 0 else 0


def _is_better(t: float, b_dec: int, best: Allocation | None) -> bool:
    if best is None:
        return True
    if t < best.t_total * (1 - _REL_TOL):
        return True
    return t <= best.t_total * (1 + _REL_TOL) and b_dec > best.b_dec


def search_shared(costs: StepCosts, budget: float) -> Allocation | None:
    """The best (B_pre, B_dec) with B_pre·KV_ver(1,S) + B_dec·KV_gen(1,S) ≤ budget; None if even
    (1, 1) does not fit. Linear in N: for each B_pre the bound on B_dec follows from the budget, and
    the best B_dec under that bound comes from a running minimum (the paper takes the bound itself;
    ⌈N/B⌉ makes the decode term non-monotone, so a smaller B_dec can be faster). Ties: larger B_dec."""
    n = costs.work.n
    max_pre = _max_batch(budget - costs.kv_gen_seq, costs.kv_ver_seq, n)
    best_dec = costs.best_upto(costs.generate, _max_batch(budget - costs.kv_ver_seq, costs.kv_gen_seq, n))
    best: Allocation | None = None
    for b_pre in range(1, max_pre + 1):
        b_dec = best_dec[_max_batch(budget - b_pre * costs.kv_ver_seq, costs.kv_gen_seq, n)]
        assert b_dec >= 1, f"B_pre={b_pre} leaves no room for the generator"
        t = costs.verify[b_pre] + costs.generate[b_dec]
        if _is_better(t, b_dec, best):
            best = Allocation("shared", b_pre, b_dec, costs.verify[b_pre], costs.generate[b_dec])
    return best


def search_offload(costs: StepCosts, budget: float, hw: Hardware) -> Allocation | None:
    """§4.3.2: each model has the whole budget while it runs (B_pre·KV_ver ≤ M, B_dec·KV_gen ≤ M);
    per step each model's resident KV cache goes to host memory and back once."""
    n = costs.work.n
    pre = costs.best_upto(costs.verify, _max_batch(budget, costs.kv_ver_seq, n))
    dec = costs.best_upto(costs.generate, _max_batch(budget, costs.kv_gen_seq, n))
    if pre[-1] == 0 or dec[-1] == 0:
        return None
    b_pre, b_dec = pre[-1], dec[-1]
    overhead = 2 * (b_pre * costs.kv_ver_seq + b_dec * costs.kv_gen_seq) / hw.link_bandwidth
    return Allocation("offload", b_pre, b_dec, costs.verify[b_pre], costs.generate[b_dec], overhead)


@dataclass(frozen=True)
class RuntimeBudget:
    """What to start one SGLang runtime with: `max_total_tokens` (KV-cache tokens) and the matching
    share of device memory for weights plus KV (`mem_fraction`, of the whole device)."""

    max_total_tokens: int
    kv_bytes: float
    mem_fraction: float


@dataclass(frozen=True)
class MemoryPlan:
    """The chosen allocation, both candidates, the static 50/50 baseline, and per-runtime budgets."""

    hardware: Hardware
    workload: Workload
    kv_budget: float
    chosen: Allocation
    shared: Allocation | None
    offload: Allocation | None
    static: Allocation | None
    generator: RuntimeBudget
    verifier: RuntimeBudget


def kv_budget(hw: Hardware, gen: ModelSpec, ver: ModelSpec, utilization: float = 0.9) -> float:
    """KV-cache memory left on the device after both models' weights, using `utilization` of it."""
    return utilization * hw.mem_bytes - gen.weight_bytes - ver.weight_bytes


def _budget(model: ModelSpec, hw: Hardware, kv_bytes: float) -> RuntimeBudget:
    tokens = int(kv_bytes // model.kv_bytes_per_token)
    kv = tokens * model.kv_bytes_per_token
    return RuntimeBudget(tokens, float(kv), (model.weight_bytes + kv) / hw.mem_bytes)


def plan_memory(gen: ModelSpec, ver: ModelSpec, hw: Hardware, work: Workload,
                budget: float | None = None) -> MemoryPlan:
    """Choose the faster of the shared-memory optimum and offloading; `budget` is the KV memory M in
    bytes (default: `kv_budget`). Budgets: shared mode gives the verifier B_pre sequences and the
    generator the rest; offload mode gives each the whole budget."""
    budget = kv_budget(hw, gen, ver) if budget is None else budget
    if budget <= 0:
        weights = (gen.weight_bytes + ver.weight_bytes) / GIB
        raise ValueError(f"no KV memory left: the models' weights take {weights:.2f} GiB of "
                         f"{hw.name}'s {hw.mem_bytes / GIB:.2f} GiB")
    costs = StepCosts(gen, ver, hw, work)
    shared = search_shared(costs, budget)
    offload = search_offload(costs, budget, hw)
    if shared is None and offload is None:
        raise ValueError(f"a KV budget of {budget / GIB:.3f} GiB holds not even one sequence of "
                         f"{work.seq_len} tokens per model")
    chosen = shared if offload is None or (shared is not None and shared.t_total <= offload.t_total) else offload
    assert chosen is not None, "one of the candidates exists"
    half_pre = _max_batch(budget / 2, costs.kv_ver_seq, work.n)
    half_dec = _max_batch(budget / 2, costs.kv_gen_seq, work.n)
    static = (Allocation("static", half_pre, half_dec, costs.verify[half_pre], costs.generate[half_dec])
              if half_pre and half_dec else None)
    if chosen.mode == "shared":
        ver_kv = chosen.b_pre * costs.kv_ver_seq
        gen_kv = budget - ver_kv
    else:
        ver_kv = gen_kv = budget
    return MemoryPlan(hw, work, budget, chosen, shared, offload, static,
                      _budget(gen, hw, gen_kv), _budget(ver, hw, ver_kv))


def bench_planner(ns: tuple[int, ...] = (16, 64, 256, 1024), repeats: int = 20) -> dict[int, float]:
    """Microseconds per `plan_memory` call (best of `repeats`) for each n, on the RTX 4090 profile."""
    gen = load_model_spec("qwen2.5-math-1.5b")
    ver = load_model_spec("skywork-prm-1.5b")
    timings: dict[int, float] = {}
    for n in ns:
        work = Workload(n, 512, 256)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan_memory(gen, ver, HARDWARE["rtx4090"], work)
            best = min(best, time.perf_counter() - t0)
        timings[n] = best * 1e6
    return timings


def _describe(a: Allocation | None) -> str:
    if a is None:
        return "infeasible"
    extra = f" + offload {a.overhead * 1e3:.2f} ms" if a.overhead else ""
    return (f"B_pre={a.b_pre:<4d} B_dec={a.b_dec:<4d} T_tot={a.t_total * 1e3:9.2f} ms "
            f"(verify {a.t_verify * 1e3:.2f} + generate {a.t_generate * 1e3:.2f}{extra})")


def _handle_plan_memory(args: argparse.Namespace) -> int:
    try:
        hw = get_hardware(args.hardware)
        dtype = args.dtype or ("float32" if hw.name == THIS_MACHINE else None)  # SGLang on CPU runs fp32
        gen = load_model_spec(args.generator_config, dtype)
        ver = load_model_spec(args.verifier_config, dtype)
        work = Workload(args.n, args.prompt_len, args.decode_len)
        budget = args.memory_gb * GIB if args.memory_gb is not None else None
        plan = plan_memory(gen, ver, hw, work, budget)
    except (KeyError, ValueError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}")
        return 2
    print(f"hardware  {hw.name}: {hw.peak_flops / 1e12:.2f} TFLOP/s, {hw.mem_bandwidth / 1e9:.1f} GB/s, "
          f"{hw.mem_bytes / GIB:.1f} GiB, link {hw.link_bandwidth / 1e9:.1f} GB/s")
    for role, m in (("generator", gen), ("verifier", ver)):
        print(f"{role:<9} {m.name}: {m.weight_bytes / GIB:.2f} GiB weights, "
              f"{m.kv_bytes_per_token} KV bytes/token")
    print(f"workload  n={work.n} prompt_len={work.prompt_len} decode_len={work.decode_len}; "
          f"KV budget {plan.kv_budget / GIB:.3f} GiB")
    for label, a in (("shared", plan.shared), ("offload", plan.offload), ("static", plan.static)):
        print(f"{label:<9} {_describe(a)}")
    print(f"chosen    {plan.chosen.mode}")
    for role, b in (("generator", plan.generator), ("verifier", plan.verifier)):
        print(f"{role:<9} --max-total-tokens {b.max_total_tokens} "
              f"(KV {b.kv_bytes / GIB:.3f} GiB, mem fraction {b.mem_fraction:.3f})")
    if args.bench:
        for n, us in bench_planner().items():
            print(f"bench     n={n:<5d} {us:8.1f} µs per plan")
    return 0


def add_plan_memory_parser(plan_subparsers: Any) -> argparse.ArgumentParser:
    """Add `memory` to the `plan` command's subparsers; its handler returns an exit code."""
    p = plan_subparsers.add_parser("memory", help="split KV memory between generator and verifier (roofline)")
    p.add_argument("--hardware", default=THIS_MACHINE,
                   help=f"one of {', '.join([*HARDWARE, THIS_MACHINE])} (default: probe this machine)")
    p.add_argument("--generator-config", default="smollm2-135m",
                   help=f"config.json path, model folder, or one of {', '.join(BUILTIN_CONFIGS)}")
    p.add_argument("--verifier-config", default="smollm2-135m", help="as --generator-config")
    p.add_argument("--n", type=int, default=16, help="beams per step (N)")
    p.add_argument("--prompt-len", type=int, default=256, help="context tokens per beam before the step")
    p.add_argument("--decode-len", type=int, default=128, help="tokens generated per beam per step")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="KV-cache budget M in GiB (default: 90%% of device memory minus both models' weights)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="weights and KV dtype (default: float32 on this-machine, else each config's torch_dtype)")
    p.add_argument("--bench", action="store_true", help="also time the planner")
    p.set_defaults(func=_handle_plan_memory)
    return p
