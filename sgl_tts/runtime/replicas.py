"""N SGLang servers of one runtime config behind SGLang's router, standing in for one runtime.

A `ReplicaSet` (what a session starts for `config.replicas > 1` or `config.remote_workers`) is the servers
on free ports (on CUDA, replica i from GPU i·tp on), any servers running elsewhere, and
`python -m sglang_router.launch_router` (package sglang-router) in front of them, with cache-aware routing (a
prompt goes where its prefix is cached). The set has the `Runtime` interface (`url` is the router's), so
sessions, programs and scorers use it unchanged. Each router gets its own
`--prometheus-port`: two routers on the default (29000) collide and the second panics.

A dead replica is replaced with `restart_replica` while the others serve. The router is told through its worker
API rather than left to find out: by itself it keeps a dead worker in rotation (its health check runs once a
minute), so the requests it sends there fail (cache-aware routing sends each prompt whose prefix that worker had
cached, and the router's retries go to the same worker) until ten attempts have failed and the worker's circuit
breaker opens; from then on it skips the worker until the breaker's timeout (60 s) has passed, even when a new
server is already back on the worker's URL (observed with sglang-router 0.3.2).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from sgl_tts.runtime.http_client import http_json, request
from sgl_tts.runtime.server import Runtime, RuntimeConfig, RuntimeDiedError, flag_value, free_port, spawn_group

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


# The router's worker API (sglang-router 0.3.2): GET /workers lists each worker as {"id", "url", "is_healthy",
# ...}; POST /workers {"url": ...} and DELETE /workers/{id} queue an addition or a removal (202 Accepted) that a
# background job carries out, so a change is done once the list shows it.
ROUTER_API_TIMEOUT_S = 10.0
ROUTER_CHANGE_TIMEOUT_S = 120.0  # the longest the router's job may take to list an added worker or drop one


def router_workers(router_url: str) -> dict[str, dict]:
    """The workers the router at `router_url` routes to: URL → its record."""
    listed = http_json(router_url + "/workers", timeout=ROUTER_API_TIMEOUT_S)["workers"]
    return {worker["url"]: worker for worker in listed}


def remove_worker(router_url: str, worker_url: str) -> None:
    """Stop the router routing to `worker_url`; returns once the router no longer lists it (at once when it did
    not)."""
    listed = router_workers(router_url).get(worker_url)
    if listed is not None:
        request("DELETE", f"{router_url}/workers/{listed['id']}", timeout=ROUTER_API_TIMEOUT_S)
    _wait_for(lambda: worker_url not in router_workers(router_url),
              f"the router at {router_url} still lists worker {worker_url}")


def add_worker(router_url: str, worker_url: str) -> None:
    """Have the router route to `worker_url` (a ready server); returns once the router lists it as healthy."""
    request("POST", router_url + "/workers", {"url": worker_url}, timeout=ROUTER_API_TIMEOUT_S)
    _wait_for(lambda: router_workers(router_url).get(worker_url, {}).get("is_healthy") is True,
              f"the router at {router_url} does not list worker {worker_url} as healthy")


def _wait_for(done: Callable[[], bool], failure: str, timeout_s: float = ROUTER_CHANGE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{failure} after {timeout_s:.0f} s")
        time.sleep(0.1)


def set_aside(log_path: Path) -> None:
    """Rename a stopped server's log to the first free `<name>.<k>.log`, so that a server started again under the
    same name and port does not overwrite it."""
    if not log_path.exists():
        return
    k = 1
    while (kept := log_path.with_name(f"{log_path.stem}.{k}{log_path.suffix}")).exists():
        k += 1
    log_path.rename(kept)


def replica_config(config: RuntimeConfig, index: int) -> RuntimeConfig:
    """The config of local replica `index`: a free port and, on CUDA, its own GPUs (`--base-gpu-id` after the
    previous replicas' `--tp-size` GPUs each) unless the config places them itself."""
    extra = list(config.extra_args)
    if config.device == "cuda" and flag_value(extra, "--base-gpu-id") is None:
        tp = int(flag_value(extra, "--tp-size", "--tensor-parallel-size") or 1)
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

    def restart_replica(self, index: int) -> Runtime:
        """Replace local replica `index` (dead or not) by a new server of its config on its port, routed to
        again; returns the new server. The other replicas serve meanwhile.

        The router stops routing to the old server before it is stopped, and routes to the new one once it is
        ready (see the module's docstring for why the router is told). The old server's log is kept
        (`set_aside`). When a step fails, the replica is left out of the router; calling this again retries."""
        if self.router is None or not self.router.alive():
            raise RuntimeDiedError(f"replica set '{self.name}': its router is not running")
        old = self.workers[index]
        remove_worker(self.router.url, old.url)
        old.stop()
        set_aside(old.log_path)
        config = replace(replica_config(self.config, index), port=old.port)
        new = Runtime.start(config, name=old.name, log_dir=self.log_dir)
        self.workers[index] = new
        add_worker(self.router.url, new.url)
        return new

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

