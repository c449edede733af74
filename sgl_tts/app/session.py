"""A run's configuration and the session that owns its runtimes.

`Session(config)` starts the generator runtime and, when the scorer has a runtime of its own, the scorer
runtime, and, when `target` is a runtime config, the target runtime (RSD's target model); all co-located,
each with its own token budget. Then it solves problems with the configured program.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from sgl_tts.config import find_config, load_yaml
from sgl_tts.fasttts.speculation import HttpSpeculationClient, extension_factory
from sgl_tts.fasttts.switches import FastTTSConfig, configure_runtimes
from sgl_tts.search.records import SearchResult
from sgl_tts.search.programs import load_program
from sgl_tts.rsd.acceptance import RSDConfig
from sgl_tts.runtime.replicas import ReplicaSet
from sgl_tts.runtime.server import Runtime, RuntimeConfig, share_cpu_cores
from sgl_tts.scoring.config import ScorerConfig
from sgl_tts.scoring.factory import make_scorer
from sgl_tts.search.api import Runtimes, SearchConfig, SearchError, fill_in_counts

DETERMINISTIC_FLAG = "--enable-deterministic-inference"  # SGLang honours per-request sampling_seed only with it


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "builtin"  # builtin, aime24, amc23, math500, gsm8k, or a JSONL path
    limit: int | None = None
    offset: int = 0


@dataclass(frozen=True)
class RunConfig:
    generator: RuntimeConfig = field(default_factory=RuntimeConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    concurrency: int = 4  # problems searched at once (their beams share the runtimes' batches)
    log_dir: str | None = None
    # RSD's target model: its own runtime, or "generator" to let the generator's runtime (the draft) serve it.
    target: RuntimeConfig | Literal["generator"] | None = None
    rsd: RSDConfig = field(default_factory=RSDConfig)  # read by the rsd program
    fasttts: FastTTSConfig = field(default_factory=FastTTSConfig)  # switches P, M, S (sgl_tts.fasttts.switches)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.search.program == "rsd":
            if self.target is None:
                raise ValueError("search.program 'rsd' needs 'target': a runtime config for the target model, "
                                 "or 'generator' to let the generator's runtime serve as the target")
            # RSD's step loop settings live in the rsd section; refuse them where they would be ignored.
            defaults = SearchConfig()
            for name in ("max_steps", "temperature", "top_p", "step_delimiter"):
                if getattr(self.search, name) != getattr(defaults, name):
                    raise ValueError(f"program 'rsd' reads {name} from the rsd section: "
                                     f"set 'rsd.{name}' instead of 'search.{name}'")


RUN_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # sgl_tts/configs: package data


def load_run_config(path: str | Path) -> RunConfig:
    """Load a run config from `path`, or, when no such relative path exists, the packaged config of that name."""
    return load_yaml(RunConfig, find_config(path, RUN_CONFIGS))


def planned_runtimes(config: RunConfig) -> tuple[Any, dict[str, RuntimeConfig]]:
    """The runtimes a session of `config` starts, with the FastTTS settings applied (the generator's policy
    and priority scheduling, the KV split with the scorer) and the CPU cores split between them."""
    wanted = {"generator": config.generator}
    if config.scorer.runtime is not None:
        wanted["scorer"] = config.scorer.runtime
    if isinstance(config.target, RuntimeConfig):
        wanted["target"] = config.target
    # One KV split of the scorer and target runtimes with the generator's. RSD decodes one path per problem,
    # so its step holds `concurrency` paths.
    paths = config.concurrency if config.search.program == "rsd" else None
    settings = configure_runtimes(config.fasttts, config.search, wanted["generator"], wanted.get("scorer"),
                                  wanted.get("target"), paths)
    wanted["generator"] = settings.generator
    if settings.verifier is not None:
        wanted["scorer"] = settings.verifier
    if settings.target is not None:
        wanted["target"] = settings.target
    return settings, share_cpu_cores(wanted)


class Session:
    """Owns the runtimes of one run. Use as a context manager so they are always stopped."""

    def __init__(self, config: RunConfig, reuse: dict[str, Runtime] | None = None):
        """`reuse`: started runtimes (from `detach`) to keep where the new config wants the same settings;
        the others are stopped."""
        self.config = config
        self._reuse = dict(reuse or {})
        self.program = load_program(config.search.program)
        self.runtimes: dict[str, Runtime] = {}
        self.started_s = 0.0
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from sgl_tts.frontend.backend import TTSEndpoint, chat_prompt

        began = time.monotonic()
        log_dir = self.config.log_dir
        self.fasttts, wanted = planned_runtimes(self.config)
        # Start all processes first, then wait: start-ups overlap.
        for name, runtime_config in wanted.items():
            previous = self._reuse.pop(name, None)
            if previous is not None and previous.config == runtime_config and previous.alive():
                self.runtimes[name] = previous
                continue
            if previous is not None:
                previous.stop()
            starter = ReplicaSet.start if runtime_config.routed else Runtime.start
            self.runtimes[name] = starter(runtime_config, name=name, log_dir=log_dir, wait=False)
        for unused in self._reuse.values():
            unused.stop()
        self._reuse.clear()
        for runtime in self.runtimes.values():
            runtime.wait_ready()
        self.started_s = time.monotonic() - began
        generator = self.runtimes["generator"]
        scorer_runtime = self.runtimes.get("scorer", generator)
        tokenizer = AutoTokenizer.from_pretrained(generator.model_path)
        scorer_tokenizer = (tokenizer if scorer_runtime is generator
                            else AutoTokenizer.from_pretrained(scorer_runtime.model_path))
        self.tokenizer = tokenizer
        fast = self.config.fasttts
        self.search_runtimes = Runtimes(
            generator=TTSEndpoint(
                generator, standard_priority=fast.standard_priority if fast.speculative else None,
                send_seed=DETERMINISTIC_FLAG in generator.config.extra_args,
                extension_factory=extension_factory(fast, HttpSpeculationClient(generator, fast.engine_batch),
                                                    tokenizer, fast.seed) if fast.speculative else None),
            scorer=make_scorer(self.config.scorer, scorer_runtime, scorer_tokenizer),
            prompt=lambda question: chat_prompt(tokenizer, question),
        )
        target = self.runtimes.get("target", generator if self.config.target == "generator" else None)
        if target is not None:
            # Steps pass as text: the target gets its own prompt, in its own chat format.
            target_tokenizer = (tokenizer if target.model_path == generator.model_path
                                else AutoTokenizer.from_pretrained(target.model_path))
            self.search_runtimes.target = TTSEndpoint(target, send_seed=DETERMINISTIC_FLAG in target.config.extra_args)
            self.search_runtimes.extras["target_prompt"] = lambda question: chat_prompt(target_tokenizer, question)
        self.search_runtimes.extras["rsd"] = self.config.rsd

    def solve(self, problem: Any, search: SearchConfig | None = None) -> SearchResult:
        """One search with `search` (default: the config's), whose `program` it runs. Its runtimes are a per-run
        view (`Runtimes.for_run`): every generator request it sends is counted, so a program that counts
        nothing itself still reports the server's token counts."""
        search = search or self.config.search
        program = self.program if search.program == self.config.search.program else load_program(search.program)
        runtimes = self.search_runtimes.for_run(search.seed, str(problem.id))
        return fill_in_counts(program(problem, search, runtimes), runtimes.ledger)

    def solve_all(self, problems: Iterable[Any], on_result: Callable[[Any, SearchResult], None] | None = None,
                  search: Callable[[Any], SearchConfig] | None = None) -> Iterator[tuple[Any, SearchResult]]:
        """Solve problems `concurrency` at a time (each with `search(problem)`, default the config's search);
        yields (problem, result) as each finishes, in order. A search that failed mid-way (`SearchError`)
        yields its partial result, whose `error` says what failed."""
        problems = list(problems)
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            futures = [pool.submit(self.solve, p, search(p) if search else None) for p in problems]
            for problem, future in zip(problems, futures):
                try:
                    result = future.result()
                except SearchError as exc:
                    result = exc.result
                if on_result is not None:
                    on_result(problem, result)
                yield problem, result

    def close(self) -> None:
        for runtime in [*self.runtimes.values(), *self._reuse.values()]:
            runtime.stop()
        self.runtimes.clear()
        self._reuse.clear()

    def detach(self) -> dict[str, Runtime]:
        """Hand over the running runtimes (for `Session(..., reuse=...)`) instead of stopping them."""
        runtimes, self.runtimes = self.runtimes, {}
        return runtimes

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
