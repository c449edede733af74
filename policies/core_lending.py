"""An idle rank lends its core to a working one: a decode step (or a short extend) runs on its rank's core and on its
idle peers'.

A CPU session's generator runs one single-threaded SGLang rank per core (`share_cpu_cores`): with many requests
every rank decodes, each on its core, and no thread waits at a barrier for a core another process holds. With one
search at a time (a served request, `sgl-tts bench peers` solving one problem at a time) only the rank that holds
the search's run works (`policies/search_placement.py`) and the other core idles. At the 1-8 rows a search's step
decodes, a forward reads every weight once and one core cannot read them fast enough: SmolLM2-135M's bf16 linear
layers of one step take 37.6 ms at 8 rows on one thread and 22.9 ms on two (2-core Xeon, AMX;
`scripts/bench_linear_bf16.py --threads 1|2`).

The ranks of one runtime share a board (`Board`: one slot per rank in memory mapped before the ranks are forked).
Each rank stamps its slot when a forward starts and ends; before each decode step it counts the other ranks that are
idle

    idle(r)  =  r has run a forward, is not in one, and its last one ended IDLE_AFTER_S ago or more
    threads  =  own threads x (1 + number of idle ranks)                  (each rank owns its share of the cores)

and runs the forward on that many torch threads, then returns to its own (sampling, after the forward, runs in
the scheduler's thread alone, whose denormals are flushed: `policies/cpu_sampling.py`). Decode steps borrow, and
extends of at most SHORT_EXTEND new tokens in all (a step's text after its cached path, a verifier's read, a batch of
forks, one short prompt: tens of milliseconds each, the extends of a search running alone); a longer prefill does
not: it is one long forward, often of requests that arrived together, when the other rank's own are a moment behind,
and both would then run on three threads for its whole length. A rank that has not yet run a forward counts as
busy, so a board that is not shared (a rank that was not forked from the process that made it) lends nothing. When
an idle rank gets a request, the borrower sees it at its next forward: at most one step or short extend runs with a
thread more than there are cores.

The board sees only the ranks of one runtime, not another busy process on the machine (a verifier runtime of its
own, a control loop, a test run). A borrowed step then has a thread on a core that process holds, and each of the
step's parallel regions waits at its barrier until the scheduler gives that thread its turn: beside one busy
process a single request decoded at 1.8 tok/s borrowing, 16.8 not (docs/runtime-speed.md). So a rank borrows
only while the others leave the cores free (`OthersWatch`): over the last WATCH_S or more of wall time w,

    others  =  (busy CPU time of the machine  −  CPU time of this rank's process) / w    (/proc/stat, /proc/self/stat)

in cores, and a rank borrows only while others < BUSY_OTHERS (the runtime's own tokenizer and detokenizer and a
client use a few tenths of a core). A rank that borrowed counts its borrowed threads as its own, so its lending
does not stop itself; a peer rank is one of the others, so a window in which it worked holds lending back until the
next window (the watch is read only when a peer is idle).

The plugin (`policies/plugin.py`) installs it with $SGLTTS_CORE_LENDING=on (`always`: borrow whatever the others
do); `sgl_tts/runtime/server.py` sets `on` on every multi-rank CPU runtime (`env: {SGLTTS_CORE_LENDING: off}` keeps
each rank on its own core).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Any, Callable, Sequence

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
ON = "on"  # the value of $SGLTTS_CORE_LENDING that installs it
ALWAYS = "always"  # installs it without the watch on the other processes
BUSY_OTHERS = 0.5  # cores the other processes may keep busy while a rank borrows
WATCH_S = 0.25  # the least wall time over which their CPU use is measured (the kernel counts it in 10 ms ticks)
IDLE_AFTER_S = 0.1  # a busy rank's forwards follow each other within milliseconds; this is an idle rank
SHORT_EXTEND = 64  # the most new tokens of an extend that borrows: a step's text, a verifier's read, a batch of forks
SLOTS = 64  # ranks a board holds
SLOT = struct.Struct("=ddd")  # pid (0: never ran a forward), in a forward (0/1), when the last forward ended


class Board:
    """One slot per rank in shared memory (anonymous, MAP_SHARED: inherited by processes forked after it)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        self.memory = mmap.mmap(-1, SLOT.size * slots)

    def write(self, rank: int, pid: int, busy: bool, ended_at: float) -> None:
        SLOT.pack_into(self.memory, SLOT.size * rank, float(pid), float(busy), ended_at)

    def read(self) -> list[tuple[float, float, float]]:
        return [SLOT.unpack_from(self.memory, SLOT.size * rank) for rank in range(self.slots)]


def idle_ranks(slots: Sequence[tuple[float, float, float]], own: int, now: float,
               idle_after_s: float = IDLE_AFTER_S) -> int:
    """How many ranks other than `own` are idle: have run a forward, are not in one, and ended it `idle_after_s`
    ago or more."""
    return sum(1 for rank, (pid, busy, ended_at) in enumerate(slots)
               if rank != own and pid > 0 and not busy and now - ended_at >= idle_after_s)


def busy_ticks(proc_stat: str) -> int:
    """The machine's busy CPU time in clock ticks, from /proc/stat's `cpu` line (user nice system idle iowait irq
    softirq steal guest guest_nice): user + nice + system + irq + softirq (guest time is counted in user and
    nice; steal is the hypervisor's, not this machine's processes')."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in proc_stat.split("\n", 1)[0].split()[1:8])
    return user + nice + system + irq + softirq


def own_ticks(self_stat: str) -> int:
    """This process's CPU time in clock ticks, all threads: utime + stime of /proc/self/stat (after the name)."""
    fields = self_stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def read_proc() -> tuple[str, str]:
    with open("/proc/stat") as machine, open("/proc/self/stat") as own:
        return machine.read(), own.read()


class OthersWatch:
    """How many cores the processes other than this one kept busy over the last WATCH_S or more (module docstring);
    None until two readings are that far apart, or where /proc cannot be read."""

    def __init__(self, read: Callable[[], tuple[str, str]] = read_proc, clock: Callable[[], float] = time.monotonic,
                 window_s: float = WATCH_S, ticks_per_s: float | None = None) -> None:
        self.read, self.clock, self.window_s = read, clock, window_s
        self.ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self.last: tuple[float, int, int] | None = None
        self.value: float | None = None

    def cores(self) -> float | None:
        now = self.clock()
        if self.last is not None and now - self.last[0] < self.window_s:
            return self.value
        try:
            machine, own = self.read()
            reading = (now, busy_ticks(machine), own_ticks(own))
        except (OSError, ValueError, IndexError):
            return None
        if self.last is not None:
            others = (reading[1] - self.last[1]) - (reading[2] - self.last[2])
            self.value = max(0.0, others / self.ticks_per_s / (now - self.last[0]))
        self.last = reading
        return self.value


def borrows(args: tuple, kwargs: dict) -> bool:
    """Whether `ModelRunner.forward(forward_batch, ...)` may borrow: a decode step, or an extend of at most
    SHORT_EXTEND new tokens in all (not a longer prefill)."""
    batch = args[0] if args else kwargs.get("forward_batch")
    mode = getattr(batch, "forward_mode", None)
    if mode is None:
        return False
    if mode.is_decode():
        return True
    tokens = getattr(batch, "extend_num_tokens", None)
    return bool(mode.is_extend()) and tokens is not None and tokens <= SHORT_EXTEND


class CoreLending:
    """The AROUND hook on `ModelRunner.forward` of one runtime's ranks (made before they are forked)."""

    def __init__(self, board: Board | None = None, clock: Callable[[], float] = time.monotonic,
                 threads: Any = None, watch: OthersWatch | None = None) -> None:
        self.board = board or Board()
        self.clock = clock  # CLOCK_MONOTONIC: one clock for every process of the machine
        self._threads = threads  # (get, set) of the torch threads; torch's by default (tests pass their own)
        self.watch = watch  # the other processes' CPU use (None: borrow whatever they do, ALWAYS)

    def rank(self) -> int:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().dp_rank
        return 0 if rank is None else rank

    def threads(self) -> tuple[Callable[[], int], Callable[[int], None]]:
        if self._threads is None:
            import torch

            self._threads = (torch.get_num_threads, torch.set_num_threads)
        return self._threads

    def forward(self, original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
        rank, pid = self.rank(), os.getpid()
        if rank >= self.board.slots:
            return original(runner, *args, **kwargs)
        get_threads, set_threads = self.threads()
        own = get_threads()
        lent = idle_ranks(self.board.read(), rank, self.clock()) if borrows(args, kwargs) else 0
        if lent and self.watch is not None and (self.watch.cores() or 0.0) >= BUSY_OTHERS:
            lent = 0
        self.board.write(rank, pid, True, 0.0)
        if lent:
            set_threads(own * (1 + lent))
        try:
            return original(runner, *args, **kwargs)
        finally:
            if lent:
                set_threads(own)
            self.board.write(rank, pid, False, self.clock())
