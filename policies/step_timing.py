"""Where one scheduler step's time goes, recorded inside SGLang's scheduler process (for `sgl-tts bench runtime`).

With $SGLTTS_STEP_TRACE=<file> the plugin wraps two methods with AROUND hooks:
- `Scheduler.run_batch`: one step of the engine (the model's forward and sampling), and
- `ModelRunner.forward`: the model's forward alone.
Each step appends one JSON line `{"pid", "mode", "batch", "start", "run", "forward"}` (monotonic seconds): the time
from one step's start to the next is the whole step; `forward` is the model, `run - forward` is sampling and
what else `run_batch` does, and the rest of the step is the scheduler loop around it (receiving requests,
scheduling, the radix cache, sending results to the detokenizer). `step_split` turns a trace into those shares.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


class StepTrace:
    """The two hooks of one scheduler process, appending to `path` (a line per step, flushed every step: a
    step of this engine on CPU is milliseconds, a write is microseconds)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.clock = clock
        self.forward_s = 0.0

    def run_batch(self, original: Callable[..., Any], scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self.forward_s = 0.0
        start = self.clock()
        result = original(scheduler, batch, *args, **kwargs)
        run_s = self.clock() - start
        mode = getattr(getattr(batch, "forward_mode", None), "name", "?")
        record = {"pid": os.getpid(), "mode": mode, "batch": batch.batch_size(), "start": start, "run": run_s,
                  "forward": self.forward_s}
        with open(self.path, "a") as trace:
            trace.write(json.dumps(record) + "\n")
        return result

    def model_forward(self, original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
        start = self.clock()
        try:
            return original(runner, *args, **kwargs)
        finally:
            self.forward_s += self.clock() - start


@dataclass(frozen=True)
class StepSplit:
    """Median decode step at one batch size, and its parts (seconds)."""

    batch: int
    steps: int
    step_s: float  # start to next start
    forward_s: float  # the model
    sampling_s: float  # run_batch beyond the model (sampling, output bookkeeping)
    around_s: float  # the scheduler loop between two run_batch calls

    def share(self, part_s: float) -> float:
        return part_s / self.step_s if self.step_s > 0 else 0.0


def read_trace(path: str) -> list[dict[str, Any]]:
    with open(path) as trace:
        return [json.loads(line) for line in trace if line.strip()]


def step_split(records: Iterable[dict[str, Any]], batch: int, max_gap_s: float = 1.0) -> StepSplit | None:
    """The median decode step of `records` whose batch is `batch`, measured start to next start between two
    consecutive decode steps of that batch in one scheduler process (data-parallel ranks write one file; a gap
    above `max_gap_s`, an idle engine, is not a step); None when there are no two such steps."""
    by_process: dict[Any, list[dict[str, Any]]] = {}
    for record in records:
        by_process.setdefault(record.get("pid"), []).append(record)
    steps = []
    for own in by_process.values():
        own.sort(key=lambda r: r["start"])
        steps += [(now, after["start"] - now["start"]) for now, after in zip(own, own[1:])
                  if now["mode"] == after["mode"] == "DECODE" and now["batch"] == after["batch"] == batch
                  and after["start"] - now["start"] <= max_gap_s]
    if not steps:
        return None
    step_s = statistics.median(gap for _, gap in steps)
    forward_s = statistics.median(r["forward"] for r, _ in steps)
    run_s = statistics.median(r["run"] for r, _ in steps)
    return StepSplit(batch, len(steps), step_s, forward_s, max(run_s - forward_s, 0.0), max(step_s - run_s, 0.0))
