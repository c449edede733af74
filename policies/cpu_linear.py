"""The linear layers of a CPU runtime through oneDNN, on weights packed once.

Without the CPU build of sgl-kernel, SGLang 0.5.23 computes every unquantized linear layer on a CPU as
`F.linear(x, W)` (`UnquantizedLinearMethod.apply`) and the LM head as `x @ W^T` (`LogitsProcessor._compute_lm_head`):
MKL's sgemm reading W [N, K] in its row-major layout, transposed. At decode batches (1-64 rows) that is a
memory-bound product whose weight is read in an order the kernel then has to re-block on every call, and the LM
head (49,152 x 576 for SmolLM2) runs at a fraction of the others' rate. oneDNN's inner product reads a weight that
was reordered once into its own blocked layout:

    W_packed = reorder(W)                    once per weight (torch.ops.mkldnn._reorder_linear_weight)
    y        = x W^T + b                     every call, any number of rows (torch.ops.mkldnn._linear_pointwise)

The same fp32 arithmetic in another summation order (differences of ~1e-6 relative). Measured on a 2-core AMD EPYC
(AVX-512), 2 threads, SmolLM2-135M's 121 linear layers of one decode step: 63 -> 27 ms at 16 rows, 180 -> 115 ms at
64 (`docs/runtime-speed.md` has the runtime's figures). The packed copy costs the weights' size again in memory (540
MB for SmolLM2-135M fp32, per scheduler process); SGLang's own weights stay, for the embedding the LM head shares and
for anything else that reads them. A weight changed in place (a weight update) is packed again on its next use.

A head whose rows are almost all zero, as a classifier folded into an LM head is (`sgl_tts/scoring/probe.py`: one
live row of 49,152), is computed on its live rows R only, found once per weight:

    y[:, R] = x W_R^T,   y[:, j] = 0 for j not in R

exactly the product (a zero row gives 0), for ~1/V of the work: a verifier reading input logprobs of every token
otherwise spends a full-vocabulary product per token on a head of one row (0.83 -> 0.12 ms a token at 512 rows,
one thread, AVX2 EPYC).

The same head leaves SGLang's input logprobs a full-vocabulary pass per token: `compute_row_log_normalizer` takes
each row's max and log-sum-exp over all V logits, of which V - |R| are exactly 0. For such a row x

    m = max(max_R x, 0),     log sum_j exp(x_j - m) = log(sum_R exp(x_R - m) + (V - |R|) exp(-m))

is the same normalizer from the live rows alone (`sparse_row_log_normalizer`, installed in a process once its head
took the live-rows path: its only caller reads logits of that head). 94 -> 0.06 ms for 256 rows of 49,152, one
thread; in a py-spy sample of the probe verifier during `make run` the normalizer was 14% of its time.

On a CPU with AMX (amx_bf16), oneDNN multiplies bf16 matrices on its tile units. With $SGLTTS_CPU_LINEAR=packed-bf16
the packed copy is the weight rounded to bf16 (half the memory of the fp32 copy) and every call rounds its input
to bf16; oneDNN sums in fp32 and rounds the result to bf16:

    y = float(bf16(bf16(x) bf16(W)^T)) + b    three roundings of <= 2^-8 each; ~4e-3 relative on SmolLM2's head

The model's state between layers (residual stream, norms, attention, KV cache) stays fp32, as does a live-rows
head. SmolLM2-135M's linear layers of one decode step on a 2-core Xeon with AMX: 39 -> 21 ms at 16 rows, 82 -> 57
ms at 64 (`scripts/bench_linear_bf16.py`); on a CPU without AMX bf16 is emulated and slower, so
`sgl_tts/runtime/server.py` chooses it only where /proc/cpuinfo lists amx_bf16.

Weights that a 4-bit quantization wrote are read from their 4 bits at a few rows. SmolLM2-135M's decoder layers
ship as GGUF Q4_1 (each group of 32 weights along K is m + d q, q in 0..15, fp16 d and m; the quantizer sets m to
the group's least weight and d to its range / 15, so q = 0 and q = 15 both occur), and the converted fp32 weight
keeps that grid. With $SGLTTS_CPU_LINEAR=packed-bf16-int4 each weight is checked for it once, and where every group
is on it the weight is kept a second time as its q with a bf16 scale and zero per group (torch's int4 CPU layout):

    per group:  m = min w,  d = (max w - m) / 15,  q = round((w - m) / d)      on the grid: |w - (m + d q)| <= d/1000
    y = bf16(x) W'^T,   W' = (q - 8) bf16(d) + bf16(m + 8 d)                    torch's _weight_int4pack_mm_for_cpu

W' differs from W by the two bf16 roundings (<= 2^-8 of d and of the group's midpoint each), as bf16(W) differs by
one of W. The int4 copy is a quarter of the bf16 copy's bytes, but the kernel unpacks it for every row: one decode
step's linear layers of SmolLM2-135M (its 210 decoder weights from 4 bits, the LM head in bf16) on a 2-core Xeon
with AMX, 2 threads, took 19.7 / 23.7 / 30.6 / 38.0 / 49.5 ms at 1 / 4 / 8 / 10 / 16 rows against 35.3 / 35.9 / 37.4
/ 38.5 / 42.0 with every weight in bf16 (`scripts/bench_linear_bf16.py`; one thread: the same crossover), so
products of at most INT4_ROWS rows take it, larger ones the packed bf16 copy (`docs/runtime-speed.md`). Weights off
the grid (the LM head, which ships as Q8_0; any fp32 model) keep bf16. On a CPU without AMX, `packed-int4` does the
same beside the packed fp32 copy (the 4-bit product still rounds its input and result to bf16): with torch and oneDNN
held to AVX2 on that Xeon, one step's linear layers (the head in fp32) took 17.8 / 25.2 / 36.5 / 58.9 ms at 1 / 4 / 8
/ 16 rows against 41.1 / 53.0 / 60.5 / 70.6 all in fp32.

The plugin (`policies/plugin.py`) installs the hooks with $SGLTTS_CPU_LINEAR=packed, packed-bf16, packed-bf16-int4 or
packed-int4
(`sgl_tts/runtime/server.py` sets one on every CPU runtime; packed-dense packs every head whole, to measure the
live-rows head against); any call that is not a plain fp32 product on the CPU (CUDA, bf16 models, quantized or
LoRA heads, SGLang's own AMX path) goes to SGLang's code unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

LINEAR_TARGET = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD_TARGET = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
NORMALIZER_TARGET = "sglang.srt.layers.logprob_processor.compute_row_log_normalizer"
PACKED = "packed"  # the value of $SGLTTS_CPU_LINEAR that installs them
PACKED_DENSE = "packed-dense"  # the same with every head packed whole (to measure the live-rows head against)
PACKED_BF16 = "packed-bf16"  # the same on weights and inputs rounded to bf16 (CPUs with AMX)
PACKED_BF16_INT4 = "packed-bf16-int4"  # the same, and weights on a 4-bit grid from 4 bits at a few rows
PACKED_INT4 = "packed-int4"  # packed fp32, and weights on a 4-bit grid from 4 bits at a few rows (CPUs without AMX)
VALUES = (PACKED, PACKED_DENSE, PACKED_BF16, PACKED_BF16_INT4, PACKED_INT4)
BF16 = (PACKED_BF16, PACKED_BF16_INT4)  # the values whose packed copies are bf16
FOUR_BIT = (PACKED_BF16_INT4, PACKED_INT4)  # the values that read 4-bit weights
INT4_GROUP = 32  # weights along K that share a scale and zero (GGUF's Q4_0 / Q4_1 block)
INT4_LEVELS = 15  # q in 0..15
INT4_ROWS = 8  # products of at most this many rows read the 4-bit copy (measured crossover: 9-10 rows)
GRID_TOLERANCE = 1e-3  # of a group's step d: how far from m + d q a weight on the grid may lie (fp32 rounding)
_CACHE = "_sgltts_packed_weight"  # module attribute: (the weight's identity, its packed copy)
_BF16_CACHE = "_sgltts_packed_bf16_weight"  # module attribute: (the weight's identity, its packed bf16 copy)
_INT4_CACHE = "_sgltts_int4_weight"  # module attribute: (the weight's identity, (packed q, scales and zeros) or None)
_ROWS_CACHE = "_sgltts_live_rows"  # module attribute: (the weight's identity, (live rows, their weights) or None)
SPARSE_HEAD_SHARE = 1 / 64  # at most this share of a head's rows live: computed on those rows alone
PLAIN_LM_HEAD_METHODS = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")
_sparse_head: list[Any] = []  # (live rows, vocabulary size) once this process's head took the live-rows path
_int4_listeners: list[Callable[[str], None]] = []  # hear once that a product read a 4-bit weight (`tell_int4`)


def applies(x: Any, weight: Any) -> bool:
    """Whether y = x W^T is a plain fp32 product on the CPU that oneDNN can take."""
    import torch

    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.layout == torch.strided and not x.requires_grad
            and torch.backends.mkldnn.is_available())


def packed_weight(module: Any) -> Any:
    """`module.weight` reordered into oneDNN's layout, packed on first use and again after the weight changed."""
    import torch

    return per_weight(module, _CACHE, torch.ops.mkldnn._reorder_linear_weight)


def packed_bf16_weight(module: Any) -> Any:
    """`module.weight` rounded to bf16 and reordered into oneDNN's layout, as `packed_weight`."""
    import torch

    return per_weight(module, _BF16_CACHE, lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16()))


def four_bit_grid(weight: Any) -> tuple[Any, Any, Any] | None:
    """(q [N, K] int32 in 0..INT4_LEVELS, d [N, K / INT4_GROUP], m [N, K / INT4_GROUP]) with weight = m + d q per
    group of INT4_GROUP along K (to GRID_TOLERANCE of d), or None when the weight is not on such a grid."""
    import torch

    rows, columns = weight.shape
    if columns % INT4_GROUP:
        return None
    groups = weight.float().reshape(rows, columns // INT4_GROUP, INT4_GROUP)
    low = groups.amin(dim=-1, keepdim=True)
    step = (groups.amax(dim=-1, keepdim=True) - low) / INT4_LEVELS
    q = grid_levels(groups, low, step)
    if bool(((groups - (low + step * q)).abs() > GRID_TOLERANCE * step).any()):
        return None
    return q.to(torch.int32).reshape(rows, columns), step[..., 0], low[..., 0]


def grid_levels(groups: Any, low: Any, step: Any) -> Any:
    """round((w - m) / d) in 0..INT4_LEVELS for the weights [N, K / INT4_GROUP, INT4_GROUP] of groups with least
    value m and step d (each [..., 1]); 0 in a group of one value (d = 0)."""
    import torch

    return torch.round((groups - low) / torch.where(step > 0, step, torch.ones_like(step))).clamp(0, INT4_LEVELS)


def q4_1_round(weight: Any) -> Any:
    """`weight` [N, K] rounded as GGUF's Q4_1 quantizer writes it (per group of INT4_GROUP along K: m = fp16(min w),
    d = fp16((max w - min w) / 15), q = round((w - m) / d) in 0..15), as the converted fp32 weight it reads back,
    m + d q: a weight on the grid `four_bit_grid` finds. For benches and tests of the 4-bit path."""
    groups = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    least = groups.amin(dim=-1, keepdim=True)
    low = least.half().float()
    step = ((groups.amax(dim=-1, keepdim=True) - least) / INT4_LEVELS).half().float()
    return (low + step * grid_levels(groups, low, step)).reshape(weight.shape)


def int4_weight(module: Any) -> tuple[Any, Any] | None:
    """`module.weight` in torch's int4 CPU layout (packed q, bf16 scales and zeros [K / INT4_GROUP, N, 2]) when it
    is on a 4-bit grid (`four_bit_grid`) of a shape the kernel takes (N a multiple of 16), else None; found once per
    weight, and again after it changed."""
    import torch

    def derive(weight: Any) -> tuple[Any, Any] | None:
        grid = four_bit_grid(weight) if weight.dim() == 2 and weight.shape[0] % 16 == 0 else None
        if grid is None:
            return None
        q, step, low = grid
        zero = low + (INT4_LEVELS + 1) // 2 * step  # the kernel computes (q - 8) scale + zero
        scales_and_zeros = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros

    return per_weight(module, _INT4_CACHE, derive)


def int4_linear(x: Any, int4: tuple[Any, Any], bias: Any = None) -> Any:
    """fp32 x [..., K] rounded to bf16, times the 4-bit weight (`int4_weight`) transposed (a bf16 result), in fp32,
    plus bias."""
    import torch

    packed, scales_and_zeros = int4
    rows = x.reshape(-1, x.shape[-1]).bfloat16()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_and_zeros).float()
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias


def tell_int4(listener: Callable[[str], None]) -> None:
    """`listener` hears, once in this process, the first product that reads a 4-bit weight."""
    _int4_listeners.append(listener)


def per_weight(module: Any, attribute: str, derive: Callable[[Any], Any]) -> Any:
    """`derive(module.weight)` (detached), kept in `module.<attribute>` with the weight's identity (storage,
    version, shape): derived once per weight, and again after it changed in place."""
    weight = module.weight
    identity = (weight.data_ptr(), weight._version, tuple(weight.shape))
    cached = getattr(module, attribute, None)
    if cached is None or cached[0] != identity:
        cached = (identity, derive(weight.detach()))
        setattr(module, attribute, cached)
    return cached[1]


def live_rows(module: Any) -> tuple[Any, Any] | None:
    """(indices of the non-zero rows of `module.weight`, those rows) when at most SPARSE_HEAD_SHARE of its rows
    are non-zero, else None; found once per weight, and again after it changed."""
    import torch

    def find(weight: Any) -> tuple[Any, Any] | None:
        rows = torch.nonzero(weight.ne(0).any(dim=1)).flatten()
        return (rows, weight[rows].contiguous()) if len(rows) <= SPARSE_HEAD_SHARE * len(weight) else None

    return per_weight(module, _ROWS_CACHE, find)


def sparse_rows_linear(x: Any, rows: Any, row_weights: Any, out_features: int) -> Any:
    """x [..., K] times a weight [out_features, K] that is zero outside `rows` (whose rows are `row_weights`),
    transposed: [..., out_features]."""
    import torch

    out = x.new_zeros(*x.shape[:-1], out_features)
    out[..., rows] = torch.matmul(x, row_weights.T)
    return out


def packed_linear(x: Any, packed: Any, bias: Any = None) -> Any:
    """x [..., K] times the packed weight [N, K], transposed, plus bias: [..., N]."""
    import torch

    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def bf16_packed_linear(x: Any, packed_bf16: Any, bias: Any = None) -> Any:
    """fp32 x [..., K] rounded to bf16, times the packed bf16 weight [N, K] transposed (a bf16 result), in fp32,
    plus bias."""
    out = packed_linear(x.bfloat16(), packed_bf16).float()
    return out if bias is None else out + bias


def dense_linear(x: Any, module: Any, bias: Any = None, bf16: bool = False, int4: bool = False) -> Any:
    """x times `module.weight` transposed, plus bias, on its packed fp32 copy or (`bf16`) its packed bf16 one; with
    `int4`, at most INT4_ROWS rows on its 4-bit copy where it has one."""
    if int4:
        four_bits = int4_weight(module)  # found on the first call, whatever its rows
        if four_bits is not None and x.numel() <= INT4_ROWS * x.shape[-1]:
            while _int4_listeners:
                _int4_listeners.pop()(f"a product of {x.numel() // x.shape[-1]} row(s) read its "
                                      f"{tuple(module.weight.shape)} weight from 4 bits")
            return int4_linear(x, four_bits, bias)
    if bf16:
        return bf16_packed_linear(x, packed_bf16_weight(module), bias)
    return packed_linear(x, packed_weight(module), bias)


def linear_hook(original: Callable[..., Any], method: Any, layer: Any, x: Any, bias: Any = None,
                bf16: bool = False, int4: bool = False) -> Any:
    """An AROUND hook for `UnquantizedLinearMethod.apply(layer, x, bias)`."""
    if getattr(layer, "use_intel_amx_backend", False) or not applies(x, layer.weight):
        return original(method, layer, x, bias)
    return dense_linear(x, layer, bias, bf16, int4)


def bf16_linear_hook(original: Callable[..., Any], method: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    """`linear_hook` on bf16 weights ($SGLTTS_CPU_LINEAR=packed-bf16)."""
    return linear_hook(original, method, layer, x, bias, bf16=True)


def bf16_int4_linear_hook(original: Callable[..., Any], method: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    """`linear_hook` on bf16 weights, and 4-bit ones at a few rows ($SGLTTS_CPU_LINEAR=packed-bf16-int4)."""
    return linear_hook(original, method, layer, x, bias, bf16=True, int4=True)


def int4_linear_hook(original: Callable[..., Any], method: Any, layer: Any, x: Any, bias: Any = None) -> Any:
    """`linear_hook` on fp32 weights, and 4-bit ones at a few rows ($SGLTTS_CPU_LINEAR=packed-int4)."""
    return linear_hook(original, method, layer, x, bias, int4=True)


def lm_head_hook(original: Callable[..., Any], processor: Any, hidden_states: Any, lm_head: Any,
                 embedding_bias: Any = None, sparse_heads: bool = True, bf16: bool = False, **kwargs: Any) -> Any:
    """An AROUND hook for `LogitsProcessor._compute_lm_head`: the plain head (an unquantized weight, no LoRA, no
    fp32-upcast or RL settings) on its live rows when it has few (`sparse_heads`), else through `dense_linear`
    (on bf16 weights with `bf16`); every other head through SGLang's code."""
    plain = (type(getattr(lm_head, "quant_method", None)).__name__ in PLAIN_LM_HEAD_METHODS
             and not hasattr(lm_head, "set_lora") and hasattr(lm_head, "weight")
             and not getattr(lm_head, "use_intel_amx_backend", False)
             and getattr(processor, "rl_on_policy_target", None) is None
             and not getattr(processor, "use_fp32_lm_head", False))
    if not plain or embedding_bias is not None or not applies(hidden_states, lm_head.weight):
        return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)
    sparse = live_rows(lm_head) if sparse_heads else None
    if sparse is not None:
        _sparse_head[:] = [sparse[0], lm_head.weight.shape[0]]
        return sparse_rows_linear(hidden_states, *sparse, lm_head.weight.shape[0])
    _sparse_head.clear()
    return dense_linear(hidden_states, lm_head, bf16=bf16)


def sparse_row_log_normalizer(logits: Any, rows: Any) -> tuple[Any, Any]:
    """SGLang's per-row (max, logsumexp - max) of `logits` [T, V] that are 0 outside the columns `rows`."""
    import torch

    live = logits[:, rows].float()
    row_max = live.amax(dim=-1).clamp_min(0.0)
    rest = (logits.shape[-1] - len(rows)) * torch.exp(-row_max)
    return row_max, torch.log(torch.exp(live - row_max[:, None]).sum(dim=-1) + rest)


def normalizer_hook(original: Callable[..., Any], logits: Any) -> Any:
    """An AROUND hook for `compute_row_log_normalizer(logits)`: from the live rows when this process's head is
    sparse (`lm_head_hook`), else SGLang's."""
    if not _sparse_head or logits.dim() != 2 or logits.shape[-1] != _sparse_head[1] or logits.is_cuda:
        return original(logits)
    return sparse_row_log_normalizer(logits, _sparse_head[0])


def dense_lm_head_hook(original: Callable[..., Any], processor: Any, hidden_states: Any, lm_head: Any,
                       embedding_bias: Any = None, **kwargs: Any) -> Any:
    """`lm_head_hook` with every plain head packed whole ($SGLTTS_CPU_LINEAR=packed-dense)."""
    return lm_head_hook(original, processor, hidden_states, lm_head, embedding_bias, sparse_heads=False, **kwargs)


def bf16_lm_head_hook(original: Callable[..., Any], processor: Any, hidden_states: Any, lm_head: Any,
                      embedding_bias: Any = None, **kwargs: Any) -> Any:
    """`lm_head_hook` with a dense head on bf16 weights ($SGLTTS_CPU_LINEAR=packed-bf16)."""
    return lm_head_hook(original, processor, hidden_states, lm_head, embedding_bias, bf16=True, **kwargs)
