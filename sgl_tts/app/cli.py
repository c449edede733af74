"""The `sgl-tts` command line."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Sequence


def _cmd_programs(args: argparse.Namespace) -> int:
    from sgl_tts.search.programs import program_names, program_summary

    for name in program_names():
        print(f"{name:24s} {program_summary(name)}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from sgl_tts.problems import load_problems
    from sgl_tts.config import ConfigError
    from sgl_tts.app.report import print_run
    from sgl_tts.runtime.server import RuntimeConfig
    from sgl_tts.app.session import Session, load_run_config

    config = load_run_config(args.config)
    search_overrides = {}
    if args.program:
        search_overrides["program"] = args.program
    if args.n:
        search_overrides["n"] = args.n
    if args.tree:
        search_overrides["record_tree"] = True
    if search_overrides:
        try:
            config = dataclasses.replace(config, search=dataclasses.replace(config.search, **search_overrides))
        except ValueError as exc:
            raise ConfigError(f"{args.config} with --program/--n: {exc}") from None
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
    with Session(config) as session:
        print(f"runtimes ready in {session.started_s:.0f} s: "
              + ", ".join(f"{name} {rt.url}" for name, rt in session.runtimes.items()), flush=True)
        searched: list = []
        code = print_run(_collect(_write_trees(session.solve_all(problems), args.tree), searched), config)
        if args.compare:
            from sgl_tts.app.compare import print_comparison, run_comparison

            print_comparison(run_comparison(session, problems, searched))
        return code


def _collect(pairs, into: list):
    """Pass pairs through, keeping each in `into`."""
    for pair in pairs:
        into.append(pair)
        yield pair


def _write_trees(results, folder):
    """Pass (problem, result) pairs through, drawing each result's search tree into `folder` (when set)."""
    for problem, result in results:
        if folder and "tree" in result.extra:
            from sgl_tts.app.tree_plot import plot_tree

            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(problem.id))
            plot_tree(result.extra["tree"], f"{folder}/{safe}.png", f"{result.program}: {problem.id} -> {result.answer}")
        yield problem, result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgl-tts", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    programs = commands.add_parser("programs", help="list the registered search programs")
    programs.set_defaults(func=_cmd_programs)

    run = commands.add_parser("run", help="run a search program over a problem set")
    run.add_argument("--config", default="cpu-default",
                     help="run config: a YAML path or a packaged config's name (cpu-default, rsd-cpu)")
    run.add_argument("--program", help="override search.program")
    run.add_argument("--n", type=int, help="override search.n")
    run.add_argument("--limit", type=int, help="only the first LIMIT problems")
    run.add_argument("--device", choices=["cpu", "cuda"], help="override the runtimes' device")
    run.add_argument("--tree", metavar="DIR", help="draw each problem's search tree into DIR (PNG)")
    run.add_argument("--compare", action="store_true",
                     help="then self-consistency at matched tokens and the search with FastTTS off, side by side")
    run.set_defaults(func=_cmd_run)

    bench = commands.add_parser("bench", help="benchmarks that print side-by-side ratios")
    bench_commands = bench.add_subparsers(dest="bench", required=True)
    from sgl_tts.bench.runtime import add_bench_runtime_parser

    add_bench_runtime_parser(bench_commands)
    from sgl_tts.bench.fasttts import add_bench_fasttts_parser

    add_bench_fasttts_parser(bench_commands)
    from sgl_tts.bench.verifier import add_bench_verifier_parser

    add_bench_verifier_parser(bench_commands)

    from sgl_tts.bench.serve import add_bench_serve_parser

    add_bench_serve_parser(bench_commands)

    plan = commands.add_parser("plan", help="planners: speculative decoding speed, memory split")
    plan_commands = plan.add_subparsers(dest="plan", required=True)
    from sgl_tts.rsd.specdec import add_plan_spec_parser

    add_plan_spec_parser(plan_commands)
    from sgl_tts.runtime.memory_plan import add_plan_memory_parser

    add_plan_memory_parser(plan_commands)

    from sgl_tts.rsd.sweep import add_rsd_sweep_parser

    add_rsd_sweep_parser(commands)

    from sgl_tts.scoring.probe_train import add_train_parser

    add_train_parser(commands)  # sgl-tts train prm

    from sgl_tts.serve.main import add_serve_parser

    add_serve_parser(commands)

    add_plugin_commands(commands)
    return parser


COMMANDS_GROUP = "sgl_tts.commands"  # entry points: name -> function(subparsers) that adds a subcommand


def add_plugin_commands(commands: argparse._SubParsersAction) -> None:
    """Subcommands that layers above this package register as entry points (`sgl-tts eval` comes from the
    `eval` package): the command line reaches them without `sgl_tts` importing the layers above it."""
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        entry.load()(commands)


def stop_on_sigterm() -> None:
    """SIGTERM (`kill`, a job scheduler, a notebook kernel restart) stops a command the way Ctrl-C does:
    runtimes are stopped, finished results stay saved and an eval writes its partial summary. Without this
    the process would die at once and leave its runtime servers running (they are in their own sessions)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_sigterm()
    from sgl_tts.config import ConfigError
    from sgl_tts.problems import DatasetError
    from sgl_tts.runtime.cpu_shim import ShimBuildError
    from sgl_tts.runtime.models import ModelNotFoundError
    from sgl_tts.runtime.server import RuntimeStartError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, DatasetError, ModelNotFoundError, RuntimeStartError, ShimBuildError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"sgl-tts: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
