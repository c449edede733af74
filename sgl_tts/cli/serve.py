"""`sgl-tts serve`: an OpenAI-compatible endpoint answered by a search (`sgl_tts.serve.main`)."""

from __future__ import annotations

import argparse
import logging

from sgl_tts.env_names import read
from sgl_tts.runtime.server import LOCALHOST
from sgl_tts.serve.main import API_KEY_ENV


def add_parsers(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="OpenAI-compatible HTTP endpoint that answers with a search")
    parser.add_argument("--config", default="configs/cpu-default.yaml", help="run config (YAML)")
    parser.add_argument("--host", default=LOCALHOST, help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: env {API_KEY_ENV})")
    parser.add_argument("--max-searches", type=int,
                        help="searches in flight before answering 429 (default: the config's concurrency)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log level of the server's log (logger sgl_tts.serve: access lines, failures, restarts)")
    parser.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    from sgl_tts.runtime.server import prestart_cpu_zygote

    prestart_cpu_zygote()  # its imports beside the ones below (sgl_tts/runtime/zygote.py)
    from sgl_tts.config import ConfigError
    from sgl_tts.serve.main import ServeConfig, serve

    try:
        serve_config = ServeConfig(host=args.host, port=args.port, max_searches=args.max_searches,
                                   api_key=args.api_key or read(API_KEY_ENV))
    except ValueError as exc:
        raise ConfigError(f"sgl-tts serve: {exc}") from None
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sgl_tts.serve").setLevel(args.log_level.upper())
    return serve(args.config, serve_config)
