"""`sgl-tts serve` when runtimes fail, on the scripted backend: /health per runtime, 503 + Retry-After for a
search a dead runtime failed and while one is down, the supervisor's bounded restarts with backoff, /metrics."""

import logging
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sgl_tts.runtime.server import RuntimeDiedError
from sgl_tts.serve.app import create_app
from sgl_tts.serve.health import Supervisor
from sgl_tts.serve.main import HTTPServer
from sgl_tts.serve.service import SearchService
from sgl_tts.testing import ScriptedBackend
from tests.test_serve import DEFAULTS, ask, scripted_runtimes, wait_until


class FakeRuntime:
    """A runtime whose liveness the test sets."""

    def __init__(self, name):
        self.name, self.up = name, True

    def alive(self):
        return self.up


class FakeReplicaSet:
    """A replica set whose liveness the test sets; `restart_replica` replaces a replica by a live one, after
    failing as often as `failing_starts` says."""

    def __init__(self, name, replicas=2, failing_starts=0):
        self.name = name
        self.workers = [FakeRuntime(f"{name}-{i}") for i in range(replicas)]
        self.router = FakeRuntime(f"{name}-router")
        self.failing_starts = failing_starts
        self.restarted = []  # the index of each restart_replica call

    def restart_replica(self, index):
        self.restarted.append(index)
        if len(self.restarted) <= self.failing_starts:
            raise RuntimeError(f"start of {self.workers[index].name} failed ({len(self.restarted)})")
        self.workers[index] = FakeRuntime(self.workers[index].name)


@pytest.fixture
def served():
    """A server over scripted runtimes, watched by a supervisor (not polling: the test drives it) of fake
    runtime processes: generator, scorer and a target replica set."""
    runtimes = {"generator": FakeRuntime("generator"), "scorer": FakeRuntime("scorer"), "target": FakeReplicaSet("target")}
    restarted = []
    supervisor = Supervisor(lambda: runtimes, restarted.append, sleep=lambda s: None)
    service = SearchService(scripted_runtimes(), DEFAULTS, max_searches=2, health=supervisor)
    http = HTTPServer(create_app(service)).start()
    yield runtimes, supervisor, service, http
    http.stop()
    service.close()


def test_health_reports_each_runtime_and_is_503_while_one_is_down(served):
    runtimes, supervisor, service, http = served
    up = httpx.get(http.url + "/health", timeout=60)
    assert up.status_code == 200, up.text
    assert up.json()["runtimes"] == {
        "generator": {"state": "up"}, "scorer": {"state": "up"},
        "target": {"state": "up", "router": "up", "replicas": {"target-0": "up", "target-1": "up"}, "down": []}}

    runtimes["target"].workers[1].up = False  # the router routes around one dead replica: still up, named
    one_replica = httpx.get(http.url + "/health", timeout=60)
    assert one_replica.status_code == 200
    assert one_replica.json()["runtimes"]["target"] == {
        "state": "up", "router": "up", "replicas": {"target-0": "up", "target-1": "down"}, "down": ["target-1"]}

    runtimes["scorer"].up = False
    down = httpx.get(http.url + "/health", timeout=60)
    assert down.status_code == 503 and down.headers["Retry-After"] == "5"
    body = down.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "'scorer' is down" in body["error"]["message"] and body["error"]["code"] == "runtime_unavailable"
    assert body["runtimes"]["scorer"] == {"state": "down"} and body["runtimes"]["generator"] == {"state": "up"}

    # A search submitted while a runtime is down is refused at once, not started.
    refused = httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "n": 2, "messages": ask()},
                         timeout=60)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
    assert "runtime 'scorer' is down" in refused.json()["error"]["message"]
    assert service.snapshot()["in_flight"] == 0 and service.snapshot()["completed"] == 0

    runtimes["target"].workers[0].up = False  # no replica left: the set is down too
    assert httpx.get(http.url + "/health", timeout=60).json()["runtimes"]["target"]["state"] == "down"


class DyingBackend(ScriptedBackend):
    """Its runtime dies at the first generation request."""

    def generate(self, s, sampling_params):
        raise RuntimeDiedError("runtime 'generator' at http://127.0.0.1:1 exited with code -9")


def test_a_search_a_dead_runtime_failed_is_503_with_retry_after_and_logged_with_its_id(caplog):
    service = SearchService(scripted_runtimes(DyingBackend()), DEFAULTS, max_searches=1)
    http = HTTPServer(create_app(service)).start()
    try:
        with caplog.at_level(logging.INFO, logger="sgl_tts.serve"):
            answer = httpx.post(http.url + "/v1/chat/completions", json={"model": "beam_search", "messages": ask()},
                                timeout=60)
            assert answer.status_code == 503, answer.text
            assert answer.headers["Retry-After"] == "5"
            error = answer.json()["error"]
            assert error["code"] == "runtime_unavailable" and "exited with code -9" in error["message"]
            (search_id,) = [record.args[0] for record in caplog.records if record.getMessage().startswith("search ")]
            assert f"search {search_id} " in error["message"]
            failure = next(r for r in caplog.records if r.levelno == logging.ERROR and search_id in r.getMessage())
            assert "exited with code -9" in failure.getMessage()
            access = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/chat/completions")]
            assert access == [f"POST /v1/chat/completions 503 {access[0].split()[3]} s search={search_id}"]
        assert service.snapshot()["failed"] == 1
    finally:
        http.stop()
        service.close()


def test_the_supervisor_restarts_a_dead_runtime_with_exponential_backoff(caplog):
    runtimes = {"generator": FakeRuntime("generator"), "scorer": FakeRuntime("scorer")}
    sleeps, calls = [], []

    def restart(name):
        calls.append(name)
        if len(calls) < 3:
            raise RuntimeError(f"start of {name} failed ({len(calls)})")
        runtimes[name] = FakeRuntime(name)  # the session's restart replaces the runtime

    supervisor = Supervisor(lambda: runtimes, restart, attempts=5, backoff_s=1.0, max_backoff_s=30.0,
                            sleep=sleeps.append)
    supervisor.check()
    assert calls == [] and supervisor.down() == [], "nothing to restart while all are up"
    runtimes["scorer"].up = False
    with caplog.at_level(logging.INFO, logger="sgl_tts.serve"):
        supervisor.check()
    assert calls == ["scorer"] * 3 and sleeps == [1.0, 2.0]
    assert supervisor.down() == [] and supervisor.restarts == 1 and runtimes["scorer"].alive()
    attempts = [r.getMessage() for r in caplog.records if "restart attempt" in r.getMessage() and "is down" in r.getMessage()]
    assert attempts == [f"runtime 'scorer' is down: restart attempt {i} of 5" for i in (1, 2, 3)]


def test_the_supervisor_gives_up_after_its_attempts_and_the_runtime_stays_down():
    runtimes = {"generator": FakeRuntime("generator")}
    runtimes["generator"].up = False
    sleeps, calls = [], []

    def restart(name):
        calls.append(name)
        raise RuntimeError("no memory")

    supervisor = Supervisor(lambda: runtimes, restart, attempts=4, backoff_s=1.0, max_backoff_s=3.0,
                            sleep=sleeps.append)
    supervisor.check()
    assert len(calls) == 4 and sleeps == [1.0, 2.0, 3.0], "doubling, capped at max_backoff_s, none after the last"
    assert supervisor.health() == {"generator": {"state": "failed"}}
    supervisor.check()
    assert len(calls) == 4, "a runtime given up on is not retried at every look"


@pytest.fixture
def restart_under_way():
    """A polling supervisor whose generator has died and whose restart of it blocks until `release` is set (then
    a fresh runtime takes its place): (runtimes, supervisor, release)."""
    runtimes = {"generator": FakeRuntime("generator")}
    restarting, release = threading.Event(), threading.Event()

    def restart(name):
        restarting.set()
        assert release.wait(timeout=60)
        runtimes[name] = FakeRuntime(name)

    supervisor = Supervisor(lambda: runtimes, restart, interval_s=0.01).start()
    try:
        runtimes["generator"].up = False
        assert restarting.wait(timeout=60)
        yield runtimes, supervisor, release
    finally:
        release.set()
        supervisor.stop()


def test_the_supervisor_thread_restarts_what_dies_and_health_shows_restarting(restart_under_way):
    _, supervisor, release = restart_under_way
    assert supervisor.health()["generator"]["state"] == "restarting"
    release.set()
    wait_until(lambda: supervisor.restarts == 1)
    assert supervisor.down() == []


def test_the_supervisor_restarts_a_dead_replica_with_backoff_and_the_set_stays_up(caplog):
    target = FakeReplicaSet("target", replicas=3, failing_starts=2)
    runtimes = {"generator": FakeRuntime("generator"), "target": target}
    sleeps, restarted = [], []
    supervisor = Supervisor(lambda: runtimes, restarted.append, attempts=5, backoff_s=1.0, sleep=sleeps.append)
    target.workers[1].up = False
    with caplog.at_level(logging.INFO, logger="sgl_tts.serve"):
        supervisor.check()
    assert target.restarted == [1, 1, 1] and sleeps == [1.0, 2.0], "the dead replica, with doubling backoff"
    assert restarted == [], "the set is up: it is not restarted as a whole"
    assert target.workers[1].alive() and supervisor.restarts == 1
    assert supervisor.health()["target"] == {"state": "up", "router": "up", "down": [],
                                             "replicas": {"target-0": "up", "target-1": "up", "target-2": "up"}}
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "is down: restart attempt" in m] == [
        f"replica 'target-1' of runtime 'target' is down: restart attempt {i} of 5" for i in (1, 2, 3)]
    assert "replica 'target-1' of runtime 'target' restarted (attempt 3)" in messages


def test_a_replica_given_up_on_stays_failed_while_the_set_serves_and_a_set_restart_clears_it():
    target = FakeReplicaSet("target", failing_starts=10)
    runtimes = {"target": target}
    restarted = []

    def restart(name):
        restarted.append(name)
        runtimes[name] = FakeReplicaSet(name)

    supervisor = Supervisor(lambda: runtimes, restart, attempts=2, sleep=lambda s: None)
    target.workers[0].up = False
    supervisor.check()
    assert target.restarted == [0, 0] and restarted == []
    state = supervisor.health()["target"]
    assert state["state"] == "up" and state["replicas"] == {"target-0": "failed", "target-1": "up"}
    assert state["down"] == ["target-0"] and supervisor.down() == [], "the set serves on its live replica"
    supervisor.check()
    assert target.restarted == [0, 0], "a replica given up on is not retried at every look"

    target.workers[1].up = False  # no replica left: the set is down and restarted as a whole
    supervisor.check()
    assert restarted == ["target"] and supervisor.restarts == 1
    assert supervisor.health()["target"]["replicas"] == {"target-0": "up", "target-1": "up"}


def test_health_shows_a_replica_restarting_while_the_set_stays_up():
    target = FakeReplicaSet("target")
    restarting, release = threading.Event(), threading.Event()
    restart_replica = target.restart_replica

    def slow_restart(index):
        restarting.set()
        assert release.wait(timeout=60)
        restart_replica(index)

    target.restart_replica = slow_restart
    supervisor = Supervisor(lambda: {"target": target}, lambda name: None, interval_s=0.01).start()
    try:
        target.workers[0].up = False
        assert restarting.wait(timeout=60)
        state = supervisor.health()["target"]
        assert state["state"] == "up" and state["replicas"] == {"target-0": "restarting", "target-1": "up"}
        assert supervisor.down() == []
        release.set()
        wait_until(lambda: supervisor.restarts == 1)
        assert supervisor.health()["target"]["replicas"] == {"target-0": "up", "target-1": "up"}
        assert target.restarted == [0]
    finally:
        release.set()
        supervisor.stop()


def metrics(http):
    answer = httpx.get(http.url + "/metrics", timeout=60)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {sample.name + repr(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(answer.text) for sample in family.samples}


def test_metrics_are_prometheus_text_and_move_with_requests(served):
    runtimes, supervisor, service, http = served
    before = metrics(http)
    assert before["sgl_tts_searches_total[('outcome', 'completed')]"] == 0
    assert before["sgl_tts_searches_running[]"] == 0 and before["sgl_tts_searches_queued[]"] == 0
    assert before["sgl_tts_runtime_up[('runtime', 'scorer')]"] == 1
    reply = httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "n": 2, "messages": ask()},
                       timeout=60).json()
    assert httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "n": 0, "messages": ask()},
                      timeout=60).status_code == 400
    assert httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "n": 10**6, "messages": ask()},
                      timeout=60).status_code == 400
    runtimes["scorer"].up = False
    assert httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "messages": ask()},
                      timeout=60).status_code == 503
    after = metrics(http)
    assert after["sgl_tts_searches_total[('outcome', 'completed')]"] == 1
    assert after["sgl_tts_search_latency_seconds_count[]"] == 1
    assert after["sgl_tts_generated_tokens_total[]"] == reply["usage"]["completion_tokens"] > 0
    assert after["sgl_tts_cached_tokens_total[]"] == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after["sgl_tts_requests_refused_total[('reason', 'bad_request')]"] == 1
    assert after["sgl_tts_requests_refused_total[('reason', 'limits')]"] == 1
    assert after["sgl_tts_requests_refused_total[('reason', 'unavailable')]"] == 1
    assert after["sgl_tts_runtime_up[('runtime', 'scorer')]"] == 0
    timings = reply["sgl_tts"]["timings"]
    share = timings["verifier_s"] / timings["total_s"] if timings["total_s"] else 0.0
    assert after["sgl_tts_verifier_time_share[]"] == pytest.approx(share)


def test_stopping_the_supervisor_waits_for_a_restart_under_way_no_longer_than_asked(restart_under_way):
    _, supervisor, release = restart_under_way
    supervisor.stop(timeout_s=0.05)
    assert not release.is_set() and supervisor._thread.is_alive(), "returned with the restart still blocked"
    release.set()
    supervisor.stop()
    assert not supervisor._thread.is_alive()
