"""`sgl-tts train prm`: train the probe PRM head (`sgl_tts.scoring.probe_train`)."""

from __future__ import annotations

import argparse

from sgl_tts.scoring.probe import DEFAULT_HEAD
from sgl_tts.scoring.probe_train import DEFAULT_L2, DEFAULT_LAYERS


def add_parsers(commands: argparse._SubParsersAction) -> None:
    train_parser = commands.add_parser("train", help="train verifiers")
    train_commands = train_parser.add_subparsers(dest="train", required=True)
    prm = train_commands.add_parser("prm", help="train the probe PRM head on step-labelled solutions (CPU)")
    prm.add_argument("--data", help="ProcessBench-format JSONL (default: the shared processbench-math set)")
    prm.add_argument("--base-model", default="smollm2-135m", help="the Llama model whose hidden states it reads")
    prm.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS), help="candidate layers")
    prm.add_argument("--l2", type=float, nargs="+", default=list(DEFAULT_L2), help="candidate L2 strengths")
    prm.add_argument("--seed", type=int, default=0, help="seed of the solution order (and torch)")
    prm.add_argument("--solutions", type=int, help="only the first SOLUTIONS of the seeded order (default: all)")
    prm.add_argument("--workers", type=int, default=1, help="feature-extraction processes (one thread each)")
    prm.add_argument("--out", default=str(DEFAULT_HEAD), help="where to write the head (JSON)")
    prm.set_defaults(func=train_prm_command)


def train_prm_command(args: argparse.Namespace) -> int:
    from sgl_tts.scoring.probe_train import train_prm

    train_prm(data=args.data, base_model=args.base_model, layers=args.layers, l2=args.l2, seed=args.seed,
              solutions=args.solutions, workers=args.workers, out=args.out)
    return 0
