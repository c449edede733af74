"""`sgl-tts bench runtime`: SGLang CPU runtime settings vs Hugging Face `generate`, measured side by side.

Every engine decodes the same prompts with the same model, greedily or (`--temperature T`, as the searches do)
sampled from the whole vocabulary at temperature T, for the same number of new tokens (end of sequence ignored),
at each parallel request count. Arms are SGLang runtimes that differ in server
arguments (`--arm NAME=ARGS`, e.g. `--arm "steps4=--num-continuous-decode-steps 4"`; leading `VAR=value` words
set the runtime's environment, as in a shell line: `--arm "t1=OMP_NUM_THREADS=1"`) plus HF `generate` as the
reference. All SGLang arms are started together and idle (`--sleep-on-idle`) while another arm runs; the arms
run one at a time, interleaved round by round, and the table prints each arm's median tokens/s with its
min-max over the rounds and the median of its per-round ratios to HF, and each SGLang arm's share of the
machine's ceiling for the engine: a roofline bound from the weights' bytes as the engine reads them (its 4- and
8-bit grids) over the measured memory read rate, and 2 FLOPs a parameter and token over the faster of the measured
fp32 and bf16 matmul rates (`MachineCeiling.engine_tokens_per_s`). Then a fork of 16 from one prompt on the first
arm reports the fraction of prompt tokens served from the radix cache.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from policies.step_timing import StepSplit, read_trace, step_split
from sgl_tts import env_names
from sgl_tts.measure.summary import median_range
from sgl_tts.measure.tables import Column, console_table
from sgl_tts.runtime.hardware import cpu_summary
from sgl_tts.runtime.http_client import request
from sgl_tts.runtime.server import http_json

HF_ARM = "hf"


@dataclass(frozen=True)
class RuntimeArm:
    """One SGLang runtime setting: a name, environment variables, and launch_server arguments added to the CPU
    defaults (later flags override earlier ones)."""

    name: str
    server_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def ranks(self) -> int:
        """SGLang's data-parallel ranks (`--dp-size`): each decodes its share of the parallel requests."""
        args = list(self.server_args)
        return int(args[args.index("--dp-size") + 1]) if "--dp-size" in args[:-1] else 1

    def describe(self) -> str:
        words = [f"{key}={value}" for key, value in self.env] + list(self.server_args)
        return shlex.join(words) or "(CPU defaults)"


def _prompts(tokenizer, count: int) -> list[str]:
    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.problems import builtin_problems

    questions = [p.question for p in builtin_problems()]
    return [chat_prompt(tokenizer, questions[i % len(questions)] + f" (variant {i})") for i in range(count)]


def sglang_tokens_per_s(url: str, prompts: list[str], new_tokens: int, temperature: float = 0.0) -> float:
    def one(prompt: str) -> int:
        answer = http_json(url + "/generate", {
            "text": prompt,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True},
        })
        return int(answer["meta_info"]["completion_tokens"])

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - began)


def left_padded(tokenizer, prompts: list[str]):
    """`prompts` as one left-padded batch (a decoder's new tokens follow every prompt's last token)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def hf_tokens_per_s(model, tokenizer, prompts: list[str], new_tokens: int, temperature: float = 0.0) -> float:
    import torch

    batch = left_padded(tokenizer, prompts)
    # sampled as SGLang samples: the whole vocabulary at `temperature` (HF's own default would cut it to top 50)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    began = time.perf_counter()
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                pad_token_id=tokenizer.pad_token_id, **sampling)
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


TORCH_ARM = "torch"  # the bare forward loop: the model's own forward at the batch, no engine around it


@dataclass(frozen=True)
class Sample:
    """One measurement of one arm at one parallel count."""

    tokens_per_s: float  # p requests of `new_tokens` each: tokens over wall time
    first_token_s: float  # p parallel requests of one new token each: the median request's latency


def flush_cache(url: str) -> None:
    request("POST", url + "/flush_cache?timeout=60", timeout=60)


def sglang_sample(url: str, prompts: list[str], new_tokens: int, temperature: float = 0.0) -> Sample:
    def latency(prompt: str) -> float:
        began = time.perf_counter()
        http_json(url + "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        return time.perf_counter() - began

    flush_cache(url)  # each measure prefills its prompts, as HF does: none reads another's cache
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        first = statistics.median(pool.map(latency, prompts))
    flush_cache(url)
    return Sample(sglang_tokens_per_s(url, prompts, new_tokens, temperature), first)


def hf_sample(model, tokenizer, prompts: list[str], new_tokens: int, temperature: float = 0.0) -> Sample:
    began = time.perf_counter()
    hf_tokens_per_s(model, tokenizer, prompts, 1)
    first = time.perf_counter() - began
    return Sample(hf_tokens_per_s(model, tokenizer, prompts, new_tokens, temperature), first)


def bare_forward_sample(model, tokenizer, prompts: list[str], new_tokens: int) -> Sample:
    """The ceiling an engine can reach with this model in torch: one prefill forward of the batch, then
    `new_tokens` one-token forwards with the KV cache and an argmax, nothing else (no sampling, no scheduling,
    no text). tokens_per_s counts the decode forwards only."""
    import torch

    batch = left_padded(tokenizer, prompts)
    mask = batch.attention_mask
    with torch.no_grad():
        began = time.perf_counter()
        out = model(**batch, use_cache=True)
        first = time.perf_counter() - began
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        began = time.perf_counter()
        for _ in range(new_tokens):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        elapsed = time.perf_counter() - began
    return Sample(len(prompts) * new_tokens / elapsed, first)


@dataclass(frozen=True)
class MachineCeiling:
    """What this machine's cores can do, measured with torch at the benchmark's thread count, and the
    roofline bound it puts on decoding a model: a decode step reads every weight once (bandwidth) and spends
    2 FLOPs per parameter per sequence (compute); the KV cache's reads are left out (small at these lengths)."""

    flops: float  # fp32 matmul, FLOP/s
    read_bandwidth: float  # bytes/s, a sum over an array far larger than the caches
    bf16_flops: float = 0.0  # bf16 matmul, FLOP/s (on AMX's tiles where the CPU has them); 0: not measured

    def decode_tokens_per_s(self, batch: int, parameters: int, bytes_per_parameter: int = 4) -> float:
        step_s = max(parameters * bytes_per_parameter / self.read_bandwidth, batch * 2 * parameters / self.flops)
        return batch / step_s

    def engine_tokens_per_s(self, batch: int, parameters: int, read_bytes: int) -> float:
        """The bound on a decode step that reads `read_bytes` (the weights as the engine keeps them: its grids,
        `grid_read_bytes`) and multiplies at the faster of the two measured matmul rates (the engine's products
        above a few rows are bf16 on a CPU with AMX): the ceiling the runtime's own arithmetic is held to."""
        step_s = max(read_bytes / self.read_bandwidth, batch * 2 * parameters / max(self.flops, self.bf16_flops))
        return batch / step_s


def measure_machine(repeats: int = 5) -> MachineCeiling:
    import torch

    a = torch.randn(2048, 2048)
    half = a.bfloat16()
    big = torch.ones(128 * 2**20)  # 512 MiB
    best_mm = best_half = best_read = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        a @ a
        best_mm = min(best_mm, time.perf_counter() - began)
        began = time.perf_counter()
        half @ half
        best_half = min(best_half, time.perf_counter() - began)
        began = time.perf_counter()
        big.sum()
        best_read = min(best_read, time.perf_counter() - began)
    return MachineCeiling(2 * 2048**3 / best_mm, big.numel() * big.element_size() / best_read, 2 * 2048**3 / best_half)


def grid_read_bytes(weights: Iterable[Any]) -> int:
    """The bytes a one-row decode step reads from `weights` (fp32 tensors: the ones a step reads, each once) as the
    grid products read them (policies/cpu_linear.py): a weight on a 4- or 8-bit grid as its tiles (`grid_tiles`: q,
    and fp16 d and m or d per group), any other as stored (norms, weights on no grid)."""
    from policies.cpu_linear import grid_tiles

    total = 0
    for weight in weights:
        tiles = grid_tiles(weight)
        total += sum(part.numel() * part.element_size() for part in (tiles or (weight,)))
    return total


def step_weights(model: Any) -> list[Any]:
    """The parameters of a transformers model a decode step reads whole: all but an input embedding that is not
    also the LM head (a step reads one row of it); tied ones once."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return [parameter for parameter in model.parameters() if parameter is not embedding or embedding is head]


def machine_line(ceiling: MachineCeiling, parameters: int, parallel: Sequence[int],
                 grid_bytes: int | None = None) -> str:
    """The machine's ceilings and the roofline bounds they put on decoding: for fp32 parameters at each parallel
    count and, given `grid_bytes` (`grid_read_bytes`), for the engine's own weights and arithmetic
    (`MachineCeiling.engine_tokens_per_s`)."""
    bound = ", ".join(f"{p}: {ceiling.decode_tokens_per_s(p, parameters):.0f}" for p in parallel)
    as_read = "" if grid_bytes is None else (
        f"; as the engine reads them ({grid_bytes / 1e6:.0f} MB a step, its grids) and multiplies (the faster "
        f"matmul), tok/s at " + ", ".join(f"{p}: {ceiling.engine_tokens_per_s(p, parameters, grid_bytes):.0f}"
                                           for p in parallel))
    return (f"machine: {cpu_summary()}; torch {torch_threads()} threads: fp32 matmul {ceiling.flops / 1e9:.0f} "
            f"GFLOP/s, bf16 matmul {ceiling.bf16_flops / 1e9:.0f} GFLOP/s, memory read "
            f"{ceiling.read_bandwidth / 1e9:.1f} GB/s; roofline decode bound for {parameters / 1e6:.0f}M fp32 "
            f"parameters, tok/s at {bound}{as_read}")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def step_column(split: StepSplit | None) -> str:
    if split is None:
        return "-"
    return (f"{split.step_s * 1e3:.0f} ms: {split.share(split.forward_s):.0%} / {split.share(split.sampling_s):.0%}"
            f" / {split.share(split.around_s):.0%}")


BENCH_COLUMNS = (Column("parallel"), Column("arm"), Column("tok/s median [min-max]"), Column("vs hf"),
                 Column("of torch loop"), Column("of engine bound"), Column("first token s"),
                 Column("decode step: forward / sampling / loop", align="<"))


def bench_table(samples: dict[tuple[str, int], list[Sample]], splits: dict[tuple[str, int], StepSplit | None],
                bounds: dict[int, float] | None = None) -> str:
    """The bench's table; `bounds`: the engine's roofline bound in tok/s at each parallel count
    (`MachineCeiling.engine_tokens_per_s`), each SGLang arm's rounds as shares of it."""
    rates = {key: [sample.tokens_per_s for sample in values] for key, values in samples.items()}
    rows = []
    for p, arm, rate, vs_hf in summary_rows(rates, HF_ARM):
        torch_rates = rates.get((TORCH_ARM, p))
        of_torch = ("-" if torch_rates is None or arm == TORCH_ARM else
                    median_range([a / b for a, b in zip(rates[arm, p], torch_rates)], ".2f", suffix="x"))
        bound = (bounds or {}).get(p)
        of_bound = ("-" if bound is None or arm in (HF_ARM, TORCH_ARM) else
                    median_range([value / bound for value in rates[arm, p]], ".2f"))
        first = median_range([sample.first_token_s for sample in samples[arm, p]], ".2f")
        rows.append([str(p), arm, rate, vs_hf, of_torch, of_bound, first, step_column(splits.get((arm, p)))])
    return console_table(BENCH_COLUMNS, rows)


def run_bench(*, model: str = "smollm2-135m", new_tokens: int = 64, parallel: Sequence[int] = (1, 8, 16, 64),
              repeats: int = 3, arms: Sequence[RuntimeArm] | None = None, threads: int | None = None,
              max_total_tokens: int = 16384, temperature: float = 0.0, hf_dtype: str = "float32") -> int:
    """Start every arm's runtime (`arms`, default one arm 'default' with the CPU defaults), then measure each
    arm, HF generate and the bare torch forward loop at each parallel request count, `repeats` interleaved
    rounds; print the machine's ceiling, the table (tokens/s, ratios to HF and to the torch loop, share of the
    engine's bound, time to first token, the decode step's split from the scheduler's own step trace) and the fork
    cache check. HF and the torch loop run the model in `hf_dtype` (float32, or bfloat16 to hold bf16 arms against a
    bf16 model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_tts.runtime.server import Runtime, RuntimeConfig, RuntimeStartError

    parallel = list(parallel)
    arms = list(arms or [RuntimeArm("default", ())])
    if len({arm.name for arm in arms}) != len(arms) or {arm.name for arm in arms} & {HF_ARM, TORCH_ARM}:
        raise SystemExit(f"bench runtime: arm names must differ from each other and from {HF_ARM!r} and "
                         f"{TORCH_ARM!r}, got {[arm.name for arm in arms]}")
    if threads:
        torch.set_num_threads(threads)
    base = RuntimeConfig(model=model, device="cpu", cpu_threads=threads, max_total_tokens=max_total_tokens)
    print(f"bench runtime: model={model} new_tokens={new_tokens} temperature={temperature} parallel={parallel} "
          f"repeats={repeats} "
          f"arms={[arm.name for arm in arms]} + {HF_ARM}, {TORCH_ARM}; {_load()}", flush=True)
    trace_dir = Path(tempfile.mkdtemp(prefix="sgl-tts-step-trace-"))
    traces = {arm.name: trace_dir / f"{arm.name}.jsonl" for arm in arms}
    runtimes: dict[str, Runtime] = {}
    try:
        for arm in arms:  # start every process first, then wait: start-ups overlap
            env = {env_names.STEP_TRACE: str(traces[arm.name]), **dict(arm.env)}
            config = dataclasses.replace(base, extra_args=list(arm.server_args), env=env)
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
        hf_model = AutoModelForCausalLM.from_pretrained(first.model_path, dtype=getattr(torch, hf_dtype))
        hf_model.eval()
        parameters = sum(parameter.numel() for parameter in hf_model.parameters())
        fp32_model = hf_model if hf_dtype == "float32" else AutoModelForCausalLM.from_pretrained(
            first.model_path, dtype=torch.float32)  # grids are found on fp32 weights (bf16 ones are off them)
        grid_bytes = grid_read_bytes(step_weights(fp32_model))
        del fp32_model
        ceiling = measure_machine()
        print(machine_line(ceiling, parameters, parallel, grid_bytes), flush=True)
        bounds = {p: ceiling.engine_tokens_per_s(p, parameters, grid_bytes) for p in parallel}
        measures: dict[str, Callable[[int], Sample]] = {}
        for name, runtime in runtimes.items():
            sglang_tokens_per_s(runtime.url, prompts[:2], 4)  # warm-up
            measures[name] = lambda p, url=runtime.url: sglang_sample(url, prompts[:p], new_tokens, temperature)
        hf_tokens_per_s(hf_model, tokenizer, prompts[:1], 4)  # warm-up
        measures[HF_ARM] = lambda p: hf_sample(hf_model, tokenizer, prompts[:p], new_tokens, temperature)
        measures[TORCH_ARM] = lambda p: bare_forward_sample(hf_model, tokenizer, prompts[:p], new_tokens)

        def show(round_index: int, arm: str, p: int, sample: Sample) -> None:
            print(f"  round {round_index + 1} {arm:>10s} x{p}: {sample.tokens_per_s:.1f} tok/s, first token "
                  f"{sample.first_token_s:.2f} s", flush=True)

        samples = interleaved(measures, parallel, repeats, show)
        cache_fraction = fork_cache_fraction(first, prompts[0])
    finally:
        for runtime in runtimes.values():
            runtime.stop()
    splits = {(arm.name, p): step_split(read_trace(str(traces[arm.name])), max(1, p // arm.ranks))
              if traces[arm.name].exists() else None for arm in arms for p in parallel}
    print()
    print(bench_table(samples, splits, bounds))
    for arm in arms:
        print(f"  {arm.name}: {arm.describe()}")
    decoding = f"sampled at temperature {temperature}" if temperature > 0 else "greedy"
    print(f"  {HF_ARM}: transformers generate, {hf_dtype}, {decoding}, in this process; {TORCH_ARM}: the model's "
          f"{hf_dtype} forward in a loop "
          f"with its KV cache and an argmax (decode tokens only); decode step: the median scheduler step at that "
          f"batch, the model's forward / sampling and output / the scheduler loop around them")
    print(f"fork of 16 on {arms[0].name}: {cache_fraction:.0%} of the branches' prompt tokens served from the "
          f"radix cache; {_load()}")
    return 0
