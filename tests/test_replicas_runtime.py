"""A replica set on real SGLang runtimes (two tiny-random servers behind SGLang's router) when one replica dies:
the router goes on answering from the live replica, and `restart_replica` brings the dead one back on its port,
routed to again."""

import itertools
import os
import signal
import threading
import time

import pytest

from sgl_tts.runtime.http_client import RuntimeHTTPError, http_json
from sgl_tts.runtime.replicas import ReplicaSet, router_workers
from sgl_tts.runtime.server import RuntimeConfig, abort_requests, share_cpu_cores

pytestmark = pytest.mark.runtime

PROMPT = "A replica set keeps serving when one of its servers dies. "  # the prefix every request here shares


def generate(url, text, rid=None, **sampling):
    """Generate from `text` (2 tokens unless `sampling` says otherwise), as request `rid` when given."""
    payload = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0, **sampling}}
    return http_json(url + "/generate", {**payload, **({"rid": rid} if rid else {})}, timeout=600)


def load(url):
    (rank,) = http_json(url + "/v1/loads", timeout=60)["loads"]
    return rank


def prefilled(url):
    """Prompt tokens the server at `url` has prefilled (it grows with each request the server serves)."""
    return load(url)["total_prefill_uncached_tokens"]


def running(url):
    """Requests the server at `url` is running or has queued."""
    rank = load(url)
    return rank["num_running_reqs"] + rank["num_waiting_reqs"]


def wait_until(predicate, timeout=300.0):
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


def test_a_replica_set_serves_on_its_live_replica_and_restarts_a_dead_one(tmp_path):
    config = RuntimeConfig(model="tiny-random", replicas=2, max_total_tokens=16384, startup_timeout_s=1800)
    config = share_cpu_cores({"generator": config})["generator"]
    with ReplicaSet.start(config, name="generator", log_dir=tmp_path) as replicas:
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
        assert (tmp_path / f"{victim.log_path.stem}.1.log").exists(), "the dead replica's log is kept"
        assert http_json(restarted.url + "/get_model_info", timeout=60)["model_path"] == victim.model_path
        listed = router_workers(replicas.url)
        assert set(listed) == {survivor.url, restarted.url} and listed[restarted.url]["is_healthy"], listed

        # The router routes to the restarted replica again. It sends a prompt that matches no cached prefix to
        # the replica with the fewest requests in flight, ties broken in its own worker order (which need not put
        # the restarted one first), so of two such prompts, the second sent while the first runs, one reaches
        # the restarted replica.
        baseline = prefilled(restarted.url)
        long = threading.Thread(target=long_request, args=(replicas.url, "long"))
        long.start()
        try:
            wait_until(lambda: sum(running(worker.url) for worker in replicas.workers) >= 1)
            generate(replicas.url, "What is the capital of France?")
            wait_until(lambda: prefilled(restarted.url) > baseline)
        finally:
            abort_requests(replicas, ["long"])
            long.join(timeout=300)
        assert replicas.alive()
