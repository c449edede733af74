"""The state of one search, in one object: `SearchContext`.

A search is started by `Runtimes.new_search` (the one place a context is made) and its context is handed to the
program and to `expand`. Everything that belongs to that one search lives here and nowhere else: its label
(lineage run id prefix), seed, request ledger, step extension (FastTTS S), observers, cancellation and the
requests in flight, its budget and stopping rules (`sgl_tts.search.budget`, `sgl_tts.search.stopping`), and its
own timing (on its `clock`), counts, search tree and the paths it has seen end. The runtimes (`Runtimes`) and the endpoints
beneath them are shared by every search and hold no per-search state.

How a request finds its search: SGLang's interpreter runs each program state on a worker thread started in a
copy of the creating thread's `contextvars`, and `fork` copies the parent's variables into each child. The
search binds itself while its program runs (`with context.running():`); the endpoint reads it back from the
state (`sgl_tts.frontend.sglang_internals.search_of`), as SGLang keeps per-program state in the executor.

A context made while another search is bound in its thread (a program that makes its own state inside the run
its caller bound, `sgl_tts.search.programs.load_program`) runs inside that search, its `outer`: the two share one
ledger, and every request the inner one sends is in flight, observed and cancelled in the outer one as well.

A search stops early when its budget is spent (`search.budget`), its answer has settled or its best-ranked paths
have ended (`search.stopping`):
from then on every request is refused with `SearchStopped`, the requests in flight are aborted (`on_stop`,
given by `Runtimes.new_search`), and the program's runner turns the refusal into the search's answer from the
paths it has seen (`sgl_tts.search.api.stopped_result`): no program has code of its own for it.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

from policies.base import decode_rid
from sgl_tts.frontend.ledger import Request, RequestLedger
from sgl_tts.frontend.sglang_internals import running_search, searching
from sgl_tts.scoring.base import ScoredPaths, StepScorer, rank_key, scoring_run
from sgl_tts.search.budget import Budget, Narrowing
from sgl_tts.search.grading import normalize_answer
from sgl_tts.search.stopping import (LOW_CONFIDENCE, RANKED, SETTLED, RankedEndRule, SettledAnswerRule, Stopping,
                                     TraceConfidenceRule)
from sgl_tts.search.tree import SearchTree


# A request refused because its search stopped or was cancelled ends the SGLang state that sent it, and SGLang's
# executor reports that with a warning and its traceback. It is how a search ends early, not an error: not shown.
warnings.filterwarnings("ignore", message=r"Error in stream_executor(?s:.*)(SearchStopped|SearchCancelled)")


class SearchCancelled(RuntimeError):
    """The search was cancelled (its client left); raised by its next generator request."""


class SearchStopped(RuntimeError):
    """The search stopped early (`reason`: "deadline", "token_budget", "settled", "ranked"); raised by its next
    request and caught by the program's runner, which answers with the paths seen so far. Never reaches the user."""

    def __init__(self, reason: str):
        super().__init__(f"the search stopped: {reason}")
        self.reason = reason


class SearchContext:
    """One search's state (see the module docstring).

    Token counts come from the ledger (every request the search sent, from the server's meta_info) unless the
    program counts by hand with `record` (RSD, whose step cache replays work without requests). `outer`: the search
    this one runs inside (see the module docstring), None for a search of its own. `clock` is the search's time
    (seconds, monotonic; a fake one in tests); `on_stop(context)` is called once when the search stops early, to
    abort its requests in flight; `scorer`, the runtimes' verifier, scores first steps for `stopping.prune`.
    """

    def __init__(self, config: Any, label: str = "search", seed: int | None = None,
                 extension_factory: Callable[["SearchContext"], Any] | None = None,
                 observers: Sequence[Callable[[Request], None]] = (),
                 scoring_observers: Sequence[Callable[[list[list[float]]], None]] = (),
                 clock: Callable[[], float] = time.monotonic,
                 on_stop: Callable[["SearchContext"], None] | None = None, scorer: StepScorer | None = None):
        self.config = config
        self.scorer = scorer  # the search's verifier, for `stopping.prune`'s and `stopping.enough`'s scores
        self.prompt: str | None = None  # the problem's prompt (`run_search`), which `stopping.enough` scores after
        self.label = label
        self.seed = seed
        self.outer: SearchContext | None = running_search()
        self._inner: weakref.WeakSet[SearchContext] = weakref.WeakSet()  # searches run inside this one
        if self.outer is not None:
            self.outer._inner.add(self)
        self.ledger = self.outer.ledger if self.outer is not None else RequestLedger(
            record_windows=bool(getattr(config, "record_timeline", False)))
        self.observers = tuple(observers)  # called with every answered standard request
        self.scoring_observers = tuple(scoring_observers)  # called with every scoring round's scores
        self._changed = threading.Condition()
        self._cancelled = False
        self._in_flight: dict[str, int] = {}  # rid -> requests in flight with it
        self.last_run: str | None = None  # the program run of the latest tagged request (`score` serves it)
        self._tickets_issued = self._tickets_admitted = 0  # requests queued / sent under `stopping.stage`
        self.aborted_requests = 0  # requests answered with finish_reason 'abort'
        self.clock = clock
        self.on_stop = on_stop
        self.budget: Budget = getattr(config, "budget", None) or Budget()
        stopping = getattr(config, "stopping", None) or Stopping()
        self.stopping: Stopping = stopping.beneath(getattr(config, "program", ""))  # none where it names others
        self.stop_reason: str | None = None  # why the search stopped early, once it has
        self.confidence_rule = (TraceConfidenceRule(self.stopping.window, self.stopping.keep_fraction,
                                                    self.stopping.warmup) if self.stopping.confidence else None)
        self.settled_rule = (SettledAnswerRule(self.stopping.consensus, self.stopping.min_answers,
                                               self.stopping.agree)
                             if self.stopping.settled else None)
        self.ranked_rule = RankedEndRule(self.stopping.top) if self.stopping.ranked else None
        self.finished_paths: list[Any] = []  # every path that ended (`sgl_tts.search.api.finish`)
        self.frontier: list[Any] = []  # the live paths `expand` last held (its parents while it runs)
        self._answers: list[str] = []  # the answers of the ended paths, for the settled rule
        self.settled_vote: list[str] = []  # the answers whose vote settled the search (`finish_reason` settled)
        # timing and counts of the search itself
        self.start = clock()
        self.generator_time_s = 0.0
        self.verifier_time_s = 0.0
        self.iterations = 0
        self.verifier_calls = 0
        self.tree = SearchTree()
        self.extra: dict[str, Any] = {}  # program-specific counts for the result's `extra`
        self._hand_counts: list[int] | None = None  # [generated, prompt, cached] once `record` was called
        self.extension = extension_factory(self) if extension_factory is not None else None
        self._timer = None
        if self.budget.deadline_s is not None:  # the deadline stops requests in flight, not only the next one
            self._timer = threading.Timer(self.budget.deadline_s, self.check_budget)
            self._timer.daemon = True
            self._timer.start()

    # -- binding ------------------------------------------------------------------------------------------

    def running(self):
        """`with context.running():` program states created inside belong to this search."""
        return searching(self)

    # -- requests (called by the endpoint beneath the DSL) -------------------------------------------------

    def request_sent(self, rid: str) -> None:
        """A request with lineage id `rid` is about to be sent; refused once the search is cancelled or stopped."""
        if self.outer is not None:
            self.outer.request_sent(rid)
        self.check_budget()
        with self._changed:
            self._wait_for_a_stage_slot()
            self._refuse_if_cancelled()
            self.refuse_if_stopped()
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
            tag = decode_rid(rid)
            if tag is not None:
                self.last_run = tag.problem_id

    def _wait_for_a_stage_slot(self) -> None:
        """With `stopping.stage` k > 0, wait (holding no lock) until fewer than k requests are in flight and every
        request sent before this one has gone out: requests leave in the order they came. A stop or a cancel
        wakes every waiter, to be refused."""
        stage = self.stopping.stage
        if stage <= 0:
            return
        ticket = self._tickets_issued
        self._tickets_issued += 1

        def may_go() -> bool:
            return self.cancelled or self.stopped is not None or (
                ticket == self._tickets_admitted and sum(self._in_flight.values()) < stage)

        self._changed.wait_for(may_go)  # an outer search's stop or cancel notifies this one too (_wake)
        if ticket == self._tickets_admitted:
            self._tickets_admitted += 1
            self._changed.notify_all()

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
        self.check_budget()  # an answer past the budget stops the search; the answer itself is kept
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
            rids = sorted(self._in_flight)
        self._wake()
        return rids

    def _wake(self) -> None:
        """Wake the requests waiting for a stage slot here and in every search inside this one (a stop or cancel
        here refuses theirs too)."""
        with self._changed:
            self._changed.notify_all()
        for inner in list(self._inner):
            inner._wake()

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
        if self.cancelled:
            raise SearchCancelled(f"search {self.label} was cancelled")

    # -- stopping early -----------------------------------------------------------------------------------

    @property
    def stopped(self) -> str | None:
        """Why this search (or the one it runs inside) stopped early; None while it runs."""
        return self.stop_reason or (self.outer.stopped if self.outer is not None else None)

    def stop(self, reason: str) -> list[str]:
        """Stop the search early (refuse new requests) for `reason`; returns the rids in flight. The first stop
        calls `on_stop` (which aborts them)."""
        with self._changed:
            first = self.stop_reason is None
            if first:
                self.stop_reason = reason
            rids = sorted(self._in_flight)
        if first:
            self._wake()
            if self._timer is not None:
                self._timer.cancel()
            if self.on_stop is not None:
                self.on_stop(self)
        return rids

    def check_budget(self) -> str | None:
        """Stop the search once its budget is spent; why it stopped, or None."""
        if self.stop_reason is None:
            reason = self.budget.exhausted(self.elapsed(), self.generated_tokens)
            if reason is not None:
                self.stop(reason)
        return self.stopped

    def refuse_if_stopped(self) -> None:
        """Raise SearchStopped when this search, or the one it runs inside, has stopped."""
        reason = self.stopped
        if reason is not None:
            raise SearchStopped(reason)

    @property
    def narrowing(self) -> bool:
        """Whether the budget's slack is below its threshold (`Budget.narrowing`): the search narrows."""
        return self.budget.narrowing(self.elapsed(), self.generated_tokens)

    def path_finished(self, path: Any) -> None:
        """A path ended (`sgl_tts.search.api.finish`): kept for an early answer, heard by the stopping rules (a
        path they stopped is not): its confidence may warm the confidence rule up, its answer settle the vote."""
        with self._changed:
            self.finished_paths.append(path)
        if path.finish_reason == LOW_CONFIDENCE:
            return
        confidences = path.extra.get("token_confidences")
        if self.confidence_rule is not None and confidences and self.stopping.reads == "ended":
            self.confidence_rule.warm_up(self.confidence_rule.confidence(confidences))
        if self.settled_rule is not None and path.answer is not None:
            with self._changed:
                self._answers.append(path.answer)
                answers = list(self._answers)
            self._settle_on(answers)

    def step_confidences_heard(self, paths: Sequence[Any]) -> None:
        """`reads: live`: the paths of one step, ended and live; the first step whose paths carry confidences
        sets the confidence rule's threshold (at least `warmup` of them)."""
        rule = self.confidence_rule
        if rule is not None and rule.threshold is None:
            rule.warm_up_at_once([rule.confidence(p.extra["token_confidences"]) for p in paths
                                  if p.extra.get("token_confidences")])

    def live_answers_heard(self, answers: Sequence[str | None]) -> None:
        """`reads: live`: the live paths' answers so far (`expand`'s probes); the vote of the ended paths' answers
        and these may settle the search."""
        if self.settled_rule is not None:
            with self._changed:
                vote = self._answers + [answer for answer in answers if answer is not None]
            self._settle_on(vote)

    def _settle_on(self, answers: list[str]) -> None:
        """Stop the search (settled) when the vote of `answers`, one each, is settled; `settled_vote` keeps it."""
        if self.settled_rule.settled([normalize_answer(a) for a in answers], [1.0] * len(answers), remaining=1):
            with self._changed:
                if self.stop_reason is None:
                    self.settled_vote = list(answers)
            self.stop(SETTLED)

    @property
    def prunes(self) -> bool:
        """Whether whole-solution requests are sent in two parts, cut after the first step when the verifier scores
        it below `stopping.prune` (`SearchBackend`): where the config cuts samples (`SearchConfig.cuts_samples`)
        and the search has a verifier."""
        return self.scorer is not None and bool(getattr(self.config, "cuts_samples", False))

    def first_step_kept(self, prompt: str, first_step: str) -> bool:
        """`stopping.prune`: the verifier scores a sample's first step (a verifier call of the search, timed and
        counted as `score`'s are); whether the sample goes on: its score is at least `prune`, or the search's other
        n - 1 samples were cut (one is always kept, so the search has an answer)."""
        scored, _ = self._verifier_call(self.scorer, prompt, [[first_step]])
        with self._changed:
            cut = self.extra.get("pruned_samples", 0)
            kept = scored.scores[0][0] >= self.stopping.prune or cut >= getattr(self.config, "n", 1) - 1
            if not kept:
                self.extra["pruned_samples"] = cut + 1
        return kept

    @property
    def sends_in_waves(self) -> bool:
        """`stopping.enough`: whether `expand` sends each parent's children a wave at a time, and no more once the
        verifier is content with one of them; it needs the search's verifier and its prompt."""
        return self.stopping.enough > 0 and self.scorer is not None and self.prompt is not None

    def content_parents(self, children: Sequence[Any]) -> set[int]:
        """`stopping.enough`: the parents (`parent` indices) of `children` with a child whose newest step the
        verifier scores at least `enough` (one verifier call of the search, timed and counted as `score`'s are; the
        children's own scores are left to the program's scoring)."""
        if not children:
            return set()
        scored, _ = self._verifier_call(self.scorer, self.prompt, [child.steps for child in children])
        return {child.parent for child, scores in zip(children, scored.scores) if scores[-1] >= self.stopping.enough}

    def unsure(self, path: Any) -> bool:
        """Whether the confidence rule stops the live `path` (its confidence so far is below the threshold)."""
        confidences = path.extra.get("token_confidences")
        return (self.confidence_rule is not None and bool(confidences)
                and self.confidence_rule.should_stop(self.confidence_rule.confidence(confidences)))

    def close(self) -> None:
        """The search has ended: its deadline timer goes."""
        if self._timer is not None:
            self._timer.cancel()

    def release_paths(self) -> None:
        """The search's result is built: let go of its paths. Each path holds its SGLang program state, whose
        worker thread ends only when the state is freed, and the program's arguments (this context among them)
        are held by those threads: paths kept here would keep their threads running for good."""
        with self._changed:
            self.finished_paths.clear()
            self.frontier.clear()

    # -- timing and counts --------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.clock() - self.start

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
        """Score every step of `paths` in one batched scorer call; writes each path's `step_scores`. Refused
        (SearchStopped) once the search has stopped. While the search narrows (`narrowing`) the call scores at
        most `Narrowing.verifier_batch` of the paths, those ranked best by their current scores (ties by text);
        the others keep the scores they had (their new steps unscored)."""
        self.refuse_if_stopped()
        if not paths:
            return None
        if self.narrowing and len(paths) > 1:
            aggregation = getattr(self.config, "aggregation", "last")
            ranked = sorted(paths, key=lambda p: rank_key(p, aggregation))
            paths = ranked[:Narrowing.verifier_batch(len(paths))]
            self.extra["narrowed_verifier_calls"] = self.extra.get("narrowed_verifier_calls", 0) + 1
        scored, seconds = self._verifier_call(scorer, prompt, [p.steps for p in paths])
        # per verification: paths, steps scored, the verifier's input and radix-cached tokens, its time
        self.extra.setdefault("verifier_iterations", []).append({**scored.counts.as_dict(), "time_s": seconds})
        for path, path_scores in zip(paths, scored.scores):
            assert len(path_scores) == len(path.steps), "scorer must return one score per step"
            path.step_scores = list(path_scores)
            self.tree.add(path.steps, path.step_scores, path.extra.get("head_start_tokens", 0))
        self.scored(scored.scores)
        if self.ranked_rule is not None:
            self._rank_ends(paths)
        return scored

    def _verifier_call(self, scorer: StepScorer, prompt: str, paths: list[list[str]]) -> tuple[ScoredPaths, float]:
        """One scorer call of the search, timed and counted (verifier time and calls, a `verify` window); the
        scores and its seconds."""
        began = self.clock()
        with scoring_run(self.last_run):  # a scorer on the generator's runtime reads the run's cached tokens
            scored = scorer.score_counted(prompt, paths)
        seconds = self.clock() - began
        with self._changed:  # the first steps of several samples are scored from their own threads
            self.verifier_time_s += seconds
            self.verifier_calls += 1
        self.ledger.window("verify", "scorer", began, began + seconds, **scored.counts.as_dict())
        return scored, seconds

    def _rank_ends(self, scored: Sequence[Any]) -> None:
        """The ranked rule, after a scoring round: stop (ranked) once the best-ranked scored paths have ended. The
        ended ones are every scored path that ended (a path the confidence rule stopped is not), the live ones
        those of this round and of `expand`'s last children."""
        aggregation = getattr(self.config, "aggregation", "last")
        with self._changed:
            ended = [p for p in self.finished_paths if p.step_scores and p.finish_reason != LOW_CONFIDENCE]
        live = {id(p): p for p in [*scored, *self.frontier] if p.active and p.step_scores}.values()
        if self.ranked_rule.ended([rank_key(p, aggregation) for p in ended], [rank_key(p, aggregation) for p in live]):
            self.stop(RANKED)

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
