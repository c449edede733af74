"""Runtime health for the server: each runtime's state, and a supervisor that restarts a dead one.

A runtime is up while its process is (`alive()`); a replica set while its router and at least one replica are
(the router routes around a dead replica), with the dead replicas named. The `Supervisor` polls the runtimes on a
thread and restarts a dead one through `restart(name)` (the session's `Session.restart`: same config and name,
endpoints rebuilt): at most `attempts` tries, `backoff_s` doubling between them up to `max_backoff_s`, each
logged. While a runtime is not up, `/health` answers 503 and new searches are refused with 503 at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("sgl_tts.serve")

UP, DOWN, RESTARTING, FAILED = "up", "down", "restarting", "failed"  # FAILED: the restarts gave up


def runtime_state(runtime: Any) -> dict[str, Any]:
    """{"state": up/down} of one runtime; for a replica set also its router's and each replica's state and the
    replicas that are down."""
    workers = getattr(runtime, "workers", None)
    if workers is None:
        return {"state": UP if runtime.alive() else DOWN}
    router = getattr(runtime, "router", None)
    replicas = {worker.name: UP if worker.alive() else DOWN for worker in workers}
    router_up = router is not None and router.alive()
    up = router_up and UP in replicas.values()
    return {"state": UP if up else DOWN, "router": UP if router_up else DOWN, "replicas": replicas,
            "down": [name for name, state in replicas.items() if state == DOWN]}


class Supervisor:
    """Watches `runtimes()` (name → runtime, read anew each look: a restart replaces entries) and restarts a
    dead one with `restart(name)`. `sleep` is injectable so tests need not wait out the backoff."""

    def __init__(self, runtimes: Callable[[], dict[str, Any]], restart: Callable[[str], None], attempts: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, interval_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self.runtimes, self.restart = runtimes, restart
        self.attempts, self.backoff_s, self.max_backoff_s = attempts, backoff_s, max_backoff_s
        self.interval_s, self.sleep = interval_s, sleep
        self.restarts = 0  # successful restarts
        self._status: dict[str, str] = {}  # name → RESTARTING or FAILED while the runtime is not up
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def health(self) -> dict[str, dict[str, Any]]:
        states = {}
        for name, runtime in dict(self.runtimes()).items():
            state = runtime_state(runtime)
            if name in self._status:
                state["state"] = self._status[name]
            states[name] = state
        return states

    def down(self) -> list[str]:
        """The runtimes that are not up (down, restarting, or given up on)."""
        return [name for name, state in self.health().items() if state["state"] != UP]

    def check(self) -> None:
        """One look: restart each runtime that is down (not one already given up on)."""
        for name, state in self.health().items():
            if state["state"] == DOWN:
                self.recover(name)

    def recover(self, name: str) -> bool:
        """Restart runtime `name`, retrying with exponential backoff; whether it came back."""
        self._status[name] = RESTARTING
        for attempt in range(1, self.attempts + 1):
            log.warning("runtime '%s' is down: restart attempt %d of %d", name, attempt, self.attempts)
            try:
                self.restart(name)
            except Exception as exc:
                log.error("runtime '%s': restart attempt %d of %d failed: %s", name, attempt, self.attempts, exc)
                if attempt < self.attempts:
                    delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                    log.info("runtime '%s': next restart attempt in %.1f s", name, delay)
                    self.sleep(delay)
                continue
            self._status.pop(name, None)
            self.restarts += 1
            log.warning("runtime '%s' restarted (attempt %d)", name, attempt)
            return True
        self._status[name] = FAILED
        log.error("runtime '%s': gave up after %d restart attempts; the server answers 503", name, self.attempts)
        return False

    def start(self) -> "Supervisor":
        def watch() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.check()
                except Exception:  # a look that failed must not end the watch
                    log.exception("runtime supervisor: a health check failed")

        self._thread = threading.Thread(target=watch, name="sgl-tts-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
