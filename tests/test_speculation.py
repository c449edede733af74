"""Speculative beam extension (sgl_tts/fasttts/speculation.py) on a timed fake generator.

`TimedScriptedBackend` serves `ScriptedModel` one token (word) at a time with a delay, for the frontend's
standard requests and for speculative requests (`speculate`/`abort`), and logs when each request starts,
ends or is aborted. A path's next step is decided by the text up to its last step delimiter and a variant
counter per such text (the k-th step drawn there gets variant k), drawn when the first token is produced;
a request whose text already holds part of a step continues that step. So a speculative continuation of a
path is exactly a step the path's copies would otherwise generate, and a head start changes when a step is
produced but not which: with truncation ratio 0 (duplicates keep nothing) the search must then send the
verifier exactly the steps it sends with S off. With R > 0 duplicates share a truncated prefix of their
original's step, FastTTS's accepted departure from equivalence, checked separately.

Copy k of a beam takes the branch launched k-th, so speculative requests on one text draw their variants in
launch order (the rid's beam number, given at launch): a request waits to draw until no request launched
before it on the same text and already started is still to draw. The thread pool starts requests in launch
order, so only a worker held between taking its request and starting it could still draw late.
"""

import dataclasses
import threading
import time
from collections import defaultdict

import pytest
from sglang.lang.backend.base_backend import BaseBackend

from sgl_tts.problems import Problem
from policies.base import decode_rid
from policies.speculative import TruncationSampler
from sgl_tts.frontend.backend import SearchBackend
from sgl_tts.fasttts.switches import FastTTSConfig, from_label
from sgl_tts.search.programs import load_program
from sgl_tts.search.api import ReasoningPath, Runtimes, SearchConfig, straggler_tail
from sgl_tts.search.context import SearchContext
from sgl_tts.search.grading import extract_answer
from sgl_tts.fasttts.speculation import (Branch, SpeculationClient, assign_head_starts, extension_factory,
                                         token_splitter, word_pieces)
from sgl_tts.testing import EOS_ID, ScriptedModel, ScriptedScorer, _hash

DELIMITER = "\n\n"
PROMPT = "Q: what is two plus two?" + DELIMITER
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")


class TimedScriptedBackend(SearchBackend, BaseBackend, SpeculationClient):
    """A fake generator runtime with per-token delays, priorities ignored, and aborts (see the module doc)."""

    def __init__(self, model: ScriptedModel, token_delay_s=None, speculative_delay_s=None):
        super().__init__()
        self.model = model
        # Seconds per token of a step, by (text before the step, variant): some steps are stragglers.
        self.token_delay_s = token_delay_s or (lambda done, variant: 0.002 * (1 + _hash(done, variant) % 8))
        self.speculative_delay_s = speculative_delay_s or self.token_delay_s
        self.lock = threading.Lock()
        self.turn = threading.Condition(self.lock)  # speculative draws on one text, in launch order
        self.undrawn: dict[str, set[int]] = defaultdict(set)  # text -> beam numbers of started, undrawn requests
        self.variants: dict[str, int] = defaultdict(int)
        self.drawn: dict[str, dict[int, tuple[list[str], str]]] = defaultdict(dict)
        self.aborted: set[str] = set()
        self.log: list[dict] = []  # one entry per request: kind, rid, text, start, end, output, reason
        self.running = {"standard": 0, "speculative": 0}
        self.peak_running: list[tuple[int, int]] = []  # (standard, speculative) at each speculative start

    def get_model_name(self) -> str:
        return "timed-scripted"

    def _draw(self, done: str, partial: str) -> tuple[list[str], str, int]:
        """(the step's tokens, its ending, variant): a new variant, or the step `partial` began."""
        if partial:
            for variant, (pieces, ending) in self.drawn[done].items():
                if "".join(pieces).startswith(partial):
                    return pieces, ending, variant
            raise AssertionError(f"no drawn step begins with the head start {partial!r}")
        variant = self.variants[done]
        self.variants[done] += 1
        step, ending = self.model.step(done, variant)
        self.drawn[done][variant] = (word_pieces(step), ending)
        return word_pieces(step), ending, variant

    def _run(self, kind: str, text: str, budget: int, rid: str | None) -> tuple[str, dict]:
        cut = text.rfind(DELIMITER) + len(DELIMITER)
        done, partial = text[:cut], text[cut:]
        entry = {"kind": kind, "rid": rid, "text": text, "budget": budget, "start": time.monotonic()}
        launch = decode_rid(rid).beam_id if kind == "speculative" else None
        with self.lock:
            self.running[kind] += 1
            if kind == "speculative":
                self.peak_running.append((self.running["standard"], self.running["speculative"]))
                self.undrawn[done].add(launch)
            self.log.append(entry)
        produced, pieces, reason = [], None, None
        skip = len(word_pieces(partial))
        while reason is None:
            if pieces is None:
                delay = 0.002
            else:
                delays = self.speculative_delay_s if kind == "speculative" else self.token_delay_s
                delay = delays(done, variant)
            self._sleep(delay, rid)
            with self.lock:
                if pieces is None and launch is not None:
                    self.turn.wait_for(lambda: rid in self.aborted or min(self.undrawn[done]) == launch)
                if rid in self.aborted:
                    reason = {"type": "abort", "message": "Aborted"}
                    self._drawn(done, launch)
                    break
                if pieces is None:  # the step is drawn with the first token
                    pieces, ending, variant = self._draw(done, partial)
                    pieces = pieces[skip:]
                    self._drawn(done, launch)
            if len(produced) == len(pieces):
                reason = {"type": "stop", "matched": EOS_ID if ending == "eos" else DELIMITER}
            elif len(produced) == budget:
                reason = {"type": "length", "length": budget}
            else:
                produced.append(pieces[len(produced)])
        output = "".join(produced)
        with self.lock:
            self.running[kind] -= 1
            entry.update(end=time.monotonic(), output=output, reason=reason["type"])
        return output, {"completion_tokens": len(produced), "prompt_tokens": len(text), "cached_tokens": 0,
                        "finish_reason": reason}

    def _drawn(self, done: str, launch: int | None) -> None:
        """A speculative request has drawn its step (or will not): the next one on `done` may draw. Under the lock."""
        if launch is not None and launch in self.undrawn[done]:
            self.undrawn[done].discard(launch)
            self.turn.notify_all()

    def _sleep(self, seconds: float, rid: str | None) -> None:
        """Sleep in short slices, so that an abort stops a request at once."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and rid not in self.aborted:
            time.sleep(min(0.002, max(0.0, end - time.monotonic())))

    def generate(self, s, sampling_params):
        assert sampling_params.stop == DELIMITER, "steps stop at the delimiter"
        began = time.perf_counter()
        text, meta = self.sent(s, lambda: self._run("standard", s.text_, sampling_params.max_new_tokens,
                                                     self.request_fields(s)["rid"]))
        self.answered(s, s.text_, began, meta, text)
        return text, meta

    def commit_lazy_operations(self, s):
        self.request_fields(s)  # the fork's parent gets its lineage node, as on a runtime

    def speculate(self, text, sampling_params, fields):
        assert sampling_params["stop"] == [DELIMITER]
        return self._run("speculative", text, sampling_params["max_new_tokens"], fields["rid"])

    def abort(self, rid):
        with self.lock:
            self.aborted.add(rid)
            self.log.append({"kind": "abort", "rid": rid, "start": time.monotonic()})
            self.turn.notify_all()

    def entries(self, kind):
        return [e for e in self.log if e["kind"] == kind]


class TaggedModel(ScriptedModel):
    """ScriptedModel whose steps begin with their variant, so a head start names the step it began."""

    def step(self, text, variant):
        step, ending = super().step(text, variant)
        return f"v{variant} {step}", ending


SEARCH = SearchConfig(n=8, beam_width=2, max_steps=5, max_step_tokens=64, max_tokens=1000, temperature=0.8)
MODEL = TaggedModel(answer_depth=3, answer_chance=0.3, eos_chance=0.05)


def run(fast, prompt=PROMPT, search=SEARCH, model=MODEL, client=None, program="beam_search", **backend_args):
    backend = TimedScriptedBackend(model, **backend_args)
    scorer = ScriptedScorer()
    runtimes = Runtimes(generator=backend, scorer=scorer, prompt=lambda q: prompt,
                        extension_factory=extension_factory(fast, client or backend, seed=fast.seed)
                        if fast.speculative else None)
    result = load_program(program)(PROBLEM, search, runtimes)
    return result, backend, scorer


def candidates(result):
    return sorted((c.text, tuple(c.step_scores), c.answer, c.finish_reason) for c in result.candidates)


def scored_paths(scorer):
    return [sorted(tuple(path) for path in call) for call in scorer.calls]


EQUIVALENT_S = from_label("S", truncation_ratio=0.0, truncation_std=0.0, lookahead=False)


@pytest.mark.parametrize("prompt", [PROMPT, f"Q: one more{DELIMITER}", f"Q: and another{DELIMITER}"])
def test_with_s_on_the_verifier_receives_exactly_the_steps_it_receives_with_s_off(prompt):
    plain, _, plain_scorer = run(FastTTSConfig(), prompt)
    spec, backend, spec_scorer = run(EQUIVALENT_S, prompt)
    stats = spec.extra["speculation"]
    assert stats["launched"] > 0 and stats["head_start_tokens"] > 0, f"speculation must happen: {stats}"
    assert scored_paths(spec_scorer) == scored_paths(plain_scorer), "same steps, same verifier calls"
    assert candidates(spec) == candidates(plain)
    assert spec.answer == plain.answer
    assert "speculation" not in plain.extra
    tails = [len(result.extra["straggler_tails"]) for result in (plain, spec)]
    assert tails[0] == tails[1] > 1, "a straggler tail per iteration, S or not"


def test_a_straggler_tail_counts_each_slot_idle_from_its_answer_to_the_last():
    tail = straggler_tail(10.0, [11.0, 13.0, 12.0])  # the last answer at 13: slots idle 2 s, 0 s, 1 s
    assert tail == {"requests": 3, "span_s": 3.0, "idle_slot_s": 3.0, "idle_share": pytest.approx(1 / 3)}
    assert straggler_tail(0.0, [5.0, 5.0])["idle_slot_s"] == 0.0, "no stragglers, no tail"
    assert straggler_tail(0.0, [0.0])["idle_share"] == 0.0, "an empty span has no share"


def test_the_ledger_gives_the_requests_answered_since_a_count():
    """What `expand` reads per iteration: the requests answered since its start, not the whole log."""
    from sgl_tts.frontend.ledger import Request, RequestLedger

    ledger = RequestLedger()
    for index, runtime in enumerate(["gen", "ver", "gen"]):
        ledger.record_request(Request(runtime, "q", f"old{index}", 1, float(index), 0.1), {"completion_tokens": 1})
    count = ledger.answered_count()
    for index, runtime in enumerate(["gen", "ver"]):
        ledger.record_request(Request(runtime, "q", f"new{index}", 1, 9.0, 0.1), {"completion_tokens": 1})
    assert count == 3 and ledger.answered_count() == 5
    assert [r.output for r in ledger.answered_requests(since=count)] == ["new0", "new1"]
    assert [r.output for r in ledger.answered_requests("gen", since=count)] == ["new0"]
    assert [r.output for r in ledger.answered_requests("gen")] == ["old0", "old2", "new0"]


def test_whole_speculative_steps_become_steps_without_generation_and_the_search_is_unchanged():
    plain, plain_backend, plain_scorer = run(FastTTSConfig())
    fast = from_label("S", truncation_ratio=0.0, truncation_std=0.0)
    spec, backend, spec_scorer = run(fast, speculative_delay_s=lambda done, variant: 0.0005)
    stats = spec.extra["speculation"]
    assert stats["whole"] > 0 and stats["lookahead_steps"] > 0, stats
    assert candidates(spec) == candidates(plain)
    assert scored_paths(spec_scorer) == scored_paths(plain_scorer), "the verifier scores the same steps"
    assert len(backend.entries("standard")) == len(plain_backend.entries("standard")) - stats["lookahead_steps"], \
        "a child that took a whole speculative step sends no standard request"


@pytest.mark.parametrize("program", ["dvts", "dynamic_branching", "varying_granularity"])
def test_every_program_that_grows_paths_with_expand_gets_speculation(program):
    """No program file knows of FastTTS: S on the backend reaches every `expand`, and with R = 0 the search
    is the one it is without S."""
    plain, _, plain_scorer = run(FastTTSConfig(), program=program)
    spec, backend, spec_scorer = run(EQUIVALENT_S, program=program)
    stats = spec.extra["speculation"]
    assert stats["launched"] > 0 and backend.entries("speculative"), f"{program} speculates: {stats}"
    assert all(decode_rid(e["rid"]).speculative for e in backend.entries("speculative"))
    assert candidates(spec) == candidates(plain) and spec.answer == plain.answer
    assert scored_paths(spec_scorer) == scored_paths(plain_scorer)


def test_speculation_fills_only_free_slots_and_is_aborted_when_the_last_standard_child_finishes():
    # Speculative tokens are slow (a step takes a second or more): a search that waited for them would show.
    result, backend, _ = run(from_label("P+S"), speculative_delay_s=lambda done, variant: 0.3)
    batch = SEARCH.n  # every iteration runs n standard children
    assert backend.peak_running and all(std + spec <= batch for std, spec in backend.peak_running), \
        "speculation never runs in more slots than the standard requests have left"
    standard = defaultdict(list)
    for entry in backend.entries("standard"):
        standard[decode_rid(entry["rid"]).iteration].append(entry)
    aborts = {e["rid"]: e["start"] for e in backend.entries("abort")}
    speculative = backend.entries("speculative")
    assert speculative and aborts, "stragglers leave free slots that speculation fills"
    for entry in speculative:
        tag = decode_rid(entry["rid"])
        assert tag.speculative and tag.iteration >= 1 and tag.priority_bin >= 1
        last_standard_end = max(e["end"] for e in standard[tag.iteration - 1])
        # (The tolerances allow for thread scheduling on a busy machine; a speculative step takes >= 0.9 s.)
        assert entry["start"] < last_standard_end + 0.1, "speculation only while standard work runs"
        assert entry["reason"] == "abort" or entry["end"] - entry["start"] >= 0.3, "aborted, or ran to a stop"
        if entry["reason"] == "abort":
            abort = aborts[entry["rid"]]
            assert last_standard_end <= abort < last_standard_end + 0.3, "aborted when the last child ends"
            assert entry["end"] < abort + 0.3, "an aborted request stops at once"
        # The next iteration's standard work starts after every speculative request has stopped.
        assert all(e["start"] >= entry["end"] for e in standard.get(tag.iteration, []))
    stats = result.extra["speculation"]
    assert stats["aborted"] == sum(e["reason"] == "abort" for e in speculative) > 0
    assert stats["launched"] == len(speculative)
    # every speculative token is used, discarded, or still waiting for the next iteration
    assert stats["tokens_used"] + stats["tokens_discarded"] + stats["tokens_pending"] == stats["tokens"] > 0
    assert stats["polls"] >= stats["idle_slot_polls"] > 0, "no engine limit: every poll saw idle slots"
    iterations = result.extra["speculation_iterations"]
    assert 1 < len(iterations) <= max(decode_rid(e["rid"]).iteration for e in backend.entries("standard")) + 1
    for key in ("launched", "polls", "idle_slot_polls", "tokens_used", "tokens_discarded"):
        assert sum(it[key] for it in iterations) == stats[key], f"the iterations' {key} add up"
    # S's slot-time: each request is timed around the call that holds the backend's own start..end window
    assert stats["slot_s"] >= sum(e["end"] - e["start"] for e in speculative) > 0
    assert sum(it["slot_s"] for it in iterations) == pytest.approx(stats["slot_s"])
    # one straggler tail per iteration, over the iteration's standard requests (a LookAhead step sends none)
    tails = result.extra["straggler_tails"]
    assert len(tails) == len(iterations)
    assert [t["requests"] for t in tails] == [len(standard[i]) for i in sorted(standard)]
    assert all(0 <= t["idle_share"] < 1 and t["idle_slot_s"] >= 0 for t in tails)
    assert any(t["idle_slot_s"] > 0 for t in tails), "stragglers leave idle slots"


def test_an_engine_without_idle_slots_counts_polls_but_launches_nothing():
    class FullEngine(TimedScriptedBackend):
        def idle_slots(self):
            return 0

    backend = FullEngine(MODEL)
    runtimes = Runtimes(generator=backend, scorer=ScriptedScorer(), prompt=lambda q: PROMPT,
                        extension_factory=extension_factory(from_label("S"), backend))
    stats = load_program("beam_search")(PROBLEM, SEARCH, runtimes).extra["speculation"]
    assert stats["launched"] == stats["idle_slot_polls"] == 0
    assert stats["polls"] == stats["engine_full"] > 0


def test_max_speculative_caps_the_requests_in_flight():
    result, backend, _ = run(from_label("S", max_speculative=1))
    assert backend.peak_running and all(spec <= 1 for _, spec in backend.peak_running)


def test_head_starts_are_truncated_by_the_sampler():
    branches = [Branch("a b c d e f g h i j", 10, "abort"), Branch("k l m n", 4, "step", {"type": "stop"})]
    heads = assign_head_starts(branches, copies=6, sampler=TruncationSampler(0.85, 0.1, seed=3),
                               split_tokens=word_pieces)
    reference = TruncationSampler(0.85, 0.1, seed=3)
    first = reference.duplicate_lengths(10, 3)  # copies 0, 2, 4 take branch 0
    second = reference.duplicate_lengths(4, 3)  # copies 1, 3, 5 take branch 1
    assert heads[0].text == branches[0].text and heads[0].branch is None, "the original keeps all"
    assert heads[1].branch is branches[1], "a whole step is taken whole by its original"
    assert 0 < first[1] < 10 or 0 < first[2] < 10, "duplicates are truncated"
    for copy, keep in ((2, first[1]), (4, first[2])):
        assert heads[copy].tokens == keep and heads[copy].text == " ".join("abcdefghij"[:keep])
    for copy, keep in ((3, second[1]), (5, second[2])):
        keep = min(keep, 3)  # a duplicate of a whole step must generate at least its last token
        assert heads[copy] is None if keep == 0 else heads[copy].text == " ".join("klmn"[:keep])
    assert assign_head_starts([], 3, reference, word_pieces) == [None] * 3
    assert assign_head_starts([Branch("", 0, "abort")], 2, reference, word_pieces) == [None] * 2


def test_duplicates_continue_a_truncated_head_start_within_the_step_budget():
    fast = from_label("S", truncation_ratio=0.85, truncation_std=0.1)
    result, backend, _ = run(fast, speculative_delay_s=lambda done, variant: 0.001)
    assert result.extra["speculation"]["head_start_tokens"] > 0
    continued = [e for e in backend.entries("standard") if not e["text"].endswith(DELIMITER)]
    assert continued, "some standard requests start inside a step (after a head start)"
    for entry in continued:
        cut = entry["text"].rfind(DELIMITER) + len(DELIMITER)
        head = word_pieces(entry["text"][cut:])
        assert entry["budget"] == SEARCH.max_step_tokens - len(head), "the head start counts against the step"
        steps = ["".join(pieces) for pieces, _ in backend.drawn[entry["text"][:cut]].values()]
        assert any(step.startswith("".join(head)) for step in steps), "a head start begins a drawn step"
    for candidate in result.candidates:
        assert all(len(word_pieces(step)) <= SEARCH.max_step_tokens for step in candidate.steps)


def test_failed_speculative_requests_do_not_stop_the_search():
    class Failing(SpeculationClient):
        def speculate(self, text, sampling_params, fields):
            raise OSError("connection refused")

        def abort(self, rid):
            raise AssertionError("nothing to abort")

    result, _, _ = run(from_label("S"), client=Failing())
    plain, _, _ = run(FastTTSConfig())
    assert result.extra["speculation"]["failed"] > 0
    assert candidates(result) == candidates(plain)


def test_splitters_cut_at_token_boundaries_and_join_back():
    from transformers import AutoTokenizer

    from sgl_tts.runtime.models import resolve_model

    text = "Tom has 3 apples.  He buys 4 more: 3 + 4 = 7 ü"
    assert "".join(word_pieces(text)) == text and len(word_pieces(text)) == 14
    assert word_pieces("  ") == ["  "] and word_pieces("") == []
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny-random"))
    split = token_splitter(tokenizer)
    ascii_text = text[:-2]
    assert "".join(split(ascii_text)) == ascii_text
    assert len(split(ascii_text)) == len(tokenizer(ascii_text, add_special_tokens=False).input_ids)
    # A character made of several byte-level tokens is never cut: fewer pieces than tokens.
    assert "".join(split(text)) == text and split(text)[-1].endswith("ü")
    assert len(split(text)) < len(tokenizer(text, add_special_tokens=False).input_ids)


def test_speculation_refuses_to_expand_with_logprobs():
    """Head starts come from requests without logprobs: a step's token confidences would miss their tokens."""
    extension = extension_factory(EQUIVALENT_S, TimedScriptedBackend(MODEL))(SearchContext(SEARCH))
    with pytest.raises(ValueError, match=r"speculative beam extension \(FastTTS S\) cannot return top logprobs"):
        extension.expand([(ReasoningPath(state=None), 2)], SEARCH, extension.search, extract_answer, logprobs=5)


def test_with_s_on_a_step_that_asks_for_logprobs_is_expanded_plainly():
    """DeepConf's steps need every token's logprobs: with a step extension on, `expand` writes them plainly."""
    from sgl_tts.search.programs import with_program_settings
    from sgl_tts.testing import ScriptedBackend

    class Untouchable:  # a step extension that must not be asked
        def expand(self, *args, **kwargs):
            raise AssertionError("a step with logprobs went to the step extension")

    config = with_program_settings(dataclasses.replace(SEARCH, program="deepconf", n=6, settings=None))

    def deepconf_result(extension_factory):
        runtimes = Runtimes(generator=ScriptedBackend(MODEL), scorer=None, prompt=lambda q: PROMPT,
                            extension_factory=extension_factory)
        return load_program("deepconf")(PROBLEM, config, runtimes)

    result = deepconf_result(lambda search: Untouchable())  # fails if any step went to the extension
    assert result.error is None and len(result.extra["deepconf"]["confidences"]) == len(result.candidates) > 0


def test_a_timeline_records_every_speculative_request_that_ran():
    backend = TimedScriptedBackend(MODEL)
    runtimes = Runtimes(generator=backend, scorer=ScriptedScorer(), prompt=lambda q: PROMPT,
                        extension_factory=extension_factory(EQUIVALENT_S, backend, seed=0))
    search = dataclasses.replace(SEARCH, record_timeline=True)
    result = load_program("beam_search")(PROBLEM, search, runtimes, runtimes.new_search(search, PROBLEM.id))
    stats = result.extra["speculation"]
    speculative = [w for w in result.extra["timeline"]["windows"] if w["kind"] == "speculative"]
    assert stats["launched"] > 0
    assert len(speculative) == stats["whole"] + stats["aborted"]  # answered: whole steps and aborted partials
    assert sum(w["aborted"] for w in speculative) == stats["aborted"]
    assert sum(w["tokens"] for w in speculative) == stats["tokens"]
    assert sum(w["ended"] - w["began"] for w in speculative) == pytest.approx(stats["slot_s"], abs=1e-6)
