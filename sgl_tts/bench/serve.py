"""`sgl-tts bench serve`: C concurrent clients × R requests against `sgl-tts serve`, side by side with the
same requests sent one at a time, with one and with two generator replicas behind SGLang's router.

For each replica count the bench starts the config's runtimes and the HTTP server in this process, then
alternates the two arms `--repeats` times (sequential, concurrent, sequential, ...). Each arm sends the same
C·R chat completions with the `openai` client and reports requests/s, generated tokens/s (the searches'
`usage`), p50/p99 latency and errors; the table gives the median over repeats with min-max, and each
throughput's ratio to the one-replica sequential baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ARMS = ("sequential", "concurrent")


def run_arm(base_url: str, program: str, questions: list[str], clients: int, api_key: str = "none"
            ) -> dict[str, Any]:
    """Send one chat completion per question, `clients` at a time; requests/s, tokens/s, latencies, errors."""
    import openai

    from sgl_tts.app.metrics import percentile

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)

    def one(question: str) -> tuple[float, int, str | None]:
        began = time.perf_counter()
        try:
            reply = client.chat.completions.create(model=program, messages=[{"role": "user", "content": question}])
        except openai.APIError as exc:
            return time.perf_counter() - began, 0, type(exc).__name__
        return time.perf_counter() - began, reply.usage.completion_tokens, None

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        outcomes = list(pool.map(one, questions))
    wall = time.perf_counter() - began
    latencies = [latency for latency, _, error in outcomes if error is None]
    tokens = sum(tokens for _, tokens, _ in outcomes)
    return {
        "requests_per_s": len(latencies) / wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "p50_s": percentile(latencies, 50) if latencies else float("nan"),
        "p99_s": percentile(latencies, 99) if latencies else float("nan"),
        "errors": sum(error is not None for _, _, error in outcomes),
    }


def median_range(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def format_table(rows: dict[tuple[int, str], list[dict[str, Any]]]) -> str:
    """One line per (replicas, arm): medians with min-max over repeats; ratios to 1 replica, sequential."""
    baseline = statistics.median(r["requests_per_s"] for r in rows[(min(r for r, _ in rows), "sequential")])
    header = (f"{'replicas':>8} {'arm':<10} {'requests/s':>22} {'tokens/s':>24} {'p50 s':>20} {'p99 s':>20} "
              f"{'errors':>6} {'ratio':>6}")
    lines = [header]
    for (replicas, arm), runs in sorted(rows.items(), key=lambda item: (item[0][0], ARMS.index(item[0][1]))):
        requests = [r["requests_per_s"] for r in runs]
        lines.append(
            f"{replicas:>8} {arm:<10} {median_range(requests, 3):>22} "
            f"{median_range([r['tokens_per_s'] for r in runs], 1):>24} "
            f"{median_range([r['p50_s'] for r in runs]):>20} {median_range([r['p99_s'] for r in runs]):>20} "
            f"{sum(r['errors'] for r in runs):>6} {statistics.median(requests) / baseline:>5.2f}x")
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.problems import load_problems
    from sgl_tts.serve.app import create_app
    from sgl_tts.serve.main import HTTPServer, session_service

    config = load_run_config(args.config)
    program = args.program or config.search.program
    problems = list(load_problems(config.dataset.name))
    count = args.clients * args.requests
    questions = [problems[i % len(problems)].question for i in range(count)]
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for replicas in args.replicas:
        run_config = dataclasses.replace(config, generator=dataclasses.replace(config.generator, replicas=replicas),
                                         concurrency=max(config.concurrency, args.clients))
        with Session(run_config) as session:
            service = session_service(session)
            print(f"replicas={replicas}: runtimes ready in {session.started_s:.0f} s", flush=True)
            with HTTPServer(create_app(service)) as http:
                run_arm(http.url + "/v1", program, questions[:1], 1)  # warm-up, not counted
                for repeat in range(args.repeats):
                    for arm in ARMS:
                        clients = 1 if arm == "sequential" else args.clients
                        row = run_arm(http.url + "/v1", program, questions, clients)
                        rows.setdefault((replicas, arm), []).append(row)
                        print(f"  repeat {repeat + 1} {arm}: {row['requests_per_s']:.3f} req/s, "
                              f"{row['tokens_per_s']:.1f} tok/s, errors {row['errors']}", flush=True)
            service.close()
    print(f"\nsgl-tts bench serve: {args.config}, program {program}, {args.clients} clients x {args.requests} "
          f"requests, {args.repeats} repeats (median, min-max)")
    print(format_table(rows))
    return 0


def add_bench_serve_parser(bench_commands: argparse._SubParsersAction) -> None:
    parser = bench_commands.add_parser("serve", help="concurrent clients against `sgl-tts serve`, 1 vs 2 replicas")
    parser.add_argument("--config", default="configs/serve-tiny.yaml", help="run config (YAML)")
    parser.add_argument("--program", help="search program (default: the config's)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (C)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client (R)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="generator replica counts")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each arm (interleaved)")
    parser.set_defaults(func=run_bench)
