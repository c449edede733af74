"""A Llama decode step (and extend) on the CPU as one loop over the compiled kernels, without SGLang's layer code
between them.

SGLang 0.5.23 runs a decode step through its general layer machinery: per decoder layer a stage boundary prepares
the input and finishes the output (residual bookkeeping, LoRA and transport hooks, quantization reads), the
attention goes through RadixAttention and the backend's dispatch, every projection through LinearBase and its
quantization method, each a module call. With the CPU kernels in place (packed linear layers, compiled norms and
rotary, paged attention) the arithmetic of one SmolLM2-135M step at one row is ~22 ms on two threads of a 2-core
Xeon (AMX), while SGLang's step took 37 ms: the rest was Python between the kernels. This hook computes the same
step with the same kernels in the order SGLang calls them (28 ms; docs/runtime-speed.md):

    h = E[ids];  r = h
    for each layer:   x = norm_in(h) at the first layer, else (x, r) = norm_in(h + r) with r = h + r
                      (the residual r is what a capture at the layer's entry records)
                      q | k | v = x Wqkv^T;   (q, k) = rope(positions, q, k);   KV[out_cache_loc] = (k, v)
                      h = attention(q, the sequence's KV) Wo^T
                      (x, r) = norm_post(h + r);   g | u = x Wgu^T;   h = (silu(g) * u) Wdown^T
    return norm_final(h + r)

Each kernel gets the inputs it got under SGLang's code, so the hidden states are SGLang's (greedy decodes of
SmolLM2-135M gave logprobs equal to the bit; tests/test_lean_decode.py compares tokens, logprobs and margins).

An extend (prefill) batch is the same loop: each request's new tokens take their rows, rotary their positions and
the KV write their slots, and the paged kernel attends each to its cached prefix and to the new tokens before it
(what SGLang's extend calls with the same kernels). Its overhead was most of a short request's prefill: one new token
of a 62-token prompt 95 -> 76 ms to the answer, of 40 new tokens after a cached prompt 106 -> 95 ms, 16 forks of a
cached prompt 295 -> 263 ms (2-core Xeon with AMX, docs/runtime-speed.md).

The plugin (`policies/plugin.py`) installs it with $SGLTTS_CPU_DECODE=lean where the kernels it calls are
installed too (packed linear layers, fused norms and rotary, paged attention; `sgl_tts/runtime/server.py` sets
all four on every CPU runtime, `env: {SGLTTS_CPU_DECODE: sglang}` keeps SGLang's layer code). It takes a plain
decode or extend batch of a plain Llama (`LlamaModel` of `LlamaDecoderLayer`s, one tensor-parallel rank, one
pipeline stage, unquantized fp32 weights, no LoRA, no auxiliary captures, causal attention without a sliding window);
mixed and speculative batches and anything else go to SGLang's forward. A layer whose forward another hook wrapped is
taken only when that hook also left the capture it needs (`CAPTURE`, a callable(residual, forward_batch);
policies/probe_readout.py leaves one), else the whole step goes to SGLang.

Where every projection reads its weight from a 4- or 8-bit grid at this step's rows
(`$SGLTTS_CPU_LINEAR=packed-int4` or `packed-bf16-int4`, at most `cpu_linear.most_grid_rows`), the loop runs
compiled (`policies/decode_step.cpp`: the same kernel calls in C++, one Python call a step and one a capture), a
decode step or an extend alike (a search's short extends, a step's text or a verifier's read of 2-3 tokens: 22.3 ->
10.5 ms median forward, docs/runtime-speed.md, "extends compiled"); with `packed-bf16-int4` on a CPU with AMX it
runs compiled at any rows, the products above the grids' rows on AMX's tiles, unpacked from the same grids
(`cpu_linear.amx_grid_linear`, as the Python loop computes them); else in Python;
$SGLTTS_CPU_DECODE=lean-python keeps it in Python at every step (to measure the one against the other).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

TARGET = "sglang.srt.models.llama.LlamaModel.forward"
LEAN = "lean"  # the value of $SGLTTS_CPU_DECODE that installs it
LEAN_PYTHON = "lean-python"  # the value that installs it with the loop in Python at every step
VALUES = (LEAN, LEAN_PYTHON)
# The compiled step: policies/decode_step.cpp after the kernels whose functions it calls, in one translation unit.
STEP_SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "cpu_layers.cpp", "paged_attention.cpp", "grid_linear.cpp", "amx_linear.cpp", "decode_step.cpp"))
_STEP = "_sgltts_compiled_step"  # model attribute: (identity, a CompiledStep or None)
CAPTURE = "_sgltts_residual_capture"  # a decoder layer's attribute: called with the residual at the layer's entry
_REFUSAL = "_sgltts_lean_refusal"  # model attribute: why the lean step does not compute the model (None: it does)


def find_refusal(model: Any) -> str | None:
    """Why the lean step cannot compute `model` (an SGLang LlamaModel), or None when it can."""
    import torch

    from policies.cpu_layers import layer_kernels, plain_norm, plain_rotary
    from policies.cpu_linear import applies
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang.srt.models.llama import LlamaDecoderLayer, LlamaModel

    if type(model) is not LlamaModel:
        return f"a {type(model).__name__}, not a LlamaModel"
    if model.pp_group.world_size != 1:
        return "pipeline parallel"
    if layer_kernels() is None:
        return "the layer kernels are not built"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return f"a {type(layer).__name__} layer"
        attention, mlp = layer.self_attn, layer.mlp
        if attention.num_heads != attention.total_num_heads:
            return "tensor parallel"
        for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if (type(linear.quant_method) is not UnquantizedLinearMethod or linear.skip_bias_add
                    or hasattr(linear, "set_lora") or getattr(linear, "use_intel_amx_backend", False)
                    or not applies(torch.empty(1, 1), linear.weight)):
                return f"a {type(linear).__name__} that is not a plain fp32 linear layer"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm) is not RMSNorm or not plain_norm(norm):
                return "a norm that is not a plain fp32 RMSNorm"
        if not plain_rotary(attention.rotary_emb):
            return f"a {type(attention.rotary_emb).__name__} rotary embedding"
        attn = attention.attn
        if (attn.is_cross_attention or attn.qk_head_dim != attn.v_head_dim or attn.attn_type != AttentionType.DECODER
                or (attn.sliding_window_size is not None and attn.sliding_window_size > -1)):
            return "an attention that is not plain causal self-attention"
    if type(model.norm) is not RMSNorm or not plain_norm(model.norm):
        return "a final norm that is not a plain fp32 RMSNorm"
    return None


def refusal(model: Any) -> str | None:
    """`find_refusal(model)`, found once per model."""
    if not hasattr(model, _REFUSAL):
        setattr(model, _REFUSAL, find_refusal(model))
    return getattr(model, _REFUSAL)


def captures(model: Any) -> list[Callable[..., Any] | None] | None:
    """Each layer's capture (None where it has none), or None when a layer's forward is wrapped without one."""
    found = []
    for layer in model.layers:
        capture = getattr(layer, CAPTURE, None)
        if capture is None and "forward" in vars(layer):
            return None
        found.append(capture)
    return found


def takes(model: Any, input_ids: Any, forward_batch: Any, input_embeds: Any, pp_proxy_tensors: Any) -> bool:
    """Whether this call is a plain decode or extend batch of a model the lean step computes, on the paged
    kernel."""
    from policies.cpu_attention import kernel_takes
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_context import get_attn_backend

    if (not (forward_batch.forward_mode.is_decode() or plain_extend(forward_batch)) or input_embeds is not None
            or pp_proxy_tensors is not None
            or model.layers_to_capture or input_ids.device.type != "cpu" or refusal(model) is not None):
        return False
    backend = get_attn_backend()
    if type(backend) is not TorchNativeAttnBackend or forward_batch.encoder_lens is not None:
        return False
    pool, attn = backend.token_to_kv_pool, model.layers[0].self_attn.attn
    query = input_ids.new_empty((0, attn.tp_q_head_num, attn.qk_head_dim), dtype=model.norm.weight.dtype)
    return kernel_takes(query, query, pool.get_key_buffer(attn.layer_id), pool.get_value_buffer(attn.layer_id),
                        req_to_token=backend.req_to_token_pool.req_to_token)


def plain_extend(forward_batch: Any) -> bool:
    """Whether `forward_batch` is a plain extend (prefill) batch: each request's new tokens after its cached
    prefix, no decode rows mixed in, no speculative verification."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return forward_batch.forward_mode == ForwardMode.EXTEND and forward_batch.extend_seq_lens is not None


@functools.lru_cache(maxsize=None)
def step_kernel() -> Any:
    """STEP_SOURCES compiled for this CPU with OpenMP (the modules of the kernel sources left out), or None when
    they cannot be built."""
    from policies.cpu_attention import build_kernel

    text = b"#define SGLTTS_ONE_UNIT\n" + b"\n".join(source.read_bytes() for source in STEP_SOURCES)
    return build_kernel(text, STEP_SOURCES[-1], threads=True)


def projections(layer: Any) -> tuple[Any, Any, Any, Any]:
    """A decoder layer's four linear layers, in the order of the step."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


@dataclass(frozen=True)
class CompiledStep:
    """A model's compiled step (`DecodeStep`): its products read their grids by the grid kernel at up to `grid_rows`
    rows, and above that on AMX's tiles where it was built for them (`most_rows` unbounded), else the step is not
    taken."""

    step: Any
    grid_rows: int
    most_rows: int


def build_step(model: Any, pool: Any, bf16: bool) -> CompiledStep | None:
    """`model`'s compiled step over the KV buffers of `pool`, or None where a projection has no grid, the pool is
    not a plain fp32 or bf16 one, or the kernel is not built."""
    import torch

    from policies.cpu_linear import amx_kernels, grid_bits, grid_weight, most_grid_rows
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kernel = step_kernel()
    if (kernel is None or type(pool) is not MHATokenToKVPool or pool.is_quantized_kv_cache
            or pool.store_dtype != pool.dtype or pool.dtype not in (torch.float32, torch.bfloat16)):
        return None
    step, rows = kernel.DecodeStep(model.norm.weight, model.norm.variance_epsilon), []
    on_amx = bf16 and amx_kernels() is not None
    for layer in model.layers:
        linears = projections(layer)
        tiles = [grid_weight(linear) for linear in linears]
        if any(tile is None for tile in tiles):
            return None
        rows += [most_grid_rows(bf16, grid_bits(tile), on_amx) for tile in tiles]
        attention, attn = layer.self_attn, layer.self_attn.attn
        rotary = attention.rotary_emb
        step.add_layer(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                       layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                       [packed for packed, _ in tiles], [scales for _, scales in tiles],
                       [linear.bias for linear in linears], on_amx, [linear.weight for linear in linears],
                       rotary.cos_sin_cache, rotary.head_size,
                       bool(rotary.is_neox_style), pool.get_key_buffer(attn.layer_id),
                       pool.get_value_buffer(attn.layer_id), attn.tp_q_head_num, attn.tp_k_head_num,
                       attn.qk_head_dim, float(attn.scaling))
    return CompiledStep(step, min(rows), sys.maxsize if on_amx else min(rows))


def compiled_step(model: Any, pool: Any, bf16: bool) -> CompiledStep | None:
    """`build_step(model, pool, bf16)`, built once and again after the pool's buffers or a projection's weight changed
    (the step checks its weights' storage and version itself: `DecodeStep.current`)."""
    identity = (id(pool), pool.get_key_buffer(model.layers[0].self_attn.attn.layer_id).data_ptr(), bf16)
    cached = getattr(model, _STEP, None)
    if cached is None or cached[0] != identity or (cached[1] is not None and not cached[1].step.current()):
        cached = (identity, build_step(model, pool, bf16))
        setattr(model, _STEP, cached)
    return cached[1]


def lean_forward(model: Any, input_ids: Any, positions: Any, forward_batch: Any, layer_captures: list[Any],
                 bf16: bool, grids: bool = False) -> Any:
    """The decode step or extend of `model` (the module docstring's loop): the final norm's output [tokens, hidden]."""
    import torch

    from policies.cpu_attention import paged_kernel
    from policies.cpu_layers import layer_kernels
    from policies.cpu_linear import dense_linear
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from sglang.srt.model_executor.forward_context import get_attn_backend

    kernels, attend = layer_kernels(), paged_kernel().paged_attention
    backend = get_attn_backend()
    pool, req_to_token = backend.token_to_kv_pool, backend.req_to_token_pool.req_to_token
    write_loc = KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc)
    req_pool_indices, seq_lens = forward_batch.req_pool_indices, forward_batch.seq_lens
    new_tokens = torch.ones_like(seq_lens) if forward_batch.forward_mode.is_decode() else forward_batch.extend_seq_lens
    positions = positions.flatten().contiguous()

    hidden = model.embed_tokens(input_ids)
    residual = None
    for layer, capture in zip(model.layers, layer_captures):
        attention, mlp, attn = layer.self_attn, layer.mlp, layer.self_attn.attn
        norm = layer.input_layernorm
        if residual is None:
            residual = hidden
            x = kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon)
        else:
            x, residual = kernels.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
        if capture is not None:
            capture(residual, forward_batch)
        qkv = dense_linear(x, attention.qkv_proj, attention.qkv_proj.bias, bf16, grids)
        q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        rotary = attention.rotary_emb
        q, k = kernels.rotary(positions, q, k, rotary.cos_sin_cache, rotary.head_size, bool(rotary.is_neox_style))
        k = k.view(-1, attn.tp_k_head_num, attn.qk_head_dim)
        pool.set_kv_buffer(attn, write_loc, k, v.reshape(-1, attn.tp_v_head_num, attn.v_head_dim))
        q = q.view(-1, attn.tp_q_head_num, attn.qk_head_dim)
        out = torch.empty_like(q)
        attend(q, out, pool.get_key_buffer(attn.layer_id), pool.get_value_buffer(attn.layer_id), req_to_token,
               req_pool_indices, seq_lens, new_tokens, float(attn.scaling))
        hidden = dense_linear(out.view(len(q), -1), attention.o_proj, attention.o_proj.bias, bf16, grids)
        norm = layer.post_attention_layernorm
        x, residual = kernels.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
        gate_up = dense_linear(x, mlp.gate_up_proj, mlp.gate_up_proj.bias, bf16, grids)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = dense_linear(torch.nn.functional.silu(gate) * up, mlp.down_proj, mlp.down_proj.bias, bf16, grids)
    norm = model.norm
    return kernels.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)[0]


def compiled_forward(compiled: CompiledStep, model: Any, input_ids: Any, positions: Any, forward_batch: Any,
                     layer_captures: list[Any], req_to_token: Any) -> Any:
    """`lean_forward` through `model`'s compiled step (`compiled_step`), which calls the layers' captures;
    `req_to_token` is the attention backend's token table."""
    from policies.cpu_linear import told_grid_read

    if len(input_ids) <= compiled.grid_rows:
        told_grid_read(len(input_ids), projections(model.layers[0])[0])
    captured = [index for index, capture in enumerate(layer_captures) if capture is not None]
    extend_lens = None if forward_batch.forward_mode.is_decode() else forward_batch.extend_seq_lens
    return compiled.step.forward(
        model.embed_tokens(input_ids), positions.flatten().contiguous(), forward_batch.out_cache_loc, req_to_token,
        forward_batch.req_pool_indices, forward_batch.seq_lens, extend_lens, captured,
        lambda index, residual: layer_captures[index](residual, forward_batch), compiled.grid_rows)


def make_forward_hook(bf16: bool, grids: bool = False, compiled: bool = True,
                      announce: Callable[[str], None] = lambda line: None) -> Callable[..., Any]:
    """An AROUND hook for `LlamaModel.forward`: `lean_forward` where `takes` says so (projections on bf16
    weights with `bf16`, and from their 4- or 8-bit grids at a few rows with `grids`, as the packed linear hook
    computes them; the loop compiled where `compiled` and the grids allow), SGLang's forward elsewhere. `announce`
    hears once per process that a step was taken, or why a model is not."""
    told: set[str] = set()

    def tell(line: str) -> None:
        if line not in told:
            told.add(line)
            announce(line)

    def forward(original: Callable[..., Any], model: Any, input_ids: Any, positions: Any, forward_batch: Any,
                input_embeds: Any = None, pp_proxy_tensors: Any = None) -> Any:
        layer_captures = None
        if takes(model, input_ids, forward_batch, input_embeds, pp_proxy_tensors):
            layer_captures = captures(model)
        if layer_captures is None:
            if refusal(model) is not None:
                tell(f"lean decode not taken: {refusal(model)}")
            return original(model, input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        kind = "step" if forward_batch.forward_mode.is_decode() else "extend"
        if compiled and grids:
            from sglang.srt.model_executor.forward_context import get_attn_backend

            backend = get_attn_backend()
            step = compiled_step(model, backend.token_to_kv_pool, bf16)
            if step is not None and len(input_ids) <= step.most_rows:
                above = f", on AMX tiles above {step.grid_rows} rows" if len(input_ids) > step.grid_rows else ""
                tell(f"lean decode took a compiled {kind} ({len(model.layers)} layers{above})")
                return compiled_forward(step, model, input_ids, positions, forward_batch, layer_captures,
                                        backend.req_to_token_pool.req_to_token)
        tell(f"lean decode took {'a step' if kind == 'step' else 'an extend'} ({len(model.layers)} layers)")
        return lean_forward(model, input_ids, positions, forward_batch, layer_captures, bf16, grids)

    return forward
