"""`sgl-tts programs` and `sgl-tts run` (with `--compare`, `--tree`, `--timeline` and `--out`)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path


def add_parsers(commands: argparse._SubParsersAction) -> None:
    programs = commands.add_parser("programs", help="list the registered search programs")
    programs.set_defaults(func=programs_command)

    run = commands.add_parser("run", help="run a search program over a problem set")
    run.add_argument("--config", default="cpu-default",
                     help="run config: a YAML path or a packaged config's name (cpu-default, rsd-cpu)")
    run.add_argument("--program", help="override search.program")
    run.add_argument("--n", type=int, help="override search.n")
    run.add_argument("--deadline", type=float, metavar="SECONDS",
                     help="override search.budget.deadline_s: each search stops at SECONDS and answers with what it "
                          "has (the report's 'end' column says so)")
    run.add_argument("--token-budget", type=int, metavar="N",
                     help="override search.budget.max_tokens: each search stops after N generated tokens (all its "
                          "paths)")
    run.add_argument("--limit", type=int, help="only the first LIMIT problems")
    run.add_argument("--device", choices=["cpu", "cuda"], help="override the runtimes' device")
    run.add_argument("--tree", metavar="DIR", help="draw each problem's search tree into DIR (PNG)")
    run.add_argument("--timeline", metavar="DIR",
                     help="draw each search's timeline (what each runtime slot did: generate, verify, speculative "
                          "head start, straggler tail, idle; iteration boundaries) into DIR/<problem>.png, and the "
                          "step latency against context length over the run into DIR/latency-vs-context.png")
    run.add_argument("--out", metavar="DIR", help="append each problem's result to DIR/results.jsonl as it "
                                                  "finishes (the record `sgl-tts eval` writes per result line)")
    run.add_argument("--compare", action="store_true",
                     help="then greedy, one sample and self-consistency at matched tokens, side by side")
    run.add_argument("--compare-fasttts", action="store_true",
                     help="with --compare: also the search on runtimes restarted with FastTTS off (P, M, S)")
    run.set_defaults(func=run_command)


def programs_command(args: argparse.Namespace) -> int:
    from sgl_tts.search.programs import program_names, program_summary

    for name in program_names():
        print(f"{name:24s} {program_summary(name)}")
    return 0


def run_command(args: argparse.Namespace) -> int:
    import dataclasses

    from sgl_tts.runtime.server import prestart_cpu_zygote

    if args.device != "cuda":
        prestart_cpu_zygote()  # its imports beside the ones below (sgl_tts/runtime/zygote.py)
    from sgl_tts.measure.cpu_use import CpuMeter
    from sgl_tts.problems import load_problems
    from sgl_tts.config import ConfigError
    from sgl_tts.app.run_report import print_run
    from sgl_tts.runtime.server import RuntimeConfig
    from sgl_tts.app.session import Session, load_run_config

    config = load_run_config(args.config)
    try:
        config = dataclasses.replace(config, search=overridden_search(config.search, args))
    except ValueError as exc:
        raise ConfigError(f"{args.config} with --program/--n/--deadline/--token-budget: {exc}") from None
    if args.device:
        config = dataclasses.replace(config, generator=dataclasses.replace(config.generator, device=args.device))
        if config.scorer.runtime is not None:
            scorer_runtime = dataclasses.replace(config.scorer.runtime, device=args.device)
            config = dataclasses.replace(config, scorer=dataclasses.replace(config.scorer, runtime=scorer_runtime))
        if isinstance(config.target, RuntimeConfig):
            config = dataclasses.replace(config, target=dataclasses.replace(config.target, device=args.device))
    limit = args.limit if args.limit is not None else config.dataset.limit
    problems = load_problems(config.dataset.name, limit=limit, offset=config.dataset.offset)
    print(f"sgl-tts run: program={config.search.program} n={config.search.n} "
          f"model={config.generator.model} device={config.generator.device} problems={len(problems)}"
          + (f" target={getattr(config.target, 'model', config.target)}" if config.target else ""), flush=True)
    with contextlib.ExitStack() as stack:
        results = None
        if args.out:
            from sgl_tts.paths import folder_lock

            stack.enter_context(folder_lock(args.out, "writing sgl-tts run results into it"))
            results = start_results(args.out, config)
        session = stack.enter_context(Session(config))
        print(f"runtimes ready in {session.started_s:.0f} s: "
              + ", ".join(f"{name} {rt.url}" for name, rt in session.runtimes.items()), flush=True)
        searched: list = []
        solved = _write_trees(session.solve_all(problems), args.tree)
        comparing, greedy = args.compare or args.compare_fasttts, None
        if comparing:  # the greedy reference beside the search's last problems
            from sgl_tts.app.compare import GreedyReference

            greedy = GreedyReference(session, problems)
            solved = greedy.follow(solved, start_after=len(problems) - config.concurrency)
        timelines: list = []
        if args.timeline:
            solved = _write_timelines(solved, args.timeline, timelines)
        if results is not None:
            solved = _save_results(solved, results, config)
        with CpuMeter() as meter:
            code = print_run(_collect(solved, searched), config)
        print(f"while solving: {meter.use.describe()}, machine-wide (the runtimes included)", flush=True)
        if timelines:
            from sgl_tts.app.timeline import plot_latency_vs_context

            plot_latency_vs_context(timelines, Path(args.timeline) / "latency-vs-context.png",
                                    f"{config.search.program} n={config.search.n}: step latency vs context length")
            print(f"timelines: {args.timeline}/ (one per problem, latency-vs-context.png)", flush=True)
        if comparing:
            from sgl_tts.app.compare import print_comparison, run_comparison

            print_comparison(run_comparison(session, problems, searched, fasttts_off=args.compare_fasttts,
                                            greedy=greedy))
        return code


def overridden_search(search, args: argparse.Namespace):
    """The run config's search section with the command line's overrides; ValueError (naming the field) for a
    bad value."""
    import dataclasses

    overrides = {}
    if args.program and args.program != search.program:
        overrides.update(program=args.program, settings=None)  # the file's settings are its program's
    if args.n:
        overrides["n"] = args.n
    if args.tree:
        overrides["record_tree"] = True
    if args.timeline:
        overrides["record_timeline"] = True
    budget = {name: value for name, value in (("deadline_s", args.deadline), ("max_tokens", args.token_budget))
              if value is not None}
    if budget:
        overrides["budget"] = dataclasses.replace(search.budget, **budget)
    return dataclasses.replace(search, **overrides) if overrides else search


def start_results(folder: str, config) -> "ResultStore":
    """The JSONL store `folder`/results.jsonl with this run's header (resolved config, its hash, versions)."""
    from sgl_tts.config import to_dict
    from eval.report import RESULTS_FILE
    from eval.results import ResultStore, provenance

    store = ResultStore(Path(folder) / RESULTS_FILE)
    store.append_run(provenance(to_dict(config), probe_gpu=config.generator.device == "cuda"))
    return store


def result_record(problem, result, config) -> dict:
    """One problem's line, as `sgl-tts eval` writes it (arm "run", repetition 0)."""
    from eval.results import result_line

    return result_line(problem, result, None, arm="run", dataset=config.dataset.name,
                       dataset_name=config.dataset.name, n=config.search.n, seed=config.search.seed, repetition=0)


def _save_results(pairs, store, config):
    """Pass (problem, result) pairs through, appending each one's record to `store` as it finishes (a crash
    keeps what finished)."""
    for problem, result in pairs:
        store.append(result_record(problem, result, config))
        yield problem, result


def _collect(pairs, into: list):
    """Pass pairs through, keeping each in `into`."""
    for pair in pairs:
        into.append(pair)
        yield pair


def _write_trees(results, folder):
    """Pass (problem, result) pairs through, drawing each result's search tree into `folder` (when set)."""
    for problem, result in results:
        if folder and "tree" in result.extra:
            from sgl_tts.app.timeline import safe_name
            from sgl_tts.app.tree_plot import plot_tree

            plot_tree(result.extra["tree"], f"{folder}/{safe_name(problem.id)}.png",
                      f"{result.program}: {problem.id} -> {result.answer}")
        yield problem, result


def _write_timelines(results, folder, into: list):
    """Pass (problem, result) pairs through, drawing each result's timeline into `folder` and keeping it in
    `into` (for the run's latency-vs-context plot)."""
    from sgl_tts.app.timeline import plot_timeline, safe_name

    Path(folder).mkdir(parents=True, exist_ok=True)
    for problem, result in results:
        if "timeline" in result.extra:
            into.append(result.extra["timeline"])
            plot_timeline(result.extra["timeline"], Path(folder) / f"{safe_name(problem.id)}.png",
                          f"{result.program}: {problem.id}, {result.total_time_s:.1f} s, "
                          f"{result.iterations} iterations")
        yield problem, result
