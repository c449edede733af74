"""SGLang's data-parallel controller, made to wait for requests instead of spinning.

With `--dp-size N`, SGLang 0.5.23 puts a controller process between the tokenizer and the N schedulers; its
`DataParallelController.event_loop` polls its socket with `NOBLOCK` in a bare `while True`, so an idle
controller holds a whole core (measured on a 2-core CPU machine: 98% of a core with no request in flight,
while the two idle schedulers, with `--sleep-on-idle`, used 1% each). `event_loop` here is the same loop with
one change: before draining the socket it blocks in `zmq.Poller.poll` until a message arrives (or
POLL_TIMEOUT_MS passes, to feed the soft watchdog as the original does each turn).

The plugin (`policies/plugin.py`) installs it with $SGLTTS_CPU_ATTENTION=batched, the CPU runtimes' setting.
"""

from __future__ import annotations

from typing import Any

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"
POLL_TIMEOUT_MS = 1000


def make_poller() -> Any:
    import zmq

    return zmq.Poller()


def event_loop(controller: Any) -> None:
    """A REPLACE hook for `DataParallelController.event_loop`: dispatch every request as it arrives."""
    import zmq
    from sglang.srt.managers.io_struct import sock_recv

    poller = make_poller()
    poller.register(controller.recv_from_tokenizer, zmq.POLLIN)
    while True:
        controller.soft_watchdog.feed()
        poller.poll(POLL_TIMEOUT_MS)
        while True:
            try:
                request = sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(request)
