"""The state of one search, in one object: `SearchContext`.

A search is started by `Runtimes.new_search` (the one place a context is made) and its context is handed to the
program and to `expand`. Everything that belongs to that one search lives here and nowhere else: its label
(lineage run id prefix), seed, request ledger, step extension (FastTTS S), observers, cancellation and the
requests in flight, and its own timing, counts and search tree. The runtimes (`Runtimes`) and the endpoints
beneath them are shared by every search and hold no per-search state.

How a request finds its search: SGLang's interpreter runs each program state on a worker thread started in a
copy of the creating thread's `contextvars`, and `fork` copies the parent's variables into each child. The
search binds itself while its program runs (`with context.running():`); the endpoint reads it back from the
state (`sgl_tts.frontend.sglang_internals.search_of`), as SGLang keeps per-program state in the executor.

A context made while another search is bound in its thread (a program that makes its own state inside the run
its caller bound, `sgl_tts.search.programs.load_program`) runs inside that search, its `outer`: the two share one
ledger, and every request the inner one sends is in flight, observed and cancelled in the outer one as well.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from sgl_tts.frontend.ledger import Request, RequestLedger
from sgl_tts.frontend.sglang_internals import running_search, searching
from sgl_tts.scoring.base import ScoredPaths, StepScorer
from sgl_tts.search.tree import SearchTree


class SearchCancelled(RuntimeError):
    """The search was cancelled (its client left); raised by its next generator request."""


class SearchContext:
    """One search's state (see the module docstring).

    Token counts come from the ledger (every request the search sent, from the server's meta_info) unless the
    program counts by hand with `record` (RSD, whose step cache replays work without requests). `outer`: the search
    this one runs inside (see the module docstring), None for a search of its own.
    """

    def __init__(self, config: Any, label: str = "search", seed: int | None = None,
                 extension_factory: Callable[["SearchContext"], Any] | None = None,
                 observers: Sequence[Callable[[Request], None]] = (),
                 scoring_observers: Sequence[Callable[[list[list[float]]], None]] = ()):
        self.config = config
        self.label = label
        self.seed = seed
        self.outer: SearchContext | None = running_search()
        self.ledger = self.outer.ledger if self.outer is not None else RequestLedger(
            record_windows=bool(getattr(config, "record_timeline", False)))
        self.observers = tuple(observers)  # called with every answered standard request
        self.scoring_observers = tuple(scoring_observers)  # called with every scoring round's scores
        self._changed = threading.Condition()
        self._cancelled = False
        self._in_flight: dict[str, int] = {}  # rid -> requests in flight with it
        self.aborted_requests = 0  # requests answered with finish_reason 'abort'
        # timing and counts of the search itself
        self.start = time.monotonic()
        self.generator_time_s = 0.0
        self.verifier_time_s = 0.0
        self.iterations = 0
        self.verifier_calls = 0
        self.tree = SearchTree()
        self.extra: dict[str, Any] = {}  # program-specific counts for the result's `extra`
        self._hand_counts: list[int] | None = None  # [generated, prompt, cached] once `record` was called
        self.extension = extension_factory(self) if extension_factory is not None else None

    # -- binding ------------------------------------------------------------------------------------------

    def running(self):
        """`with context.running():` program states created inside belong to this search."""
        return searching(self)

    # -- requests (called by the endpoint beneath the DSL) -------------------------------------------------

    def request_sent(self, rid: str) -> None:
        """A request with lineage id `rid` is about to be sent; refused once the search is cancelled."""
        if self.outer is not None:
            self.outer.request_sent(rid)
        with self._changed:
            self._refuse_if_cancelled()
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1

    def request_done(self, rid: str) -> None:
        with self._changed:
            left = self._in_flight.get(rid, 0) - 1
            if left > 0:
                self._in_flight[rid] = left
            else:
                self._in_flight.pop(rid, None)
            self._changed.notify_all()
        if self.outer is not None:
            self.outer.request_done(rid)

    def request_answered(self, request: Request, meta: dict[str, Any]) -> None:
        """A standard request was answered: into the ledger, to the observers; refused after a cancel."""
        self.ledger.record_request(request, meta)
        self._heard(request, meta)

    def _heard(self, request: Request, meta: dict[str, Any]) -> None:
        """An answered request beyond the ledger (which an inner search shares): the abort count, the observers
        and a cancel's refusal, here and in the outer search."""
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            with self._changed:
                self.aborted_requests += 1
        for observer in self.observers:
            observer(request)
        if self.outer is not None:
            self.outer._heard(request, meta)
        with self._changed:
            self._refuse_if_cancelled()

    # -- cancellation -------------------------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        return self._cancelled or (self.outer is not None and self.outer.cancelled)

    def cancel(self) -> list[str]:
        """Refuse new requests from now on; returns the rids in flight (to abort on the runtime)."""
        with self._changed:
            self._cancelled = True
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

    def _refuse_if_cancelled(self) -> None:
        if self._cancelled:
            raise SearchCancelled(f"search {self.label} was cancelled")

    # -- timing and counts --------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def record(self, tokens: int, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """Count work by hand (in the outer search too); from then on the search's token counts are these, not
        the ledger's."""
        if self._hand_counts is None:
            self._hand_counts = [0, 0, 0]
        self._hand_counts[0] += tokens
        self._hand_counts[1] += prompt_tokens
        self._hand_counts[2] += cached_tokens
        if self.outer is not None:
            self.outer.record(tokens, prompt_tokens, cached_tokens)

    @property
    def generated_tokens(self) -> int:
        return self._hand_counts[0] if self._hand_counts is not None else self.ledger.completion_tokens

    @property
    def prompt_tokens(self) -> int:
        return self._hand_counts[1] if self._hand_counts is not None else self.ledger.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self._hand_counts[2] if self._hand_counts is not None else self.ledger.cached_tokens

    def scored(self, scores: list[list[float]]) -> None:
        """Tell the scoring observers about one scoring round (what `score` does; for programs that call the
        scorer themselves)."""
        for observer in self.scoring_observers:
            observer(scores)
        if self.outer is not None:
            self.outer.scored(scores)

    def score(self, scorer: StepScorer, prompt: str, paths: Sequence[Any]) -> ScoredPaths | None:
        """Score every step of `paths` in one batched scorer call; writes each path's `step_scores`."""
        if not paths:
            return None
        began = time.monotonic()
        scored = scorer.score_counted(prompt, [p.steps for p in paths])
        seconds = time.monotonic() - began
        self.verifier_time_s += seconds
        self.verifier_calls += 1
        # per verification: paths, steps scored, the verifier's input and radix-cached tokens, its time
        self.extra.setdefault("verifier_iterations", []).append({**scored.counts.as_dict(), "time_s": seconds})
        self.ledger.window("verify", "scorer", began, began + seconds, **scored.counts.as_dict())
        for path, path_scores in zip(paths, scored.scores):
            assert len(path_scores) == len(path.steps), "scorer must return one score per step"
            path.step_scores = list(path_scores)
            self.tree.add(path.steps, path.step_scores, path.extra.get("head_start_tokens", 0))
        self.scored(scored.scores)
        return scored

    def timeline(self) -> dict[str, Any]:
        """What the search's runtimes did for it, in seconds from its start (`sgl_tts.app.timeline` draws it):
        every standard request (runtime, sent, answered, tokens, context tokens, the server's queue and
        end-to-end time) from the ledger, and the windows it recorded (iterations, verifier calls, speculative
        requests; only when its config's `record_timeline` is on)."""
        origin = self.start
        requests = [{"runtime": r.runtime, "began": r.sent_at - origin, "ended": r.answered_at - origin,
                     "tokens": r.completion_tokens, "prompt_tokens": r.prompt_tokens, "queue_s": r.queue_time,
                     "e2e_s": r.e2e_latency} for r in self.ledger.answered_requests()]
        windows = [{"kind": w.kind, "runtime": w.runtime, "began": w.began - origin, "ended": w.ended - origin,
                    **dict(w.numbers)} for w in self.ledger.recorded_windows()]
        return {"label": self.label, "requests": requests, "windows": windows}
