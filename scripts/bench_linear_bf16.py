"""One decode step's linear layers of SmolLM2-135M (30 layers of the fused qkv, o, fused gate-up and down products,
then the LM head; random weights of the model's shapes, the layers' rounded as GGUF's Q4_1 writes them and the head
as Q8_0 does, as the model ships) through each way the runtime can compute them: oneDNN on the packed fp32 and bf16
copies, the project's AMX product on the bf16 tiles (`amx_linear`, where the CPU has AMX), the grid kernel on the 4-
and 8-bit tiles (`grid_linear`), and torch's int4 kernel (bf16 scales, input and result rounded to bf16) for the
layers. The arms run interleaved; prints the median [min-max] ms of the layers
and of the head per arm at each row count, the CPU (`cpu_summary`) and the load. Where oneDNN has no bf16
instructions the bf16 arms are left out.

    .venv/bin/python scripts/bench_linear_bf16.py [--threads 2] [--repeats 5] [--rows 1,4,8,16,32,64]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/bench_linear_bf16.py  # held to AVX2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from policies.cpu_linear import (GRID_GROUP, INT4_LEVELS, amx_grid_linear, amx_kernels, amx_linear, amx_tiles,
                                 bf16_packed_linear,
                                 four_bit_grid, grid_kernels, grid_linear, grid_tiles, packed_linear, q4_1_round,
                                 q8_0_round)
from sgl_tts.runtime.hardware import cpu_summary

HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
LAYER_SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)] * LAYERS  # [out, in]


def torch_int4(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product on `weight` through torch's int4 CPU kernel (its layout: packed q, bf16 scale and zero per
    group, (q - 8) scale + zero)."""
    q, step, low = four_bit_grid(weight)
    zero = low + (INT4_LEVELS + 1) // 2 * step
    scales_and_zeros = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GRID_GROUP,
                                                                scales_and_zeros).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,4,8,16,32,64", help="comma-separated row counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = [q4_1_round(torch.randn(n, k) * 0.02) for n, k in LAYER_SHAPES]
    head = q8_0_round(torch.randn(VOCAB, HIDDEN) * 0.05)
    products: dict[str, dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]] = {"layers": {}, "head": {}}
    for part, weights in (("layers", layers), ("head", [head])):
        fp32 = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        products[part]["fp32 packed"] = [lambda x, w=w: packed_linear(x, w) for w in fp32]
        try:
            bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()) for w in weights]
            products[part]["bf16 packed"] = [lambda x, w=w: bf16_packed_linear(x, w) for w in bf16]
        except RuntimeError as exc:  # oneDNN without bf16 instructions (e.g. held to AVX2)
            print(f"no bf16 arm for the {part}: {exc}")
        if amx_kernels() is not None:
            on_tiles = [amx_tiles(w) for w in weights]
            products[part]["amx tiles"] = [lambda x, t=t: amx_linear(x, t) for t in on_tiles]
        if grid_kernels() is not None:
            tiles = [grid_tiles(w) for w in weights]
            products[part]["grid"] = [lambda x, t=t: grid_linear(x, t) for t in tiles]
            if amx_kernels() is not None:
                products[part]["grid on amx"] = [lambda x, t=t: amx_grid_linear(x, t) for t in tiles]
    products["layers"]["torch int4"] = [torch_int4(w) for w in layers]
    print(f"{cpu_summary()}; {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    for rows in (int(count) for count in args.rows.split(",")):
        inputs = {"layers": [torch.randn(rows, k) for _, k in LAYER_SHAPES], "head": [torch.randn(rows, HIDDEN)]}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats + 1):  # the first round warms up
            for part, arms in products.items():
                for name, calls in arms.items():
                    start = time.perf_counter()
                    for call, x in zip(calls, inputs[part]):
                        call(x)
                    times.setdefault((part, name), []).append((time.perf_counter() - start) * 1e3)
        cells = []
        for (part, name), measured in times.items():
            measured = measured[1:]
            cells.append(f"{part} {name} {statistics.median(measured):.2f} [{min(measured):.2f}-{max(measured):.2f}]")
        print(f"{rows:4d} rows  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
