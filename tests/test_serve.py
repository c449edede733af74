"""`sgl-tts serve` on the scripted backend (no SGLang runtime): the OpenAI format, validation, the key, the
bound, streaming, cancellation, chats through the tokenizer's chat template; checked against the same program
run directly."""

import dataclasses
import json
import threading
import time

import httpx

from policies.base import decode_rid
import openai
import pytest

from sgl_tts.problems import Problem
from sgl_tts.runtime.server import RuntimeConfig, share_cpu_cores
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.programs import load_program, program_names
from sgl_tts.serve.app import create_app
from sgl_tts.serve.main import HTTPServer
from sgl_tts.serve.protocol import selected_candidate
from sgl_tts.serve.service import SearchService
from sgl_tts.search.context import SearchCancelled
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

DEFAULTS = SearchConfig(program="beam_search", n=4, beam_width=2, max_steps=4, max_tokens=8_000)
KEY = "test-key"


def prompt(question):
    return f"Q: {question}\n\n"


def scripted_runtimes(backend=None, prompt=prompt):
    return Runtimes(generator=backend or ScriptedBackend(), scorer=ScriptedScorer(), prompt=prompt)


def direct(program, question, search, prompt=prompt):
    """The reference: the same program on a fresh scripted backend, without the server."""
    problem = Problem(id="direct", question=question, gold=None)
    return load_program(program)(problem, search, scripted_runtimes(prompt=prompt))


class GatedBackend(ScriptedBackend):
    """Every request, once its rid is assigned (in flight), waits until `release` is set; `entered` tells that
    one is waiting."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def request_fields(self, s):
        fields = super().request_fields(s)
        self.entered.set()
        assert self.release.wait(timeout=60), "test never released the backend"
        return fields


def start_server(backend=None, max_searches=8, api_key=None):
    service = SearchService(scripted_runtimes(backend), DEFAULTS, max_searches=max_searches)
    return service, HTTPServer(create_app(service, api_key)).start()


@pytest.fixture(scope="module")
def server():
    service, http = start_server(max_searches=32, api_key=KEY)
    yield service, http
    http.stop()
    service.close()


def client(http, key=KEY, **kwargs):
    return openai.OpenAI(base_url=http.url + "/v1", api_key=key, max_retries=0, **kwargs)


def test_models_lists_the_registered_programs(server):
    _, http = server
    assert sorted(m.id for m in client(http).models.list()) == program_names()


@pytest.mark.parametrize("program,settings", [("beam_search", {"n": 4, "beam_width": 2}),
                                              ("best_of_n", {"n": 3, "temperature": 0.5}),
                                              ("dvts", {"n": 4, "beam_width": 2, "max_steps": 3})])
def test_completion_is_the_search_result(server, program, settings):
    _, http = server
    question = f"completion {program}?"
    reply = client(http).chat.completions.create(model=program, messages=[{"role": "user", "content": question}],
                                                 extra_body={k: v for k, v in settings.items() if k != "n"},
                                                 n=settings["n"])
    expected = direct(program, question, SearchConfig(**{**vars(DEFAULTS), "program": program, **settings}))
    assert reply.model == program and len(reply.choices) == 1
    assert reply.choices[0].message.content == selected_candidate(expected).text
    assert reply.usage.completion_tokens == expected.generated_tokens
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == expected.cached_tokens
    extension = reply.model_extra["sgl_tts"]
    assert extension["answer"] == expected.answer
    assert [c["text"] for c in extension["candidates"]] == [c.text for c in expected.candidates]
    assert [c["step_scores"] for c in extension["candidates"]] == [c.step_scores for c in expected.candidates]
    assert extension["search"]["n"] == settings["n"] and extension["search"]["program"] == program
    assert set(extension["timings"]) == {"total_s", "generator_s", "verifier_s"}


@pytest.mark.parametrize("body,field", [
    ({"model": "no_such_program"}, "no_such_program"),
    ({"model": "../programs/beam_search.py"}, "beam_search.py"),
    ({"model": "beam_search", "n": 0}, "n must be at least 1"),
    ({"model": "beam_search", "n": "four"}, "'n'"),
    ({"model": "beam_search", "temperature": -1}, "temperature"),
    ({"model": "beam_search", "beam_widht": 2}, "beam_widht"),
    ({"model": "beam_search", "program": "dvts"}, "program"),
    ({"model": "beam_search", "messages": []}, "messages"),
    ({"model": "beam_search", "messages": [{"role": "assistant", "content": "x"}]}, "role 'user'"),
    ({"model": "rsd", "settings": {"delta": 2}}, "settings: delta must be in [0, 1]"),
    ({"model": "rsd", "settings": {"omega": 1}}, "unknown key 'settings.omega'"),
    ({"model": "beam_search", "settings": {"delta": 0.5}}, "program 'beam_search' takes no settings"),
])
def test_bad_requests_are_400_naming_the_field(server, body, field):
    _, http = server
    body = {"messages": [{"role": "user", "content": "q"}], **body}
    answer = httpx.post(http.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"]["message"]


def test_a_requests_program_settings_override_the_servers_key_by_key():
    from programs.rsd import Settings

    defaults = SearchConfig(program="rsd", settings=Settings(weighting="logistic", delta=0.6))
    service = SearchService(scripted_runtimes(), defaults, max_searches=1)
    try:
        assert service.search_config("rsd", {"settings": {"delta": 0.3}}).settings == Settings(
            weighting="logistic", delta=0.3)
        assert service.search_config("rsd", {}).settings == defaults.settings
        assert service.search_config("beam_search", {"n": 2}).settings is None, "rsd's settings are not beam's"
    finally:
        service.close()


def test_bad_n_through_the_openai_client(server):
    _, http = server
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client(http).chat.completions.create(model="beam_search", n=0, messages=[{"role": "user", "content": "q"}])
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client(http).chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "q"}])


def test_the_key_is_checked_on_every_route_but_health(server):
    _, http = server
    with pytest.raises(openai.AuthenticationError):
        client(http, key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        client(http, key="wrong").chat.completions.create(model="beam_search", messages=[{"role": "user", "content": "q"}])
    assert httpx.post(http.url + "/v1/chat/completions", json={}).status_code == 401
    assert httpx.get(http.url + "/health").json()["status"] == "ok"


def test_streamed_progress_then_the_answer_in_chunk_format(server):
    _, http = server
    question = "streamed?"
    stream = client(http).chat.completions.create(model="beam_search", messages=[{"role": "user", "content": question}],
                                                  stream=True, stream_options={"include_usage": True})
    *chunks, usage_chunk = list(stream)
    events = [c.model_extra.get("sgl_tts", {}).get("event") for c in chunks]
    expected = direct("beam_search", question, DEFAULTS)
    assert events[0] == "start" and events[-1] == "finish"
    progress = [c.model_extra["sgl_tts"] for c in chunks if events[chunks.index(c)] == "progress"]
    assert [p["iteration"] for p in progress] == list(range(1, expected.verifier_calls + 1))
    assert all(0 <= p["best_score"] < 1 and p["paths"] >= 1 for p in progress)
    assert progress[-1]["generated_tokens"] == expected.generated_tokens
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == selected_candidate(expected).text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage is None
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == expected.generated_tokens, \
        "with include_usage the usage comes last, in a chunk without choices"


def test_concurrent_requests_are_all_answered(server):
    _, http = server
    questions = [f"concurrent {i}?" for i in range(32)]
    replies = [None] * len(questions)

    def ask(index):
        replies[index] = client(http).chat.completions.create(
            model="beam_search", messages=[{"role": "user", "content": questions[index]}])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for question, reply in zip(questions, replies):
        assert reply.choices[0].message.content == selected_candidate(direct("beam_search", question, DEFAULTS)).text


def test_past_the_bound_429_with_retry_after_and_health_stays_responsive():
    backend = GatedBackend()
    service, http = start_server(backend, max_searches=1)
    try:
        first = {}
        holder = threading.Thread(target=lambda: first.setdefault("reply", client(http, key="k").chat.completions.create(
            model="beam_search", messages=[{"role": "user", "content": "held"}])))
        holder.start()
        assert backend.entered.wait(timeout=300)
        health = httpx.get(http.url + "/health", timeout=60).json()  # answered while the search is held open
        assert health["in_flight"] == 1 and health["max_searches"] == 1
        refused = httpx.post(http.url + "/v1/chat/completions", timeout=60,
                             json={"model": "beam_search", "messages": [{"role": "user", "content": "q"}]})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError):
            client(http, key="k").chat.completions.create(model="beam_search", messages=[{"role": "user", "content": "q"}])
        backend.release.set()
        holder.join(timeout=60)
        assert first["reply"].choices[0].message.content
        assert service.snapshot()["rejected"] == 2 and service.snapshot()["completed"] == 1
    finally:
        backend.release.set()
        http.stop()
        service.close()


def wait_until(predicate, timeout=60.0):
    """Wait for a state (not a fixed time): poll `predicate` until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "state not reached in time"
        time.sleep(0.01)


class AbortRecorder:
    """Stands in for the SGLang servers behind a router: records the /abort_request bodies it receives."""

    def __init__(self, servers=2):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.append((self.server.server_address[1], self.path, body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler) for _ in range(servers)]
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        self.url = "http://127.0.0.1:1"  # the router: never asked to abort
        self.worker_urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def close(self):
        for server in self.servers:
            server.shutdown()
            server.server_close()


def test_a_client_that_disconnects_cancels_its_search():
    backend = GatedBackend()
    backend.runtime = workers = AbortRecorder()
    service, http = start_server(backend, max_searches=1)
    try:
        with httpx.stream("POST", http.url + "/v1/chat/completions", timeout=300,
                          json={"model": "beam_search", "stream": True,
                                "messages": [{"role": "user", "content": "left"}]}) as response:
            lines = response.iter_lines()  # kept: a dropped line iterator closes the connection
            first = next(lines)
            assert json.loads(first.removeprefix("data: "))["sgl_tts"]["event"] == "start"
            assert backend.entered.wait(timeout=300)
            (job,) = service.jobs.values()
        wait_until(lambda: job.context.cancelled)  # the server saw the client go
        backend.release.set()
        with pytest.raises(SearchCancelled):
            job.future.result(timeout=60)
        wait_until(lambda: service.snapshot()["in_flight"] == 0)
        snapshot = service.snapshot()
        assert snapshot["cancelled"] == 1 and snapshot["completed"] == 0, snapshot
        # Only the first iteration's children (held at the gate when the client left) ever reached the backend.
        assert len(backend.requests) <= DEFAULTS.n
        # The requests in flight at the cancel were aborted by rid on every server behind the router.
        assert job.aborted.wait(timeout=60)
        aborted = {(port, body["rid"]) for port, path, body in workers.received if path == "/abort_request"}
        ports = {server.server_address[1] for server in workers.servers}
        assert aborted and {port for port, _ in aborted} == ports
        assert all(decode_rid(rid) is not None for _, rid in aborted), "the lineage rids the requests were sent with"
    finally:
        backend.release.set()
        http.stop()
        service.close()
        workers.close()


def test_the_search_context_tracks_the_lineage_rids_in_flight_and_refuses_after_cancel():
    from policies.base import decode_rid
    from sgl_tts.frontend.sglang_internals import bind_search
    from sgl_tts.search.api import Runtimes, SearchConfig

    class State:
        text_ = "Q: x\n\n"

        def __init__(self):
            self.variables = {}

    class Params:
        max_new_tokens, stop, return_logprob, top_logprobs_num = 5, ("\n\n",), None, None

    seen_in_flight = []

    class Watched(ScriptedBackend):
        def _generate(self, s, sampling_params):
            out = super()._generate(s, sampling_params)
            seen_in_flight.append(context.in_flight())  # still in flight while the backend answers
            return out

    shared = Watched()
    context = Runtimes(generator=shared, scorer=None, prompt=str).new_search(SearchConfig(), "p1")
    state = State()
    bind_search(state, context)
    shared.generate(state, Params())
    rids = [r["fields"]["rid"] for r in shared.requests]
    assert len(rids) == 1 and decode_rid(rids[0]).problem_id.startswith("p1/"), "the lineage rid is sent"
    assert seen_in_flight == [rids], "tracked while in flight"
    assert context.in_flight() == [] and context.wait_idle(0.0), "and no longer once answered"
    assert [r.completion_tokens for r in context.ledger.answered_requests()] == [
        context.ledger.completion_tokens], "answered into the search's ledger"
    assert context.cancel() == [] and context.cancelled
    cancelled = State()
    bind_search(cancelled, context)
    with pytest.raises(SearchCancelled):
        shared.generate(cancelled, Params())
    assert len(shared.requests) == 1, "a cancelled search sends nothing"
    other = State()  # a state of no search goes through the same shared backend untouched
    shared.generate(other, Params())
    assert len(shared.requests) == 2 and context.ledger.requests == 1


def test_replicas_count_in_the_core_split():
    two = share_cpu_cores({"generator": RuntimeConfig(replicas=2)}, cores=2)["generator"]
    assert (two.cpu_threads, two.data_parallel) == (1, 1) and "OMP_WAIT_POLICY" not in two.env, "a core a replica"
    four = share_cpu_cores({"generator": RuntimeConfig(replicas=2), "scorer": RuntimeConfig(max_total_tokens=8)},
                           cores=4)
    assert [(c.cpu_threads, c.data_parallel) for c in four.values()] == [(1, 2), (1, 1)]
    with pytest.raises(ValueError, match="replicas"):
        RuntimeConfig(replicas=0)


def test_replica_configs_and_the_router_command():
    from sgl_tts.runtime.replicas import replica_config, router_command

    gpu = RuntimeConfig(device="cuda", replicas=2, port=9000, extra_args=["--tp-size", "2"])
    assert [replica_config(gpu, i).extra_args[-2:] for i in range(2)] == [["--base-gpu-id", "0"], ["--base-gpu-id", "2"]]
    assert replica_config(gpu, 1).port is None and replica_config(gpu, 1).replicas == 1, "the router takes the port"
    placed = RuntimeConfig(device="cuda", replicas=2, extra_args=["--base-gpu-id", "4"])
    assert replica_config(placed, 1).extra_args == ["--base-gpu-id", "4"]
    placed_inline = RuntimeConfig(device="cuda", replicas=2, extra_args=["--base-gpu-id=4"])
    assert replica_config(placed_inline, 1).extra_args == ["--base-gpu-id=4"]
    for flags in (["--tp-size=4"], ["--tensor-parallel-size", "4"], ["--tp-size", "2", "--tensor-parallel-size=4"]):
        # the last value of either spelling, as SGLang's parser takes it
        config = RuntimeConfig(device="cuda", replicas=2, extra_args=flags)
        assert replica_config(config, 1).extra_args[-2:] == ["--base-gpu-id", "4"], flags
    assert replica_config(RuntimeConfig(replicas=2), 1).extra_args == [], "CPU replicas have no GPU ids"
    routed = RuntimeConfig(replicas=1, remote_workers=["http://10.0.0.2:30000"], router_args=["--policy", "round_robin"])
    assert routed.routed and not RuntimeConfig().routed
    command = router_command(routed, 8001, ["http://127.0.0.1:1", "http://10.0.0.2:30000"], 8002)
    assert command[command.index("--worker-urls") + 1:][:2] == ["http://127.0.0.1:1", "http://10.0.0.2:30000"]
    assert command[command.index("--prometheus-port") + 1] == "8002" and command[-2:] == ["--policy", "round_robin"]
    with pytest.raises(ValueError, match="remote_workers"):
        RuntimeConfig(remote_workers=["10.0.0.2:30000"])


def test_bench_arm_and_table(server):
    from sgl_tts.bench.serve import format_table, run_arm

    _, http = server
    row = run_arm(http.url + "/v1", "best_of_n", [f"bench {i}?" for i in range(6)], clients=3, api_key=KEY)
    assert row["errors"] == 0 and row["requests_per_s"] > 0 and row["p99_s"] >= row["p50_s"] > 0
    expected_tokens = sum(direct("best_of_n", f"bench {i}?", dataclasses.replace(DEFAULTS, program="best_of_n"))
                          .generated_tokens for i in range(6))
    assert row["generated_tokens"] == expected_tokens > 0
    refused = run_arm(http.url + "/v1", "best_of_n", ["q"], clients=1, api_key="wrong")
    assert refused["errors"] == 1 and refused["requests_per_s"] == 0
    rows = {(1, "sequential"): [dict(row, requests_per_s=1.0), dict(row, requests_per_s=3.0)],
            (1, "concurrent"): [dict(row, requests_per_s=4.0)], (2, "concurrent"): [dict(row, requests_per_s=6.0)]}
    table = format_table(rows).splitlines()
    assert [line.split()[:2] for line in table[1:]] == [["1", "sequential"], ["1", "concurrent"], ["2", "concurrent"]]
    assert [line.split()[-1] for line in table[1:]] == ["1.00x", "2.00x", "3.00x"], "ratios to the median baseline"


def test_closing_the_service_cancels_the_searches_in_flight():
    backend = GatedBackend()
    service = SearchService(scripted_runtimes(backend), DEFAULTS, max_searches=2)
    job = service.submit("beam_search", DEFAULTS, "closing")
    assert backend.entered.wait(timeout=300)
    closer = threading.Thread(target=service.close)
    closer.start()
    wait_until(lambda: job.context.cancelled)
    backend.release.set()
    closer.join(timeout=60)
    assert not closer.is_alive() and service.snapshot()["cancelled"] == 1
    with pytest.raises(SearchCancelled):
        job.future.result(timeout=0)


# ---- bad requests, table-driven: status, the field named, the OpenAI error shape; the server answers on ----

CONTEXT_TOKENS = 9_000  # the bounded server's generator context (scripted prompt tokens are its characters)


@pytest.fixture(scope="module")
def bounded():
    service = SearchService(scripted_runtimes(), DEFAULTS, max_searches=4, prompt_tokens=len,
                            context_tokens=CONTEXT_TOKENS)
    http = HTTPServer(create_app(service)).start()
    yield service, http
    http.stop()
    service.close()


def ask(text="What is 2 + 2?"):
    return [{"role": "user", "content": text}]


def chat(**fields):
    return json.dumps({"model": "beam_search", "messages": ask(), **fields})


REFUSED = [  # (case, method, path, raw body, status, param, words of the message)
    ("NaN temperature", "POST", "/v1/chat/completions", chat().replace('"model"', '"temperature": NaN, "model"'),
     400, "temperature", "finite number, got nan"),
    ("Infinity top_p", "POST", "/v1/chat/completions", chat().replace('"model"', '"top_p": Infinity, "model"'),
     400, "top_p", "finite number, got inf"),
    ("huge n", "POST", "/v1/chat/completions", chat(n=1000), 400, "n", "'n' is 1000, above the limit 256 (limits.n)"),
    ("n = 10^6", "POST", "/v1/chat/completions", chat(n=10**6), 400, "n", "'n' is 1000000, above the limit 256"),
    ("max_tokens 10^9", "POST", "/v1/chat/completions", chat(max_tokens=10**9), 400, "max_tokens",
     "'max_tokens' is 1000000000, above the limit 16384 (limits.max_tokens)"),
    ("max_completion_tokens 10^9", "POST", "/v1/chat/completions", chat(max_completion_tokens=10**9), 400,
     "max_completion_tokens", "above the limit 16384"),
    ("both token fields, different", "POST", "/v1/chat/completions", chat(max_tokens=10, max_completion_tokens=20),
     400, "max_completion_tokens", "give one of them"),
    ("lookahead", "POST", "/v1/chat/completions", chat(lookahead=100), 400, "lookahead", "above the limit 8"),
    ("beam_width", "POST", "/v1/chat/completions", chat(beam_width=1000), 400, "beam_width", "(limits.n)"),
    ("200,000-character question", "POST", "/v1/chat/completions",
     json.dumps({"model": "beam_search", "messages": ask("7" * 200_000)}), 400, "messages[0].content",
     "200000 characters, above the limit 65536 (limits.message_chars)"),
    ("question past the context", "POST", "/v1/chat/completions",
     json.dumps({"model": "beam_search", "messages": ask("7" * 10_000)}), 400, "messages",
     f"the generator's context {CONTEXT_TOKENS}"),
    ("max_tokens past the context", "POST", "/v1/chat/completions",
     json.dumps({"model": "beam_search", "max_tokens": 8192, "messages": ask("7" * 1_000)}), 400, "max_tokens",
     f"past the generator's context {CONTEXT_TOKENS}"),
    ("too many messages", "POST", "/v1/chat/completions", chat(messages=ask() * 65), 400, "messages",
     "65 messages, above the limit 64"),
    ("body over the limit", "POST", "/v1/chat/completions",
     json.dumps({"model": "beam_search", "messages": ask(), "user": "x" * (1 << 20)}), 413, None,
     "over the limit 1048576 bytes"),
    ("unknown field", "POST", "/v1/chat/completions", chat(frequency_penalty=0.5), 400, "frequency_penalty",
     "unknown field 'frequency_penalty'"),
    ("unknown role", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "tool", "content": "4"}, *ask()]), 400, "messages[0].role", "unknown role 'tool'"),
    ("system message after the first", "POST", "/v1/chat/completions",
     chat(messages=[*ask(), {"role": "system", "content": "Be brief."}, *ask("And 3 + 3?")]), 400,
     "messages[1].role", "only the first message may be a system message"),
    ("last message not the user's", "POST", "/v1/chat/completions",
     chat(messages=[*ask(), {"role": "assistant", "content": "4"}]), 400, "messages[1].role",
     "the last message must have role 'user'"),
    ("earlier turn over the limit", "POST", "/v1/chat/completions",
     chat(messages=[{"role": "assistant", "content": "7" * 70_000}, *ask()]), 400, "messages[0].content",
     "70000 characters, above the limit 65536"),
    ("assistant turn without text", "POST", "/v1/chat/completions",
     chat(messages=[*ask(), {"role": "assistant", "content": None}, *ask()]), 400, "messages[1].content",
     "must be a string or a list of text parts"),
    ("a chat, on a prompt of one question", "POST", "/v1/chat/completions",  # this server's prompt is a function
     chat(messages=[{"role": "system", "content": "Be brief."}, *ask()]), 400, "messages", "takes one question"),
    ("stop", "POST", "/v1/chat/completions", chat(stop=["\n"]), 400, "stop", "'stop' is not supported"),
    ("record_tree", "POST", "/v1/chat/completions", chat(record_tree=True), 400, "record_tree",
     "not available per request"),
    ("record_timeline", "POST", "/v1/chat/completions", chat(record_timeline=True), 400, "record_timeline",
     "not available per request"),
    ("not JSON", "POST", "/v1/chat/completions", "{", 400, None, "not JSON"),
    ("404 path", "POST", "/v1/completions", chat(), 404, None, "Not Found"),
    ("405 method", "GET", "/v1/chat/completions", None, 405, None, "Method Not Allowed"),
]


@pytest.mark.parametrize("case,method,path,body,status,param,words", REFUSED, ids=[row[0] for row in REFUSED])
def test_a_bad_request_is_refused_in_the_openai_error_shape_and_the_server_answers_on(
        bounded, case, method, path, body, status, param, words):
    service, http = bounded
    answer = httpx.request(method, http.url + path, content=body, timeout=60,
                           headers={"Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert words in error["message"], error
    assert service.snapshot()["in_flight"] == 0, "no search was started"
    after = httpx.post(http.url + "/v1/chat/completions", json={"model": "best_of_n", "n": 2, "messages": ask()},
                       timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"], after.text


def test_seed_and_max_completion_tokens_are_honoured(bounded):
    _, http = bounded
    question = "seeded?"  # not asked before on this server: the scripted backend counts the samples of a text
    reply = client(http, key="k").chat.completions.create(model="best_of_n", messages=ask(question), n=3, seed=7,
                                                          max_completion_tokens=50)
    search = reply.model_extra["sgl_tts"]["search"]
    assert search["seed"] == 7 and search["max_tokens"] == 50 and search["n"] == 3
    seeded = dataclasses.replace(DEFAULTS, program="best_of_n", n=3, seed=7, max_tokens=50)
    expected = direct("best_of_n", question, seeded)
    assert reply.choices[0].message.content == selected_candidate(expected).text
    other_seed = direct("best_of_n", question, dataclasses.replace(seeded, seed=8))
    assert [c.text for c in other_seed.candidates] != [c.text for c in expected.candidates], "the seed matters"


def test_include_usage_sends_the_usage_last_in_a_chunk_without_choices(bounded):
    _, http = bounded
    with httpx.stream("POST", http.url + "/v1/chat/completions", timeout=60,
                      json={"model": "best_of_n", "n": 2, "messages": ask(), "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    *chunks, last = [json.loads(line) for line in lines[:-1]]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_unexpected_error_is_a_500_in_the_openai_error_shape():
    class Broken(SearchService):
        def check_prompt(self, question, search, chat):
            raise RuntimeError("tokenizer went away")

    service = Broken(scripted_runtimes(), DEFAULTS, max_searches=1)
    http = HTTPServer(create_app(service)).start()
    try:
        answer = httpx.post(http.url + "/v1/chat/completions", json={"model": "beam_search", "messages": ask()},
                            timeout=60)
        assert answer.status_code == 500
        assert answer.json() == {"error": {"message": "internal error: RuntimeError: tokenizer went away",
                                           "type": "server_error", "param": None, "code": None}}
        assert httpx.get(http.url + "/health", timeout=60).json()["status"] == "ok"
    finally:
        http.stop()
        service.close()


# ---- chats: a system message and earlier turns through the generator's chat template ----

SYSTEM = "You are a terse tutor. Give the final number in a box."
HISTORY = [{"role": "user", "content": "What is 2 + 2?"},
           {"role": "assistant", "content": "2 + 2 = 4. The answer is $\\boxed{4}$."}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sgl_tts.runtime.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-random"))


@pytest.fixture(scope="module")
def chat_server(tokenizer):
    """A server whose prompt is the tiny model's chat template (`ChatPrompt`, as `sgl-tts serve` has it), on the
    scripted backend: its requests are the prompts the generator received."""
    from sgl_tts.frontend.backend import ChatPrompt

    backend = ScriptedBackend()
    service = SearchService(scripted_runtimes(backend, ChatPrompt(tokenizer)), DEFAULTS, max_searches=4)
    http = HTTPServer(create_app(service, KEY)).start()
    yield backend, http
    http.stop()
    service.close()


def template_prompt(tokenizer, messages, generation=True):
    """The reference: OpenAI `messages` through the tokenizer's chat template, after the solver's system prompt
    when they have no system message."""
    from sgl_tts.frontend.backend import SYSTEM_PROMPT

    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def prompt_sent(backend, since):
    """The prompt of the generator requests after the first `since`: every request text begins with it, and
    a path's first step is sent on it alone."""
    texts = [request["text"] for request in backend.requests[since:]]
    sent = min(texts, key=len)
    assert all(text.startswith(sent) for text in texts), "one prompt for the whole search"
    return sent


def assert_the_search_reply(reply, expected):
    assert reply.object == "chat.completion" and len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == selected_candidate(expected).text
    assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == expected.generated_tokens
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.model_extra["sgl_tts"]["answer"] == expected.answer


def test_a_system_message_replaces_the_solvers_system_prompt(chat_server, tokenizer):
    from sgl_tts.frontend.backend import SYSTEM_PROMPT

    backend, http = chat_server
    question = "What is 6 * 7?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    since = len(backend.requests)
    reply = client(http).chat.completions.create(model="beam_search", messages=messages)
    sent = prompt_sent(backend, since)
    assert sent == template_prompt(tokenizer, messages)
    assert SYSTEM in sent and SYSTEM_PROMPT not in sent, "in place of the default"
    assert_the_search_reply(reply, direct("beam_search", question, DEFAULTS, prompt=lambda q: sent))


def test_earlier_turns_come_before_the_question_in_order(chat_server, tokenizer):
    from sgl_tts.frontend.backend import SYSTEM_PROMPT

    backend, http = chat_server
    question = "And 3 + 3?"
    messages = [*HISTORY, {"role": "user", "content": question}]
    since = len(backend.requests)
    reply = client(http).chat.completions.create(model="best_of_n", n=3, messages=messages)
    sent = prompt_sent(backend, since)
    assert sent == template_prompt(tokenizer, messages), "the solver's system prompt first, as without turns"
    places = [sent.index(text) for text in (SYSTEM_PROMPT, HISTORY[0]["content"], HISTORY[1]["content"], question)]
    assert places == sorted(places), "the turns in order, the question last"
    chat_so_far = template_prompt(tokenizer, messages, generation=False)
    assert sent.startswith(chat_so_far) and len(sent) > len(chat_so_far), \
        "the search continues the generation prompt after the last user turn"
    search = dataclasses.replace(DEFAULTS, program="best_of_n", n=3)
    assert_the_search_reply(reply, direct("best_of_n", question, search, prompt=lambda q: sent))


def test_a_streamed_chat_with_a_system_message_and_turns(chat_server, tokenizer):
    backend, http = chat_server
    question = "And 5 + 5?"
    messages = [{"role": "system", "content": SYSTEM}, *HISTORY, {"role": "user", "content": question}]
    since = len(backend.requests)
    stream = client(http).chat.completions.create(model="beam_search", messages=messages, stream=True,
                                                  stream_options={"include_usage": True})
    *chunks, usage_chunk = list(stream)
    sent = prompt_sent(backend, since)
    assert sent == template_prompt(tokenizer, messages)
    expected = direct("beam_search", question, DEFAULTS, prompt=lambda q: sent)
    events = [c.model_extra.get("sgl_tts", {}).get("event") for c in chunks]
    assert events[0] == "start" and events[-1] == "finish" and events.count("progress") == expected.verifier_calls
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == selected_candidate(expected).text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["sgl_tts"]["answer"] == expected.answer
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == expected.generated_tokens


def test_the_messages_become_the_question_and_the_chat_before_it():
    from sgl_tts.frontend.backend import SYSTEM_PROMPT, Chat, Turn
    from sgl_tts.serve.protocol import parse_messages

    turns = (Turn("user", HISTORY[0]["content"]), Turn("assistant", HISTORY[1]["content"]))
    last = {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "3 + 3?"}]}
    system = {"role": "system", "content": SYSTEM}
    assert parse_messages([system, *HISTORY, last]) == ("And 3 + 3?", Chat(SYSTEM, turns))
    assert parse_messages([{"role": "developer", "content": SYSTEM}, last]) == ("And 3 + 3?", Chat(SYSTEM))
    assert parse_messages([*HISTORY, last]) == ("And 3 + 3?", Chat(SYSTEM_PROMPT, turns))
    assert parse_messages([last]) == ("And 3 + 3?", Chat()), "one question: the prompt of before"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is 6 * 7?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 6 * 7?"}],
    [*HISTORY, {"role": "user", "content": "And 3 + 3?"}],
    [{"role": "system", "content": SYSTEM}, *HISTORY, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because 2 and 2 make 4."}, {"role": "user", "content": "And 3 + 3?"}],
], ids=["question", "system", "turns", "system and turns"])
def test_chat_prompt_is_the_tokenizers_chat_template(tokenizer, messages):
    from sgl_tts.frontend.backend import ChatPrompt, chat_prompt
    from sgl_tts.serve.protocol import parse_messages

    question, chat = parse_messages(messages)
    assert chat_prompt(tokenizer, question, chat) == template_prompt(tokenizer, messages)
    assert ChatPrompt(tokenizer, chat)(question) == template_prompt(tokenizer, messages)


def test_chat_prompt_without_a_chat_template_is_the_plain_format():
    from sgl_tts.frontend.backend import SYSTEM_PROMPT, Chat, Turn, chat_prompt

    class NoTemplate:
        chat_template = None

    assert chat_prompt(NoTemplate(), "q?") == f"{SYSTEM_PROMPT}\n\nQuestion: q?\n\nAnswer:\n"
    chat = Chat("S.", (Turn("user", "a?"), Turn("assistant", "b.")))
    assert chat_prompt(NoTemplate(), "q?", chat) == "S.\n\nQuestion: a?\n\nAnswer:\nb.\n\nQuestion: q?\n\nAnswer:\n"


def test_a_chat_template_that_refuses_the_messages_is_a_refusal_naming_them():
    from jinja2 import TemplateError

    from sgl_tts.config import ConfigError
    from sgl_tts.frontend.backend import Chat, ChatPrompt, Turn

    class Alternating:  # a template's raise_exception, as in chat templates that want user/assistant turns
        chat_template = "..."

        def apply_chat_template(self, messages, **kwargs):
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    service = SearchService(scripted_runtimes(prompt=ChatPrompt(Alternating())), DEFAULTS, max_searches=1)
    try:
        with pytest.raises(ConfigError, match="roles must alternate") as refused:
            service.check_prompt("q?", DEFAULTS, Chat(turns=(Turn("assistant", "a."),)))
        assert refused.value.key == "messages"
    finally:
        service.close()
