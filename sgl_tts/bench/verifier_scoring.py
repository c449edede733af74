"""`sgl-tts bench verifier`: full re-scoring vs incremental (radix-cached) step scoring, side by side.

Beam search on the bundled problems with the run config's generator and scorer (SmolLM2 and the likelihood
scorer on its own runtime on the CPU default). One session; the two arms differ only in the scorer's
`incremental` switch (sgl_tts.scoring.base): `full` scores every step of every path from its first step at
each iteration, `incremental` scores only the new steps and lets the verifier runtime serve the question
and the earlier steps from its radix cache. Arms are interleaved (their order alternates per repetition)
and both runtimes' caches are flushed before every search. Prints, per beam-search iteration and arm, the
verifier's input tokens, cached tokens and time per scorer call as median (min-max) over repetitions and
problems, with the incremental/full ratio of the medians.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from typing import Sequence

from sgl_tts.measure.summary import median_range
from sgl_tts.paths import write_atomic
from sgl_tts.measure.tables import Column, console_table
from sgl_tts.scoring.base import ScoreCounts, StepScorer

ARMS = ("full", "incremental")
MEASURES = ("input_tokens", "cached_tokens", "computed_tokens", "scored_steps", "time_ms")


class CallLog(StepScorer):
    """Delegates to `inner` and records each call's counts and wall time (one call per search iteration)."""

    def __init__(self, inner: StepScorer):
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.calls: list[dict[str, float]] = []
        self._calls_lock = threading.Lock()

    def score_into(self, prompt: str, paths: Sequence[Sequence[str]], counts: ScoreCounts) -> list[list[float]]:
        began = time.monotonic()
        scores = self.inner.score_into(prompt, paths, counts)
        with self._calls_lock:
            self.calls.append({**counts.as_dict(), "computed_tokens": counts.input_tokens - counts.cached_tokens,
                               "time_ms": 1000 * (time.monotonic() - began)})
        return scores

    def take(self) -> list[dict[str, float]]:
        with self._calls_lock:
            calls, self.calls = self.calls, []
        return calls


def format_table(calls: dict[str, list[list[dict[str, float]]]]) -> str:
    """Per iteration and measure: each arm's median (min-max) over searches, and incremental/full."""
    iterations = max((len(search) for arm in calls.values() for search in arm), default=0)
    columns = ([Column("iter", 4), Column("measure", 14, "<", gap=2)] + [Column(arm, 22) for arm in ARMS]
               + [Column("incr/full", 10)])

    def row(label: str, measure: str, values: dict[str, list[float]]) -> list[str]:
        medians = {arm: statistics.median(v) if v else float("nan") for arm, v in values.items()}
        ratio = medians["incremental"] / medians["full"] if medians["full"] else float("nan")
        return ([label, measure] + [median_range(values[arm], ".0f", brackets="()") for arm in ARMS]
                + [f"{ratio:9.2f}x"])

    rows = [row(str(index + 1), measure,
                {arm: [search[index][measure] for search in calls[arm] if index < len(search)] for arm in ARMS})
            for index in range(iterations) for measure in MEASURES]
    rows += [row("all", measure, {arm: [sum(call[measure] for call in search) for search in calls[arm]]
                                  for arm in ARMS})
             for measure in MEASURES]
    return console_table(columns, rows)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What `sgl-tts bench verifier` runs."""

    config: str = "configs/cpu-default.yaml"  # run config (YAML): models, verifier
    problems: int = 2  # bundled problems per arm and repeat
    repeats: int = 3  # repetitions of each arm, interleaved
    n: int = 8  # beams
    beam_width: int = 4  # children per kept beam
    max_steps: int = 4
    max_step_tokens: int = 32
    step_delimiter: str = "\\n"  # escapes allowed
    log_dir: str | None = None  # runtime logs (default: a temporary folder)
    out: str | None = None  # write every scorer call's counts as JSON here


def run_bench(options: BenchOptions) -> int:
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.bench.fasttts import flush_caches
    from sgl_tts.problems import load_problems

    config = load_run_config(options.config)
    search = dataclasses.replace(
        config.search, program="beam_search", n=options.n, beam_width=options.beam_width,
        max_steps=options.max_steps, max_step_tokens=options.max_step_tokens,
        max_tokens=options.max_steps * options.max_step_tokens,
        step_delimiter=options.step_delimiter.encode().decode("unicode_escape"), lookahead=0)
    config = dataclasses.replace(config, search=search, concurrency=1, log_dir=options.log_dir)
    problems = load_problems(config.dataset.name, limit=options.problems, offset=config.dataset.offset)
    print(f"bench verifier: model={config.generator.model} verifier={config.scorer.kind} on "
          f"{'its own runtime' if config.scorer.runtime else 'the generator runtime'}, problems={len(problems)} "
          f"n={search.n} beam_width={search.beam_width} steps<={search.max_steps}x{search.max_step_tokens} tokens "
          f"repeats={options.repeats}", flush=True)
    calls: dict[str, list[list[dict[str, float]]]] = {arm: [] for arm in ARMS}
    try:
        with Session(config) as session:
            print(f"runtimes ready in {session.started_s:.0f} s", flush=True)
            scorer = session.search_runtimes.scorer
            log = session.search_runtimes.scorer = CallLog(scorer)
            session.solve(problems[0], dataclasses.replace(search, n=2, max_steps=1))  # warm-up
            for repeat in range(options.repeats):
                for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                    scorer.set_incremental(arm == "incremental", config.scorer.memo_paths)
                    for problem in problems:
                        flush_caches(session.runtimes)
                        log.take()
                        result = session.solve(problem)
                        searched = log.take()
                        calls[arm].append(searched)
                        print(f"[{repeat + 1}/{options.repeats} {arm:<11s} {problem.id}] {len(searched)} scorer calls: "
                              f"input {sum(c['input_tokens'] for c in searched):.0f} tokens, cached "
                              f"{sum(c['cached_tokens'] for c in searched):.0f}, verifier "
                              f"{sum(c['time_ms'] for c in searched) / 1000:.1f} s of {result.total_time_s:.1f} s"
                              + (f", error {result.error}" if result.error else ""), flush=True)
    finally:  # a runtime that dies mid-way still leaves the searches done so far in the table
        print("\nVerifier cost per beam-search iteration, median (min-max) over searches "
              f"({', '.join(f'{arm} {len(calls[arm])}' for arm in ARMS)}):")
        print(format_table(calls))
        if options.out:
            write_atomic(options.out, json.dumps({"args": dataclasses.asdict(options), "calls": calls}, indent=2))
            print(f"wrote {options.out}")
    return 0
