"""One layer's decode attention on the paged KV pool: the batched SDPA in torch (`batched_decode`) against the
compiled kernel (`paged_decode`), side by side (policies/cpu_attention.py).

SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64, an fp32 pool or `--kv-dtype bfloat16`), one thread.
Each sequence's context is a prefix it shares with the other forks of its prompt (`--forks` sequences a prompt; 0:
one prompt for all) followed by its own tokens, on contiguous slots (`--placement strided` puts a sequence's own
tokens a batch's worth of slots apart, as decode steps allocate them, one slot per running request; `random`
scatters them over the pool; `shared` puts every sequence on the same slots, all in cache). `--against FILE` adds a
third arm: the kernel built from another version of policies/paged_attention.cpp (e.g. `git show
HEAD~1:policies/paged_attention.cpp > /tmp/before.cpp`). Each round times 10 calls of each arm, the order rotating;
prints the median [min-max] per call over the rounds and the ratios of the medians to the paged kernel's, with the
CPU model and the load.

    .venv/bin/python scripts/bench_attention.py [--sizes 16x300,64x200,128x300] [--rounds 5] [--against FILE]
        [--placement strided --forks 16 --kv-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from policies.cpu_attention import batched_decode, build_kernel, paged_decode, paged_kernel
from sgl_tts.runtime.hardware import cpu_summary

HEADS, KV_HEADS, HEAD_DIM, POOL = 9, 3, 64, 65536


def batch(sequences: int, context: int, placement: str, forks: int = 0, dtype: torch.dtype = torch.float32,
          seed: int = 0):
    """query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens for `sequences` of `context` tokens, in
    groups of `forks` (0: one group) sharing their prompt's prefix of half the context."""
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(POOL, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    shared, own = context // 2, context - context // 2
    forks = forks or sequences
    prompts = -(-sequences // forks)
    if prompts * shared + sequences * own > POOL:
        raise SystemExit(f"{sequences}x{context}: more tokens than the pool's {POOL} slots")
    req_to_token = torch.zeros(sequences, context, dtype=torch.int32)
    for row in range(sequences):
        if placement == "shared":
            req_to_token[row] = torch.arange(context)
            continue
        prefix = torch.arange(shared) + row // forks * shared
        first = prompts * shared  # own tokens after every prompt's prefix
        mine = torch.arange(first + row * own, first + (row + 1) * own)
        if placement == "strided":
            mine = first + row + sequences * torch.arange(own)
        elif placement == "random":
            mine = torch.randint(first, POOL, (own,), generator=generator)
        req_to_token[row] = torch.cat([prefix, mine])
    query = torch.randn(sequences, HEADS, HEAD_DIM, generator=generator)
    return query, k_cache, v_cache, req_to_token, torch.arange(sequences), torch.full((sequences,), context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16x300,64x200,128x300", help="SEQUENCESxCONTEXT, comma-separated")
    parser.add_argument("--placement", choices=["contiguous", "strided", "random", "shared"], default="contiguous")
    parser.add_argument("--forks", type=int, default=0, help="sequences sharing a prompt's prefix (0: all)")
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", help="another version of policies/paged_attention.cpp, built as a third arm")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if paged_kernel() is None:
        raise SystemExit("the paged attention kernel could not be built here (the log above says why)")
    print(f"{cpu_summary()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; one thread; "
          f"placement {args.placement}, forks {args.forks or 'all'}, KV pool {args.kv_dtype}", flush=True)
    arms = {"batched SDPA": batched_decode, "paged kernel": paged_decode}
    if args.against:
        other = build_kernel(open(args.against, "rb").read())
        if other is None:
            raise SystemExit(f"{args.against} could not be built (the log above says why)")

        def against(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling, enable_gqa):
            other.paged_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                  torch.ones_like(seq_lens), scaling)
            return output

        arms[f"kernel of {os.path.basename(args.against)}"] = against
    for size in args.sizes.split(","):
        sequences, context = (int(x) for x in size.split("x"))
        query, *pool = batch(sequences, context, args.placement, args.forks, getattr(torch, args.kv_dtype))
        outputs = {name: torch.empty_like(query) for name in arms}
        for name, decode in arms.items():
            decode(query, outputs[name], *pool, scaling=HEAD_DIM ** -0.5, enable_gqa=True)
        for name in arms:
            torch.testing.assert_close(outputs[name], outputs["batched SDPA"], rtol=1e-5, atol=1e-5)
        times: dict[str, list[float]] = {name: [] for name in arms}
        for round_ in range(args.rounds):
            names = list(arms)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                began = time.perf_counter()
                for _ in range(10):
                    arms[name](query, outputs[name], *pool, scaling=HEAD_DIM ** -0.5, enable_gqa=True)
                times[name].append((time.perf_counter() - began) / 10 * 1000)
        medians = {name: statistics.median(t) for name, t in times.items()}
        row = ", ".join(f"{name} {medians[name]:.2f} ms [{min(t):.2f}-{max(t):.2f}]" for name, t in times.items())
        ratios = ", ".join(f"{name} / paged {medians[name] / medians['paged kernel']:.2f}x"
                           for name in arms if name != "paged kernel")
        print(f"{size}: {row}; {ratios}", flush=True)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
