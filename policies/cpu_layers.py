"""RMSNorm and rotary embedding of a CPU runtime in one compiled call each (`policies/cpu_layers.cpp`).

Without the CPU build of sgl-kernel, SGLang 0.5.23 runs both in torch, op by op (`RMSNorm.forward_native`,
`RotaryEmbedding.forward_native`): a norm is a cast, an add, a power, a mean, a reciprocal square root and two
products; a rotary embedding indexes its cache, splits, multiplies and concatenates query and key. At the rows a
search decodes, the tensors are a few KB and each op's dispatch costs more than its arithmetic: in a py-spy sample of
one single-threaded rank at 8 running requests (2-core Xeon, AMX, bf16 linear layers) the norms were 7.8% of the
rank's time and the rotary embedding 5.8%. The kernels compute, per row of the batch,

    RMSNorm:      s = x + residual (when given);   y = s / sqrt(mean(s^2) + eps) * w          returns y (and s)
    rotary, neox: (x1, x2) = the two halves of a head's first rotary_dim dims,  (c, s) = cache[position]
                  y1 = x1 c - x2 s,   y2 = x2 c + x1 s,   the head's other dims copied         (GPT-J: pairs 2i, 2i+1)

in fp32, the sum of squares in another order than torch's (differences of ~1e-7 relative).

The plugin (`policies/plugin.py`) installs them with $SGLTTS_CPU_LAYERS=fused (`sgl_tts/runtime/server.py` sets it
on every CPU runtime; `env: {SGLTTS_CPU_LAYERS: torch}` keeps SGLang's). A call they do not cover (another dtype, a
norm over part of the hidden size, an extra residual term, rotary offsets or a fused KV write, a subclass with its
own rotation) goes to SGLang's code unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

NORM_TARGET = "sglang.srt.layers.layernorm.RMSNorm.forward_native"
ROTARY_TARGET = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_native"
FUSED = "fused"  # the value of $SGLTTS_CPU_LAYERS that installs them
KERNEL_SOURCE = Path(__file__).with_name("cpu_layers.cpp")


@functools.lru_cache(maxsize=None)
def layer_kernels() -> Any:
    """The compiled kernels of KERNEL_SOURCE for this CPU, or None when they cannot be built."""
    from policies.cpu_attention import build_kernel

    return build_kernel(KERNEL_SOURCE.read_bytes(), KERNEL_SOURCE)


def _fp32_rows(*tensors: Any) -> bool:
    import torch

    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(-1) == 1
               for t in tensors)


def norm_hook(original: Callable[..., Any], norm: Any, x: Any, residual: Any = None,
              post_residual_addition: Any = None, quant_linear: Any = None) -> Any:
    """An AROUND hook for `RMSNorm.forward_native`: the compiled RMSNorm for fp32 rows over the whole hidden size."""
    weight = norm.weight
    if (post_residual_addition is None and quant_linear is None and plain_norm(norm) and _fp32_rows(x)
            and (residual is None or _fp32_rows(residual)) and layer_kernels() is not None):
        if residual is None:
            return layer_kernels().rms_norm(x, weight, norm.variance_epsilon)
        return tuple(layer_kernels().add_rms_norm(x, residual, weight, norm.variance_epsilon))  # (normed, x + residual)
    return original(norm, x, residual, post_residual_addition, quant_linear)


def plain_norm(norm: Any) -> bool:
    """Whether `norm` (an SGLang RMSNorm) normalises over the whole hidden size with a contiguous fp32 weight, in
    fp32: what the compiled RMSNorm computes."""
    import torch

    return (norm.variance_size_override is None and norm.override_orig_dtype in (None, torch.float32)
            and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous())


def rotary_hook(original: Callable[..., Any], rotary: Any, positions: Any, query: Any, key: Any, offsets: Any = None,
                fused_set_kv_buffer_arg: Any = None) -> Any:
    """An AROUND hook for `RotaryEmbedding.forward_native`: the compiled rotation for fp32 query and key rows."""
    import torch

    if (offsets is None and fused_set_kv_buffer_arg is None and plain_rotary(rotary)
            and query.dim() == key.dim() == 2 and _fp32_rows(query, key) and positions.dtype == torch.int64
            and layer_kernels() is not None):
        return tuple(layer_kernels().rotary(positions.flatten().contiguous(), query, key, rotary.cos_sin_cache,
                                            rotary.head_size, bool(rotary.is_neox_style)))  # (query, key) rotated
    return original(rotary, positions, query, key, offsets, fused_set_kv_buffer_arg)


def plain_rotary(rotary: Any) -> bool:
    """Whether `rotary` is SGLang's plain rotation (no subclass's own) on an fp32 cos | sin cache of rotary_dim."""
    import torch

    from sglang.srt.layers.rotary_embedding import base

    cache = getattr(rotary, "cos_sin_cache", None)
    return (not hasattr(rotary, "sin_cos_cache")
            and getattr(rotary, "_apply_rotary_emb_wrapped", None) is base.apply_rotary_emb  # the plain rotation
            and cache is not None and cache.dtype == torch.float32 and cache.is_contiguous()
            and cache.shape[-1] == rotary.rotary_dim)
