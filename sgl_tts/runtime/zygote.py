"""A process with SGLang already imported, from which CPU runtimes are forked instead of started afresh.

A CPU runtime's start-up is mostly imports: `python -m sgl_tts.runtime.launch` spends about 16 s of one core
importing torch, transformers and SGLang before its first log line (a 28 s start of the tiny model on 2 cores).
A process that starts several runtimes over its life (a test session, `serve` restarting a dead runtime, an
eval restarting its runtimes between arms) pays that once: its zygote imports them, then waits on a Unix socket
in a private folder. A runtime start sends the launch's argv, environment, working directory and log path; the
zygote forks, and the child becomes that runtime as `python -m <module> ARGS` would (a session of its own,
output to the log, the environment and working directory replaced, then the module run as `__main__`). The
zygote reaps its children and writes each one's exit code beside its log (`ForkedProcess` reads it).

What the imports read from the environment they read in the zygote, so a runtime is forked only from a zygote
whose environment equals the runtime's in every variable but those read after the imports (`READ_LATER`: the
thread count, which the child sets, and the plugin's settings, which SGLang's `load_plugins` reads in the child);
otherwise it is started the usual way. The zygote has never run a torch operation (a forked OpenMP pool would
not work) and holds no threads of its own. It exits when its owner does (`stop_all` at exit, else within
`POLL_S` of the owner's death); the runtimes it forked have their owner's watchdogs like any other. A process
keeps a zygote per import environment it starts runtimes with, at most MAX_ZYGOTES.

`run`, `serve` and `eval` start the CPU runtimes' zygote first (`prestart`, not waited for), before their own
imports (SGLang's frontend: ~9 s of a core before a session starts), so that the two imports run side by side on two
cores. The process's own import of SGLang then sets SGLang's cache variables in its environment (SET_BY_SGLANG),
which the zygote's import sets to the same values, so they are not part of the key. `sgl-tts run --limit 1` from its
start to its runtimes ready, alternating with the zygote started after the imports, six rounds each (2-core Intel
Xeon, load average 1.7-2.1): 24.4 [22.8-27.4] s against 29.1 [27.5-31.1].
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sgl_tts import env_names
from sgl_tts.paths import write_atomic

MODULE = "sgl_tts.runtime.zygote"
POLL_S = 0.2  # how often the zygote reaps its children and checks that its owner lives
READY = "ready"
UNKNOWN_EXIT = -1  # a forked process's exit code when its zygote died before it (nobody reaped it for us)
# Imported before any fork: what a runtime's launch imports (sglang.launch_server itself is left to run as
# `__main__`). A module missing from this SGLang is skipped: the runtime imports what it needs.
PRELOAD = ("torch", "transformers", "sglang", "sglang.srt.plugins", "sglang.srt.server_args",
           "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
           "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
           "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.data_parallel_controller",
           "sglang.srt.model_executor.model_runner", "sglang.srt.models.registry",
           "sglang.srt.layers.attention.torch_native_backend", "sglang.srt.mem_cache.memory_pool")
# Read after the imports, in the child: OpenMP's thread count (the child sets torch's from it), SGLang's cores
# per rank, the plugin's settings, and pytest's name of the running test.
READ_LATER = frozenset({"OMP_NUM_THREADS", "SGLANG_CPU_OMP_THREADS_BIND", "PYTEST_CURRENT_TEST", env_names.POLICY,
                        env_names.POLICY_TRACE, env_names.CPU_ATTENTION, env_names.CPU_LINEAR, env_names.CPU_LAYERS,
                        env_names.CPU_DECODE, env_names.CPU_SAMPLING, env_names.DP_PLACEMENT, env_names.CORE_LENDING,
                        env_names.STEP_TRACE, env_names.PROBE_HEAD})
# Set by SGLang's own import (`third_party_cache_defaults`, from SGLANG_CACHE_DIR, which stays in the key) where the
# caller's environment does not set them: a process that imported SGLang passes them on, and a zygote's import sets
# them to the same values, so they do not tell import environments apart.
SET_BY_SGLANG = frozenset({"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH", "TILELANG_CACHE_DIR",
                           "FLASHINFER_WORKSPACE_BASE"})
SAFE_PATH = "PYTHONSAFEPATH"  # Python's (3.11, `python -P`): no working folder first on a process's path
OFF = "off"  # $SGLTTS_RUNTIME_ZYGOTE=off: every runtime started the usual way


def import_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of `env` that imports may read and SGLang's does not set (all of it but READ_LATER and
    SET_BY_SGLANG), sorted: a zygote's key."""
    return tuple(sorted((key, value) for key, value in env.items()
                        if key not in READ_LATER and key not in SET_BY_SGLANG))


# ---------------------------------------------------------------------------------------------------------
# The owner's side


class ForkedProcess:
    """The `subprocess.Popen` surface `Runtime` uses (pid, poll, wait, returncode) for a process its zygote
    forked: not this process's child, so its exit code comes from the file the zygote writes."""

    def __init__(self, pid: int, exit_path: Path, args: list[str]):
        self.pid = pid
        self.args = args
        self.exit_path = exit_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._written_code()
            if code is None and not _exists(self.pid):  # gone: its code was written first, unless its zygote died
                code = self._written_code()
                code = UNKNOWN_EXIT if code is None else code
            self.returncode = code
        return self.returncode

    def _written_code(self) -> int | None:
        try:
            return int(self.exit_path.read_text())
        except (OSError, ValueError):  # not written: running, or its zygote died before it
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def _exists(pid: int) -> bool:
    """Whether `pid` is a process, a zombie included (a zombie's exit code is on its way)."""
    return Path(f"/proc/{pid}").exists()


class Zygote:
    """A zygote owned by this process. `Zygote(env)` starts it and waits until it has imported PRELOAD;
    `Zygote(env, wait=False)` only starts it (`wait_ready` waits)."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] | None = None, wait: bool = True,
                 unused_exit_s: float = 0.0):
        preload = PRELOAD if preload is None else preload
        self.folder = Path(tempfile.mkdtemp(prefix="sgl-tts-zygote-"))  # mode 0700: only this user connects
        self.socket_path = self.folder / "socket"
        self.log_path = self.folder / "zygote.log"
        self.children: list[ForkedProcess] = []
        self.owner = os.getpid()
        self.ready = False
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", MODULE, str(self.socket_path), str(os.getpid()), ",".join(preload),
                 str(unused_exit_s)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the zygote has imported PRELOAD (at once if it has); a RuntimeError with its log if it died."""
        if self.ready:
            return
        line = self.process.stdout.readline().decode().strip()
        if line != READY:
            self.stop()
            raise RuntimeError(f"the runtime zygote did not start ({line!r}); log {self.log_path}:\n"
                               f"{self.log_path.read_text(errors='replace')[-2000:]}")
        self.ready = True

    def fork(self, argv: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess:
        """Fork a child that runs `argv` (`python -m MODULE ARGS`) with `env`, output to `log_path`."""
        exit_path = Path(f"{log_path}.exit")
        exit_path.unlink(missing_ok=True)
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path), "exit": str(exit_path)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(str(self.socket_path))
            connection.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(connection.makefile("rb").readline())
        child = ForkedProcess(int(reply["pid"]), exit_path, argv)
        self.children = [c for c in self.children if c.poll() is None] + [child]
        return child

    def busy(self) -> bool:
        return any(child.poll() is None for child in self.children)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_lock = threading.RLock()
_zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}  # by import environment, the least recently used first
MAX_ZYGOTES = 2  # per process: 1.2 GB resident each (its imports), pages its runtimes share until they write them
PRESTARTED_UNUSED_S = 300.0  # a prestarted zygote no runtime has used exits this long after its imports


def enabled(env: dict[str, str]) -> bool:
    return env_names.read(env_names.RUNTIME_ZYGOTE, env) != OFF


def prestart(env: dict[str, str]) -> None:
    """Start this process's zygote for `env`'s import environment now, without waiting for its imports, where
    there is none yet, room for one (MAX_ZYGOTES) and zygotes are on: a command that will start runtimes calls it
    before its own imports, so that the zygote's run beside them instead of after. `start_for` then waits for it.
    One that no runtime uses (a command whose runtimes run on CUDA, or in another environment) exits by itself
    PRESTARTED_UNUSED_S after its imports, at the owner's exit, or when another import environment needs its
    place, whichever comes first."""
    key = import_environment(env)
    with _lock:
        _forget_inherited()
        if key in _zygotes or len(_zygotes) >= MAX_ZYGOTES or not enabled(env):
            return
        try:
            _zygotes[key] = Zygote(env, wait=False, unused_exit_s=PRESTARTED_UNUSED_S)
        except OSError:  # no process to start now: start_for tries again when a runtime needs it
            pass


def start_for(env: dict[str, str]) -> Zygote | None:
    """This process's zygote for `env`'s import environment (waited for, if `prestart` started it), started if there
    is none (an idle one of another environment stopped to keep at most MAX_ZYGOTES); None when MAX_ZYGOTES others
    all have runtimes alive."""
    key = import_environment(env)
    with _lock:
        _forget_inherited()
        found = _zygotes.pop(key, None)
        if found is not None and found.process.poll() is None and not found.ready:
            try:
                found.wait_ready()
            except RuntimeError:  # its imports failed: start one afresh below (and show why if that fails too)
                found = None
        if found is not None and found.process.poll() is not None:  # died: its runtimes are orphans now
            found.stop()
            found = None
        if found is None:
            for other_key, other in list(_zygotes.items()):
                if len(_zygotes) >= MAX_ZYGOTES and not other.busy():
                    other.stop()
                    del _zygotes[other_key]
            if len(_zygotes) >= MAX_ZYGOTES:
                return None
            found = Zygote(env)
        _zygotes[key] = found  # the most recently used last
        return found


def fork_runtime(argv: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess | None:
    """`argv` forked from this process's zygote for `env` (`start_for`), or None where there is none to fork it."""
    with _lock:  # not replaced between the choice and the fork
        serving = start_for(env)
        if serving is None:
            return None
        try:
            return serving.fork(argv, env, log_path)
        except (OSError, ValueError):  # it died meanwhile, or answered nothing readable: start afresh
            serving.stop()
            del _zygotes[import_environment(env)]
            return None


def _forget_inherited() -> None:
    """Drop the zygotes a parent process owned (this process is its fork): theirs to use and to stop."""
    for key in [key for key, value in _zygotes.items() if value.owner != os.getpid()]:
        del _zygotes[key]


@atexit.register
def stop_all() -> None:
    """Stop this process's zygotes (the runtimes they forked are their owner's to stop)."""
    with _lock:
        _forget_inherited()
        while _zygotes:
            _zygotes.popitem()[1].stop()


# ---------------------------------------------------------------------------------------------------------
# The zygote's side


def serve(socket_path: str, owner: int, unused_exit_s: float = 0.0) -> dict[str, Any] | None:
    """Fork a child per request while `owner` lives (and, with `unused_exit_s` > 0, until that long after the
    imports if no request came). Returns in a child, with its request; None at the end."""
    exits: dict[int, str] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(socket_path)
        listener.listen(16)
        print(READY, flush=True)
        unused_until = time.monotonic() + unused_exit_s if unused_exit_s > 0 else None
        while os.getppid() == owner:
            readable, _, _ = select.select([listener], [], [], POLL_S)
            reap(exits)
            if not readable:
                if unused_until is not None and time.monotonic() > unused_until:
                    break
                continue
            unused_until = None
            connection, _ = listener.accept()
            with connection:
                request = json.loads(connection.makefile("rb").readline())
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    return request
                exits[pid] = request["exit"]
                connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return None


def reap(exits: dict[int, str]) -> None:
    """Collect the children that ended, each one's exit code written where its owner reads it before it is
    reaped: until then it stays in /proc (a zombie), so an owner never finds it gone without its code."""
    while exits:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if ended is None:
            return
        code = ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status  # killed: -signal
        path = exits.pop(ended.si_pid, None)
        if path is not None:
            write_atomic(path, str(code))
        os.waitpid(ended.si_pid, 0)


def become(request: dict[str, Any]) -> None:
    """In the forked child: turn into `python -m MODULE ARGS` as the request describes, and run it."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    output = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    nothing = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((output, 1), (output, 2), (nothing, 0)):
        os.dup2(fd, target)
    os.close(output)
    os.close(nothing)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "torch" in sys.modules:  # OpenMP read OMP_NUM_THREADS when the zygote loaded it
        threads = os.environ.get("OMP_NUM_THREADS")
        sys.modules["torch"].set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))
    argv = request["argv"]
    module = argv[argv.index("-m") + 1]
    sys.argv = [argv[0], *argv[argv.index("-m") + 2:]]
    if not os.environ.get(SAFE_PATH):  # where `python -m` looks first, unless told not to
        sys.path[0] = request["cwd"]
    # The child keeps the zygote's command line (ps shows `-m sgl_tts.runtime.zygote`): a new title would blank
    # the memory /proc/<pid>/environ reads, where a runtime's environment is looked up (sgl_tts.testing).
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def preload(modules: list[str]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module this SGLang lacks or cannot import on this machine
            print(f"zygote: not preloaded {name}: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the owner, which stops what it started
    preload([name for name in sys.argv[3].split(",") if name])
    forked = serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
    if forked is not None:
        become(forked)
