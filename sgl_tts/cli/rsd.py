"""`sgl-tts rsd-sweep`: a run config's `Session`, the RSD delta sweep on it (`sgl_tts.rsd.sweep.run_sweep`),
the table, notes, plots and results written (`sgl_tts.measure.rsd_sweep`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from sgl_tts.rsd.sweep import DEFAULT_DELTAS


def parse_deltas(text: str) -> list[float]:
    try:
        deltas = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {text!r}") from None
    bad = [d for d in deltas if not 0.0 <= d <= 1.0]
    if not deltas or bad:
        raise argparse.ArgumentTypeError(f"every delta must be in [0, 1], got {text!r}")
    return sorted(set(deltas))


def add_parsers(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("rsd-sweep", help="RSD accuracy, draft-only fraction and FLOPs against delta")
    parser.add_argument("--config", default="rsd-cpu",
                        help="run config (YAML path or packaged name) with search.program: rsd")
    parser.add_argument("--deltas", type=parse_deltas, default=list(DEFAULT_DELTAS),
                        help="comma-separated thresholds in [0, 1] (default 0,0.1,...,1)")
    parser.add_argument("--limit", type=int, help="only the first LIMIT problems")
    parser.add_argument("--out", default="results/rsd-sweep", help="folder for the table, plot and results")
    parser.add_argument("--no-cache", action="store_true",
                        help="rerun every context per delta instead of sharing the step cache")
    parser.set_defaults(func=rsd_sweep_command)


def rsd_sweep_command(args: argparse.Namespace) -> int:
    return rsd_sweep(args.config, args.deltas, limit=args.limit, out=args.out, cache=not args.no_cache)


def rsd_sweep(config_path: str, deltas: Sequence[float], limit: int | None = None, out: str = "results/rsd-sweep",
              cache: bool = True) -> int:
    """Start the run config's runtimes, run the sweep over `deltas`, print the table and write it under `out`."""
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.config import ConfigError
    from sgl_tts.problems import load_problems
    from sgl_tts.measure.rsd_sweep import format_sweep_table, write_sweep_outputs
    from sgl_tts.rsd.sweep import SWEEP_WEIGHTINGS, TABLE_COLUMNS, run_sweep, table_cells, target_note

    config = load_run_config(config_path)
    if not hasattr(config.search.settings, "delta"):
        raise ConfigError(f"{config_path}: rsd-sweep varies search.settings.delta: program "
                          f"{config.search.program!r} has no such setting (use program rsd)")
    weighting = config.search.settings.weighting
    if weighting not in SWEEP_WEIGHTINGS:
        raise ConfigError(f"{config_path}: rsd-sweep varies search.settings.delta, which weighting {weighting!r} "
                          f"ignores: use one of {', '.join(SWEEP_WEIGHTINGS)}")
    limit = limit if limit is not None else config.dataset.limit
    problems = list(load_problems(config.dataset.name, limit=limit, offset=config.dataset.offset))
    target = (f"{config.generator.model} on the generator's runtime" if config.target == "generator"
              else config.target.model)
    title = (f"RSD delta sweep: draft {config.generator.model}, target {target}, scorer {config.scorer.kind}, "
             f"{config.dataset.name} x{len(problems)}, weighting {weighting}")
    print(f"sgl-tts rsd-sweep: {title}; deltas {', '.join(f'{d:g}' for d in deltas)}", flush=True)
    print(" | ".join(TABLE_COLUMNS), flush=True)
    with Session(config) as session:
        rows, results = run_sweep(problems, deltas, session.search_runtimes, config.search,
                                  concurrency=config.concurrency, cache=cache,
                                  on_delta=lambda row: print(" | ".join(table_cells(row)), flush=True))
    notes = []
    first = next(iter(results.values()))
    if any(r.extra["rsd"]["target_is_draft_model"] for r in first):
        notes.append(target_note(first[0].extra["rsd"]["settings"]))
    notes.append("cache: " + ("on: one draft step, score and target step per context, shared by all deltas "
                              "(exact at temperature 0)" if cache else "off (independent reruns)")
                 + "; latency = mean per problem of the model calls' seconds.")
    print()
    print(format_sweep_table(rows))
    for note in notes:
        print(note)
    for path in write_sweep_outputs(rows, results, Path(out), title, notes)[:5]:
        print(f"wrote {path}")
    return 0
