"""Accounting of every generator request a search makes, from the server's own `meta_info`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Request:
    """One standard request: the runtime it went to, its context text, what it generated, its tokens, when it
    was answered and how long it took (the client's wall time and the server's own windows, None when the
    server did not report them)."""

    runtime: str
    context: str
    output: str
    completion_tokens: int
    answered_at: float  # time.monotonic()
    client_s: float
    e2e_latency: float | None = None
    first_token_latency: float | None = None
    queue_time: float | None = None
    prompt_tokens: int = 0  # the context it was sent with, in tokens (the server's count)

    @property
    def sent_at(self) -> float:
        """When it was sent, on the clock of `answered_at` (time.monotonic)."""
        return self.answered_at - self.client_s

    @classmethod
    def answered(cls, runtime: str, context: str, output: str, meta: dict[str, Any], began: float) -> "Request":
        """The request for `context` sent at time.perf_counter() `began` and answered now with `output`."""
        return cls(runtime, context, output, int(meta.get("completion_tokens", 0) or 0), time.monotonic(),
                   time.perf_counter() - began, meta.get("e2e_latency"), meta.get("first_token_latency"),
                   meta.get("queue_time"), int(meta.get("prompt_tokens", 0) or 0))


@dataclass(frozen=True)
class Window:
    """A stretch of a search's work beside its standard requests, kept when the search records its timeline:
    an `iteration` of `expand` (its requests sent together, their answers awaited), a `verify` call of the
    scorer, a `speculative` request (FastTTS S's head start). Times on time.monotonic; `numbers`: its counts
    (tokens, paths, input and cached tokens, aborted)."""

    kind: str
    runtime: str
    began: float
    ended: float
    numbers: tuple[tuple[str, float], ...] = ()


@dataclass
class RequestLedger:
    """Token and time counts of the requests one search sent, and the requests themselves; thread-safe.

    Each request's `meta_info` (SGLang: prompt_tokens, completion_tokens, cached_tokens, e2e_latency) is
    added up here.
    """

    requests: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    server_time_s: float = 0.0  # summed end-to-end latency the server reported
    speculative_requests: int = 0
    speculative_tokens: int = 0
    log: list[Request] = field(default_factory=list, repr=False)  # standard requests with their text
    record_windows: bool = False  # keep `windows` (the search records its timeline)
    windows: list[Window] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_request(self, request: Request, meta: dict[str, Any]) -> None:
        """A standard request (kept for `path_of` and per-request timings), counted like `record`."""
        with self._lock:
            self.log.append(request)
        self.record(meta)

    def window(self, kind: str, runtime: str, began: float, ended: float, **numbers: float) -> None:
        """Keep a `Window` of the search's work (a no-op unless `record_windows`)."""
        if self.record_windows:
            with self._lock:
                self.windows.append(Window(kind, runtime, began, ended, tuple(numbers.items())))

    def recorded_windows(self) -> list[Window]:
        with self._lock:
            return list(self.windows)

    def answered_requests(self, runtime: str | None = None, since: int = 0) -> list[Request]:
        """The standard requests answered so far (those to `runtime` only, when given), from the `since`-th
        answered on (`answered_count` before a piece of work: what that work was answered)."""
        with self._lock:
            return [r for r in self.log[since:] if runtime is None or r.runtime == runtime]

    def answered_count(self) -> int:
        with self._lock:
            return len(self.log)

    def path_of(self, text: str) -> tuple[int, float | None]:
        """(tokens generated along, time the last piece was answered) for the path whose whole text (prompt
        included) is `text`: the requests whose context and output both lie on it. For programs that return
        texts, not paths (plain SGLang programs)."""
        with self._lock:
            on_path = [r for r in self.log if r.output and text.startswith(r.context + r.output)]
        return sum(r.completion_tokens for r in on_path), max((r.answered_at for r in on_path), default=None)

    def record(self, meta: dict[str, Any], speculative: bool = False) -> None:
        completion = int(meta.get("completion_tokens", 0) or 0)
        with self._lock:
            self.requests += 1
            self.completion_tokens += completion
            self.prompt_tokens += int(meta.get("prompt_tokens", 0) or 0)
            self.cached_tokens += int(meta.get("cached_tokens", 0) or 0)
            self.server_time_s += float(meta.get("e2e_latency", 0.0) or 0.0)
            if speculative:
                self.speculative_requests += 1
                self.speculative_tokens += completion
