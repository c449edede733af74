import json
import socket
import sys
import threading
import types

import pytest

from eval import results
from eval.results import ResultStore, config_hash, package_versions, provenance, result_line
from sgl_tts.measure.metrics import aggregate_rows
from sgl_tts.problems import Problem
from sgl_tts.search.records import Candidate, SearchResult


def strict_json(line):
    def reject(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(line, parse_constant=reject)


def test_append_and_read_back(tmp_path):
    store = ResultStore(tmp_path / "sub" / "results.jsonl")
    store.append_run({"run_id": "r1"})
    store.append({"problem_id": "p1", "correct": True})
    store.append({"problem_id": 2, "correct": False})
    assert [r["problem_id"] for r in store.records()] == ["p1", 2]
    assert all(r["kind"] == "result" for r in store.records())
    assert [r["run_id"] for r in store.runs()] == ["r1"]
    assert store.done_ids() == {"p1", "2"}
    lines = store.path.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "run" and len(lines) == 3


def test_resume_from_a_new_store(tmp_path):
    path = tmp_path / "results.jsonl"
    ResultStore(path).append({"problem_id": "a"})
    ResultStore(path).append({"problem_id": "b"})
    assert ResultStore(path).done_ids() == {"a", "b"}
    assert ResultStore(tmp_path / "absent.jsonl").done_ids() == set()


def test_a_result_line_stores_the_graded_value_and_old_lines_without_it_still_load(tmp_path):
    candidate = Candidate(steps=["7 + 2 = 9"], step_scores=[0.5], score=0.5, answer="7 + 2 = 9", tokens=5,
                          completion_time_s=1.0, finish_reason="answer")
    result = SearchResult(problem_id="p1", program="best_of_n", answer="7 + 2 = 9", candidates=[candidate],
                          generated_tokens=5, total_time_s=1.0)
    row = result_line(Problem("p1", "7 + 2?", "9"), result, None, arm="a", dataset="builtin",
                      dataset_name="builtin", n=1, seed=0, repetition=0)
    assert row["metrics"]["answer"] == "9" and row["metrics"]["answer_text"] == "7 + 2 = 9"
    assert row["metrics"]["correct"] is True and row["result"]["answer"] == "7 + 2 = 9"
    old = json.loads(json.dumps(row))
    old["problem_id"] = "p0"
    del old["metrics"]["answer_text"]  # a line written before answers were stored as graded
    old["metrics"]["answer"] = "7 + 2 = 9"
    store = ResultStore(tmp_path / "results.jsonl")
    store.append(old)
    store.append(row)
    records = ResultStore(store.path).records()
    assert store.done_ids() == {"p0", "p1"} and [r["metrics"].get("answer_text") for r in records] == [None,
                                                                                                       "7 + 2 = 9"]
    assert aggregate_rows([r["metrics"] for r in records])["accuracy"]["correct"] == 1.0


def test_torn_last_line_is_ignored_and_next_append_starts_fresh(tmp_path):
    store = ResultStore(tmp_path / "results.jsonl")
    store.append({"problem_id": "p1"})
    store.append({"problem_id": "p2"})
    with open(store.path, "ab") as file:  # a writer killed mid-line
        file.write(b'{"kind":"result","problem_id":"p3","ans')
    assert store.done_ids() == {"p1", "p2"}
    assert store.skipped_lines == 1
    store.append({"problem_id": "p4"})
    lines = store.path.read_text().splitlines()
    assert strict_json(lines[-1])["problem_id"] == "p4", "the new record must be on a line of its own"
    assert [r["problem_id"] for r in ResultStore(store.path).records()] == ["p1", "p2", "p4"]


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"kind":"result","problem_id":"p1"}')
    store = ResultStore(path)
    assert store.done_ids() == {"p1"}
    store.append({"problem_id": "p2"})
    assert store.done_ids() == {"p1", "p2"}


def test_bad_records_are_rejected_before_writing(tmp_path):
    store = ResultStore(tmp_path / "results.jsonl")
    with pytest.raises(ValueError, match="problem_id"):
        store.append({"answer": "1"})
    with pytest.raises(ValueError, match="append_run"):
        store.append({"problem_id": "p", "kind": "run"})
    with pytest.raises(ValueError, match="not strict JSON"):
        store.append({"problem_id": "p", "value": object()})
    assert not store.path.exists()


def test_non_finite_numbers_are_stored_as_null(tmp_path):
    store = ResultStore(tmp_path / "results.jsonl")
    store.append({"problem_id": "p", "scores": [0.5, float("nan")], "goodput": float("inf")})
    record = strict_json(store.path.read_text().splitlines()[0])
    assert record["scores"] == [0.5, None] and record["goodput"] is None


def test_concurrent_appends_stay_whole_lines(tmp_path):
    store = ResultStore(tmp_path / "results.jsonl")

    def write(worker):
        for i in range(25):
            store.append({"problem_id": f"{worker}-{i}", "text": "x" * 500})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store.done_ids()) == 100 and store.skipped_lines == 0


def test_config_hash_is_canonical():
    assert config_hash({"a": 1, "b": {"c": [1, 2]}}) == config_hash({"b": {"c": [1, 2]}, "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})
    assert len(config_hash({})) == 64


def test_provenance(tmp_path):
    config = {"program": "beam_search", "n": 4}
    header = provenance(config, probe_gpu=False)
    assert header["kind"] == "run" and header["config"] == config
    assert header["config_sha256"] == config_hash(config)
    assert {"sglang", "torch", "transformers", "math-verify"} <= set(header["packages"])
    assert header["packages"]["math-verify"] is not None
    assert header["python"] == ".".join(map(str, sys.version_info[:3]))
    assert header["hardware"]["cpu_count"] >= 1
    assert provenance(config, probe_gpu=False)["run_id"] != header["run_id"]
    hostname = socket.gethostname()
    if len(hostname) >= 6:
        assert hostname not in json.dumps(header)
    store = ResultStore(tmp_path / "results.jsonl")
    store.append_run(header)
    assert store.runs()[0]["config_sha256"] == header["config_sha256"] and store.records() == []


def test_missing_package_version_is_none():
    assert package_versions(("no-such-package-sgl-tts",)) == {"no-such-package-sgl-tts": None}


def test_gpu_names_from_driver_files(tmp_path, monkeypatch):
    (tmp_path / "0000:01:00.0").mkdir()
    (tmp_path / "0000:01:00.0" / "information").write_text("Model: \t NVIDIA H200\nIRQ: 1\n")
    monkeypatch.setattr(results, "NVIDIA_PROC", tmp_path)
    assert results.hardware()["gpus"] == ["NVIDIA H200"]


def test_gpu_names_from_nvml(tmp_path, monkeypatch):
    calls = []
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetName=lambda h: b"NVIDIA L4",
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(results, "NVIDIA_PROC", tmp_path)
    assert results.hardware()["gpus"] == ["NVIDIA L4"]
    assert calls == ["init", "shutdown"]


def test_gpu_names_from_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2, get_device_name=lambda i: f"GPU{i}")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(results, "NVIDIA_PROC", tmp_path)
    assert results.hardware()["gpus"] == ["GPU0", "GPU1"]
