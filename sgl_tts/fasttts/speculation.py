"""Speculative beam extension beneath the search API (FastTTS §4.1, Algorithm 1).

Any program that grows paths with `sgl_tts.search.expand` gets this when S is on: the search
has a `SpeculativeExtension` (`SearchContext.extension`) and `expand` hands it the iteration.
One `expand` with S on:
1. Every parent is forked into its copies. A copy may start with a head start: speculative text its parent
   generated during the previous iteration. The original copy keeps all of it, duplicates keep a truncated
   share drawn around R (Algorithm 1, lines 18-19). A head start that holds a whole step is the copy's step:
   nothing is generated for it (LookAhead, §4.1.3).
2. While the standard requests run, each child that has finished its step fills a free batch slot with a
   speculative continuation (a separate /generate with a speculative rid and a low priority): highest
   score bin first, the bins coming from the parents' scores (`SpeculativeSelector`), at most as many as
   standard requests have finished (`speculative_slots`), and never more than the engine has idle
   (`SpeculationClient.idle_slots`: the engine's running and waiting requests, read from `GET /v1/loads`,
   against `fasttts.engine_batch`; every search in flight shares that capacity). Standard work always comes
   first: it is launched before any speculation and outranks it in the runtime's priority scheduler.
3. The moment the last standard child finishes, every speculative request still running is aborted
   (`POST /abort_request`), so speculation adds no tail latency; SGLang answers an aborted request with
   the text generated so far and finish_reason type "abort", which becomes a partial head start.
The verifier scores the standard steps only (algorithmic equivalence): the program's scoring is unchanged.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sglang as sgl

from policies.base import encode_rid
from policies.speculative import SpeculativeSelector, TruncationSampler, speculative_slots
from sgl_tts.fasttts.switches import FastTTSConfig
from sgl_tts.frontend.lineage import node_of
from sgl_tts.frontend.sglang_internals import generation_done, wait_meta
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import ReasoningPath, SearchConfig, append_step, finish_reason_of
from sgl_tts.search.context import SearchContext

logger = logging.getLogger(__name__)

LOADS_MAX_AGE_S = 0.05  # how long one /v1/loads reading stands for the engine's load


class SpeculationClient(ABC):
    """Sends speculative requests to the generator and aborts them."""

    @abstractmethod
    def speculate(self, text: str, sampling_params: dict[str, Any], fields: dict[str, Any]) -> tuple[str, dict]:
        """Generate from `text` (blocking) with extra top-level request `fields` (rid, priority); returns
        (text, meta_info). An aborted request returns its partial text with finish_reason type 'abort'."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Stop request `rid` now (a no-op when it has finished)."""

    def idle_slots(self) -> int | None:
        """Batch slots the engine has idle now (None: unknown, no limit from the engine)."""
        return None


class HttpSpeculationClient(SpeculationClient):
    """Speculative requests to a started SGLang runtime over HTTP. With `engine_batch`, the engine's idle
    slots are engine_batch - (running + waiting requests) from `GET /v1/loads`, read at most every 50 ms."""

    def __init__(self, runtime: Any, engine_batch: int | None = None):
        self.runtime = runtime
        self.engine_batch = engine_batch
        self._lock = threading.Lock()
        self._load: tuple[float, int] | None = None  # (when read, running + waiting)

    def idle_slots(self) -> int | None:
        if self.engine_batch is None:
            return None
        from sgl_tts.runtime.server import engine_loads

        with self._lock:
            if self._load is None or time.monotonic() - self._load[0] > LOADS_MAX_AGE_S:
                try:
                    loads = engine_loads(self.runtime)
                    busy = sum(int(rank.get("num_running_reqs", 0)) + int(rank.get("num_waiting_reqs", 0))
                               for rank in loads)
                except (OSError, KeyError, TypeError, ValueError) as exc:
                    logger.warning("reading the engine load failed (%s); speculating without it", exc)
                    busy = 0
                self._load = (time.monotonic(), busy)
            return max(0, self.engine_batch - self._load[1])

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
    """

    text: str
    tokens: int
    ended: str
    finish_reason: Any = None
    launched: int = 0  # launch number within the search

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
                       split_tokens: Callable[[str], list[str]], take_whole: bool = True) -> list[HeadStart | None]:
    """Head starts for the `copies` children of a selected beam from its speculative `branches`.

    Copy k < len(branches) is branch k's original and keeps all of it; further copies duplicate the
    branches in turn and keep `sampler.duplicate_lengths` tokens (Algorithm 1, lines 18-19). A duplicate
    of a whole step keeps at most all but one token, so it generates, and diverges from, the rest.
    With `take_whole` off, an original whole step is kept but for its last token too (it is generated).
    """
    usable = [b for b in branches if b.usable][:copies]
    heads: list[HeadStart | None] = [None] * copies
    for index, branch in enumerate(usable):
        assigned = list(range(index, copies, len(usable)))
        pieces = split_tokens(branch.text)
        lengths = sampler.duplicate_lengths(len(pieces), len(assigned))
        if branch.whole and not take_whole:
            heads[index] = HeadStart("".join(pieces[:-1]), len(pieces) - 1) if len(pieces) > 1 else None
        else:
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
    failed: int = 0  # errors (the search goes on without them)
    tokens: int = 0  # generated by speculative requests
    head_start_tokens: int = 0  # speculative tokens children started with (each duplicate counts its share)
    lookahead_steps: int = 0  # children whose whole step came from speculation (no generation)
    engine_full: int = 0  # times a free slot stayed unused because the engine had no idle capacity
    polls: int = 0  # times the search had a free slot and a finished child to extend
    idle_slot_polls: int = 0  # of those, times the engine had an idle slot (or no limit): speculation could run
    tokens_used: int = 0  # speculative tokens a child kept: its branch's original copy's head start
    tokens_discarded: int = 0  # speculative tokens no child kept: pruned or ended beams, surplus, truncation
    tokens_pending: int = 0  # speculative tokens of the last iteration's branches, not yet used or discarded
    slot_s: float = 0.0  # slot-seconds speculative requests held in the engine, launch to answer (the tail S fills)

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """What changed since `before` (an `as_dict`): one iteration's counts."""
        return {key: value - before.get(key, 0) for key, value in self.as_dict().items()}



@dataclass
class _Pending:
    """A standard child whose step is being generated."""

    parent_index: int
    parent: ReasoningPath
    fork: Any
    head: HeadStart | None


@dataclass
class _Round:
    """The state of one `expand` with speculation."""

    children: list[ReasoningPath | None]
    pending: dict[int, _Pending]  # slot -> standard request still running
    selector: SpeculativeSelector
    pool: ThreadPoolExecutor
    finished: list[int] = field(default_factory=list)  # slots done with their step and still active, in order
    in_flight: dict[str, tuple[int, Future]] = field(default_factory=dict)  # rid -> (slot, speculative request)
    launch_order: dict[int, int] = field(default_factory=dict)  # id(branch future) -> launch number
    held_s: dict[str, float] = field(default_factory=dict)  # rid -> seconds from launch to answer
    launched: Counter = field(default_factory=Counter)  # slot -> speculative branches launched
    branches: dict[int, list[Branch]] = field(default_factory=lambda: defaultdict(list))


class SpeculativeExtension:
    """One search's speculative beam extension (see the module docstring); made per run by
    `extension_factory`, so branches never cross searches."""

    def __init__(self, search: Any, fast: FastTTSConfig, client: SpeculationClient,
                 split_tokens: Callable[[str], list[str]] = None, seed: int = 0, poll_s: float = 0.005):
        self.search = search  # the search's context (sgl_tts.search.context): its label and ledger
        self.fast = fast
        self.client = client
        self.split_tokens = split_tokens or word_pieces
        self.poll_s = poll_s
        self.sampler = TruncationSampler(fast.truncation_ratio, fast.truncation_std, seed)
        self.branches: dict[int, list[Branch]] = {}  # id(child) -> its branches, from the last expand
        self.stats = SpeculationStats()

    def expand(self, parents: Sequence[tuple[ReasoningPath, int]], config: SearchConfig, tracker: SearchContext,
               extract_answer: Callable[[str], str | None], logprobs: int = 0) -> list[ReasoningPath]:
        if logprobs:
            # A head start's tokens come from a speculative request (or none, for a LookAhead step) that asked
            # for no logprobs, so a child's token confidences would silently miss them.
            raise ValueError(f"the speculative beam extension (FastTTS S) cannot return top logprobs (asked for "
                             f"{logprobs} per token): switch S off for a program that expands with logprobs")
        slots = [(index, copy) for index, (_, count) in enumerate(parents) for copy in range(count)]
        scores = [aggregate(parent.step_scores, config.aggregation) for parent, _ in parents]
        selector = SpeculativeSelector({slot: scores[index] for slot, (index, _) in enumerate(slots)},
                                       config.beam_width)
        pool = ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="speculate")
        state = _Round(children=[None] * len(slots), pending={}, selector=selector, pool=pool)
        before = self.stats.as_dict()
        try:
            self._launch_standard(state, parents, config, tracker, extract_answer)
            while state.pending:
                self._collect_standard(state, config, tracker, extract_answer)
                self._collect_speculative(state, config)
                if state.pending:
                    self._fill_free_slots(state, config)
                    time.sleep(self.poll_s)
        finally:
            # The last standard child has finished (or the search failed): stop all speculation now, keep
            # what the aborted requests wrote, and let no request thread outlive the iteration.
            self._abort_all(state)
            self._collect_speculative(state, config, wait=True)
            pool.shutdown(wait=True, cancel_futures=True)
        children = [child for child in state.children if child is not None]
        assert len(children) == len(slots), f"{len(slots) - len(children)} children were never collected"
        # A beam's branches in launch order (not the order they finished in): copy k takes branch k.
        self.branches = {id(child): sorted(state.branches[slot], key=lambda b: b.launched)
                         for slot, child in enumerate(children) if child.active and state.branches.get(slot)}
        self.stats.tokens_discarded += sum(b.tokens for slot, child in enumerate(children) if not child.active
                                           for b in state.branches.get(slot, []))
        self.stats.tokens_pending = sum(b.tokens for branches in self.branches.values() for b in branches)
        tracker.extra["speculation"] = self.stats.as_dict()
        tracker.extra.setdefault("speculation_iterations", []).append(self.stats.since(before))
        return children

    def _launch_standard(self, state: _Round, parents: Sequence[tuple[ReasoningPath, int]], config: SearchConfig,
                         tracker: SearchContext, extract_answer: Callable[[str], str | None]) -> None:
        """Fork every parent into its copies with their head starts; generate where a step is left. A branch's
        tokens are used as far as its original copy keeps them (the duplicates keep less); the rest, and the
        branches of beams not selected again, are discarded."""
        previous, self.branches = self.branches, {}
        slot = 0
        for parent_index, (parent, count) in enumerate(parents):
            branches = previous.pop(id(parent), [])
            heads = assign_head_starts(branches, count, self.sampler, self.split_tokens, self.fast.lookahead)
            originals = len([b for b in branches if b.usable][:count])  # copy k < originals: branch k's original
            used = sum(head.tokens for head in heads[:originals] if head is not None)
            self.stats.tokens_used += used
            self.stats.tokens_discarded += max(0, sum(b.tokens for b in branches) - used)
            parent.state.text()  # commit the prefix so the fork pre-caches it (docs/sglang.md)
            for fork, head in zip(parent.state.fork(count), heads):
                if head is not None:
                    fork += head.text
                    self.stats.head_start_tokens += head.tokens
                if head is not None and head.branch is not None:
                    self.stats.lookahead_steps += 1
                    meta = {"completion_tokens": head.tokens, "finish_reason": head.branch.finish_reason}
                    child = self._child(parent, parent_index, fork, head.text, meta, config, tracker, extract_answer)
                    child.extra["head_start_tokens"] = head.tokens
                    self._child_done(state, slot, child, config)
                else:
                    budget = step_budget(parent, config) - (head.tokens if head else 0)
                    fork += sgl.gen("step", max_tokens=max(1, budget), stop=config.step_delimiter,
                                    temperature=config.temperature, top_p=config.top_p)
                    state.pending[slot] = _Pending(parent_index, parent, fork, head)
                slot += 1
        self.stats.tokens_discarded += sum(b.tokens for branches in previous.values() for b in branches)

    @staticmethod
    def _child(parent: ReasoningPath, parent_index: int, fork: Any, text: str, meta: dict[str, Any],
               config: SearchConfig, tracker: SearchContext,
               extract_answer: Callable[[str], str | None]) -> ReasoningPath:
        child = ReasoningPath(state=fork, steps=list(parent.steps), step_scores=list(parent.step_scores),
                     tokens=parent.tokens, parent=parent_index)
        append_step(child, text, meta, config, tracker, extract_answer)
        return child

    @staticmethod
    def _child_done(state: _Round, slot: int, child: ReasoningPath, config: SearchConfig) -> None:
        state.children[slot] = child
        if child.active and step_budget(child, config) > 0:
            state.finished.append(slot)

    def _collect_standard(self, state: _Round, config: SearchConfig, tracker: SearchContext,
                          extract_answer: Callable[[str], str | None]) -> None:
        for slot in [s for s, p in state.pending.items() if generation_done(p.fork, "step")]:
            pending = state.pending.pop(slot)
            meta = wait_meta(pending.fork, "step")
            head = pending.head
            text = (head.text if head else "") + pending.fork["step"]
            tokens = int(meta.get("completion_tokens", 0)) + (head.tokens if head else 0)
            child = self._child(pending.parent, pending.parent_index, pending.fork, text,
                                {**meta, "completion_tokens": tokens}, config, tracker, extract_answer)
            if head is not None:
                child.extra["head_start_tokens"] = head.tokens
            self._child_done(state, slot, child, config)

    def _fill_free_slots(self, state: _Round, config: SearchConfig) -> None:
        """Launch speculative branches into the slots that finished standard requests left free."""
        free = speculative_slots(len(state.children), len(state.pending)) - len(state.in_flight)
        if self.fast.max_speculative is not None:
            free = min(free, self.fast.max_speculative - len(state.in_flight))
        if free <= 0 or not state.finished:
            return
        self.stats.polls += 1
        idle = self.client.idle_slots()
        if idle is None or idle > 0:
            self.stats.idle_slot_polls += 1
        if idle is not None and idle < free:
            self.stats.engine_full += 1
            free = idle
        for choice in state.selector.select_speculative(state.finished, free, state.launched):
            slot = choice.beam_id
            child = state.children[slot]
            tag = node_of(child.state, self.search.label).speculative_tag(choice.bin_index)
            fields = {"rid": encode_rid(tag), "priority": self.fast.speculative_priority}
            state.launched[slot] += 1
            sampling = {"max_new_tokens": step_budget(child, config), "stop": [config.step_delimiter],
                        "temperature": config.temperature, "top_p": config.top_p}
            future = state.pool.submit(self._speculate_timed, state, child.state.text(), sampling, fields)
            state.in_flight[fields["rid"]] = (slot, future)
            state.launch_order[id(future)] = self.stats.launched
            self.stats.launched += 1

    def _speculate_timed(self, state: _Round, text: str, sampling: dict[str, Any],
                         fields: dict[str, Any]) -> tuple[str, dict]:
        """`client.speculate`, its time in the engine kept in `state.held_s` before its future is done."""
        began = time.monotonic()
        try:
            answer = self.client.speculate(text, sampling, fields)
        finally:
            state.held_s[fields["rid"]] = time.monotonic() - began
        meta = answer[1]
        reason = meta.get("finish_reason") or {}
        self.search.ledger.window("speculative", "generator", began, began + state.held_s[fields["rid"]],
                                  tokens=int(meta.get("completion_tokens", 0) or 0),
                                  prompt_tokens=int(meta.get("prompt_tokens", 0) or 0),
                                  aborted=int(isinstance(reason, dict) and reason.get("type") == "abort"))
        return answer

    def _collect_speculative(self, state: _Round, config: SearchConfig, wait: bool = False) -> None:
        """Turn finished speculative requests into branches; with `wait`, wait for every one (after the
        aborts they answer at once; a request that hangs is bounded by the runtime's request timeout)."""
        for rid, (slot, future) in list(state.in_flight.items()):
            if wait:
                future.exception()
            if not future.done():
                continue
            del state.in_flight[rid]
            self.stats.slot_s += state.held_s.pop(rid, 0.0)  # 0 for a request cancelled before it ran
            branch = self._branch(future, config)
            if branch is not None:
                branch.launched = state.launch_order[id(future)]
                state.branches[slot].append(branch)

    def _branch(self, future: Future, config: SearchConfig) -> Branch | None:
        if future.cancelled():
            return None
        try:
            text, meta = future.result()
        except Exception as exc:  # speculation is optional work: the search goes on without it
            logger.warning("speculative request failed: %s", exc)
            self.stats.failed += 1
            return None
        self.search.ledger.record(meta, speculative=True)
        reason = meta.get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            ended = "abort"
            self.stats.aborted += 1
        else:
            ended = finish_reason_of(meta, config.step_delimiter)
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
        for thread in threads:
            thread.join()

    def _abort_one(self, rid: str) -> None:
        try:
            self.client.abort(rid)
        except Exception as exc:
            logger.warning("abort of speculative request %s failed: %s", rid, exc)


def step_budget(path: ReasoningPath, config: SearchConfig) -> int:
    return min(config.max_step_tokens, config.max_tokens - path.tokens)


def extension_factory(fast: FastTTSConfig, client: SpeculationClient, tokenizer: Any = None,
                      seed: int = 0) -> Callable[[Any], SpeculativeExtension]:
    """What a new search calls (`Runtimes.new_search`) to get its extension. The truncation sampler is seeded
    with the search's seed combined with `seed` (fasttts.seed)."""
    split = token_splitter(tokenizer) if tokenizer is not None else word_pieces

    def make(search: Any) -> SpeculativeExtension:
        run_seed = seed if search.seed is None else seed * 1_000_003 + search.seed
        return SpeculativeExtension(search, fast, client, split, run_seed)

    return make
