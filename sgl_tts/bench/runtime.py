"""`sgl-tts bench runtime`: SGLang CPU runtime vs Hugging Face `generate`, measured side by side.

Both engines decode the same prompts with the same model, greedily, for the same number of new tokens
(end of sequence ignored), at 1, 16 and 64 requests in parallel; the table prints output tokens per second
and their ratio. Then a fork of 16 from one prompt reports the fraction of prompt tokens served from the
radix cache.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from sgl_tts.runtime.server import http_json


def _prompts(tokenizer, count: int) -> list[str]:
    from sgl_tts.problems import builtin_problems
    from sgl_tts.frontend.backend import chat_prompt

    questions = [p.question for p in builtin_problems()]
    return [chat_prompt(tokenizer, questions[i % len(questions)] + f" (variant {i})") for i in range(count)]


def sglang_tokens_per_s(url: str, prompts: list[str], new_tokens: int) -> float:
    def one(prompt: str) -> int:
        answer = http_json(url + "/generate", {
            "text": prompt,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        })
        return int(answer["meta_info"]["completion_tokens"])

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - began)


def hf_tokens_per_s(model, tokenizer, prompts: list[str], new_tokens: int) -> float:
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    began = time.perf_counter()
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - began
    generated = (output.shape[1] - batch.input_ids.shape[1]) * output.shape[0]
    return generated / elapsed


def fork_cache_fraction(runtime, prompt: str, width: int = 16, new_tokens: int = 16) -> float:
    """Fork `width` branches from one prompt; fraction of the branches' prompt tokens served from cache."""
    import sglang as sgl

    from sgl_tts.frontend.backend import TTSEndpoint

    @sgl.function
    def fork_program(s, prompt):
        s += prompt
        s.text()
        forks = s.fork(width)
        for fork in forks:
            fork += sgl.gen("out", max_tokens=new_tokens, temperature=0.8)
        metas = [fork.get_meta_info("out") for fork in forks]
        forks.join()
        return metas

    metas = fork_program.run(prompt=prompt, backend=TTSEndpoint(runtime)).ret_value
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    return sum(m.get("cached_tokens", 0) for m in metas) / prompt_tokens


def run_bench(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_tts.runtime.server import Runtime, RuntimeConfig

    config = RuntimeConfig(model=args.model, device="cpu", cpu_threads=args.threads,
                           chunked_prefill_size=args.chunked_prefill_size,
                           max_running_requests=args.max_running_requests, extra_args=list(args.server_arg or []))
    parallel = [int(p) for p in args.parallel.split(",")]
    print(f"bench runtime: model={args.model} new_tokens={args.new_tokens} parallel={parallel} "
          f"torch threads={torch.get_num_threads()}", flush=True)
    sglang_rates, hf_rates = {}, {}
    with Runtime.start(config, name="bench") as runtime:
        tokenizer = AutoTokenizer.from_pretrained(runtime.model_path)
        prompts = _prompts(tokenizer, max(parallel))
        sglang_tokens_per_s(runtime.url, prompts[:2], 4)  # warm-up
        for p in parallel:
            sglang_rates[p] = sglang_tokens_per_s(runtime.url, prompts[:p], args.new_tokens)
            print(f"  sglang x{p}: {sglang_rates[p]:.1f} tok/s", flush=True)
        cache_fraction = fork_cache_fraction(runtime, prompts[0])
    # The server is stopped before HF runs, so the two never share the cores.
    model = AutoModelForCausalLM.from_pretrained(runtime.model_path, dtype=torch.float32)
    model.eval()
    hf_tokens_per_s(model, tokenizer, prompts[:1], 4)  # warm-up
    for p in parallel:
        hf_rates[p] = hf_tokens_per_s(model, tokenizer, prompts[:p], args.new_tokens)
        print(f"  hf     x{p}: {hf_rates[p]:.1f} tok/s", flush=True)
    print()
    print(f"{'parallel':>8s} {'sglang tok/s':>13s} {'hf tok/s':>9s} {'sglang/hf':>10s}")
    for p in parallel:
        print(f"{p:8d} {sglang_rates[p]:13.1f} {hf_rates[p]:9.1f} {sglang_rates[p] / hf_rates[p]:9.2f}x")
    print(f"fork of 16: {cache_fraction:.0%} of the branches' prompt tokens served from the radix cache")
    return 0


def add_bench_runtime_parser(bench_subparsers) -> None:
    parser = bench_subparsers.add_parser("runtime", help="SGLang CPU runtime vs HF generate (tokens/s ratios)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--parallel", default="1,16,64", help="comma-separated request counts")
    parser.add_argument("--threads", type=int, help="torch threads in the SGLang scheduler process")
    parser.add_argument("--chunked-prefill-size", type=int)
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--server-arg", action="append", help="extra launch_server argument (repeatable)")
    parser.set_defaults(func=run_bench)
