"""The `sgl-tts` command line, the top layer: one module per command group adds its subcommands and maps the
parsed arguments onto the library (`run.py`: run, programs; `bench.py`; `plan.py`; `rsd.py`: rsd-sweep;
`train.py`; `serve.py`; `eval.py`: eval, eval verifier). Nothing below imports this package."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Sequence

DESCRIPTION = "The `sgl-tts` command line."


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.cli import bench, plan, rsd, run, serve, train
    from sgl_tts.cli import eval as eval_commands

    from sgl_tts import __version__

    parser = argparse.ArgumentParser(prog="sgl-tts", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"sgl-tts {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run.add_parsers(commands)  # programs, run
    bench.add_parsers(commands)
    plan.add_parsers(commands)
    rsd.add_parsers(commands)  # rsd-sweep
    train.add_parsers(commands)
    serve.add_parsers(commands)
    eval_commands.add_parsers(commands)  # eval, eval verifier
    return parser


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
    from sgl_tts.paths import FolderLocked
    from sgl_tts.problems import DatasetError
    from sgl_tts.runtime.cpu_shim import ShimBuildError
    from sgl_tts.runtime.models import ModelNotFoundError
    from sgl_tts.runtime.server import RuntimeStartError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, DatasetError, FolderLocked, ModelNotFoundError, RuntimeStartError, ShimBuildError,
            KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"sgl-tts: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
