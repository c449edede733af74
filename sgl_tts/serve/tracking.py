"""Per-search proxies for the generator backend and the step scorer: how the server sees into a search.

A program receives `Runtimes`; the server gives each search its own copy whose generator is a
`CancellableBackend` (every request gets a rid; the rids in flight are known, so a search whose client left
is aborted on the runtime, and its later requests are refused) and whose scorer is an `ObservedScorer`
(each scoring round is reported as progress). Nothing inside the search layer changes.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable, Sequence



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
    """A frontend backend for one search: a per-run view of the shared backend (`SearchBackend.for_run`) whose
    request ids (the lineage rids it sends) are tracked while in flight; once cancelled, new requests are
    refused. The search's own views (`for_run`, which every search makes) share that tracking."""

    def __init__(self, inner: Any, search_id: str, on_generated: Callable[[dict[str, Any]], None] | None = None):
        self._inner = inner.for_run(None, search_id) if hasattr(inner, "for_run") else inner
        self._search_id = search_id
        self._on_generated = on_generated
        self._changed = threading.Condition()
        self._in_flight: set[str] = set()
        self._cancel = threading.Event()
        self._aborted = [0]
        self._local = threading.local()  # the rids sent by the request running on this thread
        self._listen()

    def _listen(self) -> None:
        if hasattr(self._inner, "rid_listener"):
            self._inner.rid_listener = self._on_rid

    def for_run(self, seed: int | None = None, label: str | None = None) -> "CancellableBackend":
        view = copy.copy(self)
        view._inner = self._inner.for_run(seed, label) if hasattr(self._inner, "for_run") else self._inner
        view._listen()
        return view

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def aborted_requests(self) -> int:
        """Requests that came back with finish_reason 'abort'."""
        return self._aborted[0]

    @property
    def runtime(self) -> Any:
        """The runtime to abort requests on (None for a backend without one, e.g. the scripted test backend)."""
        return getattr(self._inner, "runtime", None)

    def _refuse_if_cancelled(self) -> None:
        if self.cancelled:
            raise SearchCancelled(f"search {self._search_id} was cancelled")

    def _on_rid(self, rid: str) -> None:
        with self._changed:
            self._refuse_if_cancelled()
            self._in_flight.add(rid)
        sent = getattr(self._local, "rids", None)
        if sent is not None:
            sent.append(rid)

    def _tracked(self, call: Callable[[], Any]) -> Any:
        self._local.rids = []
        try:
            return call()
        finally:
            with self._changed:
                self._in_flight.difference_update(self._local.rids)
                self._changed.notify_all()
            self._local.rids = None

    def commit_lazy_operations(self, s: Any) -> None:
        with self._changed:
            self._refuse_if_cancelled()
        return self._tracked(lambda: self._inner.commit_lazy_operations(s))

    def generate(self, s: Any, sampling_params: Any) -> tuple[str, dict[str, Any]]:
        with self._changed:
            self._refuse_if_cancelled()
        text, meta = self._tracked(lambda: self._inner.generate(s, sampling_params))
        reason = (meta or {}).get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            with self._changed:
                self._aborted[0] += 1
        with self._changed:
            self._refuse_if_cancelled()
        if self._on_generated is not None:
            self._on_generated(meta or {})
        return text, meta

    def cancel(self) -> list[str]:
        """Refuse new requests from now on; returns the rids in flight (to abort on the runtime)."""
        with self._changed:
            self._cancel.set()
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
        return self.score_counted(prompt, paths).scores

    def score_counted(self, prompt: str, paths: Sequence[Sequence[str]]) -> Any:
        scored = self._inner.score_counted(prompt, paths)
        self._on_scored(scored.scores)
        return scored
