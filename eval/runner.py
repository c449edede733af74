"""`sgl-tts eval`: run an experiment's arms side by side, append every finished problem, then report.

A run folder (`--out DIR`, `--resume DIR`, else `<output_dir>/<name>-<UTC time>`) holds:
  experiment.yaml   the resolved experiment (`--resume DIR` without `--config` reads it back)
  results.jsonl     append-only (eval/results.py): a run header per start or resume, one line per problem
  summary.md, summary.json, plots/*.png   the report (eval/report.py), rewritten at every end
  logs/             the runtimes' logs

Results are never lost. Each problem's line is written and fsync'ed as soon as that problem finishes (not in
submission order). Starting again on the same folder skips every (arm, dataset, n, seed, repetition,
problem) that has a line, so a run killed with SIGKILL loses at most the problems in flight. A problem
whose search raised while the runtimes were alive gets a `failed` line and is retried on the next resume. A
problem that failed because a runtime died (its process exited, or it stopped answering for a grace period;
`TTSEndpoint` and the scorer raise `RuntimeDiedError` via `Runtime.check_alive()`) is not written: the
arm's runtimes are stopped, started again, and the problem is solved again, up to `max_restarts` times per
arm. Ctrl-C stops the runtimes,
keeps every written line, and writes a partial summary.

Runtimes: each arm gets a `Session`. With `reuse_runtimes` (default) an arm whose runtime settings equal the
previous arm's keeps those runtimes (`sgl_tts.app.session.SessionPool`), and every unit starts with flushed
radix caches (`flush_cache`), so no cell reuses another's prefixes.

Timing windows, each kept apart (edge-inference evaluation §VI):
  runtime_start_s      Session start: launching the servers until each answered a first request
                       (model load, server init, warm-up); once per runtime start, restarts included;
                       `runtimes_reused` names the runtimes kept from the previous arm instead.
  total_s              the program's whole search of one problem (SearchResult.total_time_s), split into
  generator_s, verifier_s   the program's generator and verifier time (SearchContext).
  solve_wall_s         the harness's wall clock around the program call.
  requests.*           per generator request (`sgl.gen` -> /generate), summarised per problem:
    client_s           client-side wall time of the request;
    server_e2e_s       SGLang meta_info `e2e_latency` (arrival at the server until finished);
    with the runtime flag `--enable-metrics` also (else absent):
    first_token_s      meta_info `first_token_latency` (arrival until prefill done; queueing included),
    queue_s            meta_info `queue_time`,
    prompt_processing_s  first_token_s - queue_s,
    decode_s_per_token   (server_e2e_s - first_token_s) / (completion tokens - 1).
Not measured: client-side time to first token (requests are not streamed); the scorer's requests one by
one (they bypass the frontend backend: their sum is verifier_s); the frontend's prefix pre-send before a
fork (inside generator_s, outside the request windows); energy.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from sgl_tts.problems import Problem, load_problems
from eval.report import RESULTS_FILE, row_key, write_report
from eval.results import ResultStore, config_hash, provenance, result_line
from sgl_tts.config import ConfigError
from sgl_tts.paths import folder_lock, write_atomic
from sgl_tts.measure.metrics import summarize
from sgl_tts.search.records import SearchResult
from sgl_tts.runtime.server import RuntimeDiedError, kv_pool_dtype

if TYPE_CHECKING:  # eval.experiment imports sgl_tts.app.session, which imports sglang (seconds): not for --help
    from eval.experiment import Experiment, ScriptedOptions, Unit
    from sgl_tts.app.session import RunConfig

EXPERIMENT_FILE = "experiment.yaml"
SCRIPTED_PROMPT = "Q: {question}\n\n"


# ---------------------------------------------------------------------------------------------------------
# Per-request timings


def _brief(values: list[float]) -> dict[str, float | int] | None:
    if not values:
        return None
    stats = summarize(values)
    return {key: stats[key] for key in ("n", "mean", "p50", "p90", "max")}


def request_windows(entries: list[Any]) -> dict[str, Any]:
    """Per-problem summaries (n, mean, p50, p90, max) of each request timing window of the search's requests
    (`sgl_tts.frontend.ledger.Request`); None when not reported."""
    def column(fn: Callable[[Any], float | None]) -> dict[str, float | int] | None:
        values = []
        for entry in entries:
            value = fn(entry)
            if value is not None:
                values.append(float(value))
        return _brief(values)

    def prompt_processing(e):
        if e.first_token_latency is None or e.queue_time is None:
            return None
        return max(0.0, e.first_token_latency - e.queue_time)

    def decode_per_token(e):
        tokens = e.completion_tokens or 0
        if e.e2e_latency is None or e.first_token_latency is None or tokens < 2:
            return None
        return max(0.0, e.e2e_latency - e.first_token_latency) / (tokens - 1)

    return {
        "requests": len(entries),
        "client_s": column(lambda e: e.client_s),
        "server_e2e_s": column(lambda e: e.e2e_latency),
        "first_token_s": column(lambda e: e.first_token_latency),
        "queue_s": column(lambda e: e.queue_time),
        "prompt_processing_s": column(prompt_processing),
        "decode_s_per_token": column(decode_per_token),
    }


def end_leaked_executors(backends: list[Any]) -> int:
    """End the SGLang frontend executors on `backends` that are still running.

    Every program state (and fork) has an executor with a non-daemon worker thread that ends when the state is
    garbage-collected. A program that keeps its states reachable from the program's own arguments (a reference
    cycle through the worker thread) leaks one thread per fork, and a process with such threads never exits.
    Called between units, when none of these backends' programs is running."""
    from sgl_tts.frontend.sglang_internals import end_program_states

    return end_program_states(backends)


# ---------------------------------------------------------------------------------------------------------
# Solvers: what an arm's problems are solved on


def model_revision(path: str) -> Any:
    """What identifies a model folder's weights: sgl-tts's provisioning record, else a hub snapshot hash."""
    folder = Path(path)
    marker = folder / "sgl-tts-provenance.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    parts = folder.parts
    if "snapshots" in parts and parts.index("snapshots") + 1 < len(parts):
        return parts[parts.index("snapshots") + 1]
    if not folder.exists():  # a hub id: the snapshot in the local cache, if any
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
            if isinstance(cached, str):
                return model_revision(str(Path(cached).parent))
        except Exception:  # no cache or no hub client: the revision stays unknown
            pass
    return None


def _precision(runtime: Any) -> str:
    """The dtype the server runs in (runtime.server_command's rule: 'auto' is float32 on CPU)."""
    dtype = runtime.config.dtype
    if dtype != "auto":
        return dtype
    if runtime.config.device == "cpu":
        return "float32"
    try:
        config = json.loads((Path(runtime.model_path) / "config.json").read_text())
        return f"auto ({config.get('torch_dtype') or config.get('dtype')})"
    except (OSError, ValueError):
        return "auto"


class SessionSolver:
    """An arm's SGLang runtimes (`sgl_tts.app.session.Session`)."""

    def __init__(self, config: RunConfig, log_dir: Path, pool: Any):
        """`pool`: a `sgl_tts.app.session.SessionPool` holding the previous arm's runtimes, if it kept them."""
        self.config = config
        self.pool = pool
        self.session = pool.switch(dataclasses.replace(config, log_dir=config.log_dir or str(log_dir)))
        self.startup_s = self.session.started_s
        self.reused = sorted(self.session.reused)

    def backends(self) -> list[Any]:
        runtimes = self.session.search_runtimes
        return [backend for backend in (runtimes.generator, runtimes.target) if backend is not None]

    def new_search(self, problem: Problem, search: Any) -> Any:
        return self.session.new_search(problem, search)

    def solve(self, problem: Problem, search: Any, context: Any) -> SearchResult:
        return self.session.solve(problem, search, context)

    def alive(self, grace_s: float = 10.0) -> bool:
        """Whether every runtime still serves: its process runs and answers /get_model_info within `grace_s`.

        Asked after a failed search. A killed server refuses connections a moment before its process exits,
        so a refusal alone is not taken as death until the grace period ends; a server that stays unreachable
        that long counts as dead (and is stopped and started again)."""
        from sgl_tts.runtime.server import http_json

        deadline = time.monotonic() + grace_s
        for runtime in self.session.runtimes.values():
            while True:
                if not runtime.alive():
                    return False
                try:
                    http_json(runtime.url + "/get_model_info", timeout=5)
                    break
                except (OSError, ValueError):
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.2)
        return True

    def flush_cache(self) -> list[str]:
        """Empty every runtime's radix cache; returns the runtimes that refused.

        SGLang's /flush_cache only flushes an idle scheduler; with `timeout` it waits that long for idleness
        (right after a batch the scheduler is not idle until its loop has turned once more)."""
        from sgl_tts.runtime.http_client import request

        refused = []
        for name, runtime in self.session.runtimes.items():
            if runtime.config.is_embedding:
                continue
            try:
                request("POST", runtime.url + "/flush_cache?timeout=30", timeout=60)
            except OSError as exc:  # unreachable, or an error answer (not idle in time)
                refused.append(f"{name} ({exc})")
        return refused

    def describe(self) -> dict[str, Any]:
        tokenizer = self.session.tokenizer
        models = {
            name: {"model": rt.config.model, "path": rt.model_path, "revision": model_revision(rt.model_path),
                   "device": rt.config.device, "precision": _precision(rt),
                   "kv_cache_dtype": kv_pool_dtype(rt.config) or "model", "server": rt.model_info}
            for name, rt in self.session.runtimes.items()
        }
        models["tokenizer"] = {"name_or_path": tokenizer.name_or_path, "class": type(tokenizer).__name__,
                               "vocab_size": len(tokenizer)}
        models["scorer_kind"] = self.config.scorer.kind
        return models

    def give_back(self) -> None:
        """Keep the running runtimes in the pool for the next arm instead of stopping them."""
        self.pool.give_back(self.session)

    def close(self) -> None:
        self.session.close()


class ScriptedSolver:
    """The scripted test/demo backend: `sgl_tts.testing`'s model and scorer, no SGLang runtime.

    `die_on` simulates a runtime that dies: the first time a listed problem starts (per process), this
    solver turns dead and every later solve raises RuntimeDiedError, as requests to a dead server do.
    """

    def __init__(self, config: RunConfig, options: ScriptedOptions, died: set[str], lock: threading.Lock):
        from sgl_tts.search.programs import load_program
        from sgl_tts.search.api import Runtimes
        from sgl_tts.testing import ScriptedScorer

        began = time.monotonic()
        self.runtimes = Runtimes(generator=None, scorer=ScriptedScorer(),
                                 prompt=lambda question: SCRIPTED_PROMPT.format(question=question))
        self.program = load_program(config.search.program)
        self.options = options
        self.flush_cache()
        self.dead = False
        self._died, self._lock = died, lock
        self.startup_s = time.monotonic() - began
        self.reused: list[str] = []

    def backends(self) -> list[Any]:
        return [self.runtimes.generator]

    def new_search(self, problem: Problem, search: Any) -> Any:
        return self.runtimes.new_search(search, problem.id)

    def solve(self, problem: Problem, search: Any, context: Any) -> SearchResult:
        with self._lock:
            if not self.dead and problem.id in self.options.die_on and problem.id not in self._died:
                self._died.add(problem.id)
                self.dead = True
            if self.dead:
                raise RuntimeDiedError(f"scripted runtime died (simulated at problem '{problem.id}')")
        time.sleep(self.options.delay_s)
        return self.program(problem, search, self.runtimes, context)

    def alive(self) -> bool:
        return not self.dead

    def flush_cache(self) -> list[str]:
        """A fresh scripted model: its per-text variant counters and prefix cache start empty, so a unit's
        results depend on nothing solved before it (as a flushed radix cache and a fixed seed would)."""
        from sgl_tts.testing import ScriptedBackend, ScriptedModel

        backend = ScriptedBackend(ScriptedModel(answer_depth=self.options.answer_depth, answers=self.options.answers))
        self.runtimes.generator = backend
        return []

    def describe(self) -> dict[str, Any]:
        return {"generator": {"model": "scripted", "revision": None, "precision": None},
                "scorer_kind": "scripted", "options": dataclasses.asdict(self.options)}

    def give_back(self) -> None:
        pass

    def close(self) -> None:
        pass


class ArmRuntimes:
    """The solver of one arm; restarts it when a runtime died, at most `max_restarts` times."""

    def __init__(self, arm: str, start: Callable[[], Any], max_restarts: int):
        self.arm = arm
        self.start = start
        self.max_restarts = max_restarts
        self.restarts = 0
        self.solver = start()

    def restart(self, reason: str) -> None:
        if self.restarts >= self.max_restarts:
            raise RuntimeDiedError(
                f"arm '{self.arm}': a runtime died after {self.restarts} restart(s) (max_restarts "
                f"{self.max_restarts}); finished problems are saved, --resume continues the run. Last error: {reason}"
            )
        self.solver.close()
        self.restarts += 1
        self.solver = self.start()

    def give_back(self) -> None:
        self.solver.give_back()

    def close(self) -> None:
        self.solver.close()


# ---------------------------------------------------------------------------------------------------------
# The run


@dataclass
class RunOutcome:
    run_dir: Path
    written: int  # result lines written by this process
    failed: int  # failed lines written by this process
    restarts: int
    interrupted: bool
    complete: bool
    summary: str  # the markdown report


def new_run_dir(experiment: Experiment) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(experiment.config.output_dir) / f"{experiment.config.name}-{stamp}"


class EvalRun:
    def __init__(self, experiment: Experiment, run_dir: str | Path, progress: bool | None = None,
                 log: Callable[[str], None] | None = None, timeline: str | Path | None = None):
        """`timeline`: a folder to draw each draw's timeline into (`sgl_tts.app.timeline`; not stored in the
        results)."""
        self.timeline = Path(timeline) if timeline else None
        self.experiment = experiment
        self.config = experiment.config
        self.run_dir = Path(run_dir)
        self.store = ResultStore(self.run_dir / RESULTS_FILE)
        self.progress = progress
        self._log = log
        self.fingerprint_sha = config_hash(experiment.fingerprint())  # the folder holds this experiment only
        self._died: set[str] = set()  # scripted die_on ids already used
        self._died_lock = threading.Lock()
        self.pool: Any = None  # SessionPool: the previous arm's runtimes, offered to the next (reuse_runtimes)
        self.active: ArmRuntimes | None = None  # the running arm's runtimes

    def log(self, message: str) -> None:
        if self._log is not None:
            self._log(message)
        else:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    # -- checks before anything starts -------------------------------------------------------------------
    def load_problems(self) -> dict[str, list[Problem]]:
        from eval.experiment import half_of

        problems = {}
        for selection in self.config.datasets:
            loaded = load_problems(selection.name, limit=selection.limit, offset=selection.offset, ids=selection.ids,
                                   question_field=selection.question_field, gold_field=selection.gold_field,
                                   id_field=selection.id_field, gold_format=selection.gold_format,
                                   split=selection.split, skip_malformed=selection.skip_malformed)
            if loaded.skipped_lines:
                self.log(f"{loaded.source}: skipped {loaded.skipped_lines} malformed line(s)")
            problems[selection.key] = half_of(list(loaded.problems), selection.half)
        return problems

    def check_arms(self) -> None:
        """Every arm's program (and, on SGLang, model) exists: fail before any runtime starts."""
        from sgl_tts.search.programs import load_program

        for index, arm in enumerate(self.config.arms):
            arm_config = self.experiment.arm_configs[arm.name]
            try:
                load_program(arm_config.search.program)
            except KeyError as exc:
                raise ConfigError(f"{self.experiment.source}: arms[{index}] ('{arm.name}'): {exc.args[0]}") from None
            if self.config.backend == "sglang":
                from sgl_tts.runtime.models import resolve_model

                for runtime in (arm_config.generator, arm_config.scorer.runtime, getattr(arm_config, "target", None)):
                    if hasattr(runtime, "model"):  # a RuntimeConfig (not None, not "generator")
                        resolve_model(runtime.model)

    def prepare(self) -> dict[str, Any]:
        """Create or reopen the run folder; refuse one that holds a different experiment."""
        from eval.experiment import plain

        self.run_dir.mkdir(parents=True, exist_ok=True)
        previous = self.store.runs()
        stored = {run.get("experiment_sha256") for run in previous}
        if stored and stored != {self.fingerprint_sha}:
            raise ConfigError(
                f"{self.run_dir} holds results of a different experiment (sha256 {sorted(stored)[0][:12]}…, this "
                f"config {self.fingerprint_sha[:12]}…); use another --out folder"
            )
        experiment_file = self.run_dir / EXPERIMENT_FILE
        if not experiment_file.exists():
            write_atomic(experiment_file, yaml.safe_dump(plain(self.config), sort_keys=False))
        header = provenance(self.experiment.fingerprint(), probe_gpu=self.config.backend == "sglang")
        header.update(experiment_sha256=self.fingerprint_sha, source=self.experiment.source,
                      resumed=bool(previous))
        self.store.append_run(header)
        return header

    # -- solving --------------------------------------------------------------------------------------------
    def start_solver(self, arm: str) -> Any:
        config = self.experiment.arm_configs[arm]
        if self.config.backend == "scripted":
            return ScriptedSolver(config, self.config.scripted, self._died, self._died_lock)
        self.log(f"arm '{arm}': starting runtimes ({config.generator.model} on {config.generator.device})")
        if self.pool is None:
            from sgl_tts.app.session import SessionPool

            self.pool = SessionPool()
        solver = SessionSolver(config, self.run_dir / "logs" / arm, self.pool)
        self.log(f"arm '{arm}': runtimes ready in {solver.startup_s:.0f} s"
                 + (f" (kept from the previous arm: {', '.join(solver.reused)})" if solver.reused else ""))
        return solver

    def stop_spare(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def run(self) -> RunOutcome:
        from tqdm import tqdm

        problems = self.load_problems()
        self.check_arms()
        header = self.prepare()
        done = {row_key(r) for r in self.store.records() if not r.get("failed")}
        units = self.experiment.units()
        total = sum(len(problems[u.dataset]) for u in units)
        self.written = self.failed = self.restarts = 0
        interrupted = False
        bar = tqdm(total=total, initial=len(done), unit="problem", desc=self.config.name,
                   disable=None if self.progress is None else not self.progress, file=sys.stderr)
        try:
            for arm in self.config.arms:
                arm_units = [u for u in units if u.arm == arm.name]
                todo = {u.key: [p for p in problems[u.dataset] if u.key + (p.id,) not in done] for u in arm_units}
                if not any(todo.values()):
                    continue
                runtimes = self.active = ArmRuntimes(arm.name, lambda name=arm.name: self.start_solver(name),
                                                     self.config.max_restarts)
                finished = False
                try:
                    for unit in arm_units:
                        if todo[unit.key]:
                            bar.set_postfix(arm=unit.arm, dataset=unit.dataset, n=unit.n, seed=unit.seed,
                                            rep=unit.repetition)
                            self.run_unit(unit, todo[unit.key], runtimes, header, done, bar)
                    finished = True
                finally:
                    self.restarts += runtimes.restarts
                    self.active = None
                    if finished and self.config.reuse_runtimes:
                        runtimes.give_back()
                    else:
                        runtimes.close()
        except KeyboardInterrupt:
            interrupted = True
            self.log("interrupted: every finished problem is saved; writing a partial summary")
        finally:
            self.stop_spare()
            bar.close()
            finished = {row_key(r) for r in self.store.records() if not r.get("failed")}
            complete = not interrupted and all(u.key + (p.id,) in finished for u in units for p in problems[u.dataset])
            summary = write_report(self.run_dir, self.experiment, partial=not complete)
        return RunOutcome(self.run_dir, self.written, self.failed, self.restarts, interrupted, complete, summary)

    def run_unit(self, unit: Unit, todo: list[Problem], runtimes: ArmRuntimes, header: dict[str, Any],
                 done: set, bar: Any) -> None:
        while todo:
            solver = runtimes.solver
            if self.config.flush_cache:
                refused = solver.flush_cache()
                if refused:
                    self.log(f"warning: radix cache not flushed before {unit.arm} n={unit.n} seed={unit.seed} "
                             f"rep={unit.repetition}: {'; '.join(refused)}")
            row_provenance = self.row_provenance(unit, solver, header)
            retry, reason = [], ""
            pool = ThreadPoolExecutor(max_workers=unit.config.concurrency)
            try:
                futures = {pool.submit(self.solve_one, solver, unit, p, self.timeline is not None): p for p in todo}
                for future in as_completed(futures):
                    problem = futures[future]
                    result, error, wall_s, entries = future.result()
                    if error is not None and not solver.alive():
                        retry.append(problem)
                        reason = reason or f"{type(error).__name__}: {error}"
                        continue
                    self.write_row(unit, problem, result, error, wall_s, entries, solver, runtimes.restarts,
                                   row_provenance)
                    if error is None:
                        done.add(unit.key + (problem.id,))
                    bar.update(1)
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
            leaked = end_leaked_executors(solver.backends())
            if leaked:
                self.log(f"warning: program '{unit.config.search.program}' left {leaked} SGLang program state(s) "
                         "running (their threads would keep the process alive); ended them")
            if retry:
                self.log(f"arm '{unit.arm}': a runtime died ({reason.splitlines()[0]}); restarting it and "
                         f"solving {len(retry)} problem(s) again")
                runtimes.restart(reason)
            order = {p.id: i for i, p in enumerate(todo)}
            todo = sorted(retry, key=lambda p: order[p.id])

    @staticmethod
    def solve_one(solver: Any, unit: Unit, problem: Problem, timeline: bool = False
                  ) -> tuple[SearchResult | None, Exception | None, float, list]:
        began = time.monotonic()  # before the context, whose own clock (the result's total_s) starts when it is made
        search = dataclasses.replace(unit.config.search, record_timeline=True) if timeline else unit.config.search
        context = solver.new_search(problem, search)
        try:
            result, error = solver.solve(problem, search, context), None
        except Exception as exc:  # reported per problem; a dead runtime is told apart by the caller
            result, error = getattr(exc, "result", None), exc  # a SearchError keeps the finished candidates
        return result, error, time.monotonic() - began, context.ledger.answered_requests()

    def row_provenance(self, unit: Unit, solver: Any, header: dict[str, Any]) -> dict[str, Any]:
        from eval.experiment import plain

        config = plain(unit.config)
        return {"run_id": header["run_id"], "experiment_sha256": self.fingerprint_sha, "config": config,
                "config_sha256": config_hash(config), "seed": unit.seed, "packages": header["packages"],
                "python": header["python"], "platform": header["platform"], "hardware": header["hardware"],
                "models": solver.describe()}

    def write_row(self, unit: Unit, problem: Problem, result: SearchResult | None, error: Exception | None,
                  wall_s: float, entries: list, solver: Any, session: int, row_provenance: dict[str, Any]) -> None:
        selection = next(d for d in self.config.datasets if d.key == unit.dataset)
        if result is not None and "timeline" in result.extra:
            result = self.draw_timeline(unit, problem, result)
        row = result_line(problem, result, error, arm=unit.arm, dataset=unit.dataset, dataset_name=selection.name,
                          n=unit.n, seed=unit.seed, repetition=unit.repetition, session=session)
        if row["failed"]:
            self.failed += 1
            self.log(f"arm '{unit.arm}' problem '{problem.id}' failed: {row['error'].splitlines()[0]}")
        else:
            row["timing"] = {"runtime_start_s": solver.startup_s, "runtimes_reused": solver.reused,
                             "solve_wall_s": wall_s, **row["timing"],
                             "requests": request_windows([e for e in entries if e.runtime == "generator"])}
            if any(e.runtime == "target" for e in entries):
                row["timing"]["target_requests"] = request_windows([e for e in entries if e.runtime == "target"])
            self.written += 1
        row["provenance"] = row_provenance
        self.store.append(json.loads(json.dumps(row, default=repr)))


    def draw_timeline(self, unit: Unit, problem: Problem, result: SearchResult) -> SearchResult:
        """Draw the draw's timeline into the timeline folder; the result without it (the results file stays as
        it is without --timeline)."""
        from sgl_tts.app.timeline import plot_timeline, safe_name

        self.timeline.mkdir(parents=True, exist_ok=True)
        name = safe_name(f"{unit.arm}-n{unit.n}-seed{unit.seed}-rep{unit.repetition}-{problem.id}")
        plot_timeline(result.extra["timeline"], self.timeline / f"{name}.png",
                      f"{unit.arm} n={unit.n} seed {unit.seed}: {problem.id}, {result.total_time_s:.1f} s")
        return dataclasses.replace(result, extra={k: v for k, v in result.extra.items() if k != "timeline"})


# ---------------------------------------------------------------------------------------------------------
# `sgl-tts eval`


def run_eval(config: str | Path | None = None, out: str | Path | None = None, resume: str | Path | None = None,
             progress: bool | None = None, timeline: str | Path | None = None) -> int:
    """Run (or resume) an experiment and print its summary; returns the exit code (0 complete, 1 incomplete or a
    runtime died, 130 interrupted). `config`: the experiment YAML, else `resume`'s experiment.yaml; `out`: the run
    folder (default: a new one under the experiment's output_dir); `progress`: the bar (None: when a terminal)."""
    from eval.experiment import load_experiment

    if out and resume and Path(out).resolve() != Path(resume).resolve():
        raise ConfigError("give --out or --resume, not two different folders")
    run_dir = resume or out
    if config:
        experiment = load_experiment(config)
    elif resume:
        experiment = load_experiment(Path(resume) / EXPERIMENT_FILE)
    else:
        raise ConfigError("sgl-tts eval needs --config FILE or --resume RUN_DIR")
    if resume and not (Path(resume) / RESULTS_FILE).is_file():
        raise ConfigError(f"nothing to resume: {Path(resume) / RESULTS_FILE} does not exist")
    run = EvalRun(experiment, run_dir or new_run_dir(experiment), progress=progress, timeline=timeline)
    with folder_lock(run.run_dir, "running sgl-tts eval on it"):  # one eval writes a run folder at a time
        print(f"sgl-tts eval: {experiment.source} -> {run.run_dir}", flush=True)
        try:
            outcome = run.run()
        except RuntimeDiedError as exc:
            print(f"sgl-tts eval: error: {exc}", file=sys.stderr)
            return 1
    print(outcome.summary, flush=True)
    print(f"results: {outcome.run_dir / RESULTS_FILE}  summary: {outcome.run_dir / 'summary.md'}", flush=True)
    if outcome.interrupted:
        return 130
    return 0 if outcome.complete else 1
