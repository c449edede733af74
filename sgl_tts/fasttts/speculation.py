"""Speculative beam extension in the search layer (FastTTS §4.1, Algorithm 1).

One beam-search iteration with S on (`SpeculativeSteps.step`):
1. Every kept beam is forked into its copies. A copy may start with a head start: speculative text its
   beam generated during the previous iteration. The original copy keeps all of it, duplicates keep a
   truncated share drawn around R (Algorithm 1, lines 18-19). A head start that holds a whole step is the
   copy's step: nothing is generated for it (LookAhead, §4.1.3).
2. While the standard requests run, each child that has finished its step fills a free batch slot with a
   speculative continuation (a separate /generate with a speculative rid and a low priority): highest
   score bin first, the bins coming from the previous iteration's scores (`SpeculativeSelector`), at most
   as many as standard requests have finished (`speculative_slots`). Standard work always comes first:
   it is launched before any speculation and outranks it in the runtime's priority scheduler.
3. The moment the last standard child finishes, every speculative request still running is aborted
   (`POST /abort_request`), so speculation adds no tail latency; SGLang answers an aborted request with
   the text generated so far and finish_reason type "abort".
4. The verifier scores the standard steps only (algorithmic equivalence). With LookAhead, a child's
   speculative whole next step is verified in the same request as the child's step, and that score is
   reused if the child is selected. Aborted requests' partial texts are collected while the verifier runs.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sglang as sgl

from policies.speculative import SpeculativeSelector, TruncationSampler, speculative_slots
from sgl_tts.fasttts.switches import BeamTagger, FastTTSConfig, SearchSteps
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import (Path, SearchConfig, SearchTracker, append_step, finish_reason_of, set_request_fields,
                            wait_meta)

SPECULATION_CLIENT = "speculation_client"  # Runtimes.extras key: a SpeculationClient for the generator
TOKEN_SPLITTER = "token_splitter"  # Runtimes.extras key: text -> token pieces (for truncation)

logger = logging.getLogger(__name__)


class SpeculationClient(ABC):
    """Sends speculative requests to the generator and aborts them."""

    @abstractmethod
    def speculate(self, text: str, sampling_params: dict[str, Any], fields: dict[str, Any]) -> tuple[str, dict]:
        """Generate from `text` (blocking) with extra top-level request `fields` (rid, priority); returns
        (text, meta_info). An aborted request returns its partial text with finish_reason type 'abort'."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Stop request `rid` now (a no-op when it has finished)."""


class HttpSpeculationClient(SpeculationClient):
    """Speculative requests to a started SGLang runtime over HTTP."""

    def __init__(self, runtime: Any):
        self.runtime = runtime

    def speculate(self, text: str, sampling_params: dict[str, Any], fields: dict[str, Any]) -> tuple[str, dict]:
        from sgl_tts.runtime.server import http_json, request_timeout

        answer = http_json(self.runtime.url + "/generate",
                           {"text": text, "sampling_params": sampling_params, **fields},
                           timeout=request_timeout(self.runtime))
        return answer["text"], answer["meta_info"]

    def abort(self, rid: str) -> None:
        from sgl_tts.runtime.server import abort_requests

        abort_requests(self.runtime, [rid])  # on every server behind a router: it does not route aborts


def word_pieces(text: str) -> list[str]:
    """Split text into whitespace-led words (a stand-in for tokens); the pieces join back to `text`."""
    pieces = re.findall(r"\s*\S+", text)
    tail = text[len("".join(pieces)):]
    if tail:
        pieces = pieces[:-1] + [pieces[-1] + tail] if pieces else [tail]
    return pieces


def token_splitter(tokenizer: Any) -> Callable[[str], list[str]]:
    """Split text at the tokenizer's token boundaries (offsets); the pieces join back to the text."""

    def split(text: str) -> list[str]:
        if not text:
            return []
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        cuts = sorted({end for _, end in offsets if 0 < end < len(text)})
        bounds = [0, *cuts, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    return split


@dataclass
class Branch:
    """A speculative continuation of a child beyond its current step.

    ended: 'step' (stopped at the delimiter), 'length' (the step's token cap) or 'eos': a whole next step;
    'abort': stopped when the iteration's standard work finished, a partial step.
    score: LookAhead's verifier score of the whole step (None until verified).
    """

    text: str
    tokens: int
    ended: str
    finish_reason: Any = None
    score: float | None = None

    @property
    def whole(self) -> bool:
        return self.ended != "abort"

    @property
    def usable(self) -> bool:
        return self.whole or bool(self.text and self.tokens > 0)


@dataclass(frozen=True)
class HeadStart:
    """What one copy of a selected beam starts its step with. `branch` is set when the copy takes a whole
    speculative step as its step (nothing left to generate)."""

    text: str
    tokens: int
    branch: Branch | None = None


def assign_head_starts(branches: Sequence[Branch], copies: int, sampler: TruncationSampler,
                       split_tokens: Callable[[str], list[str]]) -> list[HeadStart | None]:
    """Head starts for the `copies` children of a selected beam from its speculative `branches`.

    Copy k < len(branches) is branch k's original and keeps all of it; further copies duplicate the
    branches in turn and keep `sampler.duplicate_lengths` tokens (Algorithm 1, lines 18-19). A duplicate
    of a whole step keeps at most all but one token, so it generates, and diverges from, the rest.
    """
    usable = [b for b in branches if b.usable][:copies]
    heads: list[HeadStart | None] = [None] * copies
    for index, branch in enumerate(usable):
        assigned = list(range(index, copies, len(usable)))
        pieces = split_tokens(branch.text)
        lengths = sampler.duplicate_lengths(len(pieces), len(assigned))
        heads[index] = HeadStart(branch.text, branch.tokens, branch if branch.whole else None)
        for copy, keep in zip(assigned[1:], lengths[1:]):
            if branch.whole:
                keep = min(keep, len(pieces) - 1)
            if keep > 0:
                heads[copy] = HeadStart("".join(pieces[:keep]), keep)
    return heads


@dataclass
class SpeculationStats:
    """Counts for one search, reported in the result's `extra["speculation"]`."""

    launched: int = 0  # speculative requests sent
    whole: int = 0  # of those, finished a whole next step before the iteration ended
    aborted: int = 0  # stopped by an abort (partial text returned)
    abandoned: int = 0  # no answer within the grace period after the abort; ignored
    failed: int = 0  # errors (the search goes on without them)
    tokens: int = 0  # generated by speculative requests
    head_start_tokens: int = 0  # speculative tokens children started with (each duplicate counts its share)
    lookahead_steps: int = 0  # children whose whole step came from speculation (no generation)
    lookahead_scores: int = 0  # of those, already verified with their parent (LookAhead)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class _Pending:
    """A standard child whose step is being generated."""

    parent_index: int
    parent: Path
    fork: Any
    head: HeadStart | None


@dataclass
class _Round:
    """The state of one iteration's generation phase."""

    children: list[Path | None]
    pending: dict[int, _Pending]  # slot -> standard request still running
    selector: SpeculativeSelector
    pool: ThreadPoolExecutor
    finished: list[int] = field(default_factory=list)  # slots done with their step and still active, in order
    in_flight: dict[str, tuple[int, Future]] = field(default_factory=dict)  # rid -> (slot, speculative request)
    launched: Counter = field(default_factory=Counter)  # slot -> speculative branches launched
    branches: dict[int, list[Branch]] = field(default_factory=lambda: defaultdict(list))


def _step_done(fork: Any) -> bool:
    """Non-blocking: has the fork's `step` generation finished (or failed)?"""
    event = fork.stream_executor.variable_event.get("step")
    return event is None or event.is_set()


class SpeculativeSteps(SearchSteps):
    """One beam-search iteration with speculative beam extension (see the module docstring)."""

    def __init__(self, config: SearchConfig, tracker: SearchTracker, extract_answer: Callable[[str], str | None],
                 tagger: BeamTagger, fast: FastTTSConfig, client: SpeculationClient,
                 split_tokens: Callable[[str], list[str]] = word_pieces, poll_s: float = 0.005,
                 abort_grace_s: float = 2.0):
        super().__init__(config, tracker, extract_answer, tagger)
        self.fast = fast
        self.client = client
        self.split_tokens = split_tokens
        self.poll_s = poll_s
        self.abort_grace_s = abort_grace_s
        self.sampler = TruncationSampler(fast.truncation_ratio, fast.truncation_std, fast.seed)
        self.branches: dict[int, list[Branch]] = {}  # id(child) -> its branches, from the last iteration
        self.stats = SpeculationStats()

    @classmethod
    def from_runtimes(cls, runtimes: Any, config: SearchConfig, tracker: SearchTracker,
                      extract_answer: Callable[[str], str | None], tagger: BeamTagger | None,
                      fast: FastTTSConfig) -> "SpeculativeSteps":
        client = runtimes.extras.get(SPECULATION_CLIENT)
        if client is None:
            raise ValueError(f"fasttts.speculative needs a speculation client in runtimes.extras"
                             f"[{SPECULATION_CLIENT!r}] (the Session sets one for its generator runtime)")
        return cls(config, tracker, extract_answer, tagger or BeamTagger("search", fast), fast, client,
                   runtimes.extras.get(TOKEN_SPLITTER) or word_pieces)

    # ---- one iteration ----

    def step(self, beams: Sequence[Path], fan_out: int, iteration: int, scorer: Any, prompt: str) -> list[Path]:
        began = time.monotonic()
        scores = [aggregate(beam.step_scores, self.config.aggregation) for beam in beams]
        batch = len(beams) * fan_out
        selector = SpeculativeSelector({slot: scores[slot // fan_out] for slot in range(batch)},
                                       self.config.beam_width)
        pool = ThreadPoolExecutor(max_workers=batch, thread_name_prefix="speculate")
        state = _Round(children=[None] * batch, pending={}, selector=selector, pool=pool)
        try:
            self._launch_standard(state, beams, fan_out, iteration)
            while state.pending:
                self._collect_standard(state)
                self._collect_speculative(state)
                if state.pending:
                    self._fill_free_slots(state, iteration)
                    time.sleep(self.poll_s)
        finally:
            # The last standard child has finished (or the search failed): stop all speculation now.
            aborted_at = time.monotonic()
            self._abort_all(state)
            pool.shutdown(wait=False, cancel_futures=True)
        self.tracker.generator_time_s += aborted_at - began
        self.tracker.iterations += 1
        children = [child for child in state.children if child is not None]
        assert len(children) == batch, f"{batch - len(children)} children were never collected"
        self._score(scorer, prompt, state)
        self._collect_speculative(state, until=aborted_at + self.abort_grace_s)
        self.branches = {id(child): state.branches[slot] for slot, child in enumerate(children)
                         if child.active and state.branches.get(slot)}
        self.tagger.number(children)
        self.tracker.extra["speculation"] = self.stats.as_dict()
        return children

    def _launch_standard(self, state: _Round, beams: Sequence[Path], fan_out: int, iteration: int) -> None:
        """Fork every beam into `fan_out` copies with their head starts; generate where a step is left."""
        fields = self.tagger.standard(beams, fan_out, iteration)
        for parent_index, beam in enumerate(beams):
            heads = assign_head_starts(self.branches.get(id(beam), []), fan_out, self.sampler, self.split_tokens)
            beam.state.text()  # commit the prefix so the fork pre-caches it (DESIGN.md)
            forks = beam.state.fork(fan_out)
            for copy, (fork, head) in enumerate(zip(forks, heads)):
                slot = parent_index * fan_out + copy
                if head is not None:
                    fork += head.text
                    self.stats.head_start_tokens += head.tokens
                if head is not None and head.branch is not None:
                    self.stats.lookahead_steps += 1
                    child = self._child(beam, parent_index, fork, head.text,
                                        {"completion_tokens": head.tokens, "finish_reason": head.branch.finish_reason})
                    if head.branch.score is not None:
                        child.step_scores.append(head.branch.score)
                        self.stats.lookahead_scores += 1
                    self._child_done(state, slot, child)
                    continue
                set_request_fields(fork, fields(beam, copy))
                budget = self._step_budget(beam) - (head.tokens if head else 0)
                fork += sgl.gen("step", max_tokens=max(1, budget), stop=self.config.step_delimiter,
                                temperature=self.config.temperature, top_p=self.config.top_p)
                state.pending[slot] = _Pending(parent_index, beam, fork, head)

    def _step_budget(self, path: Path) -> int:
        return min(self.config.max_step_tokens, self.config.max_tokens - path.tokens)

    def _child(self, parent: Path, parent_index: int, fork: Any, text: str, meta: dict[str, Any]) -> Path:
        child = Path(state=fork, steps=list(parent.steps), step_scores=list(parent.step_scores),
                     tokens=parent.tokens, parent=parent_index)
        append_step(child, text, meta, self.config, self.tracker, self.extract_answer)
        return child

    def _child_done(self, state: _Round, slot: int, child: Path) -> None:
        state.children[slot] = child
        if child.active and self._step_budget(child) > 0:
            state.finished.append(slot)

    def _collect_standard(self, state: _Round) -> None:
        for slot in [s for s, p in state.pending.items() if _step_done(p.fork)]:
            pending = state.pending.pop(slot)
            meta = wait_meta(pending.fork, "step")
            self.tracker.record(meta)
            head = pending.head
            text = (head.text if head else "") + pending.fork["step"]
            tokens = int(meta.get("completion_tokens", 0)) + (head.tokens if head else 0)
            child = self._child(pending.parent, pending.parent_index, pending.fork, text,
                                {**meta, "completion_tokens": tokens})
            self._child_done(state, slot, child)

    def _fill_free_slots(self, state: _Round, iteration: int) -> None:
        """Launch speculative branches into the slots that finished standard requests left free."""
        free = speculative_slots(len(state.children), len(state.pending)) - len(state.in_flight)
        if self.fast.max_speculative is not None:
            free = min(free, self.fast.max_speculative - len(state.in_flight))
        if free <= 0 or not state.finished:
            return
        for choice in state.selector.select_speculative(state.finished, free, state.launched):
            slot = choice.beam_id
            child = state.children[slot]
            fields = self.tagger.speculative(iteration, slot, state.launched[slot], choice.bin_index)
            state.launched[slot] += 1
            sampling = {"max_new_tokens": self._step_budget(child), "stop": [self.config.step_delimiter],
                        "temperature": self.config.temperature, "top_p": self.config.top_p}
            future = state.pool.submit(self.client.speculate, child.state.text(), sampling, fields)
            state.in_flight[fields["rid"]] = (slot, future)
            self.stats.launched += 1

    def _collect_speculative(self, state: _Round, until: float | None = None) -> None:
        """Turn finished speculative requests into branches; with `until`, wait for all of them up to then
        and abandon the rest."""
        for rid, (slot, future) in list(state.in_flight.items()):
            if until is not None:
                try:
                    future.exception(timeout=max(0.0, until - time.monotonic()))
                except FutureTimeout:
                    pass
            if not future.done():
                if until is not None:
                    self.stats.abandoned += 1
                    del state.in_flight[rid]
                continue
            del state.in_flight[rid]
            branch = self._branch(future)
            if branch is not None:
                state.branches[slot].append(branch)

    def _branch(self, future: Future) -> Branch | None:
        if future.cancelled():
            return None
        try:
            text, meta = future.result()
        except Exception as exc:  # speculation is optional work: the search goes on without it
            logger.warning("speculative request failed: %s", exc)
            self.stats.failed += 1
            return None
        self.tracker.record(meta)
        reason = meta.get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            ended = "abort"
            self.stats.aborted += 1
        else:
            ended = finish_reason_of(meta, self.config.step_delimiter)
            self.stats.whole += 1
        tokens = int(meta.get("completion_tokens", 0))
        self.stats.tokens += tokens
        return Branch(text, tokens, ended, reason)

    def _abort_all(self, state: _Round) -> None:
        """Abort every speculative request still running, concurrently (one POST per rid)."""
        rids = []
        for rid, (_, future) in list(state.in_flight.items()):
            if future.cancel():  # never started: nothing to abort
                del state.in_flight[rid]
            else:
                rids.append(rid)
        threads = [threading.Thread(target=self._abort_one, args=(rid,), daemon=True) for rid in rids]
        for thread in threads:
            thread.start()

    def _abort_one(self, rid: str) -> None:
        try:
            self.client.abort(rid)
        except Exception as exc:
            logger.warning("abort of speculative request %s failed: %s", rid, exc)

    # ---- verification ----

    def _score(self, scorer: Any, prompt: str, state: _Round) -> None:
        """Score every child's new step (children whose step was verified with their parent are done). With
        LookAhead the child's first whole speculative step rides along in the child's request: one request,
        its scores for the child's steps, and the next step's score kept for the copy that takes it."""
        requests: list[tuple[Path, Path, Branch | None]] = []  # (child, what the verifier scores, branch)
        for slot, child in enumerate(state.children):
            if len(child.step_scores) == len(child.steps):
                continue
            whole = [b for b in state.branches.get(slot, []) if b.whole] if self.fast.lookahead and child.active else []
            if whole:
                step = whole[0].text + (self.config.step_delimiter if whole[0].ended == "step" else "")
                requests.append((child, Path(state=None, steps=[*child.steps, step]), whole[0]))
            else:
                requests.append((child, child, None))
        self.tracker.score(scorer, prompt, [scored for _, scored, _ in requests])
        for child, scored, branch in requests:
            child.step_scores = scored.step_scores[: len(child.steps)]
            if branch is not None:
                branch.score = scored.step_scores[-1]
