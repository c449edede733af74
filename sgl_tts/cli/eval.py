"""`sgl-tts eval` (`eval.runner`: an experiment's arms side by side) and `sgl-tts eval verifier`
(`eval.verifier`: configured scorers on step-labelled solutions)."""

from __future__ import annotations

import argparse


def add_parsers(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("eval", help="run an experiment's arms side by side; resumable; report + plots")
    parser.add_argument("--config", help="experiment config (YAML), e.g. eval/configs/cpu-default.yaml")
    parser.add_argument("--out", help="run folder (an existing one is resumed: same experiment only)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="resume a run folder (with its experiment.yaml "
                                                             "unless --config is given)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeline", metavar="DIR", help="draw each draw's timeline (runtime slots over time: "
                                                          "generate, verify, speculation, straggler tail, idle) "
                                                          "into DIR")
    parser.set_defaults(func=eval_command)

    # Optional, so that `sgl-tts eval --config ...` runs an experiment as before.
    eval_commands = parser.add_subparsers(dest="eval_command", required=False, metavar="{verifier}")
    verifier = eval_commands.add_parser("verifier", help="find-the-first-wrong-step figures of configured scorers")
    verifier.add_argument("--config", nargs="+", required=True, help="run configs whose scorers to compare")
    verifier.add_argument("--data", help="ProcessBench-format JSONL (default: the shared processbench-math set)")
    verifier.add_argument("--part", choices=["heldout", "train", "all"], default="heldout",
                          help="which part of the fixed split (sgl_tts.scoring.step_labels.in_heldout) to use")
    verifier.add_argument("--limit", type=int, help="only the first LIMIT solutions of that part")
    verifier.add_argument("--folds", type=int, default=2, help="folds for choosing the F1 threshold")
    verifier.add_argument("--concurrency", type=int, default=8, help="solutions scored at once")
    verifier.add_argument("--out", help="run folder (an existing one is resumed)")
    verifier.set_defaults(func=eval_verifier_command)


def eval_command(args: argparse.Namespace) -> int:
    from sgl_tts.runtime.server import prestart_cpu_zygote

    prestart_cpu_zygote()  # its imports beside the ones below (sgl_tts/runtime/zygote.py)
    from eval.runner import run_eval

    return run_eval(args.config, out=args.out, resume=args.resume, progress=False if args.no_progress else None,
                    timeline=args.timeline)


def eval_verifier_command(args: argparse.Namespace) -> int:
    from eval.verifier import evaluate_verifiers

    return evaluate_verifiers(args.config, data=args.data, part=args.part, limit=args.limit, folds=args.folds,
                              concurrency=args.concurrency, out=args.out)
