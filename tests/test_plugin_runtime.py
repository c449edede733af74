"""The scheduler plugin inside a real SGLang CPU runtime: it loads in the scheduler process and the
waiting queue is served in prefix-aware order, not arrival order."""

import json
import os
import threading
import time

import pytest

from policies.base import BeamTag, decode_rid, encode_rid

pytestmark = pytest.mark.runtime


def test_plugin_reorders_the_waiting_queue_inside_the_scheduler(policy_runtime):
    from sgl_tts.runtime.server import http_json

    runtime, trace = policy_runtime
    finished, lock = [], threading.Lock()

    def send(rid, max_new_tokens):
        try:
            http_json(runtime.url + "/generate", {
                "rid": rid, "text": "The answer is",
                "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0},
            })
        finally:
            with lock:
                finished.append(rid)

    # A request as long as the context occupies the only running slot while the forks arrive, parents
    # out of order; it is aborted once all of them wait, so the test does not depend on machine speed.
    blocker = threading.Thread(target=send, args=("blocker", 2000))
    blocker.start()
    time.sleep(1.0)
    arrivals = [encode_rid(BeamTag("q", 1, beam, parent)) for beam, parent in
                enumerate([2, 0, 1, 2, 0, 1])]
    forks = [threading.Thread(target=send, args=(rid, 4)) for rid in arrivals]
    for thread in forks:
        thread.start()
        time.sleep(0.05)
    time.sleep(0.5)
    assert not finished, f"the blocker should still hold the running slot; finished: {finished}"
    http_json(runtime.url + "/abort_request", {"rid": "blocker"})
    for thread in [blocker, *forks]:
        thread.join(timeout=300)
    runtime.check_alive()

    served_rids = [rid for rid in finished if rid != "blocker"]
    served = [decode_rid(rid) for rid in served_rids]
    assert [t.parent_id for t in served] == [0, 0, 1, 1, 2, 2], finished
    assert [t.beam_id for t in served] == [1, 4, 2, 5, 0, 3], "queue order within a parent's group"

    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines and all(line["pid"] != os.getpid() for line in lines), "reordered in the scheduler process"
    assert any(line["rids"] == served_rids for line in lines)
