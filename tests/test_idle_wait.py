"""The data-parallel controller's loop: every request dispatched, and a blocking poll before each drain."""

import pytest

zmq = pytest.importorskip("zmq")
io_struct = pytest.importorskip("sglang.srt.managers.io_struct")

from policies import idle_wait  # noqa: E402


class Stop(Exception):
    pass


class RecordingPoller:
    """A real zmq poller that counts its polls and ends the loop after `polls` of them."""

    def __init__(self, polls, events):
        self.inner = zmq.Poller()
        self.polls = polls
        self.events = events

    def register(self, socket, flags):
        self.inner.register(socket, flags)

    def poll(self, timeout):
        if self.polls == 0:
            raise Stop
        self.polls -= 1
        self.events.append(("poll", timeout))
        return self.inner.poll(timeout)


class FakeController:
    def __init__(self, socket, events):
        self.recv_from_tokenizer = socket
        self.events = events
        self.soft_watchdog = self

    def feed(self):
        self.events.append("feed")

    def _request_dispatcher(self, request):
        self.events.append(("dispatch", request))


def test_requests_are_dispatched_after_a_blocking_poll(monkeypatch):
    context = zmq.Context.instance()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        for request in ("a", "b", "c"):
            io_struct.sock_send(push, request)
        events = []
        monkeypatch.setattr(idle_wait, "make_poller", lambda: RecordingPoller(2, events))
        monkeypatch.setattr(idle_wait, "POLL_TIMEOUT_MS", 50)
        with pytest.raises(Stop):
            idle_wait.event_loop(FakeController(pull, events))
    finally:
        pull.close(0)
        push.close(0)
    dispatched = [event[1] for event in events if event[0] == "dispatch"]
    assert dispatched == ["a", "b", "c"]
    # Each turn feeds the watchdog and blocks in poll before it drains the socket.
    first_dispatch = events.index(("dispatch", "a"))
    assert events[:2] == ["feed", ("poll", 50)] and first_dispatch > 1
    assert events.count(("poll", 50)) == 2
