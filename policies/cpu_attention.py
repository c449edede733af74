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

The plugin (`policies/plugin.py`) installs it with $SGLTTS_CPU_ATTENTION=batched; anything this function does
not cover (encoder lengths, sliding windows) is passed to SGLang's own loop.
"""

from __future__ import annotations

from typing import Any, Callable

TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode"
BATCHED = "batched"  # the value of $SGLTTS_CPU_ATTENTION that installs it


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


def decode_hook(original: Callable[..., Any], backend: Any, query, output, k_cache, v_cache, req_to_token,
                req_pool_indices, seq_lens, encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                is_cross_attn=False, sliding_window_size=None) -> Any:
    """An AROUND hook for `_run_sdpa_forward_decode`: `batched_decode` where it applies, SGLang's loop elsewhere."""
    if encoder_lens is None and not is_cross_attn and (sliding_window_size is None or sliding_window_size < 0):
        return batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                              scaling=scaling, enable_gqa=enable_gqa)
    return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    encoder_lens, scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                    is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
