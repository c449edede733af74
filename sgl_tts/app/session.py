"""A run's configuration and the session that owns its runtimes.

`Session(config)` starts the generator runtime and, when the scorer has a runtime of its own, the scorer
runtime, and, when `target` is a runtime config, the target runtime (RSD's target model); all co-located,
each with its own token budget. Then it solves problems with the configured program.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from sgl_tts.config import ConfigError, find_config, load_yaml
from sgl_tts.fasttts.speculation import HttpSpeculationClient, extension_factory
from sgl_tts.fasttts.switches import FastTTSConfig, configure_runtimes
from sgl_tts.search.records import SearchResult
from sgl_tts.search.programs import load_program, program_decoded_paths, program_runtimes, with_program_settings
from sgl_tts.runtime.replicas import ReplicaSet
from sgl_tts.runtime.server import Runtime, RuntimeConfig, share_cpu_cores
from sgl_tts.scoring.scorer_config import ScorerConfig
from sgl_tts.scoring.factory import make_scorer
from sgl_tts.scoring.probe import generator_with_probe
from sgl_tts.search.api import Runtimes, SearchConfig, SearchError
from sgl_tts.search.context import SearchContext
from sgl_tts.search.limits import Limits, check_limits

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
    # A second model for programs that need one (RSD's target): its own runtime, or "generator" to let the
    # generator's runtime serve it.
    target: RuntimeConfig | Literal["generator"] | None = None
    fasttts: FastTTSConfig = field(default_factory=FastTTSConfig)  # switches P, M, S (sgl_tts.fasttts.switches)
    limits: Limits = field(default_factory=Limits)  # upper bounds of a search and of a served request

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        check_limits(self.search, self.limits, "search.")


RUN_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # sgl_tts/configs: package data

# What the run config must set for each runtime a program may need (sgl_tts.search.programs.RUNTIME_NAMES).
RUNTIME_SECTIONS = {
    "scorer": "the step scorer",
    "target": "a runtime config for the target model, or 'generator' to let the generator's runtime serve as "
              "the target",
}


def checked_program(config: RunConfig, where: str = "run config",
                    settings_key: str = "search.settings") -> RunConfig:
    """`config` with `search.settings` made its program's `Settings` (errors name `settings_key.<field>` and
    `where`), after checking that `config` sets every runtime the program needs."""
    search = with_program_settings(config.search, where, settings_key)
    for name in program_runtimes(search.program):
        if getattr(config, name) is None:
            raise ConfigError(f"{where}: program {search.program!r} needs {name!r}: {RUNTIME_SECTIONS[name]}")
    return dataclasses.replace(config, search=search)


def load_run_config(path: str | Path) -> RunConfig:
    """Load a run config from `path`, or, when no such relative path exists, the packaged config of that name;
    its program's settings and runtimes are checked (`checked_program`)."""
    path = find_config(path, RUN_CONFIGS)
    return checked_program(load_yaml(RunConfig, path), str(path))


def planned_runtimes(config: RunConfig) -> tuple[Any, dict[str, RuntimeConfig]]:
    """The runtimes a session of `config` starts, with the FastTTS settings applied (the generator's policy
    and priority scheduling, the KV split with the scorer) and the CPU cores split between them."""
    wanted = {"generator": generator_with_probe(config.generator, config.scorer)}
    if config.scorer.runtime is not None:
        wanted["scorer"] = config.scorer.runtime
    if isinstance(config.target, RuntimeConfig):
        wanted["target"] = config.target
    # One KV split of the scorer and target runtimes with the generator's, for the paths one step decodes.
    paths = program_decoded_paths(config.search.program, config.search, config.concurrency)
    settings = configure_runtimes(config.fasttts, config.search, wanted["generator"], wanted.get("scorer"),
                                  wanted.get("target"), paths, searches=config.concurrency)
    wanted["generator"] = settings.generator
    if settings.verifier is not None:
        wanted["scorer"] = settings.verifier
    if settings.target is not None:
        wanted["target"] = settings.target
    return settings, share_cpu_cores(wanted)


def start_runtime(config: RuntimeConfig, name: str, log_dir: str | None, wait: bool = True) -> Any:
    """One runtime of `config`: a server, or replicas behind SGLang's router when the config routes."""
    starter = ReplicaSet.start if config.routed else Runtime.start
    return starter(config, name=name, log_dir=log_dir, wait=wait)


class Session:
    """Owns the runtimes of one run. Use as a context manager so they are always stopped."""

    def __init__(self, config: RunConfig, reuse: dict[str, Runtime] | None = None):
        """`reuse`: started runtimes (from `detach`) to keep where the new config wants the same settings;
        the others are stopped."""
        self.config = config = checked_program(config)
        self._reuse = dict(reuse or {})
        self.program = load_program(config.search.program)
        self.runtimes: dict[str, Runtime] = {}
        self.reused: list[str] = []  # the runtimes kept from `reuse`
        self.started_s = 0.0
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        from transformers import AutoTokenizer

        began = time.monotonic()
        log_dir = self.config.log_dir
        self.fasttts, wanted = planned_runtimes(self.config)
        # Start all processes first, then wait: start-ups overlap.
        for name, runtime_config in wanted.items():
            previous = self._reuse.pop(name, None)
            if previous is not None and previous.config == runtime_config and previous.alive():
                self.runtimes[name] = previous
                self.reused.append(name)
                continue
            if previous is not None:
                previous.stop()
            self.runtimes[name] = start_runtime(runtime_config, name, log_dir, wait=False)
        for unused in self._reuse.values():
            unused.stop()
        self._reuse.clear()
        for runtime in self.runtimes.values():
            runtime.wait_ready()
        self.started_s = time.monotonic() - began
        generator = self.runtimes["generator"]
        scorer_runtime = self.runtimes.get("scorer", generator)
        tokenizer = AutoTokenizer.from_pretrained(generator.model_path)
        self.tokenizer = tokenizer
        self._scorer_tokenizer = (tokenizer if scorer_runtime is generator
                                  else AutoTokenizer.from_pretrained(scorer_runtime.model_path))
        target = self.runtimes.get("target", generator if self.config.target == "generator" else None)
        # Steps pass as text: the target gets its own prompt, in its own chat format.
        self._target_tokenizer = (None if target is None else tokenizer if target.model_path == generator.model_path
                                  else AutoTokenizer.from_pretrained(target.model_path))
        self.search_runtimes = self._connect()

    def _connect(self) -> Runtimes:
        """The search runtimes on `self.runtimes`: endpoints, scorer and speculation client each hold the runtime
        object (and so its URL) they were made with."""
        from sgl_tts.frontend.backend import ChatPrompt, TTSEndpoint

        generator = self.runtimes["generator"]
        scorer_runtime = self.runtimes.get("scorer", generator)
        tokenizer, fast = self.tokenizer, self.config.fasttts
        search_runtimes = Runtimes(
            generator=TTSEndpoint(
                generator, standard_priority=fast.standard_priority if fast.speculative else None,
                send_seed=DETERMINISTIC_FLAG in generator.config.extra_args),
            scorer=make_scorer(self.config.scorer, scorer_runtime, self._scorer_tokenizer),
            prompt=ChatPrompt(tokenizer),
            extension_factory=extension_factory(fast, HttpSpeculationClient(generator, self.fasttts.engine_batch),
                                                tokenizer, fast.seed) if fast.speculative else None,
        )
        target = self.runtimes.get("target", generator if self.config.target == "generator" else None)
        if target is not None:
            search_runtimes.target = TTSEndpoint(target, send_seed=DETERMINISTIC_FLAG in target.config.extra_args)
            search_runtimes.target_prompt = ChatPrompt(self._target_tokenizer)
        return search_runtimes

    @property
    def scorer_tokenizer(self) -> Any:
        """The tokenizer of the scorer's runtime (the generator's when the scorer reads from it)."""
        return self._scorer_tokenizer

    def restart(self, name: str) -> None:
        """Replace runtime `name` (dead, say) by a new server of the same config and name, and point the search
        runtimes at it: the endpoints, scorer and speculation client are made anew and swapped into the same
        `search_runtimes` object, so whoever holds it (a server's SearchService) sends its next search to the new
        server. Searches in flight on the old one fail with a runtime error. Raises what the start raises."""
        old = self.runtimes[name]
        old.stop()
        self.runtimes[name] = start_runtime(old.config, name, self.config.log_dir)
        fresh = self._connect()
        for item in dataclasses.fields(Runtimes):
            setattr(self.search_runtimes, item.name, getattr(fresh, item.name))

    def new_search(self, problem: Any, search: SearchConfig | None = None, **observers: Any) -> SearchContext:
        """The context of one search of `problem` (`Runtimes.new_search`; `observers`, `scoring_observers`)."""
        return self.search_runtimes.new_search(search or self.config.search, str(problem.id), **observers)

    def solve(self, problem: Any, search: SearchConfig | None = None,
              context: SearchContext | None = None) -> SearchResult:
        """One search with `search` (default: the config's), whose `program` it runs, in `context` (default: a new
        one). The program runs bound to the context (`sgl_tts.search.programs.load_program`): every generator
        request it sends is counted in the context's ledger and the result carries those counts, whatever the
        program counts or makes itself; a program whose result counts tokens the search never saw fails
        (`UnaccountedProgram`, naming the program and what to change)."""
        search = search or self.config.search
        program = self.program if search.program == self.config.search.program else load_program(search.program)
        return program(problem, search, self.search_runtimes, context or self.new_search(problem, search))

    def solve_all(self, problems: Iterable[Any], on_result: Callable[[Any, SearchResult], None] | None = None,
                  search: Callable[[Any], SearchConfig] | None = None,
                  concurrency: int | None = None) -> Iterator[tuple[Any, SearchResult]]:
        """Solve problems `concurrency` (default the config's) at a time, each with `search(problem)` (default the
        config's search); yields (problem, result) as each finishes, in order. A search that failed mid-way
        (`SearchError`) yields its partial result, whose `error` says what failed."""
        problems = list(problems)
        with ThreadPoolExecutor(max_workers=concurrency or self.config.concurrency) as pool:
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


# Host memory one SGLang server takes beyond its model's weights and KV: its tokenizer manager, scheduler and
# detokenizer processes (0.8-1.9 GB each, docs/runtime-speed.md). Measured: a SmolLM2-135M server on CPU takes
# about 3.2 GB in all, 0.54 GB of which are its fp32 weights.
SERVER_HOST_BYTES = 2.5 * 2**30


def host_bytes_needed(configs: dict[str, RuntimeConfig]) -> float:
    """The host memory the runtimes of `configs` take when started: `SERVER_HOST_BYTES` per server and, on
    cpu, each server's weights and KV (`max_total_tokens`)."""
    from sgl_tts.runtime.memory_plan import model_spec_for

    total = 0.0
    for config in configs.values():
        per_server = SERVER_HOST_BYTES
        if config.device == "cpu":
            spec = model_spec_for(config)
            per_server += spec.weight_bytes + (config.max_total_tokens or 0) * spec.kv_bytes_per_token
        total += config.replicas * per_server
    return total


class SessionPool:
    """Started runtimes kept between sessions, at most `live` sets of them and no more than the host's free
    memory holds: `switch` gives a session that keeps a set started for the same settings, else the runtimes it
    shares with the oldest set, which goes."""

    def __init__(self, live: int = 1, available_bytes: Callable[[], float] | None = None):
        import psutil

        self.live = live
        self.available_bytes = available_bytes or (lambda: psutil.virtual_memory().available)
        self.kept: OrderedDict[tuple, dict[str, Runtime]] = OrderedDict()

    def switch(self, config: RunConfig) -> Session:
        """A session for `config` on the kept runtimes it wants; the kept runtimes it does not want are stopped
        once there is no room left for them: `live` sets, or fewer when the host's available memory would not
        hold a new set beside them (`host_bytes_needed`; a start-up short of memory fails or swaps)."""
        wanted = planned_runtimes(checked_program(config))[1]
        reuse = self.kept.pop(_settings_key(wanted), None)
        room = self.live
        if reuse is None and self.kept and host_bytes_needed(wanted) > self.available_bytes():
            room = len(self.kept)  # no memory for one more set: the oldest goes (or lends what it shares)
        while reuse is None and self.kept and len(self.kept) >= room:
            oldest = self.kept.popitem(last=False)[1]
            if len(self.kept) >= room:
                _stop(oldest)
            else:
                reuse = oldest  # Session keeps what it wants and stops the rest
        return Session(config, reuse=reuse)

    def give_back(self, session: Session) -> None:
        """Keep `session`'s runtimes for a later `switch` instead of stopping them."""
        runtimes = session.detach()
        self.kept[_settings_key({name: runtime.config for name, runtime in runtimes.items()})] = runtimes

    def close(self) -> None:
        while self.kept:
            _stop(self.kept.popitem()[1])


def _settings_key(configs: dict[str, RuntimeConfig]) -> tuple:
    return tuple(sorted((name, repr(config)) for name, config in configs.items()))


def _stop(runtimes: dict[str, Runtime]) -> None:
    for runtime in runtimes.values():
        runtime.stop()
