"""Searches in flight for the server: validation of per-request settings, a bound, progress, cancellation.

HTTP-agnostic: `SearchService.submit` starts a search on a thread of its own (never on the event loop) and
returns its `SearchJob`; past `max_searches` searches in flight it raises `Busy` instead of queueing.
`cancel(job)` stops a search whose client left: new generator requests are refused and the ones in flight
are aborted on the runtime (`POST /abort_request` by rid on every server behind it).

Shutting down comes in two steps, so that no client waits for a search thread: `shut_down()` refuses new
searches and answers every search in flight at once (its future fails with `ShuttingDown`) while cancelling it;
`join(timeout_s)` waits, bounded, for the search threads to end. A thread blocked in a runtime call (a scorer
request, say) ends when the runtimes are stopped, which fails the call; search threads are daemons, so one still
blocked never holds up the process's exit.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import TemplateError

from sgl_tts.config import ConfigError, load_dataclass, to_dict
from sgl_tts.frontend.backend import Chat, ChatPrompt
from sgl_tts.problems import Problem
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import Runtimes, SearchConfig, cancel_search
from sgl_tts.search.limits import LimitError, Limits, check_limits
from sgl_tts.search.programs import load_program, program_names, with_program_settings
from sgl_tts.search.records import SearchResult
from sgl_tts.search.context import SearchCancelled, SearchContext
from sgl_tts.serve.metrics import ServeMetrics

log = logging.getLogger("sgl_tts.serve")
ProgressCallback = Callable[[dict[str, Any]], None]


class Busy(RuntimeError):
    """`max_searches` searches are in flight."""


class Unavailable(RuntimeError):
    """A runtime the searches need is down (being restarted, or given up on)."""


class ShuttingDown(SearchCancelled):
    """The server is shutting down: a new search is refused with it, and each search in flight is cancelled
    and answered with it."""


@dataclass
class SearchJob:
    """One search in flight."""

    id: str
    program: str
    search: SearchConfig
    question: str  # the last user turn
    chat: Chat = Chat()  # the system prompt and the turns before the question
    context: SearchContext | None = None  # the search's state: its requests in flight, cancellation
    future: Future = field(default_factory=Future)  # its answer: the result, or why there is none
    started_s: float = field(default_factory=time.monotonic)
    generated_tokens: int = 0  # so far, for progress
    rounds: int = 0  # scoring rounds so far
    on_progress: ProgressCallback | None = None
    aborted: threading.Event = field(default_factory=threading.Event)  # set once a cancel's aborts are sent
    running: bool = False  # its thread has started it (else queued)


def request_error(field: str | None, message: str, reason: str = "bad_request") -> ConfigError:
    """A refused request setting: a ConfigError whose `key` is the request field it is about and whose `reason`
    is the refusal's metrics label (bad_request, limits)."""
    error = ConfigError(f"request: {message}")
    error.key = field
    error.reason = reason
    return error


class SearchService:
    """Runs searches on shared runtimes. `validate(search)` checks a search config against the whole run
    config (e.g. `RunConfig`'s program-specific rules); it raises ValueError. A request's search is bounded
    by `limits` (the operator's, never the request's); `prompt_tokens(prompt)` counts the tokens of a request's
    prompt text, checked with the search's `max_tokens` against `context_tokens` (None: unchecked).
    `health` (a `Supervisor`, None: not watched) names the runtimes that are down: new searches are refused
    (`Unavailable`) until they are up again."""

    def __init__(self, runtimes: Runtimes, default_search: SearchConfig, max_searches: int,
                 validate: Callable[[SearchConfig], None] | None = None, abort_timeout_s: float = 30.0,
                 limits: Limits = Limits(), prompt_tokens: Callable[[str], int] | None = None,
                 context_tokens: int | None = None, health: Any = None):
        if max_searches < 1:
            raise ValueError(f"max_searches must be at least 1, got {max_searches}")
        self.runtimes = runtimes
        self.default_search = default_search
        self.max_searches = max_searches
        self.validate = validate
        self.limits = limits
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens
        self.abort_timeout_s = abort_timeout_s
        self.health = health
        self.programs = program_names()
        self._slots = threading.BoundedSemaphore(max_searches)
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified whenever a search ends
        self.shutting_down = False
        self._numbers = itertools.count(1)
        self.jobs: dict[str, SearchJob] = {}  # in flight, by id
        self.counts = {"in_flight": 0, "completed": 0, "failed": 0, "cancelled": 0, "rejected": 0,
                       "aborted_requests": 0}
        self.metrics = ServeMetrics(running=lambda: self._in_flight(running=True),
                                    queued=lambda: self._in_flight(running=False))

    # ---- requests ----

    def search_config(self, program: str, settings: dict[str, Any]) -> SearchConfig:
        """The search config for a request: the server's defaults with the request's `settings`, validated
        by the config loader (ConfigError naming the field). `program` must be a registered program name."""
        if program not in self.programs:
            raise request_error("model", f"unknown model (program) {program!r}; known: {', '.join(self.programs)}")
        if "program" in settings:
            raise request_error("program", "unknown field 'program'; the program is chosen by 'model'")
        if settings.get("record_tree"):  # the reply has no place for the tree: it would only cost memory
            raise request_error("record_tree", "'record_tree' is not available per request (the reply does not "
                                               "carry the search tree; `sgl-tts run --tree` draws it)")
        if settings.get("record_timeline"):
            raise request_error("record_timeline", "'record_timeline' is not available per request (the reply "
                                                   "does not carry the timeline; `sgl-tts run --timeline` draws it)")
        defaults = to_dict(self.default_search)
        if program != self.default_search.program:
            defaults["settings"] = None  # the server's program settings are not this program's
        merged = {**defaults, **settings, "program": program}
        for section in ("settings", "budget", "stopping"):  # only the named keys of a section change
            if isinstance(defaults[section], dict) and isinstance(settings.get(section), dict):
                merged[section] = {**defaults[section], **settings[section]}
        search = with_program_settings(load_dataclass(SearchConfig, merged, source="request"), "request", "settings")
        try:
            check_limits(search, self.limits)
        except LimitError as exc:
            raise request_error(exc.field, str(exc), "limits") from None
        if self.validate is not None:
            try:
                self.validate(search)
            except ConfigError:
                raise
            except ValueError as exc:
                raise ConfigError(f"request: {exc}") from exc
        return search

    def check_prompt(self, question: str, search: SearchConfig, chat: Chat = Chat()) -> None:
        """Refuse (ConfigError naming `messages` or `max_tokens`) a request whose prompt, `question` after `chat`
        in the generator's chat format, cannot be made or, with the search's `max_tokens` after it, does not fit
        the generator's context."""
        try:
            prompt = chat_runtimes(self.runtimes, chat).prompt(question)
        except TemplateError as exc:  # a chat template's own refusal, e.g. of roles that do not alternate
            raise request_error("messages", f"the generator's chat template refuses the messages: {exc}") from None
        if self.prompt_tokens is None or self.context_tokens is None:
            return
        tokens = self.prompt_tokens(prompt)
        if tokens >= self.context_tokens:
            raise request_error("messages", f"the prompt is {tokens} tokens, the generator's context "
                                            f"{self.context_tokens}: shorten the question", "limits")
        if tokens + search.max_tokens > self.context_tokens:
            raise request_error("max_tokens", f"'max_tokens' {search.max_tokens} after a prompt of {tokens} tokens "
                                              f"is past the generator's context {self.context_tokens}: at most "
                                              f"{self.context_tokens - tokens}", "limits")

    def submit(self, program: str, search: SearchConfig, question: str,
               on_progress: ProgressCallback | None = None, chat: Chat = Chat()) -> SearchJob:
        """Start a search of `question` after `chat` (`chat_runtimes`; checked by `check_prompt`); raises Busy
        when `max_searches` are in flight. `on_progress(event)` is called from the search's thread after each
        scoring round; raises Unavailable while a runtime is down, ShuttingDown once the server is shutting
        down."""
        if self.shutting_down:
            self.refused("unavailable")
            raise ShuttingDown("the server is shutting down")
        down = self.health.down() if self.health is not None else []
        if down:
            self.refused("unavailable")
            raise Unavailable(f"runtime {', '.join(repr(name) for name in down)} is down (being restarted)")
        if not self._slots.acquire(blocking=False):
            self.refused("busy")
            raise Busy(f"{self.max_searches} searches in flight")
        job = SearchJob(id=f"{next(self._numbers)}-{uuid.uuid4().hex[:8]}", program=program, search=search,
                        question=question, chat=chat, on_progress=on_progress)
        job.future.set_running_or_notify_cancel()  # only the service settles it (a waiter's cancel does not)
        with self._lock:
            self.counts["in_flight"] += 1
            self.jobs[job.id] = job
        try:
            job.context = self._new_context(job)  # before the job can be cancelled
            if self.shutting_down:  # shut_down may have passed this job by before it had a context
                self._answer_shutting_down(job)
            threading.Thread(target=self._run, args=(job,), name=f"sgl-tts-search-{job.id}", daemon=True).start()
        except BaseException:
            self._finished(job, "failed")
            raise
        return job

    def cancel(self, job: SearchJob) -> None:
        """Stop `job` in the background (its client left): no new requests, the ones in flight aborted."""
        threading.Thread(target=self._abort, args=(job,), name=f"cancel-{job.id}", daemon=True).start()

    def refused(self, reason: str) -> None:
        """Count a refused request (`reason`: a `metrics.REFUSALS` label)."""
        self.metrics.refused.labels(reason).inc()
        if reason in ("busy", "unavailable"):
            self._count("rejected")

    def _in_flight(self, running: bool) -> int:
        with self._lock:
            return sum(job.running == running for job in self.jobs.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "max_searches": self.max_searches}

    def shut_down(self) -> None:
        """Refuse new searches (ShuttingDown) and answer each search in flight now with ShuttingDown, its
        cancellation (requests refused, the ones in flight aborted) going on in the background."""
        with self._lock:
            self.shutting_down = True
            in_flight = [job for job in self.jobs.values() if job.context is not None]  # else submit answers it
        for job in in_flight:
            self._answer_shutting_down(job)

    def join(self, timeout_s: float) -> bool:
        """Wait until every search thread has ended, at most `timeout_s`; whether they all did."""
        with self._ended:
            return self._ended.wait_for(lambda: not self.jobs, timeout=timeout_s)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Shut down (`shut_down`) and wait, at most `timeout_s`, for the search threads to end; whether they
        all did."""
        self.shut_down()
        return self.join(timeout_s)

    # ---- inside ----

    def _count(self, name: str, delta: int = 1) -> None:
        with self._lock:
            self.counts[name] += delta

    def _finished(self, job: SearchJob, outcome: str, result: SearchResult | None = None) -> None:
        self.metrics.search_ended(outcome, time.monotonic() - job.started_s, result)
        with self._lock:
            self.counts["in_flight"] -= 1
            self.counts[outcome] += 1
            self.jobs.pop(job.id, None)
            self.counts["aborted_requests"] += job.context.aborted_requests if job.context is not None else 0
            self._ended.notify_all()
        self._slots.release()

    def _answer_shutting_down(self, job: SearchJob) -> None:
        """Answer `job` with ShuttingDown at once and cancel it in the background."""
        _settle(job.future, error=ShuttingDown(f"search {job.id} was cancelled: the server is shutting down"))
        job.context.cancel()  # no new requests from now on, even before the aborts are sent
        self.cancel(job)

    def _new_context(self, job: SearchJob) -> SearchContext:
        def generated(request: Any) -> None:
            job.generated_tokens += request.completion_tokens

        def scored(scores: list[list[float]]) -> None:
            job.rounds += 1
            if job.on_progress is not None:
                best = max((aggregate(s, job.search.aggregation) for s in scores), default=None)
                job.on_progress({"event": "progress", "iteration": job.rounds, "paths": len(scores),
                                 "best_score": best, "generated_tokens": job.generated_tokens,
                                 "elapsed_s": round(time.monotonic() - job.started_s, 3)})

        return self.runtimes.new_search(job.search, job.id, observers=[generated], scoring_observers=[scored])

    def _run(self, job: SearchJob) -> None:
        """The search's thread: run the program, count the outcome, then settle the job's future (after the
        counts, so that a client that has its answer sees them)."""
        outcome, result, error = "failed", None, None
        job.running = True
        try:
            problem = Problem(id=f"serve-{job.id}", question=job.question, gold=None)
            result = load_program(job.program)(problem, job.search, chat_runtimes(self.runtimes, job.chat),
                                               job.context)
            outcome = "completed"
        except BaseException as exc:  # the thread's end: the error goes to the future
            error = exc
            if not job.context.cancelled:
                log.error("search %s (%s) failed: %s", job.id, job.program, exc)
        if job.context.cancelled:
            outcome = "cancelled"
        self._finished(job, outcome, result)
        _settle(job.future, result, error)

    def _abort(self, job: SearchJob) -> None:
        """Cancel the job's search and abort its requests in flight (`search.api.cancel_search`)."""
        cancel_search(job.context, self.runtimes, self.abort_timeout_s)
        job.aborted.set()


def chat_runtimes(runtimes: Runtimes, chat: Chat) -> Runtimes:
    """`runtimes` whose prompts put `chat` (a request's system prompt and earlier turns) before the question, each
    in its generator's chat format (`ChatPrompt`). The default chat keeps `runtimes`; a prompt that is a plain
    function of the question takes no other (ConfigError naming `messages`)."""
    if chat == Chat():
        return runtimes
    prompts = {name: prompt for name in ("prompt", "target_prompt") if (prompt := getattr(runtimes, name))}
    plain = [name for name, prompt in prompts.items() if not isinstance(prompt, ChatPrompt)]
    if plain:
        raise request_error("messages", f"this server's {plain[0]} takes one question: send the one user message "
                                        "without a system message or earlier turns")
    return dataclasses.replace(runtimes, **{name: dataclasses.replace(prompt, chat=chat)
                                            for name, prompt in prompts.items()})


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Give `future` its result (or `error`) unless it has one already: a search answered at shutdown keeps
    that answer when its thread ends."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
