"""Runtime health for the server: each runtime's state, and a supervisor that restarts a dead one.

A runtime is up while its process is (`alive()`); a replica set while its router and at least one replica are
(the router routes around a dead replica), with the replicas that are not up named. The `Supervisor` polls the
runtimes on a thread and restarts a dead one through `restart(name)` (the session's `Session.restart`: same
config and name, endpoints rebuilt), and a dead replica of a set that is up through the set's
`restart_replica(index)` (the router's URL stays, so nothing is rebuilt; the set serves on its other replicas
meanwhile). Either restart is at most `attempts` tries, `backoff_s` doubling between them up to
`max_backoff_s`, each logged. While a runtime is not up, `/health` answers 503 and new searches are refused with
503 at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("sgl_tts.serve")

UP, DOWN, RESTARTING, FAILED = "up", "down", "restarting", "failed"  # FAILED: the restarts gave up


def runtime_state(runtime: Any, replica_status: dict[str, str] | None = None) -> dict[str, Any]:
    """{"state": up/down} of one runtime; for a replica set also its router's and each replica's state and the
    replicas that are not up. `replica_status` (replica name → RESTARTING or FAILED) is the state of the replicas
    being restarted or given up on."""
    workers = getattr(runtime, "workers", None)
    if workers is None:
        return {"state": UP if runtime.alive() else DOWN}
    router = getattr(runtime, "router", None)
    status = replica_status or {}
    replicas = {worker.name: status.get(worker.name) or (UP if worker.alive() else DOWN) for worker in workers}
    router_up = router is not None and router.alive()
    up = router_up and UP in replicas.values()
    return {"state": UP if up else DOWN, "router": UP if router_up else DOWN, "replicas": replicas,
            "down": [name for name, state in replicas.items() if state != UP]}


class Supervisor:
    """Watches `runtimes()` (name → runtime, read anew each look: a restart replaces entries) and restarts a
    dead one with `restart(name)`, a dead replica with its set's `restart_replica(index)`. `sleep` is injectable
    so tests need not wait out the backoff."""

    def __init__(self, runtimes: Callable[[], dict[str, Any]], restart: Callable[[str], None], attempts: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, interval_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep):
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        self.runtimes, self.restart = runtimes, restart
        self.attempts, self.backoff_s, self.max_backoff_s = attempts, backoff_s, max_backoff_s
        self.interval_s, self.sleep = interval_s, sleep
        self.restarts = 0  # successful restarts, of runtimes and of replicas
        self._status: dict[str, str] = {}  # name → RESTARTING or FAILED while the runtime is not up
        self._replica_status: dict[str, dict[str, str]] = {}  # set name → replica name → RESTARTING or FAILED
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def health(self) -> dict[str, dict[str, Any]]:
        states = {}
        for name, runtime in dict(self.runtimes()).items():
            state = runtime_state(runtime, dict(self._replica_status.get(name, {})))
            if name in self._status:
                state["state"] = self._status[name]
            states[name] = state
        return states

    def down(self) -> list[str]:
        """The runtimes that are not up (down, restarting, or given up on)."""
        return [name for name, state in self.health().items() if state["state"] != UP]

    def check(self) -> None:
        """One look: restart each runtime that is down, and each dead replica of a replica set that is up (none
        already given up on)."""
        for name, state in self.health().items():
            if state["state"] == DOWN:
                self.recover(name)
            elif state["state"] == UP:
                for replica, replica_state in state.get("replicas", {}).items():
                    if replica_state == DOWN:
                        self.recover_replica(name, replica)

    def recover(self, name: str) -> bool:
        """Restart runtime `name`, retrying with exponential backoff; whether it came back. The restarted set's
        replicas start afresh."""
        self._replica_status.pop(name, None)
        return self._retry(self._status, name, f"runtime '{name}'", lambda: self.restart(name),
                           "the server answers 503")

    def recover_replica(self, name: str, replica: str) -> bool:
        """Restart replica `replica` of replica set `name`, retrying with exponential backoff; whether it came
        back. The set serves on its other replicas meanwhile."""
        runtime = self.runtimes()[name]
        index = [worker.name for worker in runtime.workers].index(replica)
        return self._retry(self._replica_status.setdefault(name, {}), replica,
                           f"replica '{replica}' of runtime '{name}'", lambda: runtime.restart_replica(index),
                           "the runtime serves on its other replicas")

    def _retry(self, status: dict[str, str], key: str, what: str, restart: Callable[[], Any],
               given_up: str) -> bool:
        """Call `restart` until it returns, at most `attempts` times with exponential backoff, logging each
        attempt as one of `what`; `status[key]` is RESTARTING meanwhile, FAILED once given up on (logged with
        `given_up`, what that means), and gone once `restart` succeeded."""
        status[key] = RESTARTING
        for attempt in range(1, self.attempts + 1):
            log.warning("%s is down: restart attempt %d of %d", what, attempt, self.attempts)
            try:
                restart()
            except Exception as exc:
                log.error("%s: restart attempt %d of %d failed: %s", what, attempt, self.attempts, exc)
                if attempt < self.attempts:
                    delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                    log.info("%s: next restart attempt in %.1f s", what, delay)
                    self.sleep(delay)
                continue
            status.pop(key, None)
            self.restarts += 1
            log.warning("%s restarted (attempt %d)", what, attempt)
            return True
        status[key] = FAILED
        log.error("%s: gave up after %d restart attempts; %s", what, self.attempts, given_up)
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

    def stop(self, timeout_s: float = 60.0) -> None:
        """End the watch: no new look starts; a restart under way is waited for at most `timeout_s` (its new
        server, if it comes up later, is stopped by its watchdog when this process ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
