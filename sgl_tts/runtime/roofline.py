"""Roofline model of one search step and the search for the batch sizes that minimise its time.

FastTTS §4.3: pick the verifier (prefill) batch B_pre and generator (decode) batch B_dec minimising
    T_tot = ⌈N/B_pre⌉·T_pre(B_pre, S) + ⌈N/B_dec⌉·S_dec·T_dec(B_dec, S̄_cache)
subject to B_pre·KV_ver(1, S) + B_dec·KV_gen(1, S) ≤ M, with T = max(FLOPs/P, bytes/BW) per batch
(the roofline bound, edge-inference-evaluation §III eq. 3) and KV bytes per token 2·L·H_kv·d_h·s
(eq. 2). Or, with offloading (§4.3.2), each model gets all of M while it runs and the others' KV
caches go to host memory and back, at the host-link bandwidth.

A third model, RSD's target, joins as a second decode stage: it rewrites the ⌈share·N⌉ steps the verifier
rejects, so T_tot gains ⌈N_tgt/B_tgt⌉·S_dec·T_dec,tgt(B_tgt, S̄_cache) and the budget B_tgt·KV_tgt(1, S).

Workload: N beams per step, each holding `prompt_len` tokens of context (problem and earlier steps)
and generating `decode_len` more. The verifier reads S = prompt_len + decode_len tokens; the generator
holds up to S tokens and S̄_cache = prompt_len + decode_len/2 on average while decoding (the paper's
S_dec/2 when prompt_len = 0). Prefix sharing between beams is ignored (a conservative bound).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from sgl_tts.runtime.hardware import GIB, HARDWARE, THIS_MACHINE, Hardware, get_hardware, probe_this_machine

__all__ = ["GIB", "HARDWARE", "THIS_MACHINE", "Hardware", "get_hardware", "probe_this_machine"]  # re-exported

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}
REL_TOL = 1e-12  # step times closer than this (relative) are ties


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
    kv_dtype_bytes: int | None = None  # bytes of a KV element: None, the weights' dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """2·L·H_kv·d_h·s: keys and values of every layer (edge-inference-evaluation eq. 2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)


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
    dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
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


# Hub ids whose config.json is a built-in one (base and instruct variants share the shapes): a GPU run config
# naming the hub id plans without fetching anything.
HUB_IDS: dict[str, str] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
    "Qwen/Qwen2.5-Math-1.5B": "qwen2.5-math-1.5b",
    "Qwen/Qwen2.5-Math-1.5B-Instruct": "qwen2.5-math-1.5b",
    "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b",
    "Qwen/Qwen2.5-Math-7B-Instruct": "qwen2.5-math-7b",
    "Qwen/Qwen2.5-Math-PRM-7B": "qwen2.5-math-prm-7b",
    "Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B": "skywork-prm-1.5b",
    "peiyi9979/math-shepherd-mistral-7b-prm": "math-shepherd-mistral-7b-prm",
}


def load_model_spec(name_or_path: str, dtype: str | None = None) -> ModelSpec:
    """A built-in model name or its hub id (`HUB_IDS`), a config.json path, a model folder holding config.json,
    or another hub id (its config read through transformers: the local cache, or the hub when online)."""
    builtin = HUB_IDS.get(name_or_path, name_or_path)
    if builtin in BUILTIN_CONFIGS:
        return model_spec_from_config(BUILTIN_CONFIGS[builtin], name_or_path, dtype)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return model_spec_from_config(json.loads(path.read_text()), name_or_path, dtype)
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~")):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(name_or_path).to_dict()
        except (OSError, ValueError) as exc:
            raise KeyError(f"model {name_or_path!r}: not a built-in config and its config.json could not be "
                           f"read ({exc}); give a local model folder or config.json path") from None
        return model_spec_from_config(config, name_or_path, dtype)
    raise KeyError(f"model {name_or_path!r} is neither a config.json path, a hub id nor a built-in: "
                   f"{', '.join(BUILTIN_CONFIGS)}")


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
    """One search step: `n` beams, each with `prompt_len` tokens of context, generating `decode_len`;
    `target_share` of the steps are rewritten by RSD's target model (0 without a target)."""

    n: int
    prompt_len: int
    decode_len: int
    target_share: float = 0.0

    def __post_init__(self) -> None:
        if self.n < 1 or self.prompt_len < 0 or self.decode_len < 1:
            raise ValueError(f"need n >= 1, prompt_len >= 0, decode_len >= 1; got {self}")
        if not 0.0 <= self.target_share <= 1.0:
            raise ValueError(f"target_share must be in [0, 1], got {self.target_share}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.decode_len

    @property
    def target_n(self) -> int:
        """Steps the target rewrites: ⌈target_share·n⌉ (rounded first, so 0.25·4 is 1, not 2)."""
        return math.ceil(round(self.target_share * self.n, 9))


@dataclass(frozen=True)
class Allocation:
    """Batch sizes and the modelled time of one step, in seconds (`overhead`: offload transfers).
    `b_tgt` and `t_target` are the target's (0 without a target)."""

    mode: str  # "shared", "offload" or "static"
    b_pre: int
    b_dec: int
    t_verify: float
    t_generate: float
    overhead: float = 0.0
    b_tgt: int = 0
    t_target: float = 0.0

    @property
    def t_total(self) -> float:
        return self.t_verify + self.t_generate + self.t_target + self.overhead


def _stage_times(compute: float, weights: float, kv: float, n: int) -> np.ndarray:
    """times[b] = ⌈n/b⌉·max(b·compute, weights + b·kv) for b = 1..n; times[0] = 0 (no batch)."""
    b = np.arange(1, n + 1, dtype=np.float64)
    rounds = (n + np.arange(n)) // np.arange(1, n + 1)  # ⌈n/b⌉ = (n + b - 1) // b
    return np.concatenate([[0.0], rounds * np.maximum(b * compute, weights + b * kv)])


def best_upto(times: np.ndarray) -> np.ndarray:
    """best[k] = the batch ≤ k with the smallest time, ties to the larger batch; best[0] = 0.

    A batch b is a record when its time is within REL_TOL of the smallest time of batches 1..b-1 (or is
    smaller); best[k] is the largest record ≤ k. A non-record b is never worth its memory: a smaller batch is
    faster."""
    t = times[1:]
    previous_min = np.minimum.accumulate(np.concatenate([[np.inf], t[:-1]]))
    record = t <= previous_min * (1 + REL_TOL)
    return np.concatenate([[0], np.maximum.accumulate(np.where(record, np.arange(1, len(t) + 1), 0))])


class StepCosts:
    """T_tot's terms for every batch size up to N (N_tgt for the target), computed once per plan."""

    def __init__(self, gen: ModelSpec, ver: ModelSpec, hw: Hardware, work: Workload,
                 target: ModelSpec | None = None) -> None:
        n, s, steps = work.n, work.seq_len, work.decode_len
        cache = work.prompt_len + work.decode_len / 2
        self.work = work
        self.verify = _stage_times(*_roofline_terms(ver, hw, s, s / 2, s), n)
        c, w, k = _roofline_terms(gen, hw, 1, cache, cache)
        self.generate = _stage_times(c * steps, w * steps, k * steps, n)
        self.kv_ver_seq = ver.kv_bytes_per_token * s
        self.kv_gen_seq = gen.kv_bytes_per_token * s
        self.has_target = target is not None
        if target is not None:
            c, w, k = _roofline_terms(target, hw, 1, cache, cache)
            self.target = _stage_times(c * steps, w * steps, k * steps, work.target_n)
            self.kv_tgt_seq = target.kv_bytes_per_token * s
        else:
            self.target, self.kv_tgt_seq = np.zeros(1), 0


def _max_batch(budget: float, per_seq: float, n: int) -> int:
    if per_seq <= 0:
        return n
    return min(n, int(budget // per_seq)) if budget > 0 else 0


def _pick(t: np.ndarray, b_pre: np.ndarray, b_dec: np.ndarray, b_tgt: np.ndarray, n: int) -> int | None:
    """Index of the fastest candidate, ties (within REL_TOL) to the larger B_dec, then B_pre, then B_tgt
    (FastTTS §4.3 breaks ties toward B_dec: decoding is the memory-sensitive stage); None if there is none."""
    if t.size == 0:
        return None
    tie = t <= t.min() * (1 + REL_TOL)
    key = (b_dec.astype(np.int64) * (n + 1) + b_pre) * (n + 1) + b_tgt
    return int(np.argmax(np.where(tie, key, -1)))


def search_shared(costs: StepCosts, budget: float) -> Allocation | None:
    """The best (B_pre, B_dec[, B_tgt]) with B_pre·KV_ver(1,S) + B_dec·KV_gen(1,S) [+ B_tgt·KV_tgt(1,S)] ≤
    budget; None if even one sequence each does not fit.

    FastTTS §4.3 scans every B_pre and takes the largest B_dec the rest of the budget allows. Here: only
    records of B_pre and B_tgt (`best_upto`) are scanned, since any other batch is slower than a smaller one
    and leaves less memory (for ⌈N/B⌉·max(...) the records are among the ⌈N/q⌉, about 2√N of them); and
    B_dec is the best one under the bound, not the bound itself (⌈N/B⌉ makes the decode term non-monotone,
    so a smaller B_dec can be faster)."""
    n, n_tgt = costs.work.n, costs.work.target_n
    pre_records = np.unique(best_upto(costs.verify)[1:])
    if costs.has_target and n_tgt:
        tgt_records = np.unique(best_upto(costs.target)[1:])
    else:
        tgt_records = np.zeros(1, np.int64)  # no target, or nothing for it to rewrite: no batch
    b_pre, b_tgt = (grid.ravel() for grid in np.meshgrid(pre_records, tgt_records, indexing="ij"))
    rest = budget - b_pre * costs.kv_ver_seq - b_tgt * costs.kv_tgt_seq
    bound = np.minimum(n, np.floor(np.maximum(rest, 0) / costs.kv_gen_seq)).astype(np.int64)
    b_dec = best_upto(costs.generate)[bound]
    ok = b_dec >= 1
    b_pre, b_tgt, b_dec = b_pre[ok], b_tgt[ok], b_dec[ok]
    t = costs.verify[b_pre] + costs.generate[b_dec] + costs.target[b_tgt]
    best = _pick(t, b_pre, b_dec, b_tgt, n)
    if best is None:
        return None
    return Allocation("shared", int(b_pre[best]), int(b_dec[best]), float(costs.verify[b_pre[best]]),
                      float(costs.generate[b_dec[best]]), 0.0, int(b_tgt[best]), float(costs.target[b_tgt[best]]))


def search_offload(costs: StepCosts, budget: float, hw: Hardware) -> Allocation | None:
    """§4.3.2: each model has the whole budget while it runs (B·KV ≤ M for each); per step each model's
    resident KV cache goes to host memory and back once."""
    n, n_tgt = costs.work.n, costs.work.target_n
    b_pre = int(best_upto(costs.verify)[_max_batch(budget, costs.kv_ver_seq, n)])
    b_dec = int(best_upto(costs.generate)[_max_batch(budget, costs.kv_gen_seq, n)])
    b_tgt = int(best_upto(costs.target)[_max_batch(budget, costs.kv_tgt_seq, n_tgt)]) if costs.has_target else 0
    if b_pre == 0 or b_dec == 0 or (costs.has_target and n_tgt and b_tgt == 0):
        return None
    resident = b_pre * costs.kv_ver_seq + b_dec * costs.kv_gen_seq + b_tgt * costs.kv_tgt_seq
    return Allocation("offload", b_pre, b_dec, float(costs.verify[b_pre]), float(costs.generate[b_dec]),
                      2 * resident / hw.link_bandwidth, b_tgt, float(costs.target[b_tgt]))


def search_static(costs: StepCosts, budget: float) -> Allocation | None:
    """The baseline: every model gets an equal share of the budget and runs as many sequences as fit."""
    share = budget / (3 if costs.has_target else 2)
    b_pre = _max_batch(share, costs.kv_ver_seq, costs.work.n)
    b_dec = _max_batch(share, costs.kv_gen_seq, costs.work.n)
    b_tgt = _max_batch(share, costs.kv_tgt_seq, costs.work.target_n) if costs.has_target else 0
    if b_pre == 0 or b_dec == 0 or (costs.has_target and costs.work.target_n and b_tgt == 0):
        return None
    return Allocation("static", b_pre, b_dec, float(costs.verify[b_pre]), float(costs.generate[b_dec]),
                      0.0, b_tgt, float(costs.target[b_tgt]))
