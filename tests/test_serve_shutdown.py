"""`sgl-tts serve` shutting down with searches in flight: every client answered, the runtimes stopped, no process
left, within 10 s of SIGTERM. Fast tests on the scripted backend (a search blocked in a scorer call that only a
runtime's stop releases); runtime tests start `sgl-tts serve` on the tiny random-weight model as a subprocess."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from sgl_tts.runtime import zygote
from sgl_tts.runtime.server import CPU_LAUNCHER, SGLANG_LAUNCHER, WATCHDOG_GRACE_S, group_members, http_json
from sgl_tts.search.api import Runtimes
from sgl_tts.serve.app import create_app
from sgl_tts.serve.main import HTTPServer, ShutdownBounds, shut_down, shutdown_signals, wait_for_signal
from sgl_tts.serve.service import SearchService
from sgl_tts.testing import ScriptedBackend, ScriptedScorer
from tests.test_serve import DEFAULTS, ask, prompt, wait_until

ROOT = Path(__file__).resolve().parents[1]
SGL_TTS = (sys.executable, "-m", "sgl_tts.cli")  # the `sgl-tts` command


class BlockedScorer(ScriptedScorer):
    """Every scoring call blocks, as on a runtime that does not answer, until `release` is set; then it fails
    the way a call to a stopped runtime does. `blocked` counts the calls waiting."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.blocked = 0

    def score_into(self, prompt, paths, counts):
        with self._lock:
            self.blocked += 1
        assert self.release.wait(timeout=120), "test never released the scorer"
        with self._lock:
            self.blocked -= 1
        raise ConnectionRefusedError("the runtime is stopped")


class Client(threading.Thread):
    """One chat completion on a thread of its own; once answered, its `status` and `answer` (the JSON body, or
    a stream's last event before [DONE]), and a stream's SSE data `lines`."""

    def __init__(self, url, stream, **fields):
        super().__init__(daemon=True)
        self.url, self.stream = url, stream
        self.body = {"model": "best_of_n", "n": 2, "messages": ask(), "stream": stream, **fields}
        self.started = threading.Event()  # the stream's first event (start) arrived
        self.status, self.lines, self.answer = None, [], None

    def run(self):
        with httpx.Client(timeout=600) as client:
            if not self.stream:
                response = client.post(self.url + "/v1/chat/completions", json=self.body)
                self.status, self.answer = response.status_code, response.json()
                return
            with client.stream("POST", self.url + "/v1/chat/completions", json=self.body) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line.removeprefix("data: "))
                        self.started.set()
            self.answer = json.loads(self.lines[-2]) if len(self.lines) >= 2 else None


def assert_answered_shutting_down(client):
    """`client` got the shutdown's answer: a 503 in the OpenAI error shape, or in a stream the error as its
    last event, then [DONE]."""
    assert not client.is_alive(), "the client is still waiting"
    if client.stream:
        assert client.status == 200 and client.lines[-1] == "[DONE]", client.lines
    else:
        assert client.status == 503, client.answer
    error = client.answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "shutting_down", error
    assert "shutting down" in error["message"]


@pytest.fixture
def blocked():
    """A server of two searches at once whose scorer blocks; the scorer is released at the end whatever
    happened."""
    scorer = BlockedScorer()
    service = SearchService(Runtimes(generator=ScriptedBackend(), scorer=scorer, prompt=prompt), DEFAULTS,
                            max_searches=2)
    http = HTTPServer(create_app(service)).start()
    yield scorer, service, http
    scorer.release.set()
    http.stop()
    service.close()


def start_blocked_searches(scorer, http):
    """A plain and a streamed client whose searches are both blocked in a scorer call."""
    clients = [Client(http.url, stream=False), Client(http.url, stream=True)]
    for client in clients:
        client.start()
    wait_until(lambda: scorer.blocked == 2)
    assert clients[1].started.is_set(), "the stream had begun"
    return clients


def test_shutting_down_answers_the_searches_in_flight_without_waiting_for_their_threads(blocked):
    scorer, service, http = blocked
    clients = start_blocked_searches(scorer, http)
    service.shut_down()
    for client in clients:
        client.join(timeout=60)
        assert_answered_shutting_down(client)
    assert scorer.blocked == 2 and len(service.jobs) == 2, "answered while their threads are still blocked"
    refused = httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "messages": ask()},
                         timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    assert service.join(timeout_s=0.1) is False, "a bounded wait returns while the threads are blocked"
    scorer.release.set()  # as the runtimes' stop does
    assert service.join(timeout_s=60)
    snapshot = service.snapshot()
    assert snapshot["cancelled"] == 2 and snapshot["failed"] == 0 and snapshot["rejected"] == 1, snapshot


class StoppedRuntime:
    """Stands in for a runtime: its stop releases the blocked scorer calls (they fail, as on a stopped
    server) and records what was still going on at that moment."""

    def __init__(self, scorer, service, http):
        self.name, self.scorer, self.service, self.http = "generator", scorer, service, http
        self.seen_at_stop = None

    def stop(self, grace_s):
        self.seen_at_stop = {"searches": len(self.service.jobs), "http": self.http.running(), "grace_s": grace_s}
        self.scorer.release.set()


class Watched:
    """A session or supervisor stand-in: `runtimes`, and whether `stop` was called."""

    def __init__(self, runtimes=None):
        self.runtimes, self.stopped = runtimes or {}, False

    def stop(self, timeout_s=None):
        self.stopped = True


def test_the_shutdown_stops_the_runtimes_before_waiting_for_search_threads_they_block(blocked):
    scorer, service, http = blocked
    clients = start_blocked_searches(scorer, http)
    runtime = StoppedRuntime(scorer, service, http)
    supervisor = Watched()
    bounds = ShutdownBounds(http_s=30, searches_s=0.1, runtime_grace_s=3, threads_s=60)
    shut_down(Watched({"generator": runtime}), supervisor, service, http, bounds)
    assert supervisor.stopped, "no restart while the runtimes are stopped"
    assert runtime.seen_at_stop == {"searches": 2, "http": False, "grace_s": 3}, \
        "the HTTP server ended, then the runtimes were stopped with the searches' threads still blocked"
    assert service.jobs == {} and service.snapshot()["cancelled"] == 2, "and then the threads ended"
    for client in clients:
        client.join(timeout=60)
        assert_answered_shutting_down(client)


def test_sigterm_ends_the_wait_and_the_handlers_are_restored_after():
    before = signal.getsignal(signal.SIGTERM)
    service = SearchService(Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=prompt), DEFAULTS,
                            max_searches=1)
    http = HTTPServer(create_app(service)).start()
    try:
        with shutdown_signals() as received:
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_signal(received, http)
            os.kill(os.getpid(), signal.SIGTERM)  # a second one during the shutdown is only noted
            wait_until(lambda: len(received) == 2)
        assert received == [signal.SIGTERM] * 2 and http.running()
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        http.stop()
        service.close()


# ---- runtime tier: `sgl-tts serve` as a subprocess on the tiny random-weight model ----

CONFIG = """\
generator:
  model: tiny-random
  device: cpu
  max_total_tokens: 16384
  startup_timeout_s: 1800
scorer:
  kind: likelihood
search:
  program: self_consistency
  n: 4
  max_tokens: 48
concurrency: 4
log_dir: {log_dir}
"""
# Self-consistency: one long request per sample, in flight the whole search (random weights rarely end).
LONG = {"model": "self_consistency", "n": 4, "max_tokens": 1500, "temperature": 1.0,
        "messages": [{"role": "user", "content": "Count to a thousand."}]}
SHUTDOWN_BOUND_S = 10.0  # SIGTERM to exit, with every runtime stopped


class Serve:
    """`sgl-tts serve` in a session of its own (its process group: the owner's), its output read on a thread."""

    def __init__(self, tmp_path):
        config = tmp_path / "serve.yaml"
        config.write_text(CONFIG.format(log_dir=tmp_path / "logs"))
        self.stderr = tmp_path / "serve.stderr"
        with open(self.stderr, "wb") as stderr:
            self.process = subprocess.Popen([*SGL_TTS, "serve", "--config", str(config), "--port", "0"], cwd=ROOT,
                                            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.printed: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.printed.append(line)
            self.lines.put(line)

    def wait_for_line(self, pattern, timeout=1800.0):
        """The first printed line matching `pattern` (a bound only so that a broken start fails the test)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                assert self.process.poll() is None, f"serve exited: {self.stderr.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "serve did not print the line in time"
                continue
            match = re.search(pattern, line)
            if match:
                return match

    def tree(self):
        """The serve process and every process under it, as (pid, start time) against pid reuse."""
        root = psutil.Process(self.process.pid)
        return [(p.pid, p.create_time()) for p in [root, *root.children(recursive=True)]]

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def alive(tree):
    """The processes of `tree` still running (zombies are dead)."""
    left = []
    for pid, started in tree:
        try:
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                left.append((pid, process.name()))
        except psutil.NoSuchProcess:
            pass
    return left


def kill_tree(tree):
    """Leave nothing behind whatever the test found."""
    for pid, _ in alive(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.runtime
def test_sigterm_with_searches_in_flight_answers_every_client_and_leaves_no_process(tmp_path):
    serve = Serve(tmp_path)
    tree = []
    try:
        generator = serve.wait_for_line(r"runtimes ready in .*generator (http://\S+)").group(1).rstrip(",")
        url = serve.wait_for_line(r"sgl-tts serve: (http://\S+)/v1").group(1)
        clients = [Client(url, stream=stream, **LONG) for stream in (False, True, True)]
        for client in clients:
            client.start()
        for client in clients[1:]:
            assert client.started.wait(timeout=600), "the stream did not begin"
        wait_until(lambda: httpx.get(url + "/health", timeout=60).json()["in_flight"] == len(clients), 600)
        wait_until(lambda: http_json(generator + "/v1/loads")["loads"][0]["num_running_reqs"] > 0, 600)
        tree = serve.tree()
        assert len(tree) >= 4, f"serve, the runtime's processes and its watchdog: {tree}"
        signalled = time.monotonic()
        serve.process.send_signal(signal.SIGTERM)
        code = serve.process.wait(timeout=600)
        exited_s = time.monotonic() - signalled
        print(f"SIGTERM to exit: {exited_s:.2f} s")
        assert code == 0, serve.stderr.read_text()[-3000:]
        assert exited_s < SHUTDOWN_BOUND_S, f"exited {exited_s:.1f} s after SIGTERM"
        assert alive(tree) == [], "nothing of the serve process's tree is left"
        for client in clients:
            client.join(timeout=60)
            assert_answered_shutting_down(client)
        assert any("SIGTERM: shutting down" in line for line in serve.printed)
    finally:
        serve.kill()
        kill_tree(tree)


@pytest.mark.runtime
def test_a_sigkill_of_the_owners_group_while_the_runtimes_start_leaves_no_sglang_process(tmp_path):
    serve = Serve(tmp_path)
    tree = []

    def starting_server():
        """The runtime's server once it has started a process of its own (its scheduler), else None."""
        assert serve.process.poll() is None, f"serve exited: {serve.stderr.read_text()[-3000:]}"
        for process in psutil.Process(serve.process.pid).children(recursive=True):  # or forked by its zygote
            try:
                command = " ".join(process.cmdline())
                if any(module in command for module in (CPU_LAUNCHER, SGLANG_LAUNCHER, zygote.MODULE)) \
                        and len(group_members(process.pid)) >= 2:  # the zygote leads no group: a server
                    return process.pid
            except psutil.NoSuchProcess:
                pass
        return None

    try:
        wait_until(lambda: starting_server() is not None, 600)
        server = starting_server()
        tree = serve.tree()
        assert not any("runtimes ready" in line for line in serve.printed), "still starting"
        runtime = [(pid, started) for pid, started in tree if pid != serve.process.pid]
        os.killpg(serve.process.pid, signal.SIGKILL)  # the owner's whole group: the runtimes are in their own
        serve.process.wait(timeout=60)
        wait_until(lambda: alive(runtime) == [], WATCHDOG_GRACE_S + 30)  # the watchdogs' poll, grace and SIGKILL
        assert group_members(server) == []
    finally:
        serve.kill()
        kill_tree(tree)
