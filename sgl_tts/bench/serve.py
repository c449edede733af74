"""`sgl-tts bench serve`: C concurrent clients × R requests against `sgl-tts serve`, side by side with the
same requests sent one at a time, with one and with two generator replicas behind SGLang's router.

For each replica count the bench starts the config's runtimes and the HTTP server in this process, then
alternates the two arms `--repeats` times (sequential, concurrent, sequential, ...). Each arm sends the same
C·R chat completions with the `openai` client and reports requests/s, generated tokens/s (the searches'
`usage`), p50/p99 latency and errors; the table gives the median over repeats with min-max, and each
throughput's ratio to the one-replica sequential baseline.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from sgl_tts.measure.summary import median_range
from sgl_tts.measure.tables import Column, console_table

ARMS = ("sequential", "concurrent")


def run_arm(base_url: str, program: str, questions: list[str], clients: int, api_key: str = "none"
            ) -> dict[str, Any]:
    """Send one chat completion per question, `clients` at a time; requests/s, tokens/s, latencies, errors."""
    import openai

    from sgl_tts.measure.metrics import percentile

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


TABLE_COLUMNS = (Column("replicas", 8), Column("arm", 10, "<"), Column("requests/s", 22), Column("tokens/s", 24),
                 Column("p50 s", 20), Column("p99 s", 20), Column("errors", 6), Column("ratio", 6))


def format_table(rows: dict[tuple[int, str], list[dict[str, Any]]]) -> str:
    """One line per (replicas, arm): medians with min-max over repeats; ratios to 1 replica, sequential."""
    baseline = statistics.median(r["requests_per_s"] for r in rows[(min(r for r, _ in rows), "sequential")])

    def spread(runs: list[dict[str, Any]], key: str, digits: int = 2) -> str:
        return median_range([r[key] for r in runs], f".{digits}f", brackets="()")

    cells = [[str(replicas), arm, spread(runs, "requests_per_s", 3), spread(runs, "tokens_per_s", 1),
              spread(runs, "p50_s"), spread(runs, "p99_s"), str(sum(r["errors"] for r in runs)),
              f"{statistics.median(r['requests_per_s'] for r in runs) / baseline:5.2f}x"]
             for (replicas, arm), runs in sorted(rows.items(), key=lambda item: (item[0][0], ARMS.index(item[0][1])))]
    return console_table(TABLE_COLUMNS, cells)


def run_bench(*, config: str = "configs/serve-tiny.yaml", program: str | None = None, clients: int = 8,
              requests: int = 2, replicas: Sequence[int] = (1, 2), repeats: int = 3) -> int:
    """For each generator replica count, start the run config's runtimes and the HTTP server and send
    `clients` x `requests` chat completions one at a time and concurrently, `repeats` times; print the table.
    `program`: the search program (default: the config's)."""
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.problems import load_problems
    from sgl_tts.serve.app import create_app
    from sgl_tts.serve.main import HTTPServer, session_service

    config_path = config
    config = load_run_config(config_path)
    program = program or config.search.program
    problems = list(load_problems(config.dataset.name))
    count = clients * requests
    questions = [problems[i % len(problems)].question for i in range(count)]
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for replica_count in replicas:
        generator = dataclasses.replace(config.generator, replicas=replica_count)
        run_config = dataclasses.replace(config, generator=generator, concurrency=max(config.concurrency, clients))
        with Session(run_config) as session:
            service = session_service(session)
            print(f"replicas={replica_count}: runtimes ready in {session.started_s:.0f} s", flush=True)
            with HTTPServer(create_app(service)) as http:
                run_arm(http.url + "/v1", program, questions[:1], 1)  # warm-up, not counted
                for repeat in range(repeats):
                    for arm in ARMS:
                        row = run_arm(http.url + "/v1", program, questions, 1 if arm == "sequential" else clients)
                        rows.setdefault((replica_count, arm), []).append(row)
                        print(f"  repeat {repeat + 1} {arm}: {row['requests_per_s']:.3f} req/s, "
                              f"{row['tokens_per_s']:.1f} tok/s, errors {row['errors']}", flush=True)
            service.close()
    print(f"\nsgl-tts bench serve: {config_path}, program {program}, {clients} clients x {requests} "
          f"requests, {repeats} repeats (median, min-max)")
    print(format_table(rows))
    return 0
