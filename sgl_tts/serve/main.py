"""`sgl-tts serve --config FILE`: start the run config's runtimes (a `Session`), their supervisor (a dead runtime
is restarted with `Session.restart`) and the HTTP server.

`HTTPServer` runs uvicorn on a socket bound before it starts (so the port is known and connections queue
from the start), in the foreground (`serve_forever`) or on a thread (`start`).

`serve` runs it on a thread and waits for SIGTERM or SIGINT, then shuts down in an order that answers every
client and leaves no process, within `ShutdownBounds` (about 10 s): the supervisor stops (no restart from now
on); every search in flight is answered with 503 `shutting_down` and cancelled, new ones are refused with 503;
uvicorn sends those answers and stops; the cancelled searches get a short while to end; the runtimes are
stopped together, which fails at once any runtime call a search thread is still blocked in; a last short wait
for those threads. Search threads are never waited on before the runtimes stop: one blocked in a scorer call
would hold the shutdown for up to the request timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from sgl_tts import env_names
from sgl_tts.runtime.server import LOCALHOST

API_KEY_ENV = env_names.API_KEY
SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("sgl_tts.serve")


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


@dataclass(frozen=True)
class ShutdownBounds:
    """How long each step of a shutdown may take, in seconds: 7 at most, so that with the runtimes' SIGKILL and
    the interpreter's exit (about 2 s with torch loaded) the process ends within 10 s of the signal. SGLang
    drains on SIGTERM for longer than that (on CPU, its scheduler's exit triggers 5 s of crash diagnostics),
    so a runtime is usually ended by the SIGKILL after its grace."""

    supervisor_s: float = 0.5  # a runtime restart under way is not waited for longer
    http_s: float = 1.5  # uvicorn's graceful end: the answers (already given) are sent, then it stops
    searches_s: float = 1.0  # the cancelled searches end as their aborted requests come back
    runtime_grace_s: float = 3.0  # each runtime's SIGTERM grace before SIGKILL (all runtimes at once)
    threads_s: float = 1.0  # search threads a stopped runtime's failed call releases

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            if getattr(self, item.name) < 0:
                raise ValueError(f"{item.name} must not be negative, got {getattr(self, item.name)}")


class HTTPServer:
    """uvicorn serving `app` on host:port; `graceful_s`: how long a stop waits for the responses under way."""

    def __init__(self, app: Any, host: str = LOCALHOST, port: int = 0, graceful_s: float = 5.0):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(128)
        self.host, self.port = self.socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s))
        self.thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        self.server.run(sockets=[self.socket])

    def start(self) -> "HTTPServer":
        self.thread = threading.Thread(target=self.serve_forever, name="sgl-tts-http", daemon=True)
        self.thread.start()
        return self

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

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

    def prompt_tokens(prompt: str) -> int:
        return len(session.tokenizer.encode(prompt, add_special_tokens=False))

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


@contextmanager
def shutdown_signals() -> Iterator[list[int]]:
    """Inside, SIGTERM and SIGINT only note their arrival in the list it yields (a second one during the
    shutdown changes nothing); the previous handlers come back on exit. The handler touches no lock: a signal
    arrives between any two bytecodes of the main thread, which may hold one."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in SHUTDOWN_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_for_signal(received: list[int], server: HTTPServer, poll_s: float = 0.2) -> None:
    """Return once a shutdown signal is in `received` or the server has ended by itself."""
    while not received and server.running():
        server.thread.join(timeout=poll_s)


def stop_runtimes(runtimes: Iterable[Any], grace_s: float) -> None:
    """Stop `runtimes` all at once (each: SIGTERM to its process group, SIGKILL after `grace_s`), so that the
    time to stop them is the slowest one's, not their sum."""
    stoppers = [threading.Thread(target=runtime.stop, args=(grace_s,), name=f"stop-{runtime.name}")
                for runtime in runtimes]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()


def shut_down(session: Any, supervisor: Any, service: Any, server: HTTPServer,
              bounds: ShutdownBounds = ShutdownBounds()) -> None:
    """The shutdown sequence of the module docstring: answer and cancel every search, stop the HTTP server,
    stop the runtimes, then the search threads their stop released. The session's exit then finds the
    runtimes stopped."""
    began = time.monotonic()
    supervisor.stop(bounds.supervisor_s)
    service.shut_down()
    server.stop()
    service.join(bounds.searches_s)
    stop_runtimes(session.runtimes.values(), bounds.runtime_grace_s)
    if not service.join(bounds.threads_s):
        log.warning("sgl-tts serve: %d search threads still blocked after the runtimes stopped; not waiting "
                    "for them", len(service.jobs))
    log.info("sgl-tts serve: shut down in %.1f s", time.monotonic() - began)


def serve(config_path: str, serve_config: ServeConfig, bounds: ShutdownBounds = ShutdownBounds()) -> int:
    """Serve the run config at `config_path` until SIGTERM or SIGINT, then shut down (`shut_down`); 0 after a
    signal, 1 when the HTTP server ended by itself."""
    from sgl_tts.app.session import Session, load_run_config
    from sgl_tts.serve.app import create_app
    from sgl_tts.serve.health import Supervisor

    run_config = load_run_config(config_path)
    with Session(run_config) as session:
        supervisor = Supervisor(lambda: session.runtimes, session.restart).start()
        service = session_service(session, serve_config.max_searches, health=supervisor)
        server = HTTPServer(create_app(service, serve_config.api_key), serve_config.host, serve_config.port,
                            graceful_s=bounds.http_s)
        print(f"runtimes ready in {session.started_s:.0f} s: "
              + ", ".join(f"{name} {rt.url}" for name, rt in session.runtimes.items()), flush=True)
        print(f"sgl-tts serve: {server.url}/v1 (programs: {', '.join(service.programs)}; "
              f"{service.max_searches} searches at once; API key {'on' if serve_config.api_key else 'off'})",
              flush=True)
        with shutdown_signals() as received:
            server.start()
            try:
                wait_for_signal(received, server)
                if received:
                    print(f"sgl-tts serve: {signal.Signals(received[0]).name}: shutting down", flush=True)
            finally:
                shut_down(session, supervisor, service, server, bounds)
    return 0 if received else 1  # without a signal, the HTTP server ended by itself: a failure
