"""What every search program shares: its config, the runtimes it is given, paths (beams) and their
step-by-step growth through SGLang forks, timing and token accounting, and the final result record.

A program file in `programs/` composes these pieces inside an `@sgl.function`; see docs/writing-programs.md.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import sglang as sgl

from sgl_tts.frontend.backend import GeneratorError
from sgl_tts.frontend.sglang_internals import bind_search, make_executor_finalizer_lock_free, wait_meta
from sgl_tts.runtime.server import RuntimeDiedError
from sgl_tts.scoring.base import AGGREGATIONS, ScorerError, StepScorer, aggregate, rank_key
from sgl_tts.search.budget import Budget, Narrowing
from sgl_tts.search.confidence import token_confidence
from sgl_tts.search.context import SearchContext, SearchStopped
from sgl_tts.search.grading import answer_at_end, extract_answer, normalize_answer
from sgl_tts.search.records import COMPLETE, Candidate, SearchResult
from sgl_tts.search.stopping import LOW_CONFIDENCE, RANKED, SETTLED, Stopping

Selection = Literal["best", "weighted", "majority"]

make_executor_finalizer_lock_free()  # a program state freed by the garbage collector must never hang a search


@dataclass(frozen=True)
class SearchConfig:
    program: str = "beam_search"
    n: int = 4  # beams (beam search) or samples (best-of-N)
    beam_width: int = 2  # M: children per kept beam; n / M beams are kept each step
    max_steps: int = 6
    max_step_tokens: int = 64
    max_tokens: int = 384  # per path, all steps together
    temperature: float = 0.8
    top_p: float = 1.0
    step_delimiter: str = "\n\n"
    aggregation: str = "last"  # how a path's step scores become its score: last, min, prod, mean
    selection: Selection = "weighted"  # final answer: best path, score-weighted vote, or majority vote
    seed: int = 0  # reaches the sampler: per-request seeds (scripted backend; a runtime with deterministic inference), the truncation sampler
    lookahead: int = 0  # beam_search: rank a child by a greedy rollout this many steps further (0: off)
    branching_temperature: float = 0.2  # dynamic_branching: softmax temperature of the child allocation
    granularity: int = 1  # varying_granularity: steps generated between verifications (the base g)
    adaptive_granularity: bool = False  # varying_granularity: double g while verification does not separate
    granularity_margin: float = 0.05  # ... the kept from the pruned children by at least this mean score
    record_tree: bool = False  # put the scored search tree in the result (extra["tree"], sgl_tts.search.tree)
    record_timeline: bool = False  # put what the runtimes did for the search in the result (extra["timeline"])
    budget: Budget = Budget()  # the whole search's deadline and token budget (sgl_tts.search.budget); none by default
    stopping: Stopping = Stopping()  # stopping rules beneath the program (sgl_tts.search.stopping); off by default
    # The program's own settings: its `Settings` instance, given as a mapping in YAML and validated against the
    # program's `Settings` on load (sgl_tts.search.programs.program_settings); None for a program without any.
    settings: Any = None

    def __post_init__(self) -> None:
        for name in ("n", "beam_width", "max_steps", "max_step_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.step_delimiter:
            raise ValueError("step_delimiter must not be empty")
        AGGREGATIONS.check(self.aggregation)
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.granularity < 1:
            raise ValueError(f"granularity must be at least 1, got {self.granularity}")
        if not self.branching_temperature > 0:
            raise ValueError(f"branching_temperature must be > 0, got {self.branching_temperature}")
        if not 0 <= self.granularity_margin <= 1:
            raise ValueError(f"granularity_margin must be in [0, 1], got {self.granularity_margin}")

    @property
    def may_stop_early(self) -> bool:
        """Whether a budget or a stopping rule that stops this program may end its search before the program
        does (then its result need not hold every path the program would have made)."""
        return self.budget.active or self.stopping.beneath(self.program).rule != "none"

    @property
    def cuts_samples(self) -> bool:
        """Whether the verifier may cut this program's samples after their first step (`stopping.prune`); never
        a search of one sample: it is never cut, so sending it in two parts would only add a request and a
        verifier read."""
        return self.stopping.beneath(self.program).prune > 0 and self.n > 1


def settings_of(config: SearchConfig, settings_class: type, program: str) -> Any:
    """The program's own settings in `config` (its `Settings` defaults when none are given)."""
    settings = settings_class() if config.settings is None else config.settings
    if not isinstance(settings, settings_class):
        raise ValueError(f"search.settings must be the {program} program's Settings, got {type(settings).__name__} "
                         "(a mapping is validated on load: sgl_tts.search.programs.program_settings)")
    return settings


@dataclass
class Runtimes:
    """What a program runs on, shared by every search: a frontend backend for generation, a step scorer for
    verification, and how a search's step extension is made (FastTTS S, set by the session when S is on)."""

    generator: Any  # sglang BaseBackend (TTSEndpoint on a real runtime, a scripted fake in tests)
    scorer: StepScorer | None
    prompt: Callable[[str], str]  # question -> prompt text in the generator's chat format
    target: Any = None  # a second generator backend (RSD's target model)
    target_prompt: Callable[[str], str] | None = None  # question -> prompt in the target's chat format (None: prompt)
    extension_factory: Callable[[SearchContext], Any] | None = None

    def new_search(self, config: "SearchConfig", label: str = "search", observers: Sequence[Callable] = (),
                   scoring_observers: Sequence[Callable] = (), clock: Callable[[], float] = time.monotonic
                   ) -> SearchContext:
        """The context of one new search on these runtimes: the one place a search's state is made. A search
        that stops early has its requests in flight aborted here (`abort_in_flight`, on a thread of its own)."""
        return SearchContext(config, label=str(label), seed=config.seed, extension_factory=self.extension_factory,
                             observers=observers, scoring_observers=scoring_observers, clock=clock,
                             on_stop=self._abort_stopped, scorer=self.scorer)

    def _abort_stopped(self, context: SearchContext) -> None:
        threading.Thread(target=abort_in_flight, args=(context, self, context.in_flight()),
                         name=f"stop-{context.label}", daemon=True).start()


def engine_runtimes(runtimes: Runtimes) -> list[Any]:
    """The started runtimes beneath `runtimes`' generator and target endpoints (one each, however many endpoints
    share it); none for a scripted backend."""
    found = {id(r): r for backend in (runtimes.generator, runtimes.target)
             if (r := getattr(backend, "runtime", None)) is not None}
    return list(found.values())


def cancel_search(context: SearchContext, runtimes: Runtimes, timeout_s: float = 30.0) -> bool:
    """Cancel the search of `context` (no new requests) and abort its requests in flight on the runtimes until
    none is left, at most `timeout_s`; whether none was left. A request sent just before the cancel may reach
    the runtime after the first abort (SGLang ignores an abort for a rid it has not seen), so the rids still in
    flight are aborted again each time the in-flight set has not emptied. A runtime that is gone has nothing to
    abort."""
    return abort_in_flight(context, runtimes, context.cancel(), timeout_s)


def abort_in_flight(context: SearchContext, runtimes: Runtimes, rids: list[str], timeout_s: float = 30.0) -> bool:
    """Abort the requests `rids` of `context` (which refuses new ones: cancelled or stopped) on the runtimes, and
    the ones still in flight again, until none is left or `timeout_s` passed; whether none was left."""
    from sgl_tts.runtime.server import abort_requests

    deadline = time.monotonic() + timeout_s
    while rids and time.monotonic() < deadline:
        for runtime in engine_runtimes(runtimes):  # a rid unknown to a runtime is ignored there
            try:
                abort_requests(runtime, rids)
            except OSError:
                pass
        if context.wait_idle(timeout=0.5):
            return True
        rids = context.in_flight()
    return not rids


@dataclass
class ReasoningPath:
    """One reasoning path while the search runs. `state` is its SGLang program state."""

    state: Any
    steps: list[str] = field(default_factory=list)
    step_scores: list[float] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None  # None while the path can still grow
    finish_time_s: float | None = None
    answer: str | None = None
    parent: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    @property
    def text(self) -> str:
        return "".join(self.steps)



def top_logprobs_request(logprobs: int) -> dict[str, Any]:
    """sgl.gen keywords that ask for each output token's `logprobs` most likely tokens (none when 0)."""
    if logprobs < 0:
        raise ValueError(f"logprobs must be >= 0, got {logprobs}")
    return {"return_logprob": True, "top_logprobs_num": logprobs} if logprobs else {}


def step_gen(config: SearchConfig, path: ReasoningPath, name: str = "step", logprobs: int = 0):
    """The sgl.gen expression for the next step of `path`, within its token budget; with `logprobs` > 0 the
    step's meta info carries that many top logprobs per token."""
    budget = max(1, min(config.max_step_tokens, config.max_tokens - path.tokens))
    return sgl.gen(name, max_tokens=budget, stop=config.step_delimiter,
                   temperature=config.temperature, top_p=config.top_p, **top_logprobs_request(logprobs))


def record_token_confidences(path: ReasoningPath, meta: dict[str, Any]) -> None:
    """Extend path.extra["token_confidences"] with the confidence of every token the request generated, when its
    meta info carries top logprobs (SGLang's `output_top_logprobs`: per token, [(logprob, id, text), ...])."""
    top_logprobs = meta.get("output_top_logprobs")
    if top_logprobs:
        path.extra.setdefault("token_confidences", []).extend(
            token_confidence([entry[0] for entry in position]) for position in top_logprobs)


def finish_reason_of(meta: dict[str, Any], delimiter: str) -> str:
    """'step' when the step ended at the delimiter, 'eos' at end of sequence, 'length' at the token cap,
    'abort' when the engine aborted the request (a stopped search's request in flight)."""
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind in ("length", "abort"):
        return kind
    if kind == "stop" and reason.get("matched") == delimiter:
        return "step"
    return "eos"


def expand(parents: Sequence[tuple[ReasoningPath, int]], config: SearchConfig, tracker: SearchContext,
           extract_answer: Callable[[str], str | None], logprobs: int = 0) -> list[ReasoningPath]:
    """Fork each (path, k) k times and generate one step in every child, all concurrently.

    With `logprobs` > 0 every step asks for that many top logprobs per token and each child carries the
    confidences of all its tokens so far in extra["token_confidences"] (`record_token_confidences`).

    Returns the children in (parent order, fork order). When the search has a step extension (FastTTS
    speculative beam extension, switched on in the run config) the extension does the iteration, with head
    starts from speculation; the children are the same kind either way.

    Beneath every program, from the search's context: a stopped search (its budget spent, its vote settled)
    raises SearchStopped here instead of sending, and after an iteration in which it stopped; while the budget's
    slack is below its threshold (`SearchContext.narrowing`) each parent gets `Narrowing.children` of its count
    and the step extension is not used; with the confidence rule on (`search.stopping`) every step asks for
    top logprobs and a child whose confidence falls below the threshold ends "low_confidence"; with the rules
    reading the live paths (`stopping.reads: live`) the first step's children set that threshold, and after every
    step the live children are probed for their answers so far (`probe_answers`), which may settle the search.
    """
    parents = [(parent, count) for parent, count in parents if count > 0]
    if not parents:
        return []
    tracker.check_budget()
    tracker.refuse_if_stopped()
    narrow = tracker.narrowing
    if narrow:
        parents = [(parent, Narrowing.children(count)) for parent, count in parents]
        tracker.extra["narrowed_iterations"] = tracker.extra.get("narrowed_iterations", 0) + 1
    tracker.frontier = [parent for parent, _ in parents]
    logprobs = max(logprobs, tracker.stopping.logprobs)
    began = time.monotonic()
    answered_before = tracker.ledger.answered_count()
    for parent, _ in parents:  # the children's requests belong to this search, whichever thread forks them
        bind_search(parent.state, tracker)
    extension = tracker.extension
    if extension is not None and not logprobs and not narrow and not tracker.sends_in_waves:  # speculative text
        # carries no logprobs, and its head starts are not sent a wave at a time
        children = extension.expand(parents, config, tracker, extract_answer)
    else:
        children = expand_plainly(parents, config, tracker, extract_answer, logprobs)
    ended = time.monotonic()
    tracker.generator_time_s += ended - began
    tracker.iterations += 1
    tracker.ledger.window("iteration", "generator", began, ended, index=tracker.iterations)
    answered = [r.answered_at for r in tracker.ledger.answered_requests(since=answered_before)]
    if answered:
        tracker.extra.setdefault("straggler_tails", []).append(straggler_tail(began, answered))
    tracker.frontier = children
    live_reads = tracker.stopping.reads == "live"
    if live_reads:
        tracker.step_confidences_heard(children)
    for child in children:
        if child.active and tracker.unsure(child):
            finish(child, LOW_CONFIDENCE, tracker)
    live = [child for child in children if child.active]
    if live_reads and tracker.stopping.probes and live and not tracker.stopped:
        probed = probe_answers(live, tracker.stopping)
        tracker.live_answers_heard(steady_answers(live, probed, [parent for parent, _ in parents],
                                                  tracker.stopping.steady))
    tracker.refuse_if_stopped()
    return children


PROBE_STOPS = ("}$", "}.", "}\n")  # what follows a boxed answer's closing brace in the cue's format


def probe_answers(paths: Sequence[ReasoningPath], stopping: Stopping) -> list[str | None]:
    """Each live path's answer so far (Dynasor's probe): a fork of the path writes `stopping.answer_cue` and at
    most `stopping.probe_tokens` greedy tokens; the answer is what stands before the brace that closes the cue's
    (`PROBE_STOPS` end the probe there; None: empty, or not closed within the cap). The path itself is unchanged;
    the probes are requests of its search."""
    probes = []
    for path in paths:
        path.state.text()  # the path's text committed: the probe's prefix is in the radix cache
        probe = path.state.fork(1)[0]
        probe += stopping.answer_cue + sgl.gen("probe", max_tokens=stopping.probe_tokens, stop=list(PROBE_STOPS),
                                               temperature=0.0)
        probes.append(probe)
    answers = []
    for probe in probes:
        reason = wait_meta(probe, "probe").get("finish_reason") or {}
        stopped = isinstance(reason, dict) and reason.get("type") == "stop"
        answers.append(braced_answer(probe["probe"], closed=stopped))
    return answers


def steady_answers(paths: Sequence[ReasoningPath], answers: Sequence[str | None], parents: Sequence[ReasoningPath],
                   steady: int) -> list[str | None]:
    """Each path's probe answers so far, its parent's (`parents[path.parent]`) then this one, into
    extra["probe_answers"]; the answer it casts is this one when its last `steady` probes agree, else None."""
    cast = []
    for path, answer in zip(paths, answers):
        before = parents[path.parent].extra.get("probe_answers", []) if path.parent is not None else []
        history = path.extra["probe_answers"] = [*before, answer]
        recent = history[-steady:]
        agree = len(recent) == steady and answer is not None and all(
            earlier is not None and normalize_answer(earlier) == normalize_answer(answer) for earlier in recent)
        cast.append(answer if agree else None)
    return cast


def braced_answer(text: str, closed: bool) -> str | None:
    """The text before the first "}" that closes an opened brace ("\\frac{1}{2}}." -> "\\frac{1}{2}"); with none,
    all of it when the server ended it at a stop string (which it trims: the closing brace went with it), else
    None."""
    depth = 0
    for index, char in enumerate(text):
        depth += (char == "{") - (char == "}")
        if depth < 0:
            return text[:index].strip() or None
    return (text.strip() or None) if closed and depth == 0 else None


def straggler_tail(began: float, answered_at: Sequence[float]) -> dict[str, float]:
    """One iteration's straggler tail (FastTTS §3, the idle slots S fills): its k step requests started
    together at `began` and were answered at t_1 … t_k; the last answer T = max t_i ends the iteration. Each
    request's slot stands idle from its answer to T, so the tail holds idle_slot_s = Σ_i (T − t_i) slot-seconds
    out of k · (T − began): `idle_share` is that fraction of the iteration's slot-time."""
    last = max(answered_at)
    span = last - began
    idle = sum(last - t for t in answered_at)
    return {"requests": len(answered_at), "span_s": span, "idle_slot_s": idle,
            "idle_share": idle / (len(answered_at) * span) if span > 0 else 0.0}


def expand_plainly(parents: Sequence[tuple[ReasoningPath, int]], config: SearchConfig, tracker: SearchContext,
                   extract_answer: Callable[[str], str | None], logprobs: int = 0) -> list[ReasoningPath]:
    """`expand` without an extension. Each parent is synced (`text()`) before its fork so the shared prefix
    is committed and pre-sent to the radix cache (docs/sglang.md). When the search stops while the children
    are generated, the children answered so far become its frontier before SearchStopped is raised.

    With `stopping.enough` (`SearchContext.sends_in_waves`) each parent's children go in waves of ceil(k /
    `stopping.waves`); after each wave the verifier scores the wave's new steps, and a parent with a child it is
    content with (`SearchContext.content_parents`) sends no more. The children come back in (parent order, wave
    order)."""
    left = {index: count for index, (_, count) in enumerate(parents)}
    wave_size = {index: math.ceil(count / tracker.stopping.waves) if tracker.sends_in_waves else count
                 for index, count in left.items()}
    children: list[ReasoningPath] = []
    while left:
        wave = {index: min(wave_size[index], count) for index, count in left.items()}
        grown, stopped = grow_children(parents, wave, config, tracker, extract_answer, logprobs)
        children += grown
        if stopped is not None:
            tracker.frontier = sorted(children, key=lambda child: child.parent) or tracker.frontier
            raise stopped
        left = {index: count - wave[index] for index, count in left.items() if count > wave[index]}
        if left:
            content = tracker.content_parents([child for child in grown if child.parent in left])
            tracker.extra["children_not_sent"] = (tracker.extra.get("children_not_sent", 0)
                                                  + sum(left[index] for index in content))
            left = {index: count for index, count in left.items() if index not in content}
    return sorted(children, key=lambda child: child.parent)  # stable: each parent's in the order they were sent


def grow_children(parents: Sequence[tuple[ReasoningPath, int]], counts: dict[int, int], config: SearchConfig,
                  tracker: SearchContext, extract_answer: Callable[[str], str | None], logprobs: int
                  ) -> tuple[list[ReasoningPath], SearchStopped | None]:
    """Fork `counts[i]` children of parents[i] for each i in `counts`, all concurrently, and generate one step in
    each: the children whose step was generated and, when the search stopped meanwhile, why (the refused
    children are left out)."""
    pending = []
    for index, count in counts.items():
        parent = parents[index][0]
        parent.state.text()
        for fork in parent.state.fork(count):
            fork += step_gen(config, parent, logprobs=logprobs)
            pending.append((index, parent, fork))
    children, stopped = [], None
    for index, parent, fork in pending:
        try:
            meta = wait_meta(fork, "step")
        except SearchStopped as stop:  # this child's request was refused: the others' steps are kept
            stopped = stop
            continue
        child = ReasoningPath(state=fork, steps=list(parent.steps), step_scores=list(parent.step_scores),
                     tokens=parent.tokens, parent=index)
        if "token_confidences" in parent.extra:
            child.extra["token_confidences"] = list(parent.extra["token_confidences"])
        append_step(child, fork["step"], meta, config, tracker, extract_answer)
        children.append(child)
    return children, stopped


def append_step(path: ReasoningPath, text: str, meta: dict[str, Any], config: SearchConfig, tracker: SearchContext,
                extract_answer: Callable[[str], str | None]) -> None:
    """Add one generated step to `path` and decide whether the path is finished."""
    ended = finish_reason_of(meta, config.step_delimiter)
    if ended == "step":
        # The server trims the matched stop string; put it back in the path and in the program state, so
        # the next step is generated after the delimiter.
        text += config.step_delimiter
        path.state += config.step_delimiter
    path.steps.append(text)
    path.tokens += int(meta.get("completion_tokens", 0))
    record_token_confidences(path, meta)
    settle_step(path, ended, config, tracker, extract_answer)


def settle_step(path: ReasoningPath, ending: str, config: SearchConfig, tracker: SearchContext,
                extract_answer: Callable[[str], str | None]) -> None:
    """Decide whether `path` is finished now that its newest step ended with `ending` ('step', 'eos' or
    'length'): an answer in the step, the end of the solution, or a token or step limit."""
    answer = extract_answer(current_step(path.steps, config.step_delimiter))
    if answer is not None:
        path.answer = answer
        finish(path, "answer", tracker)
    elif ending == "eos":  # the model ended the solution: its answer may stand unmarked at the end
        path.answer = answer_at_end(path.text, extract_answer)
        finish(path, "eos", tracker)
    elif path.tokens >= config.max_tokens:
        finish(path, "max_tokens", tracker)
    elif len(path.steps) >= config.max_steps:
        finish(path, "max_steps", tracker)


def current_step(steps: Sequence[str], delimiter: str) -> str:
    """The last step as written: the last piece joined with the pieces before it that a token limit cut off
    (they do not end at the delimiter), so that an answer phrase split by the cut is seen whole."""
    start = len(steps) - 1
    while start > 0 and not steps[start - 1].endswith(delimiter):
        start -= 1
    return "".join(steps[start:])


def finish(path: ReasoningPath, reason: str, tracker: SearchContext) -> None:
    """End `path` for `reason` (once), and tell the search (`SearchContext.path_finished`: its stopping rules)."""
    if path.finish_reason is None:
        path.finish_reason = reason
        path.finish_time_s = tracker.elapsed()
        tracker.path_finished(path)


def split_steps(text: str, delimiter: str, max_steps: int) -> list[str]:
    """Split a whole solution into steps, each keeping its delimiter; the tail past max_steps joins the last."""
    pieces = [p + delimiter for p in text.split(delimiter)]
    pieces[-1] = pieces[-1][: -len(delimiter)]
    pieces = [p for p in pieces if p.strip()] or [text]
    if len(pieces) > max_steps:
        pieces = pieces[: max_steps - 1] + ["".join(pieces[max_steps - 1:])]
    return pieces


def build_result(problem_id: str, program: str, paths: Sequence[ReasoningPath], config: SearchConfig,
                 tracker: SearchContext, error: str | None = None, extra: dict[str, Any] | None = None,
                 finish_reason: str | None = None) -> SearchResult:
    """The result record: candidates with aggregated scores, best first (ties by text, so the record and the
    selection's tie-breaks do not depend on which request finished first), the selected answer, counts. Its
    `finish_reason` is why the search stopped early when it did (the program answered after the stop), else
    "complete"."""
    from sgl_tts.search.selection import select

    end = tracker.elapsed()
    candidates = [
        Candidate(
            steps=list(p.steps), step_scores=list(p.step_scores),
            score=aggregate(p.step_scores, config.aggregation), answer=p.answer, tokens=p.tokens,
            completion_time_s=p.finish_time_s if p.finish_time_s is not None else end,
            finish_reason=p.finish_reason or "unfinished", parent=p.parent, extra=dict(p.extra),
        )
        for p in sorted(paths, key=lambda p: rank_key(p, config.aggregation))
    ]
    answer = select(config.selection, [c.answer for c in candidates], [c.score for c in candidates])
    extra = {**tracker.extra, **(extra or {})}
    if config.record_tree:
        for candidate in candidates:  # paths that were never scored still show where they ended
            tracker.tree.add(candidate.steps, candidate.step_scores)
        extra["tree"] = tracker.tree.export([(c.steps, c.finish_reason, c.answer is not None and c.answer == answer)
                                             for c in candidates])
    return SearchResult(
        problem_id=problem_id, program=program, answer=answer, candidates=candidates,
        generated_tokens=tracker.generated_tokens, prompt_tokens=tracker.prompt_tokens,
        cached_tokens=tracker.cached_tokens, generator_time_s=tracker.generator_time_s,
        verifier_time_s=tracker.verifier_time_s, total_time_s=end, iterations=tracker.iterations,
        verifier_calls=tracker.verifier_calls, error=error, extra=extra,
        finish_reason=finish_reason or tracker.stopped or COMPLETE,
    )


def stopped_result(problem_id: str, program: str, config: SearchConfig, tracker: SearchContext, reason: str,
                   finished: Sequence[ReasoningPath] = ()) -> SearchResult:
    """The answer of a search that stopped early for `reason` (SearchStopped), from the paths it has seen: the
    ones that ended (`finished`, the context's) and the live ones `expand` last held. A settled search answers
    with the settled vote (majority of the ended paths' answers); a ranked stop (its best-ranked paths ended) by
    the search's selection over the ended paths; a budget's stop with the best ended path
    (`rank_key`), else the best live one and the last number it wrote (`answer_at_end`). The candidates are all
    these paths, the live ones "unfinished"; `finish_reason` is `reason`."""
    from sgl_tts.search.selection import select

    paths = list({id(path): path for path in [*finished, *tracker.finished_paths, *tracker.frontier]}.values())
    result = build_result(problem_id, program, paths, config, tracker, finish_reason=reason)
    ended = sorted((p for p in paths if not p.active), key=lambda p: rank_key(p, config.aggregation))
    live = sorted((p for p in paths if p.active), key=lambda p: rank_key(p, config.aggregation))
    if reason == SETTLED:  # the vote that settled: the ended paths' answers, and the live ones' with `reads: live`
        vote = tracker.settled_vote or [p.answer for p in ended]
        answer = select("majority", vote, [1.0] * len(vote))
    elif reason == RANKED:
        answer = select(config.selection, [p.answer for p in ended], [aggregate(p.step_scores, config.aggregation)
                                                                     for p in ended])
    elif ended:
        answer = ended[0].answer
    else:
        answer = answer_at_end(live[0].text, extract_answer) if live else None
    return dataclasses.replace(result, answer=answer)


class SearchError(RuntimeError):
    """A runtime failed mid-search. The message names the runtime; `result` is the partial record: the
    candidates that had finished before the failure, the counts so far, and `error` set to the message."""

    def __init__(self, message: str, result: SearchResult):
        super().__init__(message)
        self.result = result


RUNTIME_FAILURES = (ScorerError, RuntimeDiedError, GeneratorError)  # what a program turns into SearchError


def search_failed(problem_id: str, program: str, finished: Sequence[ReasoningPath], config: SearchConfig,
                  tracker: SearchContext, exc: BaseException) -> SearchError:
    """The SearchError for `exc`, keeping the `finished` paths as the partial result's candidates."""
    message = f"{program} stopped: {exc}"
    return SearchError(message, build_result(problem_id, program, finished, config, tracker, error=message))


def start_search(runtimes: Runtimes, config: SearchConfig, label: str = "search",
                 context: SearchContext | None = None) -> SearchContext:
    """The search's context: `context` when the caller started the search, else a new one."""
    return context if context is not None else runtimes.new_search(config, label)


def run_search(program: Any, problem: Any, name: str, config: SearchConfig, runtimes: Runtimes,
               needs_scorer: bool = True, context: SearchContext | None = None, **arguments: Any) -> SearchResult:
    """Run the `@sgl.function` `program(s, prompt, config, runtimes, tracker, finished, **arguments)` and
    build the result from the paths it returns.

    The program appends each path to `finished` when the path ends, so that when the scorer or generator
    runtime dies (RUNTIME_FAILURES) the SearchError raised here still carries those candidates.
    """
    if needs_scorer and runtimes.scorer is None:
        raise ValueError(f"{name} needs a scorer: set 'scorer' in the config")
    tracker = start_search(runtimes, config, problem.id, context)
    prompt = runtimes.prompt(problem.question)
    tracker.prompt = prompt
    finished: list[ReasoningPath] = []
    try:
        try:
            with tracker.running():
                state = program.run(prompt=prompt, config=config, runtimes=runtimes, tracker=tracker,
                                    finished=finished, backend=runtimes.generator, **arguments)
        except RUNTIME_FAILURES as exc:
            raise search_failed(problem.id, name, finished, config, tracker, exc) from exc
        except SearchStopped as stop:
            return stopped_result(problem.id, name, config, tracker, stop.reason, finished)
        finally:
            tracker.close()
        return build_result(problem.id, name, state.ret_value, config, tracker)
    finally:  # the program's arguments outlive the search in its states' threads: they must not hold its paths
        finished.clear()
        if context is None:
            tracker.release_paths()


def run_plain_program(function: Any, problem: Any, name: str, config: SearchConfig, runtimes: Runtimes,
                      context: SearchContext | None = None) -> SearchResult:
    """Run a plain SGLang program: an `@sgl.function` that knows nothing of sgl-tts.

    Its arguments are filled by name from `question` (the problem text), `prompt` (the question in the
    generator's chat format) and the search config's fields (`k` for config.n); the config's temperature and
    top_p are the program's default sampling settings. It returns the chosen solution text, or a list of candidate texts; with no return value the
    state's generated text is the one candidate. Candidates are graded by the config's selection; their
    tokens and completion times come from the requests on each text's path (`RequestLedger.path_of`), so
    goodput, tokens and cache hits are reported as for any program.
    """
    import inspect

    tracker = start_search(runtimes, config, problem.id, context)
    prompt = runtimes.prompt(problem.question)
    # SglFunction.run keeps its sampling keywords (n, temperature, top_p, max_new_tokens, ...) for itself:
    # they cannot be program arguments, and the config's sampling settings become the run's defaults.
    reserved = set(inspect.signature(type(function).run).parameters)
    available = {"question": problem.question, "prompt": prompt, "k": config.n,
                 **{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in reserved}}
    wanted = list(inspect.signature(function.func).parameters)[1:]
    missing = [arg for arg in wanted if arg not in available]
    if missing:
        raise ValueError(f"program {name!r} takes {', '.join(missing)}: a plain program's arguments are named "
                         f"from {', '.join(available)} (SGLang's run() keeps {', '.join(sorted(reserved & {'n', 'temperature', 'top_p'}))})")
    try:
        with tracker.running():
            state = function.run(backend=runtimes.generator, temperature=config.temperature, top_p=config.top_p,
                                 **{arg: available[arg] for arg in wanted})
    except RUNTIME_FAILURES as exc:
        raise search_failed(problem.id, name, [], config, tracker, exc) from exc
    returned = state.ret_value
    texts = [returned] if isinstance(returned, str) else list(returned) if returned else [state.text()]
    paths = []
    for text in texts:
        text = str(text)
        whole = text if text.startswith(prompt) else None
        solution = text[len(prompt):] if whole is not None else text
        tokens, answered_at = tracker.ledger.path_of(whole or prompt + solution)
        path = ReasoningPath(state=None, steps=split_steps(solution, config.step_delimiter, config.max_steps), tokens=tokens,
                    answer=extract_answer(solution))
        path.finish_reason = "answer" if path.answer is not None else "eos"
        path.finish_time_s = (answered_at - tracker.start) if answered_at is not None else tracker.elapsed()
        paths.append(path)
    tracker.generator_time_s = tracker.elapsed()
    tracker.iterations = 1
    return build_result(problem.id, name, paths, config, tracker)
