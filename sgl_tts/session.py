"""A run's configuration and the session that owns its runtimes.

`Session(config)` starts the generator runtime and, when the scorer has a runtime of its own, the scorer
runtime (co-located, each with its own token budget), then solves problems with the configured program.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from sgl_tts.config import load_yaml
from sgl_tts.records import SearchResult
from sgl_tts.registry import load_program
from sgl_tts.runtime import Runtime, RuntimeConfig
from sgl_tts.scoring import ScorerConfig, make_scorer
from sgl_tts.search import Runtimes, SearchConfig

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

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")


def load_run_config(path: str | Path) -> RunConfig:
    return load_yaml(RunConfig, path)


class Session:
    """Owns the runtimes of one run. Use as a context manager so they are always stopped."""

    def __init__(self, config: RunConfig):
        self.config = config
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

        from sgl_tts.backend import TTSEndpoint, chat_prompt

        began = time.monotonic()
        log_dir = self.config.log_dir
        wanted = {"generator": self.config.generator}
        if self.config.scorer.runtime is not None:
            wanted["scorer"] = self.config.scorer.runtime
        # Start all processes first, then wait: start-ups overlap.
        for name, runtime_config in wanted.items():
            self.runtimes[name] = Runtime.start(runtime_config, name=name, log_dir=log_dir, wait=False)
        for runtime in self.runtimes.values():
            runtime.wait_ready()
        self.started_s = time.monotonic() - began
        generator = self.runtimes["generator"]
        scorer_runtime = self.runtimes.get("scorer", generator)
        tokenizer = AutoTokenizer.from_pretrained(generator.model_path)
        scorer_tokenizer = (tokenizer if scorer_runtime is generator
                            else AutoTokenizer.from_pretrained(scorer_runtime.model_path))
        self.tokenizer = tokenizer
        self.search_runtimes = Runtimes(
            generator=TTSEndpoint(generator),
            scorer=make_scorer(self.config.scorer, scorer_runtime, scorer_tokenizer),
            prompt=lambda question: chat_prompt(tokenizer, question),
        )

    def solve(self, problem: Any, search: SearchConfig | None = None) -> SearchResult:
        return self.program(problem, search or self.config.search, self.search_runtimes)

    def solve_all(self, problems: Iterable[Any], on_result: Callable[[Any, SearchResult], None] | None = None
                  ) -> Iterator[tuple[Any, SearchResult]]:
        """Solve problems `concurrency` at a time; yields (problem, result) as each finishes, in order."""
        problems = list(problems)
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            futures = [pool.submit(self.solve, p) for p in problems]
            for problem, future in zip(problems, futures):
                result = future.result()
                if on_result is not None:
                    on_result(problem, result)
                yield problem, result

    def close(self) -> None:
        for runtime in self.runtimes.values():
            runtime.stop()
        self.runtimes.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
