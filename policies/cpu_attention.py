"""Batched decode attention for SGLang's torch-native backend (the CPU runtime's attention).

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_decode` loops over the batch in Python: per sequence
and layer one gather of its keys and values and one `scaled_dot_product_attention` call, each on a tensor-valued
length (a host read). At 64 running requests and SmolLM2's 30 layers that is 1,920 small calls per decode step.
`batched_decode` does the same arithmetic in one call per layer:

    L      = max_i seq_len_i                               (the longest sequence in the batch)
    T      = req_to_token[req_pool_indices, :L]            [B, L]  KV slots of every sequence, padded
    K, V   = k_cache[T], v_cache[T]                        [B, L, H_kv, D]
    mask   = (arange(L) < seq_len_i)                       [B, L]  padding never attended
    out_i  = softmax(q_i K_i^T * scale + log mask_i) V_i   one SDPA over [B, H, 1, D] x [B, H_kv, L, D]

Padding costs (L - seq_len_i) gathered rows per sequence: the loop's cost was per call, this one's is per byte,
so a batch of near-equal lengths (forks of one prompt) pays almost nothing. Slots past a sequence's length in
`req_to_token` hold stale but valid pool indices, so the gather is safe and the mask hides them.

The gather is most of that call's time (8.6 of 11.4 ms a layer at 64 sequences of 200 tokens, one AVX2 core): it
copies every key and value row of the batch, padded, and SDPA then expands the KV heads for grouped queries.
`paged_decode` runs the same arithmetic in a small C++ kernel (`policies/paged_attention.cpp`) that reads each row
in place in the pool, once for the query heads sharing it. The same kernel serves extend (the prompt's tokens
after a cached prefix: `paged_extend`), where SGLang's loop attends from every position of each sequence, the
cached prefix's included, and keeps the new rows: for a fork's one new token after a 200-token prefix, 200
query rows where one is needed. It is compiled on first use into the cache, one build per SIMD level
(`paged_kernel`); where it cannot be built (no C++ compiler) `batched_decode` and SGLang's extend run.

The plugin (`policies/plugin.py`) installs them with $SGLTTS_CPU_ATTENTION=paged (decode and extend) or batched
(`batched_decode` alone); anything they do not cover (encoder lengths, sliding windows, non-causal extend) is
passed to SGLang's own loop.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
TARGET = f"{BACKEND}._run_sdpa_forward_decode"
EXTEND_TARGET = f"{BACKEND}._run_sdpa_forward_extend"
BATCHED = "batched"  # a value of $SGLTTS_CPU_ATTENTION: batched_decode
PAGED = "paged"  # paged_decode and paged_extend (batched_decode and SGLang's extend where there is no kernel)
VALUES = (BATCHED, PAGED)
KERNEL_SOURCE = Path(__file__).with_name("paged_attention.cpp")
MARCH = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}  # torch's CPU capability -> the kernel's -march
VNNI = "avx512_vnni"  # the /proc/cpuinfo flag of AVX-512's integer dot products: kernels built with them too
AMX_BF16 = "amx_bf16"  # the /proc/cpuinfo flag of AMX's bf16 tiles: bf16 linear layers (server.py), amx_linear.cpp


def batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                   scaling=None, enable_gqa=False):
    """Decode attention of B sequences, one query token each: query [B, H, D] -> output [B, H, D] (written in
    place and returned), keys and values read from the paged caches [slots, H_kv, D]."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    longest = int(seq_lens.max())
    slots = req_to_token[req_pool_indices, :longest]  # [B, L]
    keys = k_cache[slots].transpose(1, 2)  # [B, H_kv, L, D]
    values = v_cache[slots].transpose(1, 2)
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    mask = torch.arange(longest, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [B, L]
    attended = scaled_dot_product_attention(query.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                            scale=scaling, enable_gqa=enable_gqa)  # [B, H, 1, D]
    output.copy_(attended.squeeze(2))
    return output


@functools.lru_cache(maxsize=None)
def paged_kernel() -> Any:
    """The compiled kernel of KERNEL_SOURCE for this CPU, or None when it cannot be built (logged once)."""
    return build_kernel(KERNEL_SOURCE.read_bytes())


def read_cpuinfo() -> str:
    """This host's `/proc/cpuinfo`; empty where it is unreadable."""
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The flags of this host's first CPU (`/proc/cpuinfo`, or the text given); empty where it is unreadable."""
    for line in (read_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_kernel(text: bytes, source_file: Path = KERNEL_SOURCE, threads: bool = False) -> Any:
    """The extension compiled from the C++ source `text` of `source_file` (KERNEL_SOURCE's, another version of it to
    measure against: scripts/bench_attention.py, or policies/cpu_layers.cpp), or None when it cannot be built; with
    `threads`, compiled with OpenMP (policies/grid_linear.cpp). Built into the cache under a name that carries the
    file's stem, the CPU's SIMD level and a hash of the source and the OpenMP flag (a cache shared by machines with
    different CPUs, or by checkouts of different sources, keeps a build for each), then loaded from there."""
    import torch

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # its import warns of no CUDA
    from torch.utils.cpp_extension import load

    from sgl_tts.env_names import cache_root
    from sgl_tts.paths import write_atomic

    level = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    flags = ["-O3", "-fopenmp-simd"] + ([f"-march={MARCH[level]}"] if level in MARCH else [])
    if level == "AVX512" and VNNI in cpu_flags():  # x86-64-v4 leaves out VNNI's dot products (grid_linear.cpp)
        flags.append("-mavx512vnni")
        level += "_VNNI"
    if level.startswith("AVX512") and AMX_BF16 in cpu_flags():  # AMX's products (policies/amx_linear.cpp)
        flags.append("-DSGLTTS_AMX")
        level += "_AMX"
    # at::parallel_for splits its range over torch's OpenMP threads only in code compiled with OpenMP (the library
    # it links is the one torch loaded); without it a call runs on the calling thread.
    openmp = ["-fopenmp"] if threads else []
    key = hashlib.sha256(text + " ".join(openmp).encode()).hexdigest()[:10]
    name = f"sgltts_{source_file.stem}_{level.lower()}_{key}"
    build = Path(cache_root()) / "kernels" / name
    build.mkdir(parents=True, exist_ok=True)
    # Built from a copy beside the build: ninja rebuilds when a source's path changes, and every checkout (a
    # clean clone for CI, a worktree) has its own path to the same source.
    source = build / source_file.name
    if not source.exists() or source.read_bytes() != text:
        write_atomic(source, text)
    if shutil.which("ninja") is None:  # torch builds with ninja, installed beside this interpreter
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        return load(name=name, sources=[str(source)], extra_cflags=flags + openmp, extra_ldflags=openmp,
                    build_directory=str(build))
    except Exception as exc:  # no compiler, a failed build: the torch path instead
        logging.getLogger(__name__).warning("%s not built (%s); the torch paths run instead", source_file.name,
                                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def kernel_takes(query: Any, output: Any, k_cache: Any, v_cache: Any, req_to_token: Any) -> bool:
    """Whether the kernel is built and takes these tensors: on the CPU, fp32 queries and output, keys and values
    both fp32 or both bf16 (`--kv-cache-dtype bf16`), head dimension contiguous, an int32 token table."""
    import torch

    tensors = (query, output, k_cache, v_cache)
    return (paged_kernel() is not None and req_to_token.dtype == torch.int32 and req_to_token.stride(-1) == 1
            and query.dtype == output.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors))


def paged_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling=None,
                 enable_gqa=False):
    """`batched_decode`'s result, computed by the compiled kernel on the pool in place (`kernel_takes`);
    `batched_decode` for anything else."""
    import torch

    if not kernel_takes(query, output, k_cache, v_cache, req_to_token=req_to_token):
        return batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                              scaling=scaling, enable_gqa=enable_gqa)
    return paged_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        torch.ones_like(seq_lens), scaling=scaling)  # decode: an extend of one token


def paged_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
                 scaling=None) -> Any:
    """Causal attention of each sequence's last `extend_seq_lens` tokens (their keys and values already in the
    pool) to its whole context: query, output [sum(extend_seq_lens), H, D], by the compiled kernel."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    paged_kernel().paged_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                   extend_seq_lens, float(scale))
    return output


def self_attention(encoder_lens: Any, is_cross_attn: bool, sliding_window_size: int | None) -> bool:
    """Whether an SGLang attention call is plain self-attention over the whole context (no encoder, no sliding
    window): what the hooks here take; anything else goes to SGLang's loop."""
    return encoder_lens is None and not is_cross_attn and (sliding_window_size is None or sliding_window_size < 0)


def extend_hook(original: Callable[..., Any], backend: Any, query, output, k_cache, v_cache, req_to_token,
                req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None,
                enable_gqa=False, causal=False, is_cross_attn=False, sliding_window_size=None) -> Any:
    """An AROUND hook for `_run_sdpa_forward_extend`: `paged_extend` for causal self-attention the kernel takes,
    SGLang's loop elsewhere."""
    if (causal and self_attention(encoder_lens, is_cross_attn, sliding_window_size)
            and kernel_takes(query, output, k_cache, v_cache, req_to_token=req_to_token)):
        return paged_extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            extend_seq_lens, scaling=scaling)
    return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                    causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)


def make_decode_hook(decode: Callable[..., Any]) -> Callable[..., Any]:
    """An AROUND hook for `_run_sdpa_forward_decode`: `decode` (batched_decode or paged_decode) where it applies,
    SGLang's loop elsewhere."""

    def decode_hook(original: Callable[..., Any], backend: Any, query, output, k_cache, v_cache, req_to_token,
                    req_pool_indices, seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                    is_cross_attn=False, sliding_window_size=None) -> Any:
        if self_attention(encoder_lens, is_cross_attn, sliding_window_size):
            return decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                          scaling=scaling, enable_gqa=enable_gqa)
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)

    return decode_hook


DECODE = {BATCHED: batched_decode, PAGED: paged_decode}  # $SGLTTS_CPU_ATTENTION -> the decode it installs
