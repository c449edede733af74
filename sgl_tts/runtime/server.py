"""Start and stop SGLang runtimes (one server process group each) on 127.0.0.1.

A runtime binds a loopback address unless its config opts in with `allow_remote: true`.

A runtime is `python -m sglang.launch_server` (on a CPU through `sgl_tts.runtime.launch`, which forks SGLang's
children instead of spawning them) in its own process session, so that stopping it reaches the
scheduler and detokenizer children too. On CPU it runs with the shim (docs/sglang.md): the CPU engine switch,
torch-native attention, fp32 and the one-symbol libcuda stub first on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

from policies import (core_lending, cpu_attention, cpu_layers, cpu_linear, cpu_malloc, cpu_sampling, lean_decode,
                      search_placement)
from sgl_tts import env_names
from sgl_tts.runtime.hardware import cpu_flags
from sgl_tts.runtime.http_client import http_json
from sgl_tts.runtime import zygote
from sgl_tts.runtime.models import resolve_model

LOCALHOST = "127.0.0.1"
CPU_LAUNCHER, SGLANG_LAUNCHER = "sgl_tts.runtime.launch", "sglang.launch_server"  # the module a runtime runs
# Decode steps the scheduler runs between two looks at its queues, on CPU (SGLang's default is 1). Each look costs
# a scheduler round trip in Python, which on CPU is a sizeable part of a step for a small model; the price is
# that a new request waits up to this many steps to join the running batch (`sgl-tts bench runtime`,
# docs/runtime-speed.md).
CPU_CONTINUOUS_DECODE_STEPS = 4
# The least KV a data-parallel rank of a CPU generator gets from its runtime's budget (share_cpu_cores): a batch of
# 64 requests of 128 tokens, where a second rank starts to pay (docs/runtime-speed.md). A smaller budget stays one
# rank's, so that a small planned budget is not cut into pieces a long request no longer fits.
MIN_RANK_TOKENS = 8192
AVX2 = "avx2"  # the /proc/cpuinfo flag the grid kernel is vectorized for: 4- and 8-bit weights at a few rows


class RuntimeStartError(RuntimeError):
    """A runtime did not become ready; the message carries the tail of its log."""


class PortTakenError(RuntimeStartError):
    """The server could not bind its port: another process took it between `free_port` and the server's bind
    (SGLang's own servers pick internal ports too). The server does not exit then: it hangs in shutdown."""


PORT_TAKEN = "error while attempting to bind on address"  # uvicorn's message, in the server's log
# SGLang 0.5.23's --kv-cache-dtype values and the bytes of an element (its 4-bit ones: None, and the memory plan counts
# the weights' dtype for them)
KV_CACHE_DTYPES = {"bf16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "mxfp8": 1, "nvfp4": None,
                   "fp4_mx_block16": None}
START_ATTEMPTS = 3  # starts on a fresh free port after PortTakenError (not for a port the config fixes)


class RuntimeDiedError(RuntimeError):
    """A runtime stopped answering while a search was using it."""


@dataclass(frozen=True)
class RuntimeConfig:
    model: str = "smollm2-135m"  # built-in name, local HF folder or hub id (see sgl_tts.runtime.models)
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "auto"  # "auto" means float32 on CPU, the model's dtype on CUDA
    # The KV pool's dtype: "auto", bf16 on a CPU runtime that decodes with the project's paged kernel (half the bytes a
    # decode step reads: `kv_pool_dtype`) and the weights' dtype elsewhere; "model", the weights' dtype (fp32 on CPU);
    # or one of SGLang's --kv-cache-dtype values (KV_CACHE_DTYPES).
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # None: torch_native on CPU, SGLang's choice on CUDA
    host: str = LOCALHOST  # a loopback address, or any address with allow_remote
    allow_remote: bool = False  # the opt-in for a host other machines can reach
    port: int | None = None  # None: a free port
    max_total_tokens: int | None = None  # KV token budget (the memory planner sets it)
    mem_fraction_static: float | None = None
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    cpu_threads: int | None = None  # torch threads in each scheduler process (CPU only)
    # Scheduler processes behind the one URL (SGLang's --dp-size), each with its own copy of the model and an equal
    # share of max_total_tokens; requests go to them in turn. None: one, except a CPU session's generator, which
    # share_cpu_cores gives one single-threaded rank per core (docs/runtime-speed.md).
    data_parallel: int | None = None
    continuous_decode_steps: int | None = None  # None: CPU_CONTINUOUS_DECODE_STEPS on CPU, SGLang's 1 on CUDA
    random_seed: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0  # the longest one HTTP request to the runtime may take
    is_embedding: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Servers of this config behind SGLang's router (sgl_tts.runtime.replicas); `port` is then the router's.
    replicas: int = 1
    # SGLang servers already running elsewhere (other machines, same model) that the router also routes to.
    remote_workers: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)  # more sglang_router.launch_router flags

    def __post_init__(self) -> None:
        if self.port is not None and not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests", "cpu_threads",
                     "continuous_decode_steps", "data_parallel"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("startup_timeout_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is not a loopback address, so other machines could reach the "
                             "server: use 127.0.0.1, or set allow_remote: true to bind it anyway")
        if any(arg == "--host" or arg.startswith("--host=") for arg in self.extra_args):
            raise ValueError("extra_args must not set --host: set 'host' (and allow_remote for a non-loopback one)")
        if self.kv_cache_dtype not in ("auto", "model", *KV_CACHE_DTYPES):
            raise ValueError(f"kv_cache_dtype must be auto, model or one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        for url in self.remote_workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"remote_workers: expected URLs like http://HOST:PORT, got {url!r}")

    @property
    def routed(self) -> bool:
        """Whether this runtime is a router in front of several servers (sgl_tts.runtime.replicas)."""
        return self.replicas > 1 or bool(self.remote_workers)

    @property
    def ranks(self) -> int:
        """Data-parallel scheduler ranks of the server (1 unless `data_parallel` says more)."""
        return self.data_parallel or 1

    @property
    def places_searches(self) -> bool:
        """Whether each program run's requests go to one rank (policies/search_placement.py): a CPU server of more
        than one rank, with the load-balance flags (`server_command`) and the plugin switch (`server_env`)."""
        return self.device == "cpu" and self.ranks > 1


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only ("localhost" or a loopback IP; a host name may resolve
    to any interface, so it is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = LOCALHOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def server_command(config: RuntimeConfig, model_path: str, port: int) -> list[str]:
    """The launch_server command line for `config`."""
    # On a CPU, SGLang's launch_server with its children forked, not spawned (sgl_tts/runtime/launch.py): start-up
    # 41 -> 25 s for one runtime, 60 -> 30 s for a generator of two ranks, on 2 idle cores.
    launcher = CPU_LAUNCHER if config.device == "cpu" else SGLANG_LAUNCHER
    cmd = [sys.executable, "-m", launcher, "--model-path", model_path,
           "--host", config.host, "--port", str(port), "--device", config.device,
           "--random-seed", str(config.random_seed), "--log-level", "info"]
    dtype = config.dtype
    attention = config.attention_backend
    decode_steps = config.continuous_decode_steps
    if config.device == "cpu":
        dtype = "float32" if dtype == "auto" else dtype
        attention = attention or "torch_native"
        decode_steps = decode_steps or CPU_CONTINUOUS_DECODE_STEPS
        cmd += ["--sleep-on-idle", "--disable-cuda-graph"]
    cmd += ["--dtype", dtype]
    if attention:
        cmd += ["--attention-backend", attention]
    kv_dtype = kv_pool_dtype(config)
    if kv_dtype is not None and flag_value(config.extra_args, "--kv-cache-dtype") is None:
        cmd += ["--kv-cache-dtype", kv_dtype]
    ranks = config.ranks
    optional = {
        "--max-total-tokens": config.max_total_tokens // ranks if config.max_total_tokens else None,  # per rank
        "--dp-size": ranks if ranks > 1 else None,
        "--mem-fraction-static": config.mem_fraction_static,
        "--chunked-prefill-size": config.chunked_prefill_size,
        "--max-running-requests": config.max_running_requests,
        "--num-continuous-decode-steps": decode_steps,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    if config.places_searches:
        # each program run's requests on one rank, a new run on the rank with the fewest requests
        # (policies/search_placement.py), from load counts each rank publishes at every decode step
        cmd += [*search_placement.LOAD_BALANCE_ARGS, "--load-snapshot-publish-interval", "1"]
    if config.is_embedding:
        cmd.append("--is-embedding")
    return cmd + list(config.extra_args)


def flag_value(args: list[str], *flags: str) -> str | None:
    """The value `args` give the flag named by `flags` (its aliases: `--flag value` or `--flag=value`; the last one
    wins, as in SGLang's parser)."""
    value = None
    for i, arg in enumerate(args):
        if arg in flags and i + 1 < len(args):
            value = args[i + 1]
        elif arg.split("=", 1)[0] in flags and "=" in arg:
            value = arg.split("=", 1)[1]
    return value


def kv_pool_dtype(config: RuntimeConfig) -> str | None:
    """The server's --kv-cache-dtype, None for SGLang's own (the weights' dtype): what `extra_args` or the config
    name ("model": None); for "auto", bf16 where a CPU runtime that decodes has the paged kernel for attention
    (policies/paged_attention.cpp widens each bf16 row as it loads it: `make run`'s search 1.06-1.08x sooner than on
    fp32, docs/runtime-speed.md). A reward model served for its scores (`is_embedding`) only prefills and keeps the
    weights' dtype, so its scores stay its reference's."""
    named = flag_value(config.extra_args, "--kv-cache-dtype")
    if named is not None:
        return named
    if config.kv_cache_dtype == "model":
        return None
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    paged = (config.device == "cpu" and config.attention_backend in (None, "torch_native")
             and config.env.get(env_names.CPU_ATTENTION, cpu_attention.PAGED) == cpu_attention.PAGED)
    return "bf16" if paged and not config.is_embedding else None


def server_env(config: RuntimeConfig) -> dict[str, str]:
    env = dict(os.environ)
    # The runtime imports from its PYTHONPATH and this environment's packages, not from a checkout in the working
    # folder, which `python -m` would put first on its path: an arm or a generator given `PYTHONPATH=<another
    # checkout>` runs that checkout's code wherever the command runs from.
    env[zygote.SAFE_PATH] = "1"
    if config.device == "cpu":
        from sgl_tts.runtime.cpu_shim import shim_dir

        env["SGLANG_USE_CPU_ENGINE"] = "1"
        if config.attention_backend in (None, "torch_native"):
            # One compiled kernel call per layer on the paged pool instead of SGLang's loop over the sequences
            # (policies/cpu_attention.py, docs/runtime-speed.md); `env: {SGLTTS_CPU_ATTENTION: batched}` is the
            # batched SDPA in torch, `sglang` keeps SGLang's own.
            env[env_names.CPU_ATTENTION] = cpu_attention.PAGED
        # Every linear layer and the LM head through oneDNN on weights packed once (policies/cpu_linear.py): 2.3-2.9x
        # the linear layers' speed at decode batches; in bf16 where the CPU has AMX tiles for it (decode 1.5x the
        # fp32 packed runtime's at 16 requests, 1.6x at 64, docs/runtime-speed.md); `env: {SGLTTS_CPU_LINEAR: packed}`
        # keeps fp32 there, `sglang` keeps SGLang's F.linear, and so does the variable set in the caller's environment.
        # Weights a quantizer wrote (SmolLM2's layers, shipped as Q4_1, and its head, Q8_0) are read from their 4 and
        # 8 bits at a few rows by the project's kernel, in fp32 (with AMX: decode 1.20x the torch-int4 default at one
        # request, 1.12-1.22x at 4-16; that one was 1.65x bf16 at one request; docs/runtime-speed.md);
        # `packed-bf16` / `packed` read bf16 / fp32 at every size.
        flags = cpu_flags()
        env.setdefault(env_names.CPU_LINEAR, cpu_linear.PACKED_BF16_INT4 if cpu_attention.AMX_BF16 in flags
                       else cpu_linear.PACKED_INT4 if AVX2 in flags else cpu_linear.PACKED)
        # RMSNorm and the rotary embedding in one compiled call each (policies/cpu_layers.py) instead of SGLang's
        # torch ops, whose dispatch is most of their cost at a search's rows; `env: {SGLTTS_CPU_LAYERS: torch}`.
        env.setdefault(env_names.CPU_LAYERS, cpu_layers.FUSED)
        # A Llama decode step as one loop over those kernels, without SGLang's layer code between them
        # (policies/lean_decode.py); `env: {SGLTTS_CPU_DECODE: sglang}` keeps SGLang's.
        env.setdefault(env_names.CPU_DECODE, lean_decode.LEAN)
        # Temperature sampling by the inverse CDF instead of torch.multinomial (policies/cpu_sampling.py): 152 -> 8 ms
        # for 128 rows on one core; `env: {SGLTTS_CPU_SAMPLING: sglang}` keeps SGLang's.
        env[env_names.CPU_SAMPLING] = cpu_sampling.CDF
        # Denormal floats flushed to zero in the scheduler: the softmax of a row at temperature 0.3 has a denormal
        # tail that x86 computes some 20x slower (policies/cpu_sampling.py); `env: {SGLTTS_CPU_DENORMALS: keep}`.
        env.setdefault(env_names.CPU_DENORMALS, cpu_sampling.FLUSH)
        # Large temporaries (a step's logits and probabilities, 25 MB at 128 rows) reused from the heap, not mapped
        # afresh and faulted in each step (policies/cpu_malloc.py); `env: {SGLTTS_CPU_MALLOC: system}` keeps glibc's.
        env.setdefault(env_names.CPU_MALLOC, cpu_malloc.REUSE)
        # A stop (SIGTERM to the group) reads to SGLang as a crash: it sleeps 5 s "to let GPU activity settle", then
        # py-spy-dumps the schedulers and asks for CUDA core dumps. On a CPU that is 5 s and a dump per stop, for
        # nothing a user asked.
        env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
        env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(shim_dir()), env.get("LD_LIBRARY_PATH")]))
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
        if config.cpu_threads:
            env["OMP_NUM_THREADS"] = str(config.cpu_threads)
        if config.places_searches:
            env[env_names.DP_PLACEMENT] = search_placement.SEARCH
            # SGLang asks a CPU rank for its cores (one NUMA node per rank unless this names them); it pins them only
            # with the CPU build of sgl-kernel, which is not installed here, so this only lets the ranks start.
            threads = config.cpu_threads or 1
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                f"{rank * threads}-{rank * threads + threads - 1}" if threads > 1 else str(rank)
                for rank in range(config.data_parallel))
            # A rank whose peers are idle runs its forward on their cores too (policies/core_lending.py): one search
            # alone decodes on the whole machine; `env: {SGLTTS_CORE_LENDING: off}` keeps each rank on its core.
            env[env_names.CORE_LENDING] = core_lending.ON
    env.update(config.env)
    return env


def prestart_cpu_zygote() -> None:
    """Start the zygote a CPU runtime forks from (`zygote.prestart`: every CPU runtime whose config sets no `env`
    has this import environment), without waiting: `run`, `serve` and `eval` call it before their own imports,
    which then run beside the zygote's. Never an error of its own: where the CPU shim cannot be built or no process
    can be started, the runtimes' own start says so."""
    from sgl_tts.runtime.cpu_shim import ShimBuildError

    try:
        zygote.prestart(server_env(RuntimeConfig()))
    except (ShimBuildError, OSError):
        pass


def share_cpu_cores(configs: dict[str, RuntimeConfig], cores: int | None = None) -> dict[str, RuntimeConfig]:
    """Give co-located CPU runtimes the cores by what they do: the generator decodes nearly all the time, the
    scorer and target runtimes work in bursts (the probe verifier: 118 of 2,772 s in one `make run`).

    Every CPU server whose `cpu_threads` is unset runs single-threaded scheduler processes. A torch process with
    a thread per core stalls at every OpenMP barrier whenever another busy process holds one of its cores: with a
    second process busy on a 2-core machine, one request decoded at 1.1 tok/s with 2 threads and 9.7 with 1
    (docs/runtime-speed.md). The generator, unless its config sets `cpu_threads` or `data_parallel`, gets one
    single-threaded scheduler rank per core (SGLang's data parallelism; per replica when it has several), so it
    holds the whole machine while the others are idle and nothing waits at a barrier when they are not (a config's
    `data_parallel: 1` keeps it one process: the tiny test model gains nothing from a second). The other
    runtimes get one thread each and take their share of the cores only while they work. Where explicit threads
    still outnumber the cores, waiting threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the config's `env` says
    otherwise. Runtimes on CUDA are left as configured.
    """
    cores = cores or len(os.sched_getaffinity(0))
    shared = dict(configs)
    on_cpu = [name for name, config in configs.items() if config.device == "cpu"]
    for name in on_cpu:
        config = configs[name]
        if config.cpu_threads is not None:
            continue
        ranks = config.ranks
        if name == "generator" and config.data_parallel is None:
            ranks = max(1, cores // config.replicas)
            if config.max_total_tokens is not None:  # a small KV budget stays whole (bench fasttts' thrashing cells)
                ranks = max(1, min(ranks, config.max_total_tokens // MIN_RANK_TOKENS))
        shared[name] = replace(config, cpu_threads=1, data_parallel=ranks)
    threads = sum(shared[n].cpu_threads * shared[n].ranks * shared[n].replicas for n in on_cpu)
    if any(shared[n].cpu_threads > 1 for n in on_cpu) and threads > cores:
        for name in on_cpu:
            env = dict(shared[name].env)
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            shared[name] = replace(shared[name], env=env)
    return shared


# Watches one runtime from a small separate process in a session of its own (`start_watchdog`), so a kill of the
# owner's whole process group does not take it too: when the process that started the runtime is gone (the
# watchdog is reparented: killed with SIGKILL, crashed), it stops the runtime's process group the way `stop`
# does, so no server outlives its owner by more than a poll and the grace. The parent check is proof against pid
# reuse (a dead parent's pid is never the new parent's). It exits by itself once the group is gone.
# Arguments: owner pid, group id, SIGTERM grace in seconds.
WATCHDOG = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
owner, group, grace_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def alive():
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
while os.getppid() == owner and alive():
    time.sleep(0.25)
for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
    if not alive():
        break
    os.killpg(group, sig)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and alive():
        time.sleep(0.2)
"""
WATCHDOG_GRACE_S = 5.0  # an orphaned server's SIGTERM grace before SIGKILL


def spawn_group(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` the way servers are started: its own process session (its group id is its pid, so a stop
    reaches its children), output to `log_path`, no stdin."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def start_server(config: RuntimeConfig, cmd: list[str], log_path: Path) -> subprocess.Popen | zygote.ForkedProcess:
    """`cmd` running as a server: the CPU launcher forked from this process's zygote (sgl_tts/runtime/zygote.py:
    the imports done once per process, not once per runtime), any other command started by `spawn_group`."""
    env = server_env(config)
    if cmd[1:3] == ["-m", CPU_LAUNCHER] and zygote.enabled(env):
        forked = zygote.fork_runtime(cmd, env, log_path)
        if forked is not None:
            return forked
    return spawn_group(cmd, log_path, env)


def start_watchdog(group: int, grace_s: float = WATCHDOG_GRACE_S) -> subprocess.Popen:
    """The WATCHDOG of process group `group`, owned by this process, in a session of its own."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHDOG, str(os.getpid()), str(group), str(grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def request_timeout(runtime: Any) -> float:
    """The HTTP timeout for requests to `runtime`: its config's `request_timeout_s` (600 s for objects
    without a RuntimeConfig, such as test doubles)."""
    config = getattr(runtime, "config", None)
    return config.request_timeout_s if isinstance(config, RuntimeConfig) else RuntimeConfig.request_timeout_s


class Runtime:
    """One running SGLang server. Use `Runtime.start(config)`; stop it with `stop()` or a `with` block."""

    def __init__(self, name: str, config: RuntimeConfig, model_path: str, port: int,
                 process: subprocess.Popen | zygote.ForkedProcess, log_path: Path):
        self.name = name
        self.config = config
        self.model_path = model_path
        self.port = port
        self.process = process
        self.log_path = log_path
        self.url = f"http://{config.host}:{port}"
        self.model_info: dict[str, Any] = {}
        self.watchdog = start_watchdog(process.pid)
        # A new server of the same config on a fresh port (set by `start` where the config fixes no port).
        self.relaunch: Callable[[], Runtime] | None = None

    @classmethod
    def start(cls, config: RuntimeConfig, name: str = "generator", log_dir: str | Path | None = None,
              wait: bool = True) -> "Runtime":
        """Start the server; with `wait`, return once it answers (else call `wait_ready`)."""
        model_path = resolve_model(config.model)
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sgl-tts-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)

        def launch() -> "Runtime":
            port = config.port or free_port(config.host)
            log_path = log_dir / f"{name}-{port}.log"
            process = start_server(config, server_command(config, model_path, port), log_path)
            return cls(name, config, model_path, port, process, log_path)

        runtime = launch()
        if not config.port:  # a port the config fixes is not swapped for another
            runtime.relaunch = launch
        if wait:
            runtime.wait_ready()
        return runtime

    @property
    def worker_urls(self) -> list[str]:
        """The SGLang servers behind `url` (requests are aborted there: the router does not route
        /abort_request)."""
        return [self.url]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> None:
        """Wait until the server answers a generate (or encode) request. A port another process took between
        `free_port` and the server's bind (a race no pick closes) is left for a fresh one: the server is
        stopped and this runtime becomes a new one, up to START_ATTEMPTS starts in all; a port the config
        fixes raises PortTakenError at once."""
        attempt = 1
        while True:
            try:
                self._wait_answering()
                return
            except PortTakenError:
                if self.relaunch is None or attempt == START_ATTEMPTS:
                    raise
                attempt += 1
                fresh = self.relaunch()
                self.port, self.url, self.process, self.log_path, self.watchdog = (
                    fresh.port, fresh.url, fresh.process, fresh.log_path, fresh.watchdog)

    def _wait_answering(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                self.stop()  # what the server started is stopped, and so is its watchdog
                raise RuntimeStartError(
                    f"runtime '{self.name}' ({self.model_path}) exited with code {self.process.returncode} "
                    f"during start-up; log {self.log_path}:\n{self.log_tail()}"
                )
            if self._port_taken():
                self.stop()
                raise PortTakenError(f"runtime '{self.name}' could not bind port {self.port}, which another "
                                     f"process holds; log {self.log_path}:\n{self.log_tail(5)}")
            try:
                self.model_info = http_json(self.url + "/get_model_info", timeout=5)
                if self.config.is_embedding:
                    http_json(self.url + "/encode", {"text": "1"}, timeout=120)
                else:
                    http_json(self.url + "/generate",
                              {"text": "1", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}, timeout=120)
                return
            except (OSError, json.JSONDecodeError):  # not answering yet, or an error answer
                time.sleep(1.0)
        self.stop()
        raise RuntimeStartError(
            f"runtime '{self.name}' ({self.model_path}) was not ready after {self.config.startup_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _port_taken(self) -> bool:
        try:
            return PORT_TAKEN in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeDiedError(
                f"runtime '{self.name}' at {self.url} exited with code {self.process.returncode}; "
                f"log {self.log_path}:\n{self.log_tail(20)}"
            )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, wait, then SIGKILL whatever survives (zombie detokenizer)."""
        pgid = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(pgid):
                try:
                    self.process.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            if not _group_alive(pgid):
                break
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.watchdog.kill()
        self.watchdog.wait()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids in process group `pgid` (used by tests to prove a clean shutdown)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def abort_requests(runtime: Any, rids: list[str], timeout: float = 30.0) -> None:
    """Abort requests `rids` on every server behind `runtime` (a no-op for a rid that has finished or that a
    server never saw). SGLang 0.5.23 aborts by exact rid; `{"abort_all": true}` would stop other clients' too.

    A server that fails (a dead replica of a set) does not keep the others from their aborts: every server is
    tried, then the first failure is raised."""
    failure: OSError | None = None
    for url in getattr(runtime, "worker_urls", [runtime.url]):
        try:
            for rid in rids:
                http_json(url + "/abort_request", {"rid": rid}, timeout=timeout)
        except OSError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def engine_loads(runtime: Any, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The engine's own load counters, one mapping per data-parallel rank (SGLang's `GET /v1/loads?include=core`:
    `num_running_reqs`, `num_waiting_reqs`, `num_used_tokens`, ...). Raises OSError when the runtime does not
    answer, KeyError when the answer has no `loads`."""
    return http_json(runtime.url + "/v1/loads?include=core", timeout=timeout)["loads"]
