"""`sgl-tts bench fasttts`: the FastTTS ablation (Fig. 16 as a table) on the CPU default.

Beam search on the bundled problems with the run config's models (SmolLM2 generator and likelihood
verifier on their own co-located runtimes), for each n and each arm: the baseline (FCFS, no speculation,
a static 50/50 split of a KV budget small enough to force evictions), then P, P+M, P+M+S. One run, one
process; a runtime is restarted only when an arm needs other settings for it (arms outer, n inner, so the
n values of an arm share its runtimes); before each arm and n a short search warms the runtimes up and
every runtime's radix cache is flushed.
Prints precise goodput (mean over problems), p50 completion latency and the generator's cache hit rate,
with ratios to the baseline at the same n, and beside them the CPU seconds the arm used per problem and the
machine's load average while it ran (on a shared machine other work moves the wall-clock numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
from typing import Any

ARMS = ("baseline", "P", "P+M", "P+M+S")


def _bench_config(args: argparse.Namespace) -> Any:
    from sgl_tts.app.session import load_run_config

    config = load_run_config(args.config)
    search = dataclasses.replace(
        config.search, program="beam_search", beam_width=args.beam_width, max_steps=args.max_steps,
        max_step_tokens=args.max_step_tokens, max_tokens=args.max_steps * args.max_step_tokens,
        step_delimiter=args.step_delimiter.encode().decode("unicode_escape"), seed=args.seed)
    return dataclasses.replace(config, search=search, concurrency=args.concurrency, log_dir=args.log_dir)


def _flush_caches(runtimes: dict[str, Any]) -> None:
    import urllib.request

    for runtime in runtimes.values():
        with urllib.request.urlopen(urllib.request.Request(runtime.url + "/flush_cache?timeout=60", method="POST"),
                                    timeout=60) as response:
            response.read()


class RunMonitor:
    """While an arm runs: the machine's mean 1-minute load average and the CPU seconds used by the runtimes'
    processes and this one. On a shared machine the wall-clock numbers move with other work; these say how
    much there was, and how much computing the arm itself did."""

    def __init__(self, runtimes: dict[str, Any], every_s: float = 2.0):
        self.pgids = [runtime.process.pid for runtime in runtimes.values()]
        self.every_s = every_s
        self.samples: list[float] = []
        self.cpu_s = 0.0
        self._stop = threading.Event()

    def _cpu(self) -> float:
        from sgl_tts.runtime.server import group_members

        ticks = 0
        for pgid in self.pgids:
            for pid in group_members(pgid):
                try:
                    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK") + time.process_time()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "RunMonitor":
        self._cpu_start = self._cpu()
        self.samples.append(os.getloadavg()[0])
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu_s = self._cpu() - self._cpu_start

    @property
    def load(self) -> float:
        return sum(self.samples) / len(self.samples)


def measure(results: list[Any]) -> dict[str, Any]:
    """The table's numbers for one (arm, n): metrics.aggregate plus speculation counts."""
    from sgl_tts.app.metrics import aggregate

    summary = aggregate(results)
    speculation: dict[str, int] = {}
    for result in results:
        for key, value in result.extra.get("speculation", {}).items():
            speculation[key] = speculation.get(key, 0) + value
    return {
        "problems": summary["problems"],
        "errors": summary["errors"],
        "goodput": summary["precise_goodput"]["mean"] or 0.0,
        "p50_latency_s": summary["completion_latency_s"]["p50"] or 0.0,
        "cache_hit_rate": summary["cache_hit_rate"] or 0.0,
        "generator_s": summary["generator_time_s"]["mean"] or 0.0,
        "verifier_s": summary["verifier_time_s"]["mean"] or 0.0,
        "generated_tokens": summary["generated_tokens"],
        "speculation": speculation,
    }


def format_table(rows: dict[tuple[str, int], dict[str, Any]], ns: list[int], arms: list[str]) -> str:
    """Goodput, p50 latency and cache hit rate per (n, arm), with ratios to the baseline at that n."""
    lines = [f"{'n':>4s}  {'arm':<8s} {'goodput tok/s':>13s} {'x base':>7s} {'p50 latency s':>14s} "
             f"{'x base':>7s} {'cache hit':>9s} {'gen s':>7s} {'ver s':>7s} {'cpu s':>7s} {'load':>5s}"]
    for n in ns:
        base = rows.get(("baseline", n))
        for arm in arms:
            row = rows.get((arm, n))
            if row is None:
                continue
            goodput_ratio = row["goodput"] / base["goodput"] if base and base["goodput"] else float("nan")
            latency_ratio = row["p50_latency_s"] / base["p50_latency_s"] if base and base["p50_latency_s"] \
                else float("nan")
            lines.append(f"{n:4d}  {arm:<8s} {row['goodput']:13.3f} {goodput_ratio:6.2f}x "
                         f"{row['p50_latency_s']:14.1f} {latency_ratio:6.2f}x {row['cache_hit_rate']:9.3f} "
                         f"{row['generator_s']:7.1f} {row['verifier_s']:7.1f} {row.get('cpu_s', 0.0):7.1f} "
                         f"{row.get('load', 0.0):5.1f}")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    from sgl_tts.problems import load_problems
    from sgl_tts.fasttts.switches import describe_settings, from_label
    from sgl_tts.app.session import Session

    base = _bench_config(args)
    ns = [int(n) for n in args.ns.split(",")]
    arms = args.arms.split(",")
    for arm in arms:
        from_label(arm)  # a bad arm name fails before any runtime starts
    problems = load_problems(base.dataset.name, limit=args.problems, offset=base.dataset.offset)
    print(f"bench fasttts: model={base.generator.model} verifier={base.scorer.kind} problems={len(problems)} "
          f"n={ns} beam_width={args.beam_width} steps<={args.max_steps}x{args.max_step_tokens} tokens "
          f"delimiter={base.search.step_delimiter!r} KV budget {args.kv_budget_mib} MiB "
          f"concurrency={args.concurrency}", flush=True)
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    records: dict[tuple[str, int], list[dict[str, Any]]] = {}
    reuse: dict[str, Any] = {}
    began = time.monotonic()
    try:
        for arm in arms:
            fast = from_label(arm, kv_budget_mib=args.kv_budget_mib, hardware=args.hardware,
                              prompt_tokens=args.prompt_tokens, max_speculative=args.max_speculative,
                              truncation_ratio=args.truncation_ratio, seed=args.seed)
            for n in ns:
                config = dataclasses.replace(base, search=dataclasses.replace(base.search, n=n), fasttts=fast)
                started = time.monotonic()
                session = Session(config, reuse=reuse)
                try:
                    print(f"[{arm} n={n}] runtimes ready in {time.monotonic() - started:.0f} s; "
                          f"{describe_settings(session.fasttts)}", flush=True)
                    # A short search warms freshly started runtimes up, then no arm starts with a warm cache.
                    session.solve(problems[0], dataclasses.replace(config.search, n=2, max_steps=1))
                    _flush_caches(session.runtimes)
                    with RunMonitor(session.runtimes) as monitor:
                        results = [result for _, result in session.solve_all(problems)]
                finally:
                    reuse = session.detach()  # kept running for the next arm, stopped at the end
                row = rows[(arm, n)] = measure(results)
                row.update(cpu_s=monitor.cpu_s / max(1, len(results)), load=monitor.load)
                records[(arm, n)] = [result.to_dict() for result in results]
                print(f"[{arm} n={n}] goodput {row['goodput']:.3f} tok/s, p50 {row['p50_latency_s']:.1f} s, "
                      f"cache hit {row['cache_hit_rate']:.3f}, generator {row['generator_s']:.1f} s, "
                      f"verifier {row['verifier_s']:.1f} s, CPU {row['cpu_s']:.0f} s per problem, "
                      f"load {row['load']:.1f}, errors {row['errors']}"
                      + (f", speculation {row['speculation']}" if row["speculation"] else ""), flush=True)
    finally:
        for runtime in reuse.values():
            runtime.stop()
    print(f"\nFastTTS ablation ({time.monotonic() - began:.0f} s in all):")
    print(format_table(rows, ns, arms))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args) | {"func": None},
                       "rows": [{"arm": arm, "n": n, **row, "results": records[(arm, n)]}
                                for (arm, n), row in rows.items()]}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


def add_bench_fasttts_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    parser = bench_subparsers.add_parser("fasttts", help="FastTTS ablation: baseline vs P, P+M, P+M+S (Fig. 16)")
    parser.add_argument("--config", default="cpu-default",
                        help="run config (YAML path or packaged name): models, verifier")
    parser.add_argument("--ns", default="8,16", help="comma-separated beam counts n")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (baseline or P/M/S joined by +)")
    parser.add_argument("--problems", type=int, default=2, help="bundled problems per (arm, n)")
    parser.add_argument("--concurrency", type=int, default=1, help="problems searched at once")
    parser.add_argument("--beam-width", type=int, default=4, help="children per kept beam (B)")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-step-tokens", type=int, default=24)
    parser.add_argument("--step-delimiter", default="\\n",
                        help="step delimiter, escapes allowed (default \\n: SmolLM2 writes a step per line)")
    parser.add_argument("--kv-budget-mib", type=float, default=24.0,
                        help="KV memory shared by generator and verifier (small enough to force evictions)")
    parser.add_argument("--hardware", default="this-machine", help="roofline profile for M")
    parser.add_argument("--prompt-tokens", type=int, default=80, help="expected prompt length (plan, floors)")
    parser.add_argument("--max-speculative", type=int, default=None, help="cap on speculative requests in flight")
    parser.add_argument("--truncation-ratio", type=float, default=0.85, help="R for duplicates' head starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="runtime logs (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write the rows and the search results as JSON here")
    parser.set_defaults(func=run_bench)
    return parser
