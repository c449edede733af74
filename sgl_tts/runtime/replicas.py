"""N SGLang servers of one runtime config behind SGLang's router, standing in for one runtime.

A `ReplicaSet` (what a session starts for `config.replicas > 1` or `config.remote_workers`) is the servers
on free ports (on CUDA, replica i from GPU i·tp on), any servers running elsewhere, and
`python -m sglang_router.launch_router` (package sglang-router) in front of them, with cache-aware routing (a prompt goes where its prefix is cached). The set has the `Runtime` interface
(`url` is the router's), so sessions, programs and scorers use it unchanged. Each router gets its own
`--prometheus-port`: two routers on the default (29000) collide and the second panics.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from sgl_tts.runtime.server import Runtime, RuntimeConfig, RuntimeDiedError, free_port, spawn_group

ROUTING_POLICY = "cache_aware"
# Cache-aware routing sends a request where its prefix is cached unless the busiest worker has more than this
# many requests above the idlest (and 1.5x as many). Every search prompt shares the system prompt, so with the
# router's default (64) 32 concurrent beam searches (n=2, tiny-random) all went to one of two replicas
# (tests/test_serve_runtime.py); at 8 the load spreads once one replica is busier.
BALANCE_ABS_THRESHOLD = 8


def router_command(config: RuntimeConfig, port: int, worker_urls: list[str], prometheus_port: int) -> list[str]:
    """The router's command line; `config.router_args` come last, so they override (the router's parser keeps
    the last value of a flag)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", config.host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", ROUTING_POLICY,
            "--balance-abs-threshold", str(BALANCE_ABS_THRESHOLD), "--prometheus-port", str(prometheus_port),
            *config.router_args]


def replica_config(config: RuntimeConfig, index: int) -> RuntimeConfig:
    """The config of local replica `index`: a free port and, on CUDA, its own GPUs (`--base-gpu-id` after the
    previous replicas' `--tp-size` GPUs each) unless the config places them itself."""
    extra = list(config.extra_args)
    if config.device == "cuda" and "--base-gpu-id" not in extra:
        tp = next((int(extra[i + 1]) for i, flag in enumerate(extra[:-1])
                   if flag in ("--tp-size", "--tensor-parallel-size")), 1)
        extra += ["--base-gpu-id", str(index * tp)]
    return replace(config, replicas=1, remote_workers=[], router_args=[], port=None, extra_args=extra)


class ReplicaSet:
    """`config.replicas` servers and the router in front of them (started once the servers are ready)."""

    def __init__(self, name: str, config: RuntimeConfig, workers: list[Runtime], log_dir: Path):
        self.name = name
        self.config = config
        self.workers = workers
        self.log_dir = log_dir
        self.router: Runtime | None = None

    @classmethod
    def start(cls, config: RuntimeConfig, name: str = "generator", log_dir: str | Path | None = None,
              wait: bool = True) -> "ReplicaSet":
        workers: list[Runtime] = []
        try:
            for index in range(config.replicas):
                workers.append(Runtime.start(replica_config(config, index), name=f"{name}-{index}", log_dir=log_dir,
                                             wait=False))
        except BaseException:
            for worker in workers:
                worker.stop()
            raise
        replica_set = cls(name, config, workers, workers[0].log_path.parent)
        if wait:
            replica_set.wait_ready()
        return replica_set

    def wait_ready(self) -> None:
        try:
            for worker in self.workers:
                worker.wait_ready()
            if self.router is None:
                self.router = self._start_router()
            self.router.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _start_router(self) -> Runtime:
        host = self.config.host
        port = self.config.port or free_port(host)
        log_path = self.log_dir / f"{self.name}-router-{port}.log"
        process = spawn_group(router_command(self.config, port, self.worker_urls, free_port(host)), log_path)
        # The router answers /get_model_info and /generate like a server, so Runtime's readiness check,
        # process-group stop and watchdog serve it too.
        return Runtime(f"{self.name}-router", self.config, self.model_path, port, process, log_path)

    @property
    def url(self) -> str:
        if self.router is None:
            raise RuntimeError(f"runtime '{self.name}': the router starts in wait_ready()")
        return self.router.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def worker_urls(self) -> list[str]:
        return [worker.url for worker in self.workers] + list(self.config.remote_workers)

    @property
    def model_path(self) -> str:
        return self.workers[0].model_path

    @property
    def model_info(self) -> dict:
        return self.workers[0].model_info

    @property
    def log_path(self) -> Path:
        return self.router.log_path if self.router is not None else self.workers[0].log_path

    def log_tail(self, lines: int = 40) -> str:
        return self.router.log_tail(lines) if self.router is not None else self.workers[0].log_tail(lines)

    def _parts(self) -> list[Runtime]:
        return [*self.workers, *([self.router] if self.router is not None else [])]

    def alive(self) -> bool:
        return all(part.alive() for part in self._parts())

    def check_alive(self) -> None:
        for part in self._parts():
            try:
                part.check_alive()
            except RuntimeDiedError as exc:
                raise RuntimeDiedError(f"replica set '{self.name}': {exc}") from None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.router is not None:
            self.router.stop(grace_s)
        for worker in self.workers:
            worker.stop(grace_s)

    def __enter__(self) -> "ReplicaSet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

