"""Searches in flight for the server: validation of per-request settings, a bound, progress, cancellation.

HTTP-agnostic: `SearchService.submit` starts a search on a worker thread (never on the event loop) and
returns its `SearchJob`; past `max_searches` searches in flight it raises `Busy` instead of queueing.
`cancel(job)` stops a search whose client left: new generator requests are refused and the ones in flight
are aborted on the runtime (`POST /abort_request` by rid on every server behind it).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from sgl_tts.config import ConfigError, load_dataclass, to_dict
from sgl_tts.problems import Problem
from sgl_tts.runtime.server import abort_requests
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.programs import load_program, program_names
from sgl_tts.search.records import SearchResult
from sgl_tts.serve.tracking import CancellableBackend, ObservedScorer

ProgressCallback = Callable[[dict[str, Any]], None]


class Busy(RuntimeError):
    """`max_searches` searches are in flight."""


@dataclass
class SearchJob:
    """One search in flight."""

    id: str
    program: str
    search: SearchConfig
    question: str
    runtimes: Runtimes | None = None  # the shared runtimes seen through this job's proxies
    backend: CancellableBackend | None = None
    target_backend: CancellableBackend | None = None
    future: Future = field(default_factory=Future)
    started_s: float = field(default_factory=time.monotonic)
    generated_tokens: int = 0  # so far, for progress
    rounds: int = 0  # scoring rounds so far
    on_progress: ProgressCallback | None = None
    aborted: threading.Event = field(default_factory=threading.Event)  # set once a cancel's aborts are sent

    def backends(self) -> list[CancellableBackend]:
        return [b for b in (self.backend, self.target_backend) if b is not None]


class SearchService:
    """Runs searches on shared runtimes. `validate(search)` checks a search config against the whole run
    config (e.g. `RunConfig`'s program-specific rules); it raises ValueError."""

    def __init__(self, runtimes: Runtimes, default_search: SearchConfig, max_searches: int,
                 validate: Callable[[SearchConfig], None] | None = None, abort_timeout_s: float = 30.0):
        if max_searches < 1:
            raise ValueError(f"max_searches must be at least 1, got {max_searches}")
        self.runtimes = runtimes
        self.default_search = default_search
        self.max_searches = max_searches
        self.validate = validate
        self.abort_timeout_s = abort_timeout_s
        self.programs = program_names()
        self._slots = threading.BoundedSemaphore(max_searches)
        self._pool = ThreadPoolExecutor(max_workers=max_searches, thread_name_prefix="sgl-tts-search")
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self.jobs: dict[str, SearchJob] = {}  # in flight, by id
        self.counts = {"in_flight": 0, "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0,
                       "aborted_requests": 0}

    # ---- requests ----

    def search_config(self, program: str, settings: dict[str, Any]) -> SearchConfig:
        """The search config for a request: the server's defaults with the request's `settings`, validated
        by the config loader (ConfigError naming the field). `program` must be a registered program name."""
        if program not in self.programs:
            raise ConfigError(f"request: unknown model (program) {program!r}; known: {', '.join(self.programs)}")
        if "program" in settings:
            raise ConfigError("request: unknown field 'program'; the program is chosen by 'model'")
        merged = {**to_dict(self.default_search), **settings, "program": program}
        search = load_dataclass(SearchConfig, merged, source="request")
        if self.validate is not None:
            try:
                self.validate(search)
            except ValueError as exc:
                raise ConfigError(f"request: {exc}") from exc
        return search

    def submit(self, program: str, search: SearchConfig, question: str,
               on_progress: ProgressCallback | None = None) -> SearchJob:
        """Start a search; raises Busy when `max_searches` are in flight. `on_progress(event)` is called from
        the search's thread after each scoring round."""
        if not self._slots.acquire(blocking=False):
            self._count("rejected")
            raise Busy(f"{self.max_searches} searches in flight")
        job = SearchJob(id=f"{next(self._numbers)}-{uuid.uuid4().hex[:8]}", program=program, search=search,
                        question=question, on_progress=on_progress)
        with self._lock:
            self.counts["in_flight"] += 1
            self.jobs[job.id] = job
        try:
            job.runtimes = self._job_runtimes(job)  # before the job can be cancelled
            job.future = self._pool.submit(self._run, job)
        except BaseException:
            self._finished(job, "failed")
            raise
        return job

    def cancel(self, job: SearchJob) -> None:
        """Stop `job` in the background (its client left): no new requests, the ones in flight aborted."""
        threading.Thread(target=self._abort, args=(job,), name=f"cancel-{job.id}", daemon=True).start()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "max_searches": self.max_searches}

    def close(self) -> None:
        """Cancel the searches in flight (their requests aborted) and wait for their threads to end."""
        with self._lock:
            in_flight = list(self.jobs.values())
        for job in in_flight:
            self._abort(job)
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- inside ----

    def _count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            self.counts[name] += delta

    def _finished(self, job: SearchJob, outcome: str) -> None:
        with self._lock:
            self.counts["in_flight"] -= 1
            self.counts[outcome] += 1
            self.jobs.pop(job.id, None)
            self.counts["aborted_requests"] += sum(b.aborted_requests for b in job.backends())
        self._slots.release()

    def _job_runtimes(self, job: SearchJob) -> Runtimes:
        shared = self.runtimes

        def generated(meta: dict[str, Any]) -> None:
            job.generated_tokens += int(meta.get("completion_tokens", 0))

        def scored(scores: list[list[float]]) -> None:
            job.rounds += 1
            if job.on_progress is not None:
                best = max((aggregate(s, job.search.aggregation) for s in scores), default=None)
                job.on_progress({"event": "progress", "iteration": job.rounds, "paths": len(scores),
                                 "best_score": best, "generated_tokens": job.generated_tokens,
                                 "elapsed_s": round(time.monotonic() - job.started_s, 3)})

        job.backend = CancellableBackend(shared.generator, job.id, generated)
        target = shared.target
        if target is shared.generator:
            target = job.backend
        elif target is not None:
            job.target_backend = target = CancellableBackend(target, job.id + "-target", generated)
        scorer = ObservedScorer(shared.scorer, scored) if shared.scorer is not None else None
        return dataclasses.replace(shared, generator=job.backend, scorer=scorer, target=target,
                                   extras=dict(shared.extras))

    def _run(self, job: SearchJob) -> SearchResult:
        outcome = "failed"
        try:
            problem = Problem(id=f"serve-{job.id}", question=job.question, gold=None)
            result = load_program(job.program)(problem, job.search, job.runtimes)
            outcome = "completed"
            return result
        finally:
            if any(b.cancelled for b in job.backends()):
                outcome = "cancelled"
            self._finished(job, outcome)

    def _abort(self, job: SearchJob) -> None:
        """Abort the job's requests until none is in flight: a request sent just before the cancel may reach
        the runtime after the first abort (SGLang ignores an abort for a rid it has not seen), so the rids
        still in flight are aborted again each time the in-flight set has not emptied."""
        deadline = time.monotonic() + self.abort_timeout_s
        for backend in job.backends():
            rids = backend.cancel()
            while rids and time.monotonic() < deadline:
                if backend.runtime is not None:
                    try:
                        abort_requests(backend.runtime, rids)
                    except OSError:
                        pass  # the runtime is gone: nothing left to abort
                if backend.wait_idle(timeout=0.5):
                    break
                rids = backend.in_flight()
        job.aborted.set()
