"""`sgl-tts serve` on real SGLang runtimes: two tiny-random replicas behind SGLang's router, one session and
one HTTP server for the whole module."""

import threading
import time

import httpx
import openai
import pytest

from sgl_tts.runtime.server import RuntimeConfig, http_json
from sgl_tts.scoring.scorer_config import ScorerConfig
from sgl_tts.search.api import SearchConfig

pytestmark = pytest.mark.runtime

SMALL = {"n": 2, "beam_width": 2, "max_steps": 2, "max_step_tokens": 8, "max_tokens": 16}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from sgl_tts.app.session import RunConfig, Session
    from sgl_tts.serve.app import create_app
    from sgl_tts.serve.main import HTTPServer, session_service

    config = RunConfig(
        generator=RuntimeConfig(model="tiny-random", replicas=2, max_total_tokens=16384, startup_timeout_s=1800),
        scorer=ScorerConfig(kind="likelihood"),
        search=SearchConfig(program="beam_search", n=4, beam_width=2, max_steps=3, max_step_tokens=16, max_tokens=48),
        concurrency=32, log_dir=str(tmp_path_factory.mktemp("serve-logs")))
    with Session(config) as session:
        service = session_service(session)
        with HTTPServer(create_app(service)) as http:
            yield session, service, http
        service.close()


def loads(url):
    (rank,) = http_json(url + "/v1/loads")["loads"]
    return rank


def ask(http, question, **settings):
    client = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0, timeout=600)
    return client.chat.completions.create(model=settings.pop("model", "beam_search"),
                                          messages=[{"role": "user", "content": question}],
                                          extra_body=settings)


def test_a_completion_carries_the_search(served):
    session, _, http = served
    assert session.runtimes["generator"].url != session.runtimes["generator"].worker_urls[0], "behind the router"
    reply = ask(http, "What is 2 + 3?")
    extension = reply.model_extra["sgl_tts"]
    candidates = extension["candidates"]
    assert candidates and all(len(c["step_scores"]) == len(c["steps"]) for c in candidates)
    assert reply.choices[0].message.content in [c["text"] for c in candidates]
    assert reply.usage.completion_tokens >= sum(c["tokens"] for c in candidates), "pruned paths count too"
    assert 0 < reply.usage.prompt_tokens_details.cached_tokens <= reply.usage.prompt_tokens
    assert extension["timings"]["total_s"] >= extension["timings"]["generator_s"] > 0


def test_32_concurrent_requests_reach_both_replicas_and_are_all_answered(served):
    session, _, http = served
    workers = session.runtimes["generator"].worker_urls
    before = [loads(url)["total_prefill_uncached_tokens"] for url in workers]
    replies = [None] * 32

    def one(index):
        replies[index] = ask(http, f"What is {index} + {index}?", **SMALL)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(replies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None and r.choices[0].message.content is not None for r in replies)
    after = [loads(url)["total_prefill_uncached_tokens"] for url in workers]
    assert all(a > b for a, b in zip(after, before)), f"prefill tokens per replica {before} -> {after}"


def test_a_client_that_disconnects_leaves_no_request_running(served):
    session, service, http = served
    workers = session.runtimes["generator"].worker_urls
    aborted_before = service.snapshot()["aborted_requests"]
    # Self-consistency: one long request per sample, in flight the whole search (random weights rarely end).
    body = {"model": "self_consistency", "stream": True, "n": 4, "max_tokens": 1500, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Count to a thousand."}]}
    with httpx.stream("POST", http.url + "/v1/chat/completions", json=body, timeout=600) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a dropped line iterator closes the connection
        next(lines)  # the start event
        deadline = time.monotonic() + 600
        while sum(loads(url)["num_running_reqs"] + loads(url)["num_waiting_reqs"] for url in workers) < 1:
            assert time.monotonic() < deadline, "the search's requests never reached the runtime"
            time.sleep(0.05)
    deadline = time.monotonic() + 600
    while service.snapshot()["in_flight"]:
        assert time.monotonic() < deadline, "the cancelled search did not end"
        time.sleep(0.05)
    snapshot = service.snapshot()
    assert snapshot["cancelled"] == 1
    assert snapshot["aborted_requests"] > aborted_before, "the requests in flight were aborted, not finished"
    # /v1/loads reads a snapshot the scheduler publishes at prefill, when idle and every 15 decode steps; a
    # scheduler that went to sleep on idle may not have published its idle one yet, so wake it with a probe.
    for url in workers:
        http_json(url + "/generate", {"text": "probe", "sampling_params": {"max_new_tokens": 1}})
    deadline = time.monotonic() + 120
    while any(loads(url)["num_running_reqs"] + loads(url)["num_waiting_reqs"] for url in workers):
        assert time.monotonic() < deadline, [loads(url) for url in workers]
        time.sleep(0.05)
