"""`sgl-tts serve --config FILE`: start the run config's runtimes (a `Session`), their supervisor (a dead runtime
is restarted with `Session.restart`) and the HTTP server.

`HTTPServer` runs uvicorn on a socket bound before it starts (so the port is known and connections queue
from the start), in the foreground (`serve_forever`) or on a thread (`start`, for tests and benchmarks).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from dataclasses import dataclass
from typing import Any

from sgl_tts.runtime.server import LOCALHOST

API_KEY_ENV = "SGL_TTS_API_KEY"


@dataclass(frozen=True)
class ServeConfig:
    host: str = LOCALHOST  # another address only when the user asks (--host)
    port: int = 8000  # 0: a free port
    api_key: str | None = None  # checked on every route but /health
    max_searches: int | None = None  # searches in flight, past it 429; None: the run config's concurrency

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_searches is not None and self.max_searches < 1:
            raise ValueError(f"max_searches must be at least 1, got {self.max_searches}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")


class HTTPServer:
    """uvicorn serving `app` on host:port."""

    def __init__(self, app: Any, host: str = LOCALHOST, port: int = 0):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(128)
        self.host, self.port = self.socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        self.server.run(sockets=[self.socket])

    def start(self) -> "HTTPServer":
        self.thread = threading.Thread(target=self.serve_forever, name="sgl-tts-http", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.socket.close()

    def __enter__(self) -> "HTTPServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def session_service(session: Any, max_searches: int | None = None, health: Any = None) -> Any:
    """The SearchService on a started Session: its runtimes, its search config as the defaults, and the run
    config's rules for a request's search settings; `health`: the runtimes' Supervisor."""
    from sgl_tts.app.session import checked_program
    from sgl_tts.serve.service import SearchService

    def validate(search: Any) -> None:
        checked_program(dataclasses.replace(session.config, search=search), "request", "settings")

    def prompt_tokens(question: str) -> int:
        return len(session.tokenizer.encode(session.search_runtimes.prompt(question), add_special_tokens=False))

    limits = session.config.limits
    return SearchService(session.search_runtimes, session.config.search,
                         max_searches or session.config.concurrency, validate=validate, limits=limits,
                         prompt_tokens=prompt_tokens,
                         context_tokens=limits.context_tokens or context_length(session.tokenizer), health=health)


def context_length(tokenizer: Any) -> int | None:
    """The generator's context length as its tokenizer declares it (`model_max_length`); None when the tokenizer
    declares none (transformers then gives a huge placeholder, about 1e30)."""
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < 10**8 else None


def serve(config_path: str, serve_config: ServeConfig) -> int:
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.serve.app import create_app
    from sgl_tts.serve.health import Supervisor

    run_config = load_run_config(config_path)
    with Session(run_config) as session:
        supervisor = Supervisor(lambda: session.runtimes, session.restart).start()
        service = session_service(session, serve_config.max_searches, health=supervisor)
        server = HTTPServer(create_app(service, serve_config.api_key), serve_config.host, serve_config.port)
        print(f"runtimes ready in {session.started_s:.0f} s: "
              + ", ".join(f"{name} {rt.url}" for name, rt in session.runtimes.items()), flush=True)
        print(f"sgl-tts serve: {server.url}/v1 (programs: {', '.join(service.programs)}; "
              f"{service.max_searches} searches at once; API key {'on' if serve_config.api_key else 'off'})",
              flush=True)
        try:
            server.serve_forever()
        finally:
            supervisor.stop()
            service.close()
    return 0
