"""The pooled HTTP client to runtimes (sgl_tts.runtime.http_client) against a small local HTTP server: JSON round
trips, one connection reused across calls, error answers that keep the server's message, and failures that
callers catch as OSError."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_tts.runtime.http_client import RuntimeHTTPError, error_text, http_json, http_text, request
from sgl_tts.runtime.server import free_port

# path -> (status, body) for the error answers the server gives
ERRORS = {
    "/openai_error": (400, {"error": {"message": "max_new_tokens must be positive", "type": "BadRequestError"}}),
    "/detail": (422, {"detail": [{"loc": ["body", "text"], "msg": "field required"}]}),
    "/plain": (500, "Internal Server Error: the scheduler crashed"),
    "/long": (503, "x" * 5000),
}


class Handler(BaseHTTPRequestHandler):
    """Answers GET /echo and POST /echo with what it got, the ERRORS with theirs, and counts connections."""

    protocol_version = "HTTP/1.1"  # keep-alive

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def do_GET(self):
        self.answer()

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length)) if length else None
        self.server.received.append((self.path, payload))
        self.answer(payload)

    def answer(self, payload=None):
        status, body = ERRORS.get(self.path, (200, {"method": self.command, "path": self.path, "payload": payload}))
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.lock, httpd.connections, httpd.received = threading.Lock(), 0, []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_get_and_post_round_trip_json_over_one_reused_connection(server):
    httpd, url = server
    assert http_json(url + "/echo?x=1") == {"method": "GET", "path": "/echo?x=1", "payload": None}
    assert http_json(url + "/echo", {"text": "1+1=", "n": 2}) == {
        "method": "POST", "path": "/echo", "payload": {"text": "1+1=", "n": 2}}
    assert json.loads(http_text(url + "/echo"))["method"] == "GET"
    assert httpd.connections == 1, "three calls, one connection"


def test_threads_share_the_client_and_its_connections(server):
    httpd, url = server
    answers = {}

    def call(thread):
        answers[thread] = [http_json(url + "/echo", {"thread": thread, "call": k})["payload"] for k in range(5)]

    threads = [threading.Thread(target=call, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == {t: [{"thread": t, "call": k} for k in range(5)] for t in range(8)}
    assert 1 <= httpd.connections <= 8, "at most one connection per calling thread, reused for its calls"


def test_an_error_answer_names_the_status_and_the_servers_message(server):
    httpd, url = server
    with pytest.raises(RuntimeHTTPError) as caught:
        http_json(url + "/openai_error", {"text": "x"})
    error = caught.value
    assert isinstance(error, OSError), "callers catch OSError for every failure, as they did urllib's"
    assert error.status == 400 and error.text == "max_new_tokens must be positive"
    assert str(error) == f"POST {url}/openai_error: HTTP 400 Bad Request: max_new_tokens must be positive"

    with pytest.raises(RuntimeHTTPError, match=r"HTTP 422 Unprocessable Entity: .*field required"):
        http_json(url + "/detail")
    with pytest.raises(RuntimeHTTPError, match="HTTP 500 Internal Server Error: Internal Server Error: the "
                                               "scheduler crashed$"):
        request("POST", url + "/plain")
    with pytest.raises(RuntimeHTTPError) as long:
        http_json(url + "/long")
    assert long.value.text == "x" * 1000 + "...", "a long body is truncated"
    assert httpd.connections == 1, "an error answer does not cost the connection"


def test_a_runtime_that_is_not_there_is_a_connection_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectionError, match=f"GET {url}/get_model_info"):
        http_json(url + "/get_model_info", timeout=5)


def test_no_answer_in_time_is_a_timeout_error():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
            http_json(url + "/generate", {"text": "x"}, timeout=0.2)


def test_aborts_reach_every_live_server_of_a_set_with_a_dead_one(server):
    from types import SimpleNamespace

    from sgl_tts.runtime.server import abort_requests

    httpd, url = server
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = SimpleNamespace(url="http://127.0.0.1:1", worker_urls=[dead, url])
    with pytest.raises(ConnectionError, match=dead):
        abort_requests(replicas, ["a", "b"], timeout=5)
    assert httpd.received == [("/abort_request", {"rid": "a"}), ("/abort_request", {"rid": "b"})]


@pytest.mark.parametrize("body, expected", [
    ('{"error": "plain string"}', "plain string"),
    ('{"message": "top-level message"}', "top-level message"),
    ('{"object": "error", "code": 400}', '{"object": "error", "code": 400}'),
    ("not json", "not json"),
    ("", ""),
])
def test_error_text_reads_each_shape_of_error_body(body, expected):
    import httpx

    assert error_text(httpx.Response(400, text=body)) == expected
