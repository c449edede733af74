"""The eval harness on real SGLang CPU runtimes (tiny random model): timing windows from meta_info,
provenance of the model, runtime reuse between arms, and a runtime killed mid-run that is restarted."""

import os
import re
import signal
import threading
import time
import uuid

import pytest
import yaml

from eval.experiment import load_experiment
from eval.report import row_key
from eval.results import ResultStore
from eval.runner import EvalRun
from sgl_tts.env_names import EVAL_TAG
from sgl_tts.testing import processes_with_env


@pytest.mark.runtime
def test_real_runtime_run_with_a_killed_runtime(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex
    monkeypatch.setenv(EVAL_TAG, tag)  # inherited by the runtimes this test starts
    config = {
        "name": "tiny", "max_restarts": 1,
        "base": {"generator": {"model": "tiny-random", "max_total_tokens": 8192, "extra_args": ["--enable-metrics"]},
                 "search": {"max_steps": 2, "max_step_tokens": 12, "max_tokens": 24}, "concurrency": 1},
        "datasets": [{"name": "builtin", "limit": 3}],
        "arms": [{"name": "bon", "baseline": True, "overrides": {"search": {"program": "best_of_n"}}},
                 {"name": "beam", "overrides": {"search": {"program": "beam_search"}}}],
        "n_values": [2],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    run = EvalRun(load_experiment(path), tmp_path / "run", progress=False, log=lambda m: None)
    results = tmp_path / "run" / "results.jsonl"
    killed = []

    def kill_the_generator_after_the_first_result():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if results.exists() and '"kind":"result"' in results.read_text() and run.active is not None:
                runtime = run.active.solver.session.runtimes["generator"]
                os.killpg(runtime.process.pid, signal.SIGKILL)  # a runtime this test started
                killed.append(runtime.process.pid)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_generator_after_the_first_result, daemon=True)
    killer.start()
    try:
        outcome = run.run()
    finally:
        leftovers = processes_with_env(EVAL_TAG, tag)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert killed, "the generator was killed mid-run"
    assert not leftovers, f"runtimes left running: {leftovers}"
    assert outcome.complete and outcome.restarts == 1
    rows = ResultStore(results).records()
    assert sorted(row_key(r)[0] + "/" + row_key(r)[5] for r in rows) == sorted(
        f"{arm}/{pid}" for arm in ("bon", "beam") for pid in ("apples", "pencils", "cookies"))
    assert not any(r["failed"] for r in rows)
    bon = [r for r in rows if r["arm"] == "bon"]
    assert bon[0]["session"] == 0 and bon[-1]["session"] == 1, "solved again after the restart"
    for row in rows:
        requests = row["timing"]["requests"]
        assert requests["requests"] >= 2 and requests["server_e2e_s"]["mean"] > 0
        assert requests["server_e2e_s"]["max"] <= requests["client_s"]["max"] + 1e-3, "server time inside client time"
        assert requests["first_token_s"] is not None, "--enable-metrics adds first-token latency"
        generator = row["provenance"]["models"]["generator"]
        assert generator["model"] == "tiny-random" and generator["precision"] == "float32"
        assert generator["kv_cache_dtype"] == "bf16", "the CPU runtime's pool, as the server was started"
        assert generator["revision"] == {"source": "random", "seed": 0}
        assert row["provenance"]["models"]["tokenizer"]["vocab_size"] > 1000
        if not row["timing"]["runtimes_reused"]:
            assert row["timing"]["runtime_start_s"] > 1, "a real start-up was timed"
    beam = [r for r in rows if r["arm"] == "beam"]
    assert all(r["timing"]["runtimes_reused"] == ["generator"] for r in beam), "same settings: runtime kept"
    assert re.search(r"\| runtime start \(model load\), s \| [\d.,]+ \| – \|", outcome.summary), \
        "the baseline arm timed its start-up, the other reused its runtime"
