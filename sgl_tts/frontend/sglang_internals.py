"""Every touch of SGLang's frontend interpreter internals, in one place.

The SGLang DSL gives a program `ProgramState`s; each wraps a `StreamExecutor` that runs the state's
operations on a worker thread and calls the backend. sgl-tts reads and writes a few executor fields that
are not public API (checked against SGLang 0.5.23):

- `StreamExecutor.variables`: a dict that `fork` copies into every child (`dict(self.variables)`); the
  request lineage (`LINEAGE_VARIABLE`) and the state's search (`SEARCH_VARIABLE`) ride in it from parent to
  child.
- `StreamExecutor.__init__` starts the worker thread in `contextvars.copy_context()`: a search bound in the
  thread that creates a program's first state (`searching`) is seen by that state's requests (`search_of`).
- `StreamExecutor.backend`, `.use_thread`, `.worker` (the thread), `.queue`, `.error_`, `.variable_event`,
  `.end()`, which is replaced (`make_executor_finalizer_lock_free`).
- `ProgramState.stream_executor`.

`check_interface()` fails with a message naming what changed; `tests/test_frontend.py` calls it, so an
SGLang upgrade that moves one of these fails one clear test instead of many confusing ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import inspect
import sys
import threading
from typing import Any, Iterable, Iterator

LINEAGE_VARIABLE = "_sgl_tts_lineage"  # executor variable: the lineage node of the state it was forked from
NODE_ATTRIBUTE = "_sgl_tts_node"  # executor attribute (not copied by fork): the executor's own lineage node
SEARCH_VARIABLE = "_sgl_tts_search"  # executor variable: the search the state belongs to

_current_search: contextvars.ContextVar[Any] = contextvars.ContextVar("sgl_tts_search", default=None)

EXECUTOR_FIELDS = ("variables", "backend", "use_thread", "worker", "error_", "variable_event", "meta_info",
                   "text_", "arguments")


def check_interface() -> None:
    """Raise AssertionError naming the SGLang internal that is missing or changed."""
    from sglang.lang.interpreter import ProgramState, StreamExecutor

    source = inspect.getsource(StreamExecutor.__init__) + inspect.getsource(StreamExecutor.fork)
    for name in EXECUTOR_FIELDS:
        assert f"self.{name}" in source, f"SGLang's StreamExecutor no longer sets `{name}` (sgl_tts relies on it)"
    assert "variables = dict(self.variables)" in inspect.getsource(StreamExecutor.fork), (
        "SGLang's StreamExecutor.fork no longer copies the parent's variables into each child: request lineage "
        "(sgl_tts.frontend.lineage) cannot follow forks")
    assert "stream_executor" in inspect.getsource(ProgramState.__init__), "ProgramState has no stream_executor"
    assert "contextvars.copy_context().run" in inspect.getsource(StreamExecutor.__init__), (
        "SGLang's StreamExecutor no longer starts its worker in a copy of the caller's contextvars: a state's "
        "requests cannot find their search (sgl_tts.frontend.sglang_internals.search_of)")
    end_source = inspect.getsource(_sglang_end[0] if _sglang_end else StreamExecutor.end)
    for step in ("self.queue.put(None)", "self.backend.end_program(self)"):
        assert step in end_source, (f"SGLang's StreamExecutor.end no longer does `{step}`: its replacement "
                                    f"(end_without_asking_the_thread) must follow")
    for owner in (StreamExecutor, ProgramState):
        assert "end()" in inspect.getsource(owner.__del__), (
            f"SGLang's {owner.__name__}.__del__ no longer ends its state through end(): a state freed by the "
            f"garbage collector may ask threading for its lock again (end_without_asking_the_thread)")
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    for method in ("generate", "commit_lazy_operations"):
        assert "self._add_images(s, data)" in inspect.getsource(getattr(RuntimeEndpoint, method)), (
            f"RuntimeEndpoint.{method} no longer calls _add_images(s, data): TTSEndpoint adds its request "
            f"fields there")


def executor_of(state: Any) -> Any:
    """The StreamExecutor of a ProgramState (or the executor itself)."""
    return getattr(state, "stream_executor", state)


def backend_of(state: Any) -> Any:
    return executor_of(state).backend


@contextlib.contextmanager
def searching(search: Any) -> Iterator[Any]:
    """Program states created in this block (and their forks) belong to `search`."""
    token = _current_search.set(search)
    try:
        yield search
    finally:
        _current_search.reset(token)


def running_search() -> Any:
    """The search bound in this thread (`searching`), None outside any."""
    return _current_search.get()


def search_of(state: Any) -> Any:
    """The search a program state (or executor) belongs to, None outside any search. Read on the state's worker
    thread (where the backend runs) the first time, then kept in the state's variables for its forks."""
    executor = executor_of(state)
    search = executor.variables.get(SEARCH_VARIABLE)
    if search is None:
        search = running_search()
        if search is not None:
            executor.variables[SEARCH_VARIABLE] = search
    return search


def bind_search(state: Any, search: Any) -> None:
    """Make `search` the search of `state` (and of the forks made from it from now on)."""
    executor_of(state).variables[SEARCH_VARIABLE] = search


def own_node(executor: Any) -> Any:
    return getattr(executor, NODE_ATTRIBUTE, None)


def set_own_node(executor: Any, node: Any) -> None:
    """Make `node` the executor's lineage node; forks of it (made later) inherit it as their parent."""
    setattr(executor, NODE_ATTRIBUTE, node)
    executor.variables[LINEAGE_VARIABLE] = node


def inherited_node(executor: Any) -> Any:
    """The node of the state this executor was forked from (None for a program's first state)."""
    return executor.variables.get(LINEAGE_VARIABLE)


def generation_done(state: Any, name: str) -> bool:
    """Non-blocking: has generation `name` of `state` finished (or failed)?"""
    event = executor_of(state).variable_event.get(name)
    return event is None or event.is_set()


def wait_meta(state: Any, name: str) -> dict[str, Any]:
    """Block until generation `name` of `state` is done; raise the generator's error if it failed."""
    meta = state.get_meta_info(name)
    executor = executor_of(state)
    if meta is None and executor.use_thread:
        # A failed generation has no meta. SGLang 0.5.23's worker wakes the waiters first and records
        # `error_` just before its thread ends, so wait for the thread before reading the error.
        executor.worker.join(timeout=5.0)
    if executor.error_ is not None:
        raise executor.error_
    return meta or {}


def as_generated(states: list[Any], name: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, meta) of each of `states` as its generation `name` ends, first done first (`wait_meta` on each in
    a thread of its own). The first failure (a request refused because the search stopped, a runtime error) is
    raised once every state's generation has ended, and the states are ended with it: a state left to the caller's
    `join`, which the failure skips, would keep its worker thread until the process exits."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    try:
        with ThreadPoolExecutor(max_workers=max(1, len(states)), thread_name_prefix="as-generated") as pool:
            waits = {pool.submit(wait_meta, state, name): index for index, state in enumerate(states)}
            for done in as_completed(waits):
                yield waits[done], done.result()
    except BaseException:
        executors = [executor_of(state) for state in states]
        for executor in executors:
            executor.end()
        for executor in executors:  # ended, not only told to end: their generations are over, so this is quick
            if has_worker(executor):
                executor.worker.join(timeout=60.0)
        raise


def has_worker(executor: Any) -> bool:
    """Whether a StreamExecutor runs a worker thread (not one whose `__init__` raised before making it)."""
    return getattr(executor, "use_thread", False)


def running_program_states(backends: Iterable[Any] | None = None) -> list[Any]:
    """The executors of the program states (and forks) on `backends` (or all) whose worker thread runs."""
    if "sglang.lang.interpreter" not in sys.modules:  # no program state was ever made in this process
        return []
    from sglang.lang.interpreter import StreamExecutor

    wanted = None if backends is None else [b for b in backends]
    return [obj for obj in gc.get_objects()
            if type(obj) is StreamExecutor and has_worker(obj) and obj.worker.is_alive()  # type(): no __class__
            and (wanted is None or any(obj.backend is b for b in wanted))]


def end_program_states(backends: Iterable[Any] | None = None) -> int:
    """End the worker thread of every program state still alive (on `backends`, or all); returns how many.

    Each state (and fork) runs a non-daemon worker thread that ends only when the state is garbage-collected.
    A state kept alive by a reference cycle would leak its thread, and at interpreter exit make the exit wait
    forever.
    """
    running = running_program_states(backends)
    for executor in running:
        executor.end()
        executor.worker.join(timeout=5.0)
    return len(running)


def end_without_asking_the_thread(executor: Any) -> None:
    """`StreamExecutor.end` without asking the worker thread `is_alive()`: tell the worker to stop, then tell
    the backend the program ended.

    Both SGLang finalizers (`StreamExecutor.__del__`, `ProgramState.__del__`) call `end()`. The garbage
    collector frees a state at whatever allocation it runs, and a state in a reference cycle (a failed
    generation stores an error whose traceback holds the worker's frame) is freed only by the collector.
    SGLang's `end()` asks `worker.is_alive()`, and the first time that is asked of an ended thread it takes
    threading's shutdown lock. When the collection runs inside threading's own bookkeeping (a new thread
    starting, for the next fork), that lock is already held by the same thread and the process hangs. A stop
    sentinel put in the queue of a worker that has already ended is never read, so no question needs asking.
    """
    if has_worker(executor):
        executor.queue.put(None)
    executor.backend.end_program(executor)


_sglang_end: list[Any] = []  # SGLang's own StreamExecutor.end, once replaced


def make_executor_finalizer_lock_free() -> None:
    """Install `end_without_asking_the_thread` as `StreamExecutor.end` (once; called where sgl_tts imports
    SGLang's interpreter)."""
    from sglang.lang.interpreter import StreamExecutor

    if StreamExecutor.end is not end_without_asking_the_thread:
        _sglang_end.append(StreamExecutor.end)
        StreamExecutor.end = end_without_asking_the_thread


# threading's own exit hook runs before non-daemon threads are joined (atexit runs after, too late).
getattr(threading, "_register_atexit", lambda fn: None)(end_program_states)
