"""Per-search proxies for the generator backend and the step scorer: how the server sees into a search.

A program receives `Runtimes`; the server gives each search its own copy whose generator is a
`CancellableBackend` (every request gets a rid; the rids in flight are known, so a search whose client left
is aborted on the runtime, and its later requests are refused) and whose scorer is an `ObservedScorer`
(each scoring round is reported as progress). Nothing inside the search layer changes.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from typing import Any, Callable, Sequence

from sgl_tts.frontend.backend import REQUEST_FIELDS


class SearchCancelled(RuntimeError):
    """The search was cancelled (its client disconnected); raised by its next generator request."""


class _Proxy:
    """Attribute access falls through to `_inner` (what the interpreter and programs read from a backend or
    scorer: `runtime`, `is_chat_model`, `get_chat_template`, `tokens_processed`, ...)."""

    _inner: Any

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_inner":  # copy/pickle probes before __init__ ran
            raise AttributeError(name)
        return getattr(self._inner, name)


class CancellableBackend(_Proxy):
    """A frontend backend for one search: tags each generate request with a rid (keeping one the program set,
    such as a FastTTS beam tag), tracks the rids in flight and refuses new requests once cancelled."""

    def __init__(self, inner: Any, search_id: str, on_generated: Callable[[dict[str, Any]], None] | None = None):
        self._inner = inner
        self._search_id = search_id
        self._on_generated = on_generated
        self._numbers = itertools.count()
        self._changed = threading.Condition()
        self._in_flight: set[str] = set()
        self.cancelled = False
        self.aborted_requests = 0  # requests that came back with finish_reason 'abort'

    @property
    def runtime(self) -> Any:
        """The runtime to abort requests on (None for a backend without one, e.g. the scripted test backend)."""
        return getattr(self._inner, "runtime", None)

    def _refuse_if_cancelled(self) -> None:
        if self.cancelled:
            raise SearchCancelled(f"search {self._search_id} was cancelled")

    def commit_lazy_operations(self, s: Any) -> None:
        with self._changed:
            self._refuse_if_cancelled()
        return self._inner.commit_lazy_operations(s)

    def generate(self, s: Any, sampling_params: Any) -> tuple[str, dict[str, Any]]:
        fields = s.variables.get(REQUEST_FIELDS)
        rid = (fields or {}).get("rid") or f"serve-{self._search_id}-{next(self._numbers)}"
        with self._changed:
            self._refuse_if_cancelled()
            self._in_flight.add(rid)
        # The state's requests run one after another on its worker thread, so the fields can be swapped in
        # for this request and put back after it.
        s.variables[REQUEST_FIELDS] = {**(fields or {}), "rid": rid}
        try:
            text, meta = self._inner.generate(s, sampling_params)
        finally:
            if fields is None:
                s.variables.pop(REQUEST_FIELDS, None)
            else:
                s.variables[REQUEST_FIELDS] = fields
            with self._changed:
                self._in_flight.discard(rid)
                self._changed.notify_all()
        reason = (meta or {}).get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            with self._changed:
                self.aborted_requests += 1
        with self._changed:
            self._refuse_if_cancelled()
        if self._on_generated is not None:
            self._on_generated(meta or {})
        return text, meta

    def cancel(self) -> list[str]:
        """Refuse new requests from now on; returns the rids in flight (to abort on the runtime)."""
        with self._changed:
            self.cancelled = True
            return sorted(self._in_flight)

    def in_flight(self) -> list[str]:
        with self._changed:
            return sorted(self._in_flight)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is in flight (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True


class ObservedScorer(_Proxy):
    """A step scorer for one search that reports each scoring round (the per-step scores of every path it
    scored) to `on_scored`. It scores through a private shallow copy of the shared scorer, so its token
    counters count this search only (as programs/rsd.py's own copy does)."""

    def __init__(self, inner: Any, on_scored: Callable[[list[list[float]]], None]):
        self._inner = copy.copy(inner)
        self._on_scored = on_scored

    def score(self, prompt: str, paths: Sequence[Sequence[str]]) -> list[list[float]]:
        scores = self._inner.score(prompt, paths)
        self._on_scored(scores)
        return scores
