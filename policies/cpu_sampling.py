"""Sampling of the next token on a CPU runtime by the inverse of the cumulative distribution.

Without top-k, top-p or min-p (the searches' default: temperature only) and without a per-request seed, SGLang
0.5.23 samples every row of the batch with `torch.multinomial(probs, 1)` (`sampler.sampling_from_probs_torch`).
On a CPU that costs about 1.2 ms per row over SmolLM2's 49,152-token vocabulary: 152 ms for a decode step of 128
running requests, 14-17% of a generator rank's time in `make run` (py-spy, 2-core AMD EPYC, AVX2). The same draw
by the inverse of the cumulative distribution is one prefix sum and one binary search per row:

    C_i   = p_0 + ... + p_i                  cumulative sum over the vocabulary, per row
    u     ~ Uniform[0, C_{V-1})              one uniform per row, scaled by the row's total
    token = min { i : C_i > u }              searchsorted(C, u, right=True)

P(token = i) = (C_i - C_{i-1}) / C_{V-1} = p_i / sum(p): the distribution multinomial draws from, so a token of
probability zero is never drawn (C_i = C_{i-1} leaves no u with C_{i-1} <= u < C_i). 7.6 ms for 128 rows (20x).
The fp32 prefix sum rounds each C_i by about 1e-7 of the total, far below any probability that matters.

SGLang decides top-k / top-p / min-p for the batch, not the row: one request in the batch with a top-k (a greedy
request is top-k 1: a verifier's read, a `temperature: 0` answer) sends every row through
`top_k_top_p_min_p_sampling_from_probs_torch`, a full sort of the vocabulary per row, and the flag stays with the
running batch the request joined. In `make run` with the probe read inside the generator (whose reads are greedy
requests of one token) that sort was 31-35% of both ranks' time (py-spy, 2-core AMD EPYC, AVX2). `split_hook`
samples each row by what it asks:

    top_k = 1                                 argmax p             (the sort's first entry)
    top_k >= V, top_p >= 1, no min-p          inverse CDF as above (the sort changes nothing)
    any other row                             SGLang's sort, on those rows alone

Denormals. At temperature 0.3 a row's softmax writes e^((l_i - max l) / 0.3) for 49,152 logits, and the tail of
that (exponents between about -87 and -103) is denormal: x86 computes a denormal result some 100 cycles slower.
With real logits SGLang's softmax took 7% of a rank's step at 32 rows (py-spy); on 32 x 49,152 values spread to
-150 it is 20.5 ms against 0.96 ms with denormals flushed to zero (one thread, 2-core Intel Xeon). A probability
below 1.2e-38 is no probability a sampler can draw, so `flush_denormals` sets the scheduler thread's FTZ/DAZ
bits (`torch.set_flush_denormal`), which are per thread: with $SGLTTS_CPU_DENORMALS=flush (every CPU runtime;
`keep` leaves them) the plugin calls it in the scheduler's main thread, where the forward and sampling run.
One pass, in place. Done in torch, the draw writes the prefix sums (25 MB at 128 rows of 49,152), and `split_hook`
first copied the rows it draws (`probs[plain]`, 25 MB more); SGLang's sampler also copies the softmax it computed
into the logits' tensor (`logits[:] = softmax(logits)`). With the kernel built (`policies/cpu_sampling.cpp`), a row is
drawn where it lies, by sums of blocks of 16 and one walk (the .cpp has the arithmetic: min { i : C_i > u C_{V-1} }
with C in double), and `softmax_hook` writes the sampler's softmax over its logits (the same kernel, the same
values; SGLang's copy of a tensor onto itself returns at once). 128 rows of 49,152 from the logits to the tokens,
two of them greedy: 28-42 ms -> 9-12 ms on one thread (2-core Xeon with AMX); in `make run` the sampler had been
13% of a generator rank's time (py-spy). The in-place softmax is taken only inside SGLang's `Sampler.forward`
(`sampler_hook` marks it), where the logits are overwritten by the softmax anyway: the same function serves
speculative decoding's draft, whose logits may be read again.

The plugin (`policies/plugin.py`) installs the hooks with $SGLTTS_CPU_SAMPLING=cdf (`sgl_tts/runtime/server.py` sets
it on every CPU runtime); seeded sampling, a caller that wants the filtered distribution back, and any tensor not on
the CPU go to SGLang's code unchanged; where the kernel cannot be built the draw runs in torch as above.
"""

from __future__ import annotations

import contextvars
import functools
from pathlib import Path
from typing import Any, Callable

TARGET = "sglang.srt.layers.sampler.sampling_from_probs_torch"
FILTERED_TARGET = "sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch"
SOFTMAX_TARGET = "sglang.srt.layers.sampler.sampler_softmax"
SAMPLER_TARGET = "sglang.srt.layers.sampler.Sampler.forward"
KERNEL_SOURCE = Path(__file__).with_name("cpu_sampling.cpp")
CDF = "cdf"  # the value of $SGLTTS_CPU_SAMPLING that installs it
FLUSH = "flush"  # the value of $SGLTTS_CPU_DENORMALS that flushes denormals to zero
_in_sampler = contextvars.ContextVar("sgltts_in_sampler", default=False)  # inside SGLang's Sampler.forward


@functools.lru_cache(maxsize=None)
def sampling_kernel() -> Any:
    """The compiled draw of KERNEL_SOURCE for this CPU, or None when it cannot be built."""
    from policies.cpu_attention import build_kernel

    return build_kernel(KERNEL_SOURCE.read_bytes(), KERNEL_SOURCE)


def flush_denormals() -> bool:
    """Flush denormal floats to zero in this thread (FTZ and DAZ; see the module's docstring); False where the CPU
    cannot."""
    import torch

    return bool(torch.set_flush_denormal(True))


def inverse_cdf(probs: Any, uniform: Any) -> Any:
    """The token of each row of `probs` [B, V] (non-negative, any positive total) that the uniform draw
    `uniform` [B] in [0, 1) selects: the first i whose cumulative sum exceeds `uniform` x the row's total."""
    import torch

    cumulative = probs.cumsum(dim=-1)
    threshold = (uniform.to(cumulative.dtype) * cumulative[:, -1]).unsqueeze(1)
    token = torch.searchsorted(cumulative, threshold, right=True)
    return token.clamp_(max=probs.shape[-1] - 1).view(-1)  # u rounded up to the total: the last index


def sample(probs: Any, rows: Any = None) -> Any:
    """One token per row of `probs` [B, V] (of the rows listed in `rows`, int64, where given), drawn with
    probability p_i / sum(p), as int32 (SGLang's): by the kernel on fp32 rows where it is built, else in torch."""
    import torch

    count = probs.shape[0] if rows is None else len(rows)
    kernel = sampling_kernel() if probs.dtype == torch.float32 and probs.stride(-1) == 1 else None
    if kernel is not None:
        listed = torch.arange(count) if rows is None else rows
        return kernel.inverse_cdf_rows(probs, listed, torch.rand(count, dtype=torch.float32))
    uniform = torch.rand(count, dtype=torch.float64 if probs.dtype == torch.float64 else torch.float32)
    return inverse_cdf(probs if rows is None else probs[rows], uniform).to(torch.int32)


def sampling_hook(original: Callable[..., Any], probs: Any, sampling_seed: Any = None, positions: Any = None) -> Any:
    """An AROUND hook for `sampling_from_probs_torch(probs, sampling_seed, positions)`."""
    if sampling_seed is not None or probs.device.type != "cpu" or probs.dim() != 2:
        return original(probs, sampling_seed=sampling_seed, positions=positions)
    return sample(probs)


def split_hook(original: Callable[..., Any], probs: Any, top_ks: Any, top_ps: Any, min_ps: Any,
               need_min_p_sampling: bool, sampling_seed: Any, positions: Any, *, return_filtered_probs: bool = False,
               max_top_k: Any = None) -> Any:
    """An AROUND hook for `top_k_top_p_min_p_sampling_from_probs_torch`: greedy rows by argmax, unfiltered rows by
    the inverse CDF, the rest by SGLang's sort on those rows alone."""
    import torch

    if sampling_seed is not None or return_filtered_probs or probs.device.type != "cpu" or probs.dim() != 2:
        return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions,
                        return_filtered_probs=return_filtered_probs, max_top_k=max_top_k)
    vocab = probs.shape[-1]
    greedy = top_ks == 1
    plain = (top_ks >= vocab) & (top_ps >= 1.0)
    if need_min_p_sampling:
        plain &= min_ps <= 0.0
    tokens = torch.empty(probs.shape[0], dtype=torch.int32)
    if bool(greedy.any()):
        tokens[greedy] = probs[greedy].argmax(dim=-1).to(torch.int32)
    if bool(plain.any()):
        rows = plain.nonzero().view(-1)
        tokens[rows] = sample(probs, rows)
    rest = ~(greedy | plain)
    if bool(rest.any()):
        rows = rest.nonzero().view(-1)
        tokens[rows] = original(probs[rows], top_ks[rows], top_ps[rows], min_ps[rows], need_min_p_sampling, None,
                                None if positions is None else positions[rows],
                                max_top_k=int(top_ks[rows].max())).to(torch.int32)
    return tokens


def sampler_hook(original: Callable[..., Any], sampler: Any, *args: Any, **kwargs: Any) -> Any:
    """An AROUND hook for SGLang's `Sampler.forward`: marks the call, in which `softmax_hook` writes in place."""
    mark = _in_sampler.set(True)
    try:
        return original(sampler, *args, **kwargs)
    finally:
        _in_sampler.reset(mark)


def softmax_hook(original: Callable[..., Any], logits: Any, temperatures: Any = None) -> Any:
    """An AROUND hook for the sampler's `softmax(logits, temperatures)`: inside `Sampler.forward`, which overwrites
    the logits with it, torch's softmax of contiguous fp32 CPU rows written over them and returned; elsewhere, or
    with temperatures, SGLang's."""
    import torch

    if (temperatures is None and _in_sampler.get() and logits.device.type == "cpu" and logits.dim() == 2
            and logits.dtype == torch.float32 and logits.is_contiguous()):
        return torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    return original(logits, temperatures)
