"""`sgl-tts serve` on real SGLang runtimes: two tiny-random replicas behind SGLang's router, one session and
one HTTP server for the whole module. The last test kills a replica: the router answers from the live one, and
`restart_replica` brings the dead one back on its port, routed to again."""

import itertools
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from sgl_tts.runtime.http_client import RuntimeHTTPError
from sgl_tts.runtime.replicas import router_workers
from sgl_tts.runtime.server import RuntimeConfig, abort_requests, http_json
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
    # the usage counts the whole search: every path, pruned ones too, not one path (a candidate's tokens include its
    # ancestors', which its siblings share, so the candidates' sum may exceed the search's own count)
    assert reply.usage.completion_tokens > max(c["tokens"] for c in candidates), "the other paths count too"
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
        # the search's own in-flight set, not /v1/loads (a snapshot that may still show the last test's requests);
        # all n samples, not the fork's prompt pre-send alone: that one ends at once, and a cancel that came then
        # would refuse the samples before any was sent, with nothing left to abort
        deadline = time.monotonic() + 600
        while not any(job.context is not None and len(job.context.in_flight()) >= body["n"]
                      for job in list(service.jobs.values())):
            assert time.monotonic() < deadline, "the search's requests were never sent"
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


# --- last: one replica dies ---------------------------------------------------------------------------------

PROMPT = "A replica set keeps serving when one of its servers dies. "  # the prefix every request here shares


def generate(url, text, rid=None, **sampling):
    """Generate from `text` (2 tokens unless `sampling` says otherwise), as request `rid` when given."""
    payload = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0, **sampling}}
    return http_json(url + "/generate", {**payload, **({"rid": rid} if rid else {})}, timeout=600)


def prefilled(url):
    """Prompt tokens the server at `url` has prefilled (it grows with each request the server serves)."""
    return loads(url)["total_prefill_uncached_tokens"]


def wait_for(predicate, timeout=300.0):
    """Wait for a state (not a fixed time): poll `predicate` until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "state not reached in time"
        time.sleep(0.05)


def long_request(url, rid):
    """A request that runs until aborted (its answer, cut short, is not looked at)."""
    try:
        generate(url, "Count to a thousand.", rid=rid, max_new_tokens=2000, ignore_eos=True)
    except OSError:
        pass


def serving_replica(replicas, text):
    """The index of the replica the router sends `text` to."""
    before = [prefilled(worker.url) for worker in replicas.workers]
    generate(replicas.url, text)
    after = [prefilled(worker.url) for worker in replicas.workers]
    (index,) = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
    return index


def test_last_a_replica_set_serves_on_its_live_replica_and_restarts_a_dead_one(served):
    """Last in the module: it kills one of the module's replicas (and brings it back)."""
    session, _, _ = served
    replicas = session.runtimes["generator"]
    victim = replicas.workers[serving_replica(replicas, PROMPT + "0")]
    index, survivor = replicas.workers.index(victim), next(w for w in replicas.workers if w is not victim)

    # The replica the router sends this prefix to dies.
    os.killpg(victim.process.pid, signal.SIGKILL)
    victim.process.wait(timeout=60)
    assert not victim.alive() and survivor.alive() and replicas.router.alive()

    # The router keeps the dead worker in rotation until its circuit breaker opens: until then a request
    # routed there is an error answer (500) naming the dead worker; then the live replica answers them all.
    failures, in_a_row, deadline = [], 0, time.monotonic() + 600
    for k in itertools.count(1):
        assert time.monotonic() < deadline, f"the router did not route around the dead replica: {failures}"
        try:
            generate(replicas.url, PROMPT + str(k))
            in_a_row += 1
            if in_a_row == 3:
                break
        except RuntimeHTTPError as exc:
            assert exc.status == 500 and victim.url in str(exc), exc
            failures.append(str(exc))
            in_a_row = 0
    print(f"requests that failed before the router routed around the dead replica: {len(failures)}")

    began = time.monotonic()
    restarted = replicas.restart_replica(index)
    print(f"replica restarted and routed to in {time.monotonic() - began:.1f} s")
    assert replicas.workers[index] is restarted and restarted.port == victim.port and restarted.alive()
    assert (victim.log_path.parent / f"{victim.log_path.stem}.1.log").exists(), "the dead replica's log is kept"
    assert http_json(restarted.url + "/get_model_info", timeout=60)["model_path"] == victim.model_path
    listed = router_workers(replicas.url)
    assert set(listed) == {survivor.url, restarted.url} and listed[restarted.url]["is_healthy"], listed

    # The router routes to the restarted replica again. It sends a prompt that matches no cached prefix to
    # the replica with the fewest requests in flight, ties broken in its own worker order (which need not put
    # the restarted one first), so of two such prompts, the second sent while the first runs, one reaches
    # the restarted replica.
    baseline = prefilled(restarted.url)
    prefilled_before = sum(prefilled(worker.url) for worker in replicas.workers)
    long = threading.Thread(target=long_request, args=(replicas.url, "long"))
    long.start()
    try:
        # running: prefilled on a replica (a prefill publishes a fresh snapshot; SGLang computes at least the
        # prompt's last token), not a running count, which may be the survivor's stale one
        wait_for(lambda: sum(prefilled(worker.url) for worker in replicas.workers) > prefilled_before)
        generate(replicas.url, "What is the capital of France?")
        wait_for(lambda: prefilled(restarted.url) > baseline)
    finally:
        abort_requests(replicas, ["long"])
        long.join(timeout=300)
    assert replicas.alive()
