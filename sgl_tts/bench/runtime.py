"""`sgl-tts bench runtime`: SGLang CPU runtime settings vs Hugging Face `generate`, measured side by side.

Every engine decodes the same prompts with the same model, greedily, for the same number of new tokens (end
of sequence ignored), at each parallel request count. Arms are SGLang runtimes that differ in server
arguments (`--arm NAME=ARGS`, e.g. `--arm "steps4=--num-continuous-decode-steps 4"`; leading `VAR=value` words
set the runtime's environment, as in a shell line: `--arm "t1=OMP_NUM_THREADS=1"`) plus HF `generate` as the
reference. All SGLang arms are started together and idle (`--sleep-on-idle`) while another arm runs; the arms
run one at a time, interleaved round by round, and the table prints each arm's median tokens/s with its
min-max over the rounds and the median of its per-round ratios to HF. Then a fork of 16 from one prompt on
the first arm reports the fraction of prompt tokens served from the radix cache.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from sgl_tts.measure.summary import median_range
from sgl_tts.measure.tables import Column, console_table
from sgl_tts.runtime.server import http_json

HF_ARM = "hf"


@dataclass(frozen=True)
class RuntimeArm:
    """One SGLang runtime setting: a name, environment variables, and launch_server arguments added to the CPU
    defaults (later flags override earlier ones)."""

    name: str
    server_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        words = [f"{key}={value}" for key, value in self.env] + list(self.server_args)
        return shlex.join(words) or "(CPU defaults)"


def _prompts(tokenizer, count: int) -> list[str]:
    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.problems import builtin_problems

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


def interleaved(measures: dict[str, Callable[[int], float]], parallel: list[int], repeats: int,
                on_sample: Callable[[int, str, int, float], None] | None = None) -> dict[tuple[str, int], list[float]]:
    """Run every (arm, parallel) measure `repeats` times, round by round: each round runs every arm once per
    parallel count, arms in turn (their order rotates by one each round, so no arm always runs first).
    Returns the samples of each (arm, parallel) in round order."""
    samples: dict[tuple[str, int], list[float]] = {(arm, p): [] for arm in measures for p in parallel}
    names = list(measures)
    for round_index in range(repeats):
        shift = round_index % len(names)
        for p in parallel:
            for arm in names[shift:] + names[:shift]:
                value = measures[arm](p)
                samples[arm, p].append(value)
                if on_sample is not None:
                    on_sample(round_index, arm, p, value)
    return samples


def summary_rows(samples: dict[tuple[str, int], list[float]], reference: str) -> list[tuple[int, str, str, str]]:
    """(parallel, arm, tok/s median [min-max], ratio to `reference`: median [min-max] of per-round ratios)."""
    rows = []
    for (arm, p), values in samples.items():
        ref = samples.get((reference, p))
        if ref is None or arm == reference:
            ratio = "-"
        else:
            ratio = median_range([a / b for a, b in zip(values, ref)], ".2f", suffix="x")
        rows.append((p, arm, median_range(values), ratio))
    return sorted(rows, key=lambda row: row[0])


TABLE_COLUMNS = (Column("parallel", 8), Column("arm", 10), Column("tok/s median [min-max]", 24),
                 Column("vs hf: median [min-max]", 26))


def format_table(samples: dict[tuple[str, int], list[float]], reference: str) -> str:
    return console_table(TABLE_COLUMNS, [[str(p), arm, rate, ratio] for p, arm, rate, ratio
                                         in summary_rows(samples, reference)])


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def run_bench(*, model: str = "smollm2-135m", new_tokens: int = 64, parallel: Sequence[int] = (1, 16, 64),
              repeats: int = 3, arms: Sequence[RuntimeArm] | None = None, threads: int | None = None,
              max_total_tokens: int = 16384) -> int:
    """Start every arm's runtime (`arms`, default one arm 'default' with the CPU defaults), measure tokens/s
    against HF generate at each parallel request count, `repeats` interleaved rounds; print the table."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_tts.runtime.server import Runtime, RuntimeConfig, RuntimeStartError

    parallel = list(parallel)
    arms = list(arms or [RuntimeArm("default", ())])
    if len({arm.name for arm in arms}) != len(arms):
        raise SystemExit(f"bench runtime: arm names must differ, got {[arm.name for arm in arms]}")
    base = RuntimeConfig(model=model, device="cpu", cpu_threads=threads, max_total_tokens=max_total_tokens)
    print(f"bench runtime: model={model} new_tokens={new_tokens} parallel={parallel} "
          f"repeats={repeats} arms={[arm.name for arm in arms]} + {HF_ARM}; {_load()}", flush=True)
    runtimes: dict[str, Runtime] = {}
    try:
        for arm in arms:  # start every process first, then wait: start-ups overlap
            config = dataclasses.replace(base, extra_args=list(arm.server_args), env=dict(arm.env))
            runtimes[arm.name] = Runtime.start(config, name=f"bench-{arm.name}", wait=False)
        for name, runtime in list(runtimes.items()):
            try:
                runtime.wait_ready()
            except RuntimeStartError as exc:  # a setting SGLang refuses is a result too; the other arms go on
                print(f"  arm {name} did not start: {str(exc).splitlines()[-1]}", flush=True)
                del runtimes[name]
        if not runtimes:
            print("bench runtime: no arm started")
            return 1
        arms = [arm for arm in arms if arm.name in runtimes]
        first = runtimes[arms[0].name]
        tokenizer = AutoTokenizer.from_pretrained(first.model_path)
        prompts = _prompts(tokenizer, max(parallel))
        hf_model = AutoModelForCausalLM.from_pretrained(first.model_path, dtype=torch.float32)
        hf_model.eval()
        measures: dict[str, Callable[[int], float]] = {}
        for name, runtime in runtimes.items():
            sglang_tokens_per_s(runtime.url, prompts[:2], 4)  # warm-up
            measures[name] = lambda p, url=runtime.url: sglang_tokens_per_s(url, prompts[:p], new_tokens)
        hf_tokens_per_s(hf_model, tokenizer, prompts[:1], 4)  # warm-up
        measures[HF_ARM] = lambda p: hf_tokens_per_s(hf_model, tokenizer, prompts[:p], new_tokens)

        def show(round_index: int, arm: str, p: int, value: float) -> None:
            print(f"  round {round_index + 1} {arm:>10s} x{p}: {value:.1f} tok/s", flush=True)

        samples = interleaved(measures, parallel, repeats, show)
        cache_fraction = fork_cache_fraction(first, prompts[0])
    finally:
        for runtime in runtimes.values():
            runtime.stop()
    print()
    print(format_table(samples, HF_ARM))
    for arm in arms:
        print(f"  {arm.name}: {arm.describe()}")
    print(f"fork of 16 on {arms[0].name}: {cache_fraction:.0%} of the branches' prompt tokens served from the "
          f"radix cache; {_load()}")
    return 0
