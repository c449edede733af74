"""A runtime whose port another process took between `free_port` and the server's bind: SGLang's server logs
uvicorn's bind error and hangs in shutdown instead of exiting, so `wait_ready` reads the log, stops it and
starts again on a fresh port (a port the config fixes is refused at once). Fast: the "server" is a stand-in
started the way servers are started, answering the two routes `wait_ready` asks."""

import socket
import sys

import pytest

from sgl_tts.runtime import server
from sgl_tts.runtime.server import PortTakenError, Runtime, RuntimeConfig, group_members

STAND_IN = """
import http.server, json, socket, sys, time
port = int(sys.argv[1])
class Answer(http.server.BaseHTTPRequestHandler):
    def _reply(self):
        body = json.dumps({"model_path": "stand-in", "text": "1", "meta_info": {}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self): self._reply()
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0))); self._reply()
    def log_message(self, *args): pass
try:
    httpd = http.server.HTTPServer(("127.0.0.1", port), Answer)
except OSError as exc:
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    time.sleep(600)  # as SGLang's server does: it does not exit
httpd.serve_forever()
"""


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(server, "resolve_model", lambda model: model)
    monkeypatch.setattr(server, "server_env", lambda config: None)
    monkeypatch.setattr(server, "server_command",
                        lambda config, model, port: [sys.executable, "-c", STAND_IN, str(port)])


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("wait", [True, False], ids=["start-waits", "wait-ready-later"])
def test_a_port_taken_before_the_bind_is_left_for_a_fresh_one(stand_in, taken_port, monkeypatch, tmp_path, wait):
    """Sessions, replica sets and the bench start every server first and wait after (`wait=False`): the fresh
    port is taken in `wait_ready` as in a `start` that waits."""
    ports, fresh_port = [taken_port], server.free_port
    monkeypatch.setattr(server, "free_port", lambda host: ports.pop(0) if ports else fresh_port(host))
    runtime = Runtime.start(RuntimeConfig(startup_timeout_s=300), name="stand-in", log_dir=tmp_path, wait=wait)
    first_process = runtime.process
    try:
        if not wait:
            assert runtime.port == taken_port
            runtime.wait_ready()
        assert runtime.port != taken_port and runtime.alive()
        assert runtime.url.endswith(f":{runtime.port}") and runtime.log_path.name == f"stand-in-{runtime.port}.log"
        assert wait or not group_members(first_process.pid), "the server that met the taken port was stopped"
        first = tmp_path / f"stand-in-{taken_port}.log"
        assert server.PORT_TAKEN in first.read_text(), "the first server met the taken port"
    finally:
        runtime.stop()
    assert not group_members(runtime.process.pid)


def test_a_taken_port_the_config_fixes_is_refused_without_waiting_out_the_start_up(stand_in, taken_port, tmp_path):
    with pytest.raises(PortTakenError, match=f"could not bind port {taken_port}"):
        Runtime.start(RuntimeConfig(port=taken_port, startup_timeout_s=300), name="stand-in", log_dir=tmp_path)

