"""`sgl-tts bench peers`: its-hub and optillm, called as their users call them, against sgl-tts's programs, on the
same SGLang generator (and the same PRM runtime) that a sgl-tts Session starts.

Every system gets the run config's search settings: n, temperature, the token limits (whole solutions
`max_tokens`; step search `max_steps` steps of at most `max_step_tokens`), the step delimiter and aggregation,
the system prompt of sgl-tts's chat prompt (`frontend.backend.SYSTEM_PROMPT`), and top_p 1.0, SGLang's default,
which the peers never send (a config with another top_p is refused). Every final text is graded by the project's
answer key (`answer_key`) against the same gold answer (`search.grading.grade`).

The systems (`SYSTEMS`), by algorithm, with the request pattern each one sends (`System.pattern`):
- self-consistency: its-hub `SelfConsistency`, its vote projected by the project's answer key (`vote_key`);
  optillm's `majority_voting` plugin stock, and with the project's `\\boxed{}`-first extraction in place of the
  plugin's `extract_final_answer`; sgl-tts `self_consistency`.
- best-of-N with the PRM: its-hub `BestOfN` with the run's PRM behind its outcome-scorer interface
  (`its_hub_adapters.ProbeOutcomeRewardModel`); sgl-tts `best_of_n`, score-weighted vote and argmax (`best`),
  and first to end (`first_to_end`: the first sample to end with an answer is the answer, short-1@n), with the
  run's first-step cut and without it (`first_to_end_uncut`).
- step search with the PRM: its-hub `BeamSearch` and `ParticleFiltering` with the PRM behind its
  `AbstractProcessRewardModel` (`its_hub_adapters.ProbeProcessRewardModel`), the step token the config's delimiter,
  the stop token `\\boxed` (the system prompt asks for the answer in one), at most `max_steps` steps (its-hub
  checks `len(steps so far) >= max_steps` before the step it just made counts, so it is handed max_steps − 1);
  its-hub's beam width is the number of beams kept, n / M for sgl-tts's M = `beam_width` children per kept beam;
  sgl-tts `beam_search`, `dvts` and `deepconf` (its default settings).

How the peers are reached: its-hub through its `OpenAICompatibleLanguageModel` on the generator's
`/v1/chat/completions` (`its_hub_adapters.CountingLanguageModel` logs each request body); optillm's plugin through
an `openai.OpenAI` client whose httpx transport logs each request and response (`CountingTransport`). optillm's
package imports its whole proxy server on `import optillm` (flask, the Cerebras SDK, z3, ...: dependencies the
`peers` extra does not install), so the plugin file is loaded the way optillm's own server loads its plugins
(`load_plugins`: `importlib.util.spec_from_file_location` on the file) and its `run` called as the server calls
it (`execute_single_approach`: system prompt, query, client, model, request config).

Measured per system and problem (`measure_problem`): whether it is right, the wall time at the client (PRM calls
included), the generator's and the PRM runtime's prompt, generated and cached tokens and requests from SGLang's
own Prometheus counters (`/metrics` deltas; the runtimes are started with `--enable-metrics`), and the requests
the client sent (its-hub and optillm: the logs above; sgl-tts: the search's ledger; the PRM: its scorers' counts).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import httpx

from sgl_tts.bench.fasttts import server_counters
from sgl_tts.frontend.backend import SYSTEM_PROMPT
from sgl_tts.search.api import SearchConfig
from sgl_tts.search.grading import answer_at_end, extract_answer, grade, normalize_answer
from sgl_tts.search.stopping import Stopping

ALGORITHMS = ("self_consistency", "best_of_n", "step_search")
COUNTERS = {"prompt_tokens": "sglang:prompt_tokens_total", "generated_tokens": "sglang:generation_tokens_total",
            "cached_tokens": "sglang:cached_tokens_total", "requests": "sglang:num_requests_total"}
STOP_TOKEN = "\\boxed"  # its-hub's step search stops a path at the step that holds it
API_KEY = "sgl-tts-bench"  # the runtimes ask for none; the clients want one
OPTILLM_PLUGIN = "optillm/plugins/majority_voting_plugin.py"


class PeerMissing(RuntimeError):
    """A peer library is not installed (the `peers` extra: `make peers`)."""


# ---- the answer key: the same for every system --------------------------------------------------------------


def answer_key(text: str | None, finish_reason: str | None = None) -> str | None:
    """The answer of a final text as sgl-tts's programs take it: the marked answer (`extract_answer`), else, unless
    the text was cut at the token limit (`finish_reason` 'length'), the last number of its last line
    (`answer_at_end`). Step search's finish reason is not known to its-hub's result: its texts count as ended."""
    marked = extract_answer(text)
    if marked is not None or finish_reason == "length":
        return marked
    return answer_at_end(text)


def vote_key(text: str) -> Any:
    """its-hub SelfConsistency's projection: the normalised answer; a text without one votes alone."""
    answer = answer_key(text)
    return normalize_answer(answer) if answer is not None else ("no answer", text)


# ---- counting ------------------------------------------------------------------------------------------------


class RequestLog:
    """Request bodies a client sent and the JSON answers it got (thread-safe), cleared per problem."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bodies: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []

    def add(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.bodies.append(body)

    def answered(self, answer: dict[str, Any]) -> None:
        with self._lock:
            self.answers.append(answer)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.bodies)

    def clear(self) -> None:
        with self._lock:
            self.bodies.clear()
            self.answers.clear()

    def finish_reason(self, content: str) -> str | None:
        """The finish reason of the logged choice whose message is `content` (None: no such choice)."""
        with self._lock:
            for answer in self.answers:
                for choice in answer.get("choices") or ():
                    if (choice.get("message") or {}).get("content") == content:
                        return choice.get("finish_reason")
        return None


class CountingTransport(httpx.BaseTransport):
    """An httpx transport that logs each request's JSON body and its JSON answer in `log`, then hands on."""

    def __init__(self, log: RequestLog, inner: httpx.BaseTransport | None = None):
        self.log = log
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.log.add(_json_or_text(request.content))
        response = self.inner.handle_request(request)
        response.read()
        answer = _json_or_text(response.content)
        if isinstance(answer, dict):
            self.log.answered(answer)
        return response

    def close(self) -> None:
        self.inner.close()


def _json_or_text(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return {"text": content.decode(errors="replace")}


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


# ---- what the systems run on ---------------------------------------------------------------------------------


@dataclass
class PeerRuntimes:
    """The runtimes every system shares: the generator's URL and served model name, the generator's prompt format,
    the PRM scorer for the peers (one of its own), the runtimes whose /metrics are read, and the Session the sgl-tts
    programs run in."""

    url: str
    model: str
    prompt: Callable[[str], str]  # question -> the generator's prompt text (sgl-tts's chat prompt)
    generator: Any  # what /metrics is read from (has .url)
    prm: Any = None  # the PRM runtime (None: the scorer has none of its own)
    peer_scorer: Any = None  # a StepScorer for the peers' reward models
    session: Any = None  # sgl_tts.app.session.Session, for the sgl-tts systems
    log: RequestLog = field(default_factory=RequestLog)  # the peers' generator requests

    @classmethod
    def of_session(cls, session: Any) -> "PeerRuntimes":
        from sgl_tts.runtime.http_client import http_json
        from sgl_tts.scoring.factory import make_scorer

        generator = session.runtimes["generator"]
        prm = session.runtimes.get("scorer")
        model = http_json(generator.url + "/v1/models", timeout=60)["data"][0]["id"]
        scorer = make_scorer(session.config.scorer, prm or generator, session.scorer_tokenizer)
        return cls(generator.url, model, session.search_runtimes.prompt, generator, prm, scorer, session)

    def counters(self) -> dict[str, dict[str, float] | None]:
        return {"generator": server_counters(self.generator, COUNTERS),
                "prm": server_counters(self.prm, COUNTERS) if self.prm is not None else None}

    def prm_client_requests(self) -> int:
        scorers = [self.peer_scorer, getattr(getattr(self.session, "search_runtimes", None), "scorer", None)]
        return sum(scorer.requests for scorer in {id(s): s for s in scorers if s is not None}.values())

    def path_scorer(self, search: SearchConfig) -> Any:
        from sgl_tts.bench.its_hub_adapters import PathScorer

        if self.peer_scorer is None:
            raise ValueError("the peers' reward models need a scorer: the run config's `scorer`")
        return PathScorer(self.peer_scorer, self.prompt, search.step_delimiter, search.max_steps, search.aggregation)

    def openai_client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY,
                             http_client=httpx.Client(transport=CountingTransport(self.log), timeout=3600))


@dataclass(frozen=True)
class Answer:
    text: str | None  # the system's final text
    answer: str | None  # its answer by the answer key (sgl-tts: the program's own)
    generator_requests: int | None = None  # the client's count, when the system keeps its own (sgl-tts's ledger)


Solve = Callable[[PeerRuntimes, Any, SearchConfig], Answer]


@dataclass(frozen=True)
class System:
    name: str
    family: str  # its-hub, optillm, sgl-tts
    algorithm: str  # one of ALGORITHMS
    pattern: str  # the requests it sends, in words
    solve: Solve
    reference: bool = False  # the sgl-tts system its algorithm's others are paired with (McNemar)
    counterpart: str | None = None  # the sgl-tts system this one is paired with instead, where both ran


# ---- its-hub --------------------------------------------------------------------------------------------------


def _its_hub() -> ModuleType:
    try:
        import its_hub
    except ImportError as exc:
        raise PeerMissing(f"its-hub is not installed ({exc}): `make peers` installs the peers extra") from None
    return its_hub


def its_hub_model(runtimes: PeerRuntimes, search: SearchConfig, max_tokens: int) -> Any:
    """its-hub's client of the generator as its users make one: endpoint, model, system prompt, temperature and
    the completion token limit (its default for every request it sends); raw choices kept for finish reasons."""
    _its_hub()
    from sgl_tts.bench.its_hub_adapters import CountingLanguageModel

    return CountingLanguageModel(endpoint=runtimes.url + "/v1", api_key=API_KEY, model_name=runtimes.model,
                                 system_prompt=SYSTEM_PROMPT, max_completion_tokens=max_tokens,
                                 temperature=search.temperature, include_raw_choices=True, log=runtimes.log)


def _of_message(message: dict[str, Any]) -> Answer:
    text = message.get("content")
    return Answer(text, answer_key(text, (message.get("_raw_choice") or {}).get("finish_reason")))


def its_hub_self_consistency(runtimes: PeerRuntimes, problem: Any, search: SearchConfig) -> Answer:
    its_hub = _its_hub()
    algorithm = its_hub.SelfConsistency(consistency_space_projection_func=vote_key)
    result = algorithm.infer(its_hub_model(runtimes, search, search.max_tokens), problem.question, search.n,
                             return_response_only=False)
    return _of_message(result.the_one)


def its_hub_best_of_n(runtimes: PeerRuntimes, problem: Any, search: SearchConfig) -> Answer:
    its_hub = _its_hub()
    from sgl_tts.bench.its_hub_adapters import ProbeOutcomeRewardModel

    algorithm = its_hub.BestOfN(ProbeOutcomeRewardModel(runtimes.path_scorer(search)))
    result = algorithm.infer(its_hub_model(runtimes, search, search.max_tokens), problem.question, search.n,
                             return_response_only=False)
    return _of_message(result.the_one)


def step_generation(search: SearchConfig) -> Any:
    """its-hub's StepGeneration for the config: its delimiter, `STOP_TOKEN`, at most `max_steps` steps."""
    _its_hub()
    from its_hub.core.lms.step_generation import StepGeneration

    return StepGeneration(max_steps=search.max_steps - 1, step_token=search.step_delimiter, stop_token=STOP_TOKEN,
                          temperature=search.temperature)


def its_hub_beam_width(search: SearchConfig) -> int:
    """its-hub's `beam_width` (beams kept) for sgl-tts's n and M: n / M kept, each continued M ways."""
    kept = max(1, search.n // search.beam_width)
    if search.n % kept:
        raise ValueError(f"search.n: its-hub's BeamSearch needs n divisible by the beams kept (n // beam_width = "
                         f"{kept}); got n={search.n}")
    return kept


def its_hub_beam_search(runtimes: PeerRuntimes, problem: Any, search: SearchConfig) -> Answer:
    _its_hub()
    from its_hub.core.algorithms.beam_search import BeamSearch

    from sgl_tts.bench.its_hub_adapters import ProbeProcessRewardModel

    algorithm = BeamSearch(step_generation(search), ProbeProcessRewardModel(runtimes.path_scorer(search)),
                           beam_width=its_hub_beam_width(search))
    result = algorithm.infer(its_hub_model(runtimes, search, search.max_step_tokens), problem.question, search.n,
                             return_response_only=False)
    return _of_message(result.the_one)


def its_hub_particle_filtering(runtimes: PeerRuntimes, problem: Any, search: SearchConfig) -> Answer:
    _its_hub()
    from its_hub.core.algorithms.particle_gibbs import ParticleFiltering

    from sgl_tts.bench.its_hub_adapters import ProbeProcessRewardModel

    algorithm = ParticleFiltering(step_generation(search), ProbeProcessRewardModel(runtimes.path_scorer(search)))
    result = algorithm.infer(its_hub_model(runtimes, search, search.max_step_tokens), problem.question, search.n,
                             return_response_only=False)
    return _of_message(result.the_one)


# ---- optillm --------------------------------------------------------------------------------------------------


def optillm_majority_voting(boxed: bool) -> ModuleType:
    """A fresh instance of optillm's majority-voting plugin, loaded as optillm's server loads plugins; with
    `boxed`, its `extract_final_answer` is the project's `extract_answer` (the last `\\boxed{}` first), the whole
    response when that finds none (the plugin's own fallback)."""
    try:
        path = importlib.metadata.distribution("optillm").locate_file(OPTILLM_PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        raise PeerMissing("optillm is not installed: `make peers` installs the peers extra") from None
    spec = importlib.util.spec_from_file_location("majority_voting_plugin", str(path))
    if spec is None or not path.exists():
        raise PeerMissing(f"optillm is installed without its plugin {OPTILLM_PLUGIN}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if boxed:
        module.extract_final_answer = lambda response: extract_answer(response) or response
    return module


def optillm_solver(boxed: bool) -> Solve:
    def solve(runtimes: PeerRuntimes, problem: Any, search: SearchConfig) -> Answer:
        plugin = optillm_majority_voting(boxed)
        config = {"k": search.n, "temperature": search.temperature, "max_tokens": search.max_tokens}
        text, _ = plugin.run(SYSTEM_PROMPT, problem.question, runtimes.openai_client(), runtimes.model, config)
        return Answer(text, answer_key(text, runtimes.log.finish_reason(text)))

    return solve


# ---- sgl-tts --------------------------------------------------------------------------------------------------


def first_to_end(stopping: Stopping) -> Stopping:
    """short-1@n (Hassid et al. 2025, shorter chains preferred): the run's stopping with its vote settled by the
    first sample to end with an answer, whatever the others will say; the samples still being written are aborted.
    Sent together, a search's samples end shortest first, and this model's short samples are its right ones more
    often (docs/stopping.md). The first-step cut (`prune`) stays as the run sets it."""
    return dataclasses.replace(stopping, rule="settled", min_answers=1, agree=1, programs=())


def first_to_end_uncut(stopping: Stopping) -> Stopping:
    """`first_to_end` without the first-step cut: no verifier call at all, so nothing but the samples' own decoding
    stands between the prompt and the answer."""
    return dataclasses.replace(first_to_end(stopping), prune=0.0)


def sgl_tts_solver(program: str, selection: str | None = None,
                   stopping: Callable[[Stopping], Stopping] | None = None) -> Solve:
    """A sgl-tts program in the Session, as `sgl-tts run` solves (`Session.solve`), its own answer and ledger;
    `stopping`, where given, maps the run's stopping rules (`--stopping`) to this system's."""

    def solve(runtimes: PeerRuntimes, problem: Any, search: SearchConfig) -> Answer:
        search = dataclasses.replace(search, program=program, selection=selection or search.selection,
                                     stopping=stopping(search.stopping) if stopping else search.stopping)
        context = runtimes.session.new_search(problem, search)
        result = runtimes.session.solve(problem, search, context)
        if result.error:
            raise RuntimeError(result.error)
        text = result.candidates[0].text if result.candidates else None
        return Answer(text, result.answer, context.ledger.requests)

    return solve


FORK = "one fork of the prompt: its prefill, then n concurrent sampling requests"
ITS_HUB_STEPS = ("per step, concurrent requests, one per live path, each sending the path so far as an assistant "
                 "message to continue; then one PRM call re-scoring every path from its first step")
SYSTEMS = (
    System("its-hub SelfConsistency", "its-hub", "self_consistency",
           "n concurrent requests of one sample each (LMOrchestrator, up to 32 at once)", its_hub_self_consistency),
    System("optillm majority_voting", "optillm", "self_consistency", "one request with n", optillm_solver(False)),
    System("optillm majority_voting + boxed", "optillm", "self_consistency", "one request with n",
           optillm_solver(True)),
    System("sgl-tts self_consistency", "sgl-tts", "self_consistency", FORK, sgl_tts_solver("self_consistency"),
           reference=True),
    System("its-hub BestOfN + PRM", "its-hub", "best_of_n",
           "n concurrent requests of one sample each, then one PRM call for the distinct answers", its_hub_best_of_n),
    System("sgl-tts best_of_n weighted", "sgl-tts", "best_of_n", FORK + ", then one PRM call",
           sgl_tts_solver("best_of_n", "weighted"), reference=True),
    System("sgl-tts best_of_n argmax", "sgl-tts", "best_of_n", FORK + ", then one PRM call",
           sgl_tts_solver("best_of_n", "best")),
    System("sgl-tts best_of_n first to end", "sgl-tts", "best_of_n",
           FORK + "; the first sample to end with an answer is the answer, the others aborted (short-1@n)",
           sgl_tts_solver("best_of_n", "weighted", first_to_end)),
    System("sgl-tts best_of_n first to end (no cut)", "sgl-tts", "best_of_n",
           FORK + "; the first sample to end with an answer is the answer, the others aborted; no PRM call",
           sgl_tts_solver("best_of_n", "weighted", first_to_end_uncut)),
    System("its-hub BeamSearch + PRM", "its-hub", "step_search", ITS_HUB_STEPS, its_hub_beam_search),
    System("its-hub ParticleFiltering + PRM", "its-hub", "step_search", ITS_HUB_STEPS, its_hub_particle_filtering,
           counterpart="sgl-tts dvts"),
    System("sgl-tts beam_search", "sgl-tts", "step_search",
           "per step, forks of the kept paths (prefix-cached), concurrent; incremental PRM scoring of the new steps",
           sgl_tts_solver("beam_search"), reference=True),
    System("sgl-tts dvts", "sgl-tts", "step_search",
           "per step, forks of each subtree's kept path, concurrent; incremental PRM scoring of the new steps",
           sgl_tts_solver("dvts")),
    System("sgl-tts deepconf", "sgl-tts", "step_search",
           "a warm-up fork of whole traces, then pieces of the other traces, concurrent, stopped by confidence; no PRM",
           sgl_tts_solver("deepconf")),
)


def systems_named(names: str | None, algorithms: str | None = None) -> list[System]:
    """The systems of `algorithms` (comma-separated, default all) named in `names` (comma-separated, default all)."""
    wanted_algorithms = ALGORITHMS if not algorithms else tuple(a.strip() for a in algorithms.split(","))
    unknown = [a for a in wanted_algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"--algorithms: unknown {unknown}; known: {', '.join(ALGORITHMS)}")
    chosen = [s for s in SYSTEMS if s.algorithm in wanted_algorithms]
    if names:
        wanted = [name.strip() for name in names.split(",")]
        known = {s.name for s in chosen}
        missing = [name for name in wanted if name not in known]
        if missing:
            raise ValueError(f"--systems: unknown {missing}; known: {'; '.join(sorted(known))}")
        chosen = [s for s in chosen if s.name in wanted]
    return chosen


def check_settings(search: SearchConfig) -> None:
    if search.top_p != 1.0:
        raise ValueError(f"search.top_p: its-hub and optillm send no top_p, so SGLang's default 1.0 applies to them; "
                         f"the bench gives every system the same settings: set top_p 1.0 (got {search.top_p})")


# ---- one problem ----------------------------------------------------------------------------------------------


def measure_problem(system: System, problem: Any, search: SearchConfig, runtimes: PeerRuntimes,
                    clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """One system on one problem: its answer graded, its wall time at the client, the runtimes' counter deltas and
    the requests its client sent (generator: the system's own count or the peers' log; PRM: the scorers')."""
    runtimes.log.clear()
    before, prm_before = runtimes.counters(), runtimes.prm_client_requests()
    began = clock()
    answer = system.solve(runtimes, problem, search)
    wall = clock() - began
    after, prm_after = runtimes.counters(), runtimes.prm_client_requests()
    generator_requests = answer.generator_requests if answer.generator_requests is not None else runtimes.log.count
    return {
        "system": system.name, "family": system.family, "algorithm": system.algorithm, "pattern": system.pattern,
        "n": search.n, "problem_id": str(problem.id), "level": problem.meta.get("level"),
        "answer": answer.answer, "gold": problem.gold,
        "correct": None if problem.gold is None else grade(answer.answer, problem.gold),
        "wall_s": wall,
        "generator": counter_delta(before["generator"], after["generator"]),
        "prm": counter_delta(before["prm"], after["prm"]) if after["prm"] is not None else None,
        "client_requests": {"generator": generator_requests, "prm": prm_after - prm_before},
        "text": answer.text,
    }
