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

import argparse
import dataclasses
import json
import statistics
import threading
import time
from typing import Any, Sequence

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


def summarize(values: Sequence[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def format_table(calls: dict[str, list[list[dict[str, float]]]]) -> str:
    """Per iteration and measure: each arm's median (min-max) over searches, and incremental/full."""
    iterations = max((len(search) for arm in calls.values() for search in arm), default=0)
    lines = [f"{'iter':>4s}  {'measure':<14s}" + "".join(f" {arm:>22s}" for arm in ARMS) + f" {'incr/full':>10s}"]
    for index in range(iterations):
        for measure in MEASURES:
            values = {arm: [search[index][measure] for search in calls[arm] if index < len(search)] for arm in ARMS}
            medians = {arm: statistics.median(v) if v else float("nan") for arm, v in values.items()}
            ratio = medians["incremental"] / medians["full"] if medians["full"] else float("nan")
            lines.append(f"{index + 1:4d}  {measure:<14s}" + "".join(f" {summarize(values[arm]):>22s}" for arm in ARMS)
                         + f" {ratio:9.2f}x")
    for measure in MEASURES:
        totals = {arm: [sum(call[measure] for call in search) for search in calls[arm]] for arm in ARMS}
        medians = {arm: statistics.median(v) if v else float("nan") for arm, v in totals.items()}
        ratio = medians["incremental"] / medians["full"] if medians["full"] else float("nan")
        lines.append(f"{'all':>4s}  {measure:<14s}" + "".join(f" {summarize(totals[arm]):>22s}" for arm in ARMS)
                     + f" {ratio:9.2f}x")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.bench.fasttts import flush_caches
    from sgl_tts.problems import load_problems

    config = load_run_config(args.config)
    search = dataclasses.replace(
        config.search, program="beam_search", n=args.n, beam_width=args.beam_width, max_steps=args.max_steps,
        max_step_tokens=args.max_step_tokens, max_tokens=args.max_steps * args.max_step_tokens,
        step_delimiter=args.step_delimiter.encode().decode("unicode_escape"), lookahead=0)
    config = dataclasses.replace(config, search=search, concurrency=1, log_dir=args.log_dir)
    problems = load_problems(config.dataset.name, limit=args.problems, offset=config.dataset.offset)
    print(f"bench verifier: model={config.generator.model} verifier={config.scorer.kind} on "
          f"{'its own runtime' if config.scorer.runtime else 'the generator runtime'}, problems={len(problems)} "
          f"n={search.n} beam_width={search.beam_width} steps<={search.max_steps}x{search.max_step_tokens} tokens "
          f"repeats={args.repeats}", flush=True)
    calls: dict[str, list[list[dict[str, float]]]] = {arm: [] for arm in ARMS}
    try:
        with Session(config) as session:
            print(f"runtimes ready in {session.started_s:.0f} s", flush=True)
            scorer = session.search_runtimes.scorer
            log = session.search_runtimes.scorer = CallLog(scorer)
            session.solve(problems[0], dataclasses.replace(search, n=2, max_steps=1))  # warm-up
            for repeat in range(args.repeats):
                for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                    scorer.set_incremental(arm == "incremental", config.scorer.memo_paths)
                    for problem in problems:
                        flush_caches(session.runtimes)
                        log.take()
                        result = session.solve(problem)
                        searched = log.take()
                        calls[arm].append(searched)
                        print(f"[{repeat + 1}/{args.repeats} {arm:<11s} {problem.id}] {len(searched)} scorer calls: "
                              f"input {sum(c['input_tokens'] for c in searched):.0f} tokens, cached "
                              f"{sum(c['cached_tokens'] for c in searched):.0f}, verifier "
                              f"{sum(c['time_ms'] for c in searched) / 1000:.1f} s of {result.total_time_s:.1f} s"
                              + (f", error {result.error}" if result.error else ""), flush=True)
    finally:  # a runtime that dies mid-way still leaves the searches done so far in the table
        print("\nVerifier cost per beam-search iteration, median (min-max) over searches "
              f"({', '.join(f'{arm} {len(calls[arm])}' for arm in ARMS)}):")
        print(format_table(calls))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args) | {"func": None}, "calls": calls}, f, indent=2)
            print(f"wrote {args.out}")
    return 0


def add_bench_verifier_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser("verifier", help="full re-scoring vs incremental step scoring")
    parser.add_argument("--config", default="configs/cpu-default.yaml", help="run config (YAML): models, verifier")
    parser.add_argument("--problems", type=int, default=2, help="bundled problems per arm and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each arm, interleaved")
    parser.add_argument("--n", type=int, default=8, help="beams")
    parser.add_argument("--beam-width", type=int, default=4, help="children per kept beam")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-step-tokens", type=int, default=32)
    parser.add_argument("--step-delimiter", default="\\n",
                        help="step delimiter, escapes allowed (default \\n: SmolLM2 writes a step per line)")
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write every scorer call's counts as JSON here")
    parser.set_defaults(func=run_bench)
    return parser
