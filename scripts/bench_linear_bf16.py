"""One decode step's linear layers of SmolLM2-135M (30 layers of q, k, v, o, gate, up, down, then the LM head; random
weights of the model's shapes) through oneDNN on packed weights, fp32 against bf16 weights (`bf16_packed_linear`, the
runtime's packed-bf16 product), with SGLang's plain `F.linear` in fp32 beside them. The arms run
interleaved; prints the median [min-max] ms per step at each row count, the bf16 head's relative error, the CPU
(`cpu_summary`: bf16 is worth it only where it names amx_bf16) and the load.

    .venv/bin/python scripts/bench_linear_bf16.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from policies.cpu_linear import bf16_packed_linear, packed_linear
from sgl_tts.runtime.hardware import cpu_summary

HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN),
          (HIDDEN, MLP)] * LAYERS + [(VOCAB, HIDDEN)]  # [out, in] of every weight of one step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    packed_fp32 = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    packed_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()) for w in weights]
    arms = {
        "fp32 F.linear": lambda xs: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)],
        "fp32 packed": lambda xs: [packed_linear(x, w) for x, w in zip(xs, packed_fp32)],
        "bf16 packed": lambda xs: [bf16_packed_linear(x, w) for x, w in zip(xs, packed_bf16)],
    }
    print(f"{cpu_summary()}; {args.threads} threads; load average {os.getloadavg()[0]:.2f}")
    for rows in (1, 8, 16, 64, 256):
        inputs = [torch.randn(rows, k) for _, k in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in arms}
        for arm in arms.values():
            arm(inputs)  # warm-up
        for _ in range(args.repeats):
            for name, arm in arms.items():
                start = time.perf_counter()
                arm(inputs)
                times[name].append((time.perf_counter() - start) * 1e3)
        head = arms["fp32 F.linear"](inputs[-1:])[-1]
        error = (arms["bf16 packed"](inputs[-1:])[-1] - head).abs().max() / head.abs().max()
        cells = "  ".join(f"{name} {statistics.median(t):.1f} [{min(t):.1f}-{max(t):.1f}]" for name, t in times.items())
        ratio = statistics.median(times["fp32 packed"]) / statistics.median(times["bf16 packed"])
        print(f"{rows:4d} rows  {cells}  fp32/bf16 packed {ratio:.2f}x  bf16 head error {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
