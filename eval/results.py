"""Append-only JSONL result files, resumable after a crash, with a provenance header per run.

Each line is one JSON object: `{"kind": "run", ...}` (a run's provenance, written when a run starts or
resumes) or `{"kind": "result", "problem_id": ..., ...}` (one finished problem). Every append is flushed
and fsync'ed; NaN and infinities are stored as null. A process killed mid-write leaves a torn last line:
readers ignore it and the next append starts on a fresh line, so the torn text stays behind as one
unreadable line, which readers skip and count.
One writer per file (appends from the threads of one process are serialised by a lock).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import math
import platform
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sgl_tts.config import parse_json_object
from sgl_tts.measure.metrics import problem_metrics
from sgl_tts.problems import DATASETS

logger = logging.getLogger(__name__)

RUN = "run"
RESULT = "result"
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")  # the driver's per-GPU info files
PACKAGES = ("sgl-tts", "sglang", "torch", "transformers", "math-verify", "datasets")


def result_line(problem: Any, result: Any, error: BaseException | str | None, *, arm: str, dataset: str,
                dataset_name: str, n: int, seed: int, repetition: int, **fields: Any) -> dict[str, Any]:
    """One finished problem's result line, as `sgl-tts eval` and `sgl-tts run --out` write it: who it is (problem,
    arm, dataset key, n, seed, repetition, `fields`, the difficulty level when the problem has one), then either
    its metrics graded against the problem's gold (with `dataset_name`'s answer rules when it is a known dataset),
    the times and the whole result, or `failed` with the error (`error`, the result's own `error`, or grading's)
    and whatever result there is. JSON-safe: objects JSON cannot hold (a program's `extra`) are stored as repr."""
    row: dict[str, Any] = {"problem_id": problem.id, "arm": arm, "dataset": dataset, "n": n, "seed": seed,
                           "repetition": repetition, **fields}
    if "level" in problem.meta:  # a difficulty level (the graded set): the report's accuracy per level
        row["level"] = problem.meta["level"]
    if error is None and result is not None and result.error:
        error = result.error
    if error is None:
        try:
            metrics = problem_metrics(result, problem.gold, dataset_name if dataset_name in DATASETS else None,
                                      pass_ns=[n])
        except Exception as exc:  # e.g. grading could not run: keep the search, mark the line failed
            error = exc
    if error is not None:
        row.update(failed=True, error=error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        if result is not None:
            row["result"] = result.to_dict()
    else:
        row.update(failed=False, metrics=metrics,
                   timing={"total_s": result.total_time_s, "generator_s": result.generator_time_s,
                           "verifier_s": result.verifier_time_s},
                   result=result.to_dict())
    return json.loads(json.dumps(row, default=repr))


class ResultStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.skipped_lines = 0  # torn lines seen by the last read

    def append(self, record: dict[str, Any]) -> None:
        """Append one finished problem's record (it needs a "problem_id"; "kind" defaults to "result")."""
        if "problem_id" not in record:
            raise ValueError(f"a result record needs a 'problem_id'; got keys {sorted(record)}")
        if record.get("kind", RESULT) != RESULT:
            raise ValueError(f"append() writes result records; got kind {record['kind']!r} (use append_run)")
        self._write({"kind": RESULT, **record})

    def append_run(self, header: dict[str, Any]) -> None:
        """Append a run header (e.g. `provenance(config)`)."""
        self._write({**header, "kind": RUN})

    def _write(self, record: dict[str, Any]) -> None:
        try:
            line = json.dumps(_finite_or_none(record), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"record {record.get('problem_id', '')!r} is not strict JSON: {exc}") from exc
        with self._lock:
            created = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as file:
                if file.tell() > 0:
                    file.seek(-1, os.SEEK_END)
                    if file.read(1) != b"\n":  # a torn last line: start on a fresh one
                        file.write(b"\n")
                file.write(line.encode("utf-8") + b"\n")
                file.flush()
                os.fsync(file.fileno())
            if created:
                _fsync_directory(self.path.parent)

    def _lines(self) -> list[dict[str, Any]]:
        """Every intact record. A line that does not parse is skipped and counted in `skipped_lines`: this
        writer only leaves one when killed mid-write (then the next append put a newline after it)."""
        self.skipped_lines = 0
        if not self.path.exists():
            return []
        records = []
        for number, raw in enumerate(self.path.read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                record = parse_json_object(raw)
            except ValueError as exc:
                logger.warning("%s:%d: skipping a torn or damaged line (%s)", self.path, number, exc)
                self.skipped_lines += 1
                continue
            records.append(record)
        return records

    def records(self) -> list[dict[str, Any]]:
        """The result records, in file order."""
        return [r for r in self._lines() if r.get("kind") == RESULT]

    def runs(self) -> list[dict[str, Any]]:
        """The run headers, in file order (one per start or resume)."""
        return [r for r in self._lines() if r.get("kind") == RUN]

    def done_ids(self) -> set[str]:
        """Ids of the problems with a result line (to skip when resuming)."""
        return {str(r["problem_id"]) for r in self.records()}


def _finite_or_none(value: Any) -> Any:
    """The value with NaN and infinities replaced by None, so every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def _fsync_directory(path: Path) -> None:
    """Make a newly created file's directory entry durable too."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------
# Provenance


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the config as canonical JSON (sorted keys, no whitespace)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpu_names() -> list[str]:
    """GPU names, preferring sources that create no CUDA context in this process (a context takes GPU
    memory that the runtimes started after it would not get): the driver's /proc files, then NVML, then
    torch.cuda."""
    names = []
    for info in sorted(NVIDIA_PROC.glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                names.append(line.split(":", 1)[1].strip())
    if names:
        return names
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            return [_text(pynvml.nvmlDeviceGetName(handle)) for handle in handles]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: try torch
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install must not stop a run from recording its provenance
        pass
    return []


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def hardware(probe_gpu: bool = True) -> dict[str, Any]:
    """CPU model, core counts and GPU names; no hostname or other identifying detail."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "gpus": _gpu_names() if probe_gpu else None,
    }


def provenance(config: dict[str, Any], probe_gpu: bool = True) -> dict[str, Any]:
    """A run header: resolved config and its hash, package versions, Python, platform, hardware, run id."""
    now = datetime.now(timezone.utc)
    return {
        "kind": RUN,
        "run_id": now.strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8],
        "started_utc": now.isoformat(timespec="seconds"),
        "config": config,
        "config_sha256": config_hash(config),
        "packages": package_versions(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hardware": hardware(probe_gpu),
    }
