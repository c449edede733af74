"""The probe verifier's scoring with its folded head computed on its live rows (`SGLTTS_CPU_LINEAR=packed`, the
CPU default) against the same head packed whole (`packed-dense`), side by side (policies/cpu_linear.py).

Two probe runtimes run at once; each round scores, on each in turn (the order alternating), the same workload
as one `make run` wave scores: 16 problems' 16 solutions of three steps each, the problems at once, with both
runtimes' radix caches flushed first. Prints tokens scored per second per arm as the median [min-max] of the
rounds, and the ratio of the medians, with the CPU model and the load.

    .venv/bin/python scripts/bench_probe_head.py [--rounds 5] [--problems 16] [--samples 16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

from policies import cpu_linear
from sgl_tts import env_names
from sgl_tts.frontend.backend import chat_prompt
from sgl_tts.problems import graded_problems
from sgl_tts.runtime.hardware import cpu_summary
from sgl_tts.runtime.http_client import request
from sgl_tts.runtime.server import Runtime, RuntimeConfig
from sgl_tts.scoring.factory import make_scorer
from sgl_tts.scoring.scorer_config import ScorerConfig

ARMS = {"live-rows": cpu_linear.PACKED, "dense": cpu_linear.PACKED_DENSE}


def solution(rng: random.Random, question: str) -> list[str]:
    """Three steps of arithmetic in the model's style, about 40 tokens each."""
    steps = []
    for _ in range(3):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        steps.append(f"To solve {question[:40]} we first add {a} and {b}, which gives {a + b}. Then we check "
                     f"the result by subtracting {b} from {a + b}, which gives back {a}.\n\n")
    steps[-1] += f"The answer is $\\boxed{{{rng.randint(1, 200)}}}$."
    return steps


def score_round(runtime: Runtime, tokenizer, workload) -> tuple[float, int]:
    """Seconds to score every problem's paths (the problems at once), and the tokens the verifier computed."""
    request("POST", runtime.url + "/flush_cache?timeout=60", timeout=60)
    scorer = make_scorer(ScorerConfig(kind="probe", runtime=runtime.config), runtime, tokenizer)
    computed, lock = [0], threading.Lock()

    def score(prompt, paths):
        counts = scorer.score_counted(prompt, paths).counts
        with lock:
            computed[0] += counts.input_tokens - counts.cached_tokens

    threads = [threading.Thread(target=score, args=item) for item in workload]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, computed[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    runtimes = {arm: Runtime.start(RuntimeConfig(model="smollm2-135m-probe", device="cpu", max_total_tokens=8192,
                                                 env={env_names.CPU_LINEAR: value}), name=f"probe-{arm}")
                for arm, value in ARMS.items()}
    try:
        tokenizer = AutoTokenizer.from_pretrained(next(iter(runtimes.values())).model_path)
        rng = random.Random(0)
        workload = [(chat_prompt(tokenizer, p.question), [solution(rng, p.question) for _ in range(args.samples)])
                    for p in graded_problems()[:args.problems]]
        rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for round_number in range(args.rounds):
            order = list(ARMS) if round_number % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                seconds, tokens = score_round(runtimes[arm], tokenizer, workload)
                rates[arm].append(tokens / seconds)
                print(f"round {round_number + 1} {arm:9s} {tokens} tokens in {seconds:.1f} s: "
                      f"{tokens / seconds:.0f} tok/s", flush=True)
    finally:
        for runtime in runtimes.values():
            runtime.stop()
    print(f"CPU: {cpu_summary()}; load average {os.getloadavg()[0]:.1f} at the end")
    for arm, values in rates.items():
        print(f"{arm:9s} median {statistics.median(values):6.0f} tok/s [{min(values):.0f}-{max(values):.0f}]")
    ratio = statistics.median(rates["live-rows"]) / statistics.median(rates["dense"])
    print(f"live-rows / dense: {ratio:.2f}x")


if __name__ == "__main__":
    main()
