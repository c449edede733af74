"""An idle rank's core lent to a working one (policies/core_lending.py): the count of idle ranks, the threads a
forward runs on, the board shared with forked ranks, and the runtimes that get it."""

from __future__ import annotations

import os

import pytest

from policies import core_lending
from policies.core_lending import Board, CoreLending, OthersWatch, busy_ticks, idle_ranks, own_ticks


def test_an_idle_rank_is_one_that_ran_a_forward_is_out_of_it_and_has_been_for_a_while():
    now = 100.0
    slots = [(11, 0.0, 10.0),  # this rank (own): never counted
             (12, 0.0, 99.95),  # ended 50 ms ago: still between two steps
             (13, 1.0, 0.0),  # in a forward
             (0, 0.0, 0.0),  # never ran a forward: counted busy
             (14, 0.0, 99.5),  # ended 500 ms ago: idle
             (15, 0.0, 99.875)]  # ended 125 ms ago: idle
    assert idle_ranks(slots, own=0, now=now, idle_after_s=0.1) == 2
    assert idle_ranks(slots, own=4, now=now, idle_after_s=0.1) == 2  # rank 0 idle, rank 4 is itself
    assert idle_ranks(slots, own=0, now=now, idle_after_s=1.0) == 0


class Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode

    def is_extend(self) -> bool:
        return not self.decode


class Batch:
    def __init__(self, decode: bool = True, extend_num_tokens: int | None = None) -> None:
        self.forward_mode = Mode(decode)
        self.extend_num_tokens = extend_num_tokens


class FakeThreads:
    def __init__(self, threads: int) -> None:
        self.threads, self.history = threads, []

    def get(self) -> int:
        return self.threads

    def set(self, threads: int) -> None:
        self.threads = threads
        self.history.append(threads)


def lending(rank: int, clock, threads: FakeThreads, board: Board) -> CoreLending:
    lender = CoreLending(board, clock=clock, threads=(threads.get, threads.set))
    lender.rank = lambda: rank
    return lender


def test_a_decode_step_runs_on_the_idle_ranks_cores_and_returns_to_its_own_after():
    board, now = Board(slots=3), [50.0]
    threads = FakeThreads(1)
    rank0 = lending(0, lambda: now[0], threads, board)
    seen = []

    def forward(runner, forward_batch):  # what the rank's forward sees: its thread count and its own slot marked busy
        seen.append((threads.threads, board.read()[0][1]))
        return forward_batch

    step = Batch()
    assert rank0.forward(forward, None, step) is step
    assert seen[-1] == (1, 1.0) and threads.history == []  # the other ranks never ran a forward: nothing lent
    board.write(1, 1234, False, 49.0)  # rank 1 ran one and ended a second ago
    board.write(2, 1235, True, 0.0)  # rank 2 is in one
    assert rank0.forward(forward, None, forward_batch=step) is step
    assert seen[-1] == (2, 1.0) and threads.history == [2, 1]  # rank 1's core lent for this forward only
    pid, busy, ended_at = board.read()[0]
    assert (pid, busy, ended_at) == (os.getpid(), 0.0, 50.0)
    board.write(2, 1235, False, 40.0)
    rank0.forward(forward, None, step)
    assert seen[-1] == (3, 1.0)
    rank0.forward(forward, None, Batch(decode=False, extend_num_tokens=core_lending.SHORT_EXTEND + 1))
    assert seen[-1] == (1, 1.0)  # a longer prefill borrows nothing
    rank0.forward(forward, None, Batch(decode=False, extend_num_tokens=core_lending.SHORT_EXTEND))
    assert seen[-1] == (3, 1.0)  # a short extend (a step's text, a verifier's read, forks) borrows
    board.write(1, 1234, True, 0.0)
    board.write(2, 1235, True, 0.0)
    rank0.forward(forward, None, step)
    assert seen[-1] == (1, 1.0) and threads.history == [2, 1, 3, 1, 3, 1]  # both busy: its own core only


def test_a_rank_of_two_threads_borrows_the_idle_ranks_two():
    board = Board(slots=2)
    board.write(1, 77, False, 0.0)
    threads = FakeThreads(2)
    seen = []
    lending(0, lambda: 10.0, threads, board).forward(lambda runner, batch: seen.append(threads.threads), None,
                                                     Batch())
    assert seen == [4] and threads.threads == 2


def test_a_failing_forward_still_returns_the_threads_and_marks_the_rank_out_of_it():
    board = Board(slots=2)
    board.write(1, 77, False, 0.0)
    threads = FakeThreads(1)

    def failing(runner, batch):
        assert threads.threads == 2
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        lending(0, lambda: 10.0, threads, board).forward(failing, None, Batch())
    assert threads.threads == 1 and board.read()[0][1] == 0.0


class FakeProc:
    """/proc/stat and /proc/self/stat as the kernel writes them, from tick counters the test advances."""

    def __init__(self) -> None:
        self.user = self.system = self.idle = self.steal = self.own_user = self.own_system = 0

    def read(self) -> tuple[str, str]:
        machine = (f"cpu  {self.user} 7 {self.system} {self.idle} 3 0 2 {self.steal} 0 0\n"
                   f"cpu0 1 2 3 4 5 6 7 8 0 0\nintr 1 2 3\n")
        own = f"4242 (sgl (rank) 1) R 1 2 3 0 -1 4194304 10 0 0 0 {self.own_user} {self.own_system} 0 0 20 0 3 0"
        return machine, own


def test_the_proc_readings_are_the_busy_ticks_of_the_machine_and_of_this_process():
    proc = FakeProc()
    proc.user, proc.system, proc.idle, proc.steal, proc.own_user, proc.own_system = 100, 20, 500, 9, 30, 5
    machine, own = proc.read()
    assert busy_ticks(machine) == 100 + 7 + 20 + 2, "user + nice + system + softirq; idle, iowait, steal left out"
    assert own_ticks(own) == 35, "utime + stime, read after the name (which may hold spaces and parentheses)"
    with open("/proc/stat") as machine_file, open("/proc/self/stat") as own_file:
        assert busy_ticks(machine_file.read()) > 0 and own_ticks(own_file.read()) >= 0


def test_the_watch_gives_the_cores_the_other_processes_kept_busy_over_its_window():
    proc, now = FakeProc(), [10.0]
    watch = OthersWatch(proc.read, clock=lambda: now[0], window_s=0.25, ticks_per_s=100)
    assert watch.cores() is None, "one reading: no window yet"
    now[0] += 0.5
    proc.user += 60  # 60 ticks busy on the machine in 0.5 s, 20 of them this process's
    proc.own_user += 20
    assert watch.cores() == pytest.approx(0.8), "(60 - 20) ticks / 100 per s / 0.5 s"
    now[0] += 0.1
    proc.user += 100
    assert watch.cores() == pytest.approx(0.8), "within the window: the last value, /proc not read"
    now[0] += 0.4
    proc.own_system += 100  # this process alone was busy (its borrowed threads included)
    assert watch.cores() == pytest.approx(0.0)
    unreadable = OthersWatch(lambda: (_ for _ in ()).throw(OSError("no /proc")), clock=lambda: now[0])
    assert unreadable.cores() is None


def test_a_rank_borrows_only_while_the_other_processes_leave_the_cores_free():
    board, now, proc = Board(slots=2), [50.0], FakeProc()
    board.write(1, 77, False, 0.0)  # rank 1 idle
    threads = FakeThreads(1)
    watch = OthersWatch(proc.read, clock=lambda: now[0], window_s=0.25, ticks_per_s=100)
    lender = CoreLending(board, clock=lambda: now[0], threads=(threads.get, threads.set), watch=watch)
    lender.rank = lambda: 0
    seen = []

    def step():
        lender.forward(lambda runner, batch: seen.append(threads.threads), None, Batch())
        now[0] += 0.3

    step()  # no window yet: borrows
    proc.user += 30  # 30 ticks in 0.3 s, none this process's: another process kept a core busy
    step()
    proc.user += 3  # 0.1 core: the cores are free again
    step()
    proc.user, proc.own_user = proc.user + 60, proc.own_user + 55  # this rank on two cores, others 0.17 core
    step()
    assert seen == [2, 1, 2, 2]
    free = CoreLending(board, clock=lambda: now[0], threads=(threads.get, threads.set))  # `always`: no watch
    free.rank = lambda: 0
    proc.user += 300
    free.forward(lambda runner, batch: seen.append(threads.threads), None, Batch())
    assert seen[-1] == 2


def test_forked_ranks_share_the_board_their_parent_made():
    board = Board(slots=4)
    child = os.fork()
    if child == 0:  # a rank forked after the board was made, as SGLang forks them after the plugin registers
        board.write(3, os.getpid(), False, 123.0)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert status == 0
    assert board.read()[3] == (float(child), 0.0, 123.0)


def test_multi_rank_cpu_runtimes_lend_cores_unless_told_not_to(monkeypatch):
    from sgl_tts import env_names
    from sgl_tts.runtime import server

    monkeypatch.delenv(env_names.CORE_LENDING, raising=False)
    two_ranks = server.RuntimeConfig(cpu_threads=1, data_parallel=2)
    assert server.server_env(two_ranks)[env_names.CORE_LENDING] == core_lending.ON
    assert env_names.CORE_LENDING not in server.server_env(server.RuntimeConfig(cpu_threads=1))  # one rank
    off = server.RuntimeConfig(cpu_threads=1, data_parallel=2, env={env_names.CORE_LENDING: "off"})
    assert server.server_env(off)[env_names.CORE_LENDING] == "off"
