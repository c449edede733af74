"""Speculative beam extension against a real SGLang CPU runtime (the shared tiny-model runtime): what an
aborted request returns, and a beam search with S on whose speculative requests are sent, aborted and
reused as head starts through HTTP."""

import threading
import time

import pytest

from sgl_tts.problems import Problem
from sgl_tts.fasttts.switches import from_label
from sgl_tts.frontend.backend import TTSEndpoint
from sgl_tts.search.programs import load_program
from sgl_tts.search.api import SearchConfig
from sgl_tts.fasttts.speculation import HttpSpeculationClient, extension_factory

pytestmark = pytest.mark.runtime


def test_an_aborted_request_returns_its_partial_text(tiny_runtime):
    client = HttpSpeculationClient(tiny_runtime)
    answer = {}

    def long_request():
        answer["out"] = client.speculate("Once upon a time", {"max_new_tokens": 1500, "ignore_eos": True,
                                                              "temperature": 0.8}, {"rid": "spec-abort-test"})

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(2.0)
    aborted_at = time.monotonic()
    client.abort("spec-abort-test")
    thread.join(timeout=60)
    assert not thread.is_alive() and time.monotonic() - aborted_at < 30, "the abort stops the request"
    text, meta = answer["out"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 1500 and text, "the tokens generated so far come back"
    client.abort("spec-abort-test")  # aborting a finished request is a no-op


def test_beam_search_with_speculation_on_a_real_runtime(tiny_search_runtimes, tiny_runtime):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_runtime.model_path)
    fast = from_label("P+S", engine_batch=64)
    client = HttpSpeculationClient(tiny_runtime, fast.engine_batch)
    assert 0 < client.idle_slots() <= 64, "the engine's load is read from /v1/loads"
    runtimes = type(tiny_search_runtimes)(generator=TTSEndpoint(tiny_runtime), scorer=tiny_search_runtimes.scorer,
                                          prompt=tiny_search_runtimes.prompt,
                                          extension_factory=extension_factory(fast, client, tokenizer))
    # The random-weight model often emits a space: a space delimiter gives short steps of irregular length,
    # so children finish early and speculation fills their slots.
    config = SearchConfig(n=8, beam_width=2, max_steps=4, max_step_tokens=12, max_tokens=48, step_delimiter=" ")
    result = load_program("beam_search")(Problem(id="t1", question="What is 2 + 3?", gold="5"), config, runtimes)
    stats = result.extra["speculation"]
    assert stats["failed"] == 0, stats
    assert stats["launched"] > 0 and stats["launched"] == stats["whole"] + stats["aborted"], stats
    assert stats["tokens"] <= result.generated_tokens
    assert result.candidates
    for candidate in result.candidates:
        assert len(candidate.step_scores) == len(candidate.steps) <= config.max_steps
        assert candidate.tokens <= config.max_tokens


def test_a_standard_request_preempts_a_speculative_one(priority_runtime):
    """On a runtime with FastTTS's priority scheduling and plugin, a standard request arriving while a
    speculative one holds the only running slot is served first; the speculative request is paused, not
    lost: it resumes and answers its partial text when aborted."""
    from sgl_tts.runtime.server import http_json

    runtime, fast = priority_runtime
    finished, answers, lock = [], {}, threading.Lock()

    def send(rid, priority, max_new_tokens):
        answer = http_json(runtime.url + "/generate", {
            "rid": rid, "text": "The answer is", "priority": priority,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}})
        with lock:
            finished.append(rid)
            answers[rid] = answer

    def loads():
        ranks = http_json(runtime.url + "/v1/loads?include=core")["loads"]
        return (sum(int(r.get("num_running_reqs", 0)) for r in ranks),
                sum(int(r.get("num_waiting_reqs", 0)) for r in ranks))

    def used_tokens():
        return sum(int(r.get("num_used_tokens", 0)) for r in http_json(runtime.url + "/v1/loads?include=core")["loads"])

    def wait_for(condition, what):
        deadline = time.monotonic() + 300
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    # The speculative request is as long as the context: it cannot finish while the test runs.
    speculative = threading.Thread(target=send, args=("spec", fast.speculative_priority, 2000))
    speculative.start()
    wait_for(lambda: loads()[0] == 1, "the speculative request to run")
    running_with = used_tokens()  # its prompt and what it has decoded so far
    wait_for(lambda: used_tokens() > running_with, "the speculative request to decode")
    standard = threading.Thread(target=send, args=("standard", fast.standard_priority, 4))
    standard.start()
    standard.join(timeout=300)
    assert finished == ["standard"], f"the standard request should finish first; finished: {finished}"
    wait_for(lambda: loads()[0] == 1, "the speculative request to resume")
    resumed_with = used_tokens()
    wait_for(lambda: used_tokens() > resumed_with, "the resumed request to decode")  # an abort before it answers 0
    http_json(runtime.url + "/abort_request", {"rid": "spec"})
    speculative.join(timeout=300)
    runtime.check_alive()
    meta = answers["spec"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 2000
    assert answers["standard"]["meta_info"]["completion_tokens"] == 4
