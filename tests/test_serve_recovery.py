"""`sgl-tts serve` when its generator runtime is killed mid-search under load: every search in flight is answered
(503 with Retry-After, none left hanging), `/health` is 503 while the runtime is down, the supervisor restarts it,
and the server answers searches again. One tiny random-weight runtime, the likelihood scorer (no second one)."""

import os
import signal
import threading
import time

import httpx
import pytest

from sgl_tts.runtime.server import RuntimeConfig, group_members, http_json
from sgl_tts.scoring.scorer_config import ScorerConfig
from sgl_tts.search.api import SearchConfig

pytestmark = pytest.mark.runtime

# Self-consistency: one long request per sample, in flight the whole search (random weights rarely stop).
LONG = {"model": "self_consistency", "n": 2, "max_tokens": 1500, "temperature": 1.0,
        "messages": [{"role": "user", "content": "Count to a thousand."}]}
SHORT = {"model": "self_consistency", "n": 1, "max_tokens": 8, "messages": [{"role": "user", "content": "2 + 3?"}]}


def wait_until(predicate, timeout=600.0, what="state"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.05)


def running_requests(url):
    try:
        (rank,) = http_json(url + "/v1/loads", timeout=10)["loads"]
    except OSError:
        return 0
    return rank["num_running_reqs"] + rank["num_waiting_reqs"]


def test_a_runtime_killed_mid_search_answers_503_then_the_server_recovers(tmp_path):
    from sgl_tts.app.session import RunConfig, Session
    from sgl_tts.serve.app import create_app
    from sgl_tts.serve.health import Supervisor
    from sgl_tts.serve.main import HTTPServer, session_service

    config = RunConfig(generator=RuntimeConfig(model="tiny-random", max_total_tokens=8192, startup_timeout_s=1800),
                       scorer=ScorerConfig(kind="likelihood"),
                       search=SearchConfig(program="self_consistency", n=2, max_tokens=64),
                       concurrency=8, log_dir=str(tmp_path))
    with Session(config) as session:
        supervisor = Supervisor(lambda: session.runtimes, session.restart, interval_s=0.2, backoff_s=0.5).start()
        service = session_service(session, health=supervisor)
        http = HTTPServer(create_app(service)).start()
        timeline = {}
        try:
            old = session.runtimes["generator"]
            replies = [None] * 4

            def ask(index):
                replies[index] = httpx.post(http.url + "/v1/chat/completions", json=LONG, timeout=600)

            clients = [threading.Thread(target=ask, args=(i,)) for i in range(len(replies))]
            for client in clients:
                client.start()
            wait_until(lambda: running_requests(old.url) >= 4, what="the searches' requests on the runtime")
            began = time.monotonic()
            os.killpg(old.process.pid, signal.SIGKILL)  # the runtime's whole process group, as the OOM killer would
            for client in clients:
                client.join(timeout=600)
            timeline["all answered"] = time.monotonic() - began
            assert all(r is not None for r in replies), "every search in flight got an answer"
            for reply in replies:
                assert reply.status_code == 503, reply.text
                assert reply.headers.get("retry-after") and reply.json()["error"]["type"]
            # SIGKILL is delivered at once, but the kernel reaps the group's processes one by one
            wait_until(lambda: not group_members(old.process.pid), what="nothing of the killed runtime left")

            states = []

            def health_ok():
                response = httpx.get(http.url + "/health", timeout=30)
                states.append(response.status_code)
                return response.status_code == 200 and session.runtimes["generator"] is not old

            wait_until(health_ok, what="the restarted runtime")
            timeline["health ok"] = time.monotonic() - began
            assert 503 in states or supervisor.restarts == 1, "the restart was seen: /health 503, or done at once"
            assert supervisor.restarts == 1 and session.runtimes["generator"].alive()
            reply = httpx.post(http.url + "/v1/chat/completions", json=SHORT, timeout=600)
            timeline["first search answered"] = time.monotonic() - began
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] is not None
            snapshot = service.snapshot()
            assert snapshot["in_flight"] == 0 and snapshot["completed"] >= 1
        finally:
            print("recovery timeline (s after the kill):", {k: round(v, 1) for k, v in timeline.items()})
            http.stop()
            supervisor.stop()
            service.close()
