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


class StreamedRequest:
    """A /generate request streamed in a thread: the test sees how many tokens it has decoded, chunk by
    chunk, as the runtime reports them, and waits on that rather than on the clock."""

    def __init__(self, url: str, body: dict):
        self.chunks: list[dict] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._stream, args=(url, {**body, "stream": True}))
        self._thread.start()

    def _stream(self, url: str, body: dict) -> None:
        import json

        import requests

        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                payload = line.removeprefix(b"data:").strip()
                if not payload or payload == b"[DONE]":
                    continue
                with self._changed:
                    self.chunks.append(json.loads(payload))
                    self._changed.notify_all()

    def decoded(self) -> int:
        with self._changed:
            return self.chunks[-1]["meta_info"]["completion_tokens"] if self.chunks else 0

    def wait_decoded(self, tokens: int) -> None:
        with self._changed:
            reached = self._changed.wait_for(lambda: self.decoded() >= tokens or not self._thread.is_alive(),
                                             timeout=300)
        assert reached and self.decoded() >= tokens, f"the request decoded {self.decoded()} of {tokens} tokens"

    def answer(self) -> dict:
        self._thread.join(timeout=300)
        assert not self._thread.is_alive(), "the request did not end"
        return self.chunks[-1]


def test_an_aborted_request_returns_its_partial_text(tiny_runtime):
    client = HttpSpeculationClient(tiny_runtime)
    request = StreamedRequest(tiny_runtime.url, {
        "rid": "spec-abort-test", "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0.8}})
    request.wait_decoded(4)
    client.abort("spec-abort-test")
    answer = request.answer()
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", "the abort stops the request"
    assert 4 <= meta["completion_tokens"] < 1500 and answer["text"], "the tokens generated so far come back"
    client.abort("spec-abort-test")  # aborting a finished request is a no-op


def test_a_standard_request_preempts_a_speculative_one(priority_runtime):
    """On a runtime with FastTTS's priority scheduling and plugin, a standard request arriving while a
    speculative one holds the only running slot is served first; the speculative request is paused, not
    lost: it resumes and answers its partial text when aborted."""
    from sgl_tts.runtime.server import http_json

    runtime, fast = priority_runtime

    def body(rid, priority, max_new_tokens):
        return {"rid": rid, "text": "The answer is", "priority": priority,
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0}}

    # The speculative request is as long as the context: it cannot finish while the test runs.
    speculative = StreamedRequest(runtime.url, body("spec", fast.speculative_priority, 2000))
    speculative.wait_decoded(2)
    standard = http_json(runtime.url + "/generate", body("standard", fast.standard_priority, 4))
    assert standard["meta_info"]["completion_tokens"] == 4
    paused_at = speculative.decoded()
    assert speculative.chunks[-1]["meta_info"]["finish_reason"] is None, "the standard request answers first"
    # Tokens past those seen when the standard request answered were decoded after it: the speculative request
    # is back in the running batch (a few chunks may still have been on their way when it answered).
    speculative.wait_decoded(paused_at + 8)
    http_json(runtime.url + "/abort_request", {"rid": "spec"})
    meta = speculative.answer()["meta_info"]
    runtime.check_alive()
    assert meta["finish_reason"]["type"] == "abort"
    assert paused_at + 8 <= meta["completion_tokens"] < 2000


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
