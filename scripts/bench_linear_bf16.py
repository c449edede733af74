"""One decode step's linear layers of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down, then the LM head; random
weights of the model's shapes, the layers' rounded as GGUF's Q4_1 writes them, as the model ships) through oneDNN on
packed weights, fp32 against bf16 weights (`bf16_packed_linear`, the runtime's packed-bf16 product) and against the
layers read from 4 bits (`int4_linear`: what packed-bf16-int4 computes at up to INT4_ROWS rows, the head in bf16,
and what packed-int4 does, the head in fp32), with SGLang's plain `F.linear` in fp32 beside them. The arms run
interleaved; prints the median [min-max] ms per step at each row count, the bf16 head's relative error, the CPU
(`cpu_summary`: bf16 is worth it only where it names amx_bf16) and the load. Where oneDNN has no bf16 instructions
the bf16 arms are left out.

    .venv/bin/python scripts/bench_linear_bf16.py [--threads 2] [--repeats 5] [--rows 1,4,8,10,16,64,256]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/bench_linear_bf16.py  # held to AVX2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch

from policies.cpu_linear import bf16_packed_linear, int4_linear, int4_weight, packed_linear, q4_1_round
from sgl_tts.runtime.hardware import cpu_summary

HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN),
          (HIDDEN, MLP)] * LAYERS + [(VOCAB, HIDDEN)]  # [out, in] of every weight of one step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default="1,8,16,64,256", help="comma-separated row counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [q4_1_round(torch.randn(n, k) * 0.02) for n, k in SHAPES[:-1]] + [torch.randn(*SHAPES[-1]) * 0.02]
    four_bits = [int4_weight(SimpleNamespace(weight=w)) for w in weights[:-1]]
    packed_fp32 = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]

    def int4_layers(xs: list) -> list:
        return [int4_linear(x, w) for x, w in zip(xs, four_bits)]

    arms = {
        "fp32 F.linear": lambda xs: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)],
        "fp32 packed": lambda xs: [packed_linear(x, w) for x, w in zip(xs, packed_fp32)],
        "int4 layers fp32 head": lambda xs: int4_layers(xs) + [packed_linear(xs[-1], packed_fp32[-1])],
    }
    try:
        packed_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()) for w in weights]
    except RuntimeError as exc:  # oneDNN without bf16 instructions (e.g. held to AVX2)
        packed_bf16 = None
        print(f"no bf16 arms: {exc}")
    if packed_bf16 is not None:
        arms["bf16 packed"] = lambda xs: [bf16_packed_linear(x, w) for x, w in zip(xs, packed_bf16)]
        arms["int4 layers"] = lambda xs: int4_layers(xs) + [bf16_packed_linear(xs[-1], packed_bf16[-1])]
    print(f"{cpu_summary()}; {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    for rows in (int(count) for count in args.rows.split(",")):
        inputs = [torch.randn(rows, k) for _, k in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in arms}
        for arm in arms.values():
            arm(inputs)  # warm-up
        for _ in range(args.repeats):
            for name, arm in arms.items():
                start = time.perf_counter()
                arm(inputs)
                times[name].append((time.perf_counter() - start) * 1e3)
        cells = "  ".join(f"{name} {statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}]" for name, t in times.items())

        def ratio(slower: str, faster: str) -> str:
            return f"{slower}/{faster} {statistics.median(times[slower]) / statistics.median(times[faster]):.2f}x"

        ratios = [ratio("fp32 packed", "int4 layers fp32 head")]
        if packed_bf16 is not None:
            head = torch.nn.functional.linear(inputs[-1], weights[-1])
            error = (bf16_packed_linear(inputs[-1], packed_bf16[-1]) - head).abs().max() / head.abs().max()
            ratios += [ratio("fp32 packed", "bf16 packed"), ratio("bf16 packed", "int4 layers"),
                       f"bf16 head error {error:.1e}"]
        print(f"{rows:4d} rows  {cells}  {'  '.join(ratios)}", flush=True)


if __name__ == "__main__":
    main()
