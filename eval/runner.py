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
previous arm's keeps those runtimes (`Session(reuse=...)`), and every unit starts with flushed radix caches
(`flush_cache`), so no cell reuses another's prefixes.

Timing windows, each kept apart (edge-inference evaluation §VI):
  runtime_start_s      Session start: launching the servers until each answered a first request
                       (model load, server init, warm-up); once per runtime start, restarts included;
                       `runtimes_reused` names the runtimes kept from the previous arm instead.
  total_s              the program's whole search of one problem (SearchResult.total_time_s), split into
  generator_s, verifier_s   the program's generator and verifier time (SearchTracker).
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

import argparse
import dataclasses
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from sgl_tts.problems import DATASETS, Problem, load_problems
from eval.report import RESULTS_FILE, row_key, write_report
from eval.results import ResultStore, config_hash, provenance
from sgl_tts.config import ConfigError
from sgl_tts.app.metrics import problem_metrics, summarize
from sgl_tts.search.records import SearchResult
from sgl_tts.runtime.server import RuntimeDiedError

if TYPE_CHECKING:  # eval.experiment imports sgl_tts.app.session, which imports sglang (seconds): not for --help
    from eval.experiment import Experiment, ScriptedOptions, Unit
    from sgl_tts.app.session import RunConfig

EXPERIMENT_FILE = "experiment.yaml"
SCRIPTED_PROMPT = "Q: {question}\n\n"


# ---------------------------------------------------------------------------------------------------------
# Per-request timings


class RequestLog:
    """Timings of every `generate` call of a frontend backend, attributed to the problem being solved.

    SGLang's frontend runs each fork in a thread of its own, so a request is matched to a problem by its text:
    it starts with that problem's prompt (the longest match wins; two problems with the same prompt in flight
    at once cannot be told apart and their requests go to the first).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets = count()
        self._prompts: dict[int, tuple[str, ...]] = {}
        self._entries: dict[int, list[dict[str, Any]]] = {}

    def instrument(self, backend: Any, name: str = "generator") -> None:
        """Observe every request of `backend` (a `SearchBackend`, per-run views included); entries carry `name`."""
        backend.observe(lambda text, seconds, meta: self._add(name, text, seconds, meta or {}))

    def begin(self, *prompts: str) -> int:
        """Start collecting for one problem, whose requests start with one of `prompts`."""
        with self._lock:
            ticket = next(self._tickets)
            self._prompts[ticket] = prompts
            self._entries[ticket] = []
            return ticket

    def end(self, ticket: int) -> list[dict[str, Any]]:
        with self._lock:
            self._prompts.pop(ticket, None)
            return self._entries.pop(ticket, [])

    def _add(self, backend: str, text: str, client_s: float, meta: dict[str, Any]) -> None:
        entry = {"backend": backend, "client_s": client_s, "completion_tokens": meta.get("completion_tokens"),
                 "e2e_latency": meta.get("e2e_latency"), "first_token_latency": meta.get("first_token_latency"),
                 "queue_time": meta.get("queue_time")}
        with self._lock:
            matches = [(len(prompt), -ticket) for ticket, prompts in self._prompts.items() for prompt in prompts
                       if text.startswith(prompt)]
            if matches:
                self._entries[-max(matches)[1]].append(entry)


def _brief(values: list[float]) -> dict[str, float | int] | None:
    if not values:
        return None
    stats = summarize(values)
    return {key: stats[key] for key in ("n", "mean", "p50", "p90", "max")}


def request_windows(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-problem summaries (n, mean, p50, p90, max) of each request timing window; None when not reported."""
    def column(fn: Callable[[dict[str, Any]], float | None]) -> dict[str, float | int] | None:
        values = []
        for entry in entries:
            value = fn(entry)
            if value is not None:
                values.append(float(value))
        return _brief(values)

    def prompt_processing(e):
        if e["first_token_latency"] is None or e["queue_time"] is None:
            return None
        return max(0.0, e["first_token_latency"] - e["queue_time"])

    def decode_per_token(e):
        tokens = e["completion_tokens"] or 0
        if e["e2e_latency"] is None or e["first_token_latency"] is None or tokens < 2:
            return None
        return max(0.0, e["e2e_latency"] - e["first_token_latency"]) / (tokens - 1)

    return {
        "requests": len(entries),
        "client_s": column(lambda e: e["client_s"]),
        "server_e2e_s": column(lambda e: e["e2e_latency"]),
        "first_token_s": column(lambda e: e["first_token_latency"]),
        "queue_s": column(lambda e: e["queue_time"]),
        "prompt_processing_s": column(prompt_processing),
        "decode_s_per_token": column(decode_per_token),
    }


def end_leaked_executors(backends: list[Any]) -> int:
    """End the SGLang frontend executors on `backends` (and their per-run views) that are still running.

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

    def __init__(self, config: RunConfig, log_dir: Path, reuse: dict[str, Any] | None = None):
        from sgl_tts.app.session import Session

        self.config = config
        config = dataclasses.replace(config, log_dir=config.log_dir or str(log_dir))
        offered = {id(runtime) for runtime in (reuse or {}).values()}
        self.session = Session(config, reuse=reuse) if reuse else Session(config)
        self.startup_s = self.session.started_s
        self.reused = sorted(name for name, rt in self.session.runtimes.items() if id(rt) in offered)
        self.requests = RequestLog()
        runtimes = self.session.search_runtimes
        self.requests.instrument(runtimes.generator)
        if runtimes.target is not None and runtimes.target is not runtimes.generator:
            self.requests.instrument(runtimes.target, "target")  # RSD's target model

    def backends(self) -> list[Any]:
        runtimes = self.session.search_runtimes
        return [backend for backend in (runtimes.generator, runtimes.target) if backend is not None]

    def prompts(self, question: str) -> tuple[str, ...]:
        """The prompt texts this problem's requests start with (the target's own chat format too)."""
        runtimes = self.session.search_runtimes
        target_prompt = runtimes.extras.get("target_prompt")
        return (runtimes.prompt(question),) + ((target_prompt(question),) if target_prompt else ())

    def solve(self, problem: Problem, search: Any) -> SearchResult:
        return self.session.solve(problem, search)

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
        import urllib.error
        import urllib.request

        refused = []
        for name, runtime in self.session.runtimes.items():
            if runtime.config.is_embedding:
                continue
            request = urllib.request.Request(runtime.url + "/flush_cache?timeout=30", data=b"")
            try:
                urllib.request.urlopen(request, timeout=60).read()
            except (urllib.error.URLError, OSError) as exc:
                refused.append(f"{name} ({exc})")
        return refused

    def describe(self) -> dict[str, Any]:
        tokenizer = self.session.tokenizer
        models = {
            name: {"model": rt.config.model, "path": rt.model_path, "revision": model_revision(rt.model_path),
                   "device": rt.config.device, "precision": _precision(rt), "server": rt.model_info}
            for name, rt in self.session.runtimes.items()
        }
        models["tokenizer"] = {"name_or_path": tokenizer.name_or_path, "class": type(tokenizer).__name__,
                               "vocab_size": len(tokenizer)}
        models["scorer_kind"] = self.config.scorer.kind
        return models

    def detach(self) -> dict[str, Any]:
        """Hand the running runtimes over for the next arm (Session reuse) instead of stopping them."""
        return self.session.detach()

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
        self.requests = RequestLog()
        self.flush_cache()
        self.dead = False
        self._died, self._lock = died, lock
        self.startup_s = time.monotonic() - began
        self.reused: list[str] = []

    def backends(self) -> list[Any]:
        return [self.runtimes.generator]

    def prompts(self, question: str) -> tuple[str, ...]:
        return (self.runtimes.prompt(question),)

    def solve(self, problem: Problem, search: Any) -> SearchResult:
        with self._lock:
            if not self.dead and problem.id in self.options.die_on and problem.id not in self._died:
                self._died.add(problem.id)
                self.dead = True
            if self.dead:
                raise RuntimeDiedError(f"scripted runtime died (simulated at problem '{problem.id}')")
        time.sleep(self.options.delay_s)
        return self.program(problem, search, self.runtimes)

    def alive(self) -> bool:
        return not self.dead

    def flush_cache(self) -> list[str]:
        """A fresh scripted model: its per-text variant counters and prefix cache start empty, so a unit's
        results depend on nothing solved before it (as a flushed radix cache and a fixed seed would)."""
        from sgl_tts.testing import ScriptedBackend, ScriptedModel

        backend = ScriptedBackend(ScriptedModel(answer_depth=self.options.answer_depth, answers=self.options.answers))
        self.requests.instrument(backend)
        self.runtimes.generator = backend
        return []

    def describe(self) -> dict[str, Any]:
        return {"generator": {"model": "scripted", "revision": None, "precision": None},
                "scorer_kind": "scripted", "options": dataclasses.asdict(self.options)}

    def detach(self) -> dict[str, Any]:
        return {}

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

    def detach(self) -> dict[str, Any]:
        return self.solver.detach()

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
                 log: Callable[[str], None] | None = None):
        self.experiment = experiment
        self.config = experiment.config
        self.run_dir = Path(run_dir)
        self.store = ResultStore(self.run_dir / RESULTS_FILE)
        self.progress = progress
        self._log = log
        self.fingerprint_sha = config_hash(experiment.fingerprint())  # the folder holds this experiment only
        self._died: set[str] = set()  # scripted die_on ids already used
        self._died_lock = threading.Lock()
        self._spare: dict[str, Any] = {}  # the previous arm's runtimes, offered to the next (reuse_runtimes)
        self.active: ArmRuntimes | None = None  # the running arm's runtimes

    def log(self, message: str) -> None:
        if self._log is not None:
            self._log(message)
        else:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    # -- checks before anything starts -------------------------------------------------------------------
    def load_problems(self) -> dict[str, list[Problem]]:
        problems = {}
        for selection in self.config.datasets:
            loaded = load_problems(selection.name, limit=selection.limit, offset=selection.offset, ids=selection.ids,
                                   question_field=selection.question_field, gold_field=selection.gold_field,
                                   id_field=selection.id_field, gold_format=selection.gold_format,
                                   split=selection.split, skip_malformed=selection.skip_malformed)
            if loaded.skipped_lines:
                self.log(f"{loaded.source}: skipped {loaded.skipped_lines} malformed line(s)")
            problems[selection.key] = list(loaded.problems)
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
            experiment_file.write_text(yaml.safe_dump(plain(self.config), sort_keys=False))
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
        spare, self._spare = self._spare, {}
        solver = SessionSolver(config, self.run_dir / "logs" / arm, reuse=spare)
        self.log(f"arm '{arm}': runtimes ready in {solver.startup_s:.0f} s"
                 + (f" (kept from the previous arm: {', '.join(solver.reused)})" if solver.reused else ""))
        return solver

    def stop_spare(self) -> None:
        from sgl_tts.runtime.server import Runtime

        for runtime in self._spare.values():
            if isinstance(runtime, Runtime):
                runtime.stop()
        self._spare = {}

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
                        self._spare = runtimes.detach()
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
                futures = {pool.submit(self.solve_one, solver, unit, p): p for p in todo}
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
    def solve_one(solver: Any, unit: Unit, problem: Problem) -> tuple[SearchResult | None, Exception | None, float, list]:
        ticket = solver.requests.begin(*solver.prompts(problem.question))
        began = time.monotonic()
        try:
            result, error = solver.solve(problem, unit.config.search), None
        except Exception as exc:  # reported per problem; a dead runtime is told apart by the caller
            result, error = getattr(exc, "result", None), exc  # a SearchError keeps the finished candidates
        return result, error, time.monotonic() - began, solver.requests.end(ticket)

    def row_provenance(self, unit: Unit, solver: Any, header: dict[str, Any]) -> dict[str, Any]:
        from eval.experiment import plain

        config = plain(unit.config)
        return {"run_id": header["run_id"], "experiment_sha256": self.fingerprint_sha, "config": config,
                "config_sha256": config_hash(config), "seed": unit.seed, "packages": header["packages"],
                "python": header["python"], "platform": header["platform"], "hardware": header["hardware"],
                "models": solver.describe()}

    def write_row(self, unit: Unit, problem: Problem, result: SearchResult | None, error: Exception | None,
                  wall_s: float, entries: list, solver: Any, session: int, row_provenance: dict[str, Any]) -> None:
        row: dict[str, Any] = {"problem_id": problem.id, "arm": unit.arm, "dataset": unit.dataset, "n": unit.n,
                               "seed": unit.seed, "repetition": unit.repetition, "session": session}
        if error is None:
            selection = next(d for d in self.config.datasets if d.key == unit.dataset)
            try:
                metrics = problem_metrics(result, problem.gold, selection.name if selection.name in DATASETS else None,
                                          pass_ns=[unit.n])
            except Exception as exc:  # e.g. grading could not run: keep the search, mark the line failed
                error = exc
        if error is not None:
            row.update(failed=True, error=f"{type(error).__name__}: {error}")
            if result is not None:
                row["result"] = result.to_dict()
            self.failed += 1
            self.log(f"arm '{unit.arm}' problem '{problem.id}' failed: {row['error'].splitlines()[0]}")
        else:
            row.update(
                failed=False,
                metrics=metrics,
                timing={"runtime_start_s": solver.startup_s, "runtimes_reused": solver.reused,
                        "solve_wall_s": wall_s, "total_s": result.total_time_s,
                        "generator_s": result.generator_time_s, "verifier_s": result.verifier_time_s,
                        "requests": request_windows([e for e in entries if e["backend"] == "generator"])},
                result=result.to_dict(),
            )
            if any(e["backend"] == "target" for e in entries):
                row["timing"]["target_requests"] = request_windows([e for e in entries if e["backend"] == "target"])
            self.written += 1
        row["provenance"] = row_provenance
        # A program may put objects that JSON cannot hold into `extra`: store their repr rather than fail.
        self.store.append(json.loads(json.dumps(row, default=repr)))


# ---------------------------------------------------------------------------------------------------------
# Command line


def add_eval_parser(commands: Any) -> None:
    parser = commands.add_parser("eval", help="run an experiment's arms side by side; resumable; report + plots")
    parser.add_argument("--config", help="experiment config (YAML), e.g. eval/configs/cpu-default.yaml")
    parser.add_argument("--out", help="run folder (an existing one is resumed: same experiment only)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="resume a run folder (with its experiment.yaml "
                                                             "unless --config is given)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=cmd_eval)
    from eval.verifier import add_verifier_parser

    # Optional, so that `sgl-tts eval --config ...` runs an experiment as before.
    add_verifier_parser(parser.add_subparsers(dest="eval_command", required=False, metavar="{verifier}"))


def cmd_eval(args: argparse.Namespace) -> int:
    from eval.experiment import load_experiment

    if args.out and args.resume and Path(args.out).resolve() != Path(args.resume).resolve():
        raise ConfigError("give --out or --resume, not two different folders")
    run_dir = args.resume or args.out
    if args.config:
        experiment = load_experiment(args.config)
    elif args.resume:
        experiment = load_experiment(Path(args.resume) / EXPERIMENT_FILE)
    else:
        raise ConfigError("sgl-tts eval needs --config FILE or --resume RUN_DIR")
    if args.resume and not (Path(args.resume) / RESULTS_FILE).is_file():
        raise ConfigError(f"nothing to resume: {Path(args.resume) / RESULTS_FILE} does not exist")
    run = EvalRun(experiment, run_dir or new_run_dir(experiment), progress=False if args.no_progress else None)
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


if __name__ == "__main__":
    from sgl_tts.app.cli import main

    sys.exit(main(["eval", *sys.argv[1:]]))
