"""`sgl-tts bench peers` without a network or a model: its-hub and optillm against a fake OpenAI-compatible server
(stdlib HTTP on 127.0.0.1, scripted answers, Prometheus counters of its own), sgl-tts on the scripted backend, and
the report's math against brute force. The peers' tests skip, saying why, where the `peers` extra is not
installed (`make peers`)."""

import dataclasses
import http.server
import importlib.metadata
import itertools
import json
import random
import re
import threading
from collections import Counter

import numpy as np
import pytest

from sgl_tts.app.session import RunConfig, Session
from sgl_tts.bench.fasttts import read_counters
from sgl_tts.bench.peers import (COUNTERS, SYSTEMS, PeerRuntimes, answer_key, check_settings, counter_delta,
                                 first_to_end, first_to_end_uncut, measure_problem, optillm_solver,
                                 sgl_tts_solver, step_generation, vote_key)
from sgl_tts.frontend.backend import SYSTEM_PROMPT
from sgl_tts.measure.frontier import (cheapest_reaching, cost_to_reach, most_accurate_within, pareto_front,
                                      reach_ratio_interval)
from sgl_tts.measure.stats import mcnemar_exact, wilson_interval
from sgl_tts.problems import Problem
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import Runtimes, SearchConfig, split_steps
from sgl_tts.search.grading import normalize_answer
from sgl_tts.search.programs import load_program
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

try:
    import its_hub  # noqa: F401
    HAVE_ITS_HUB = True
except ImportError:
    HAVE_ITS_HUB = False
try:
    importlib.metadata.distribution("optillm")
    HAVE_OPTILLM = True
except importlib.metadata.PackageNotFoundError:
    HAVE_OPTILLM = False
needs_its_hub = pytest.mark.skipif(not HAVE_ITS_HUB, reason="its-hub is not installed here: `make peers` installs "
                                                            "the peers extra into this checkout's .venv")
needs_optillm = pytest.mark.skipif(not HAVE_OPTILLM, reason="optillm is not installed here: `make peers` installs "
                                                            "the peers extra into this checkout's .venv")

SEARCH = SearchConfig(program="best_of_n", n=4, beam_width=2, max_steps=3, max_step_tokens=12, max_tokens=30,
                      temperature=0.3, step_delimiter="\n\n", aggregation="last")
PROBLEM = Problem(id="p1", question="What is 1 + 2?", gold="3")


# ---- a fake OpenAI-compatible server --------------------------------------------------------------------------


def step_script(prefix: str, number: int) -> str:
    """A whole continuation after `prefix` (the assistant text so far): word steps, from the third step on an
    answer whose value depends on the prefix and the request number."""
    depth = prefix.count("\n\n")
    steps = []
    for d in range(depth, depth + 6):
        if d >= 2:
            steps.append(f"So the answer is $\\boxed{{{(hash(prefix) + number) % 3 + 2}}}$.")
            break
        steps.append(f"step {d} w{(hash(prefix) + number) % 17}")
    return "\n\n".join(steps)


class FakeServer:
    """/v1/chat/completions answered by `script(body, number)` (a whole text: cut at the first stop string, then
    at the completion limit, one token per word), /v1/models, and /metrics with SGLang's counter names."""

    def __init__(self, script=None):
        self.script = script or (lambda body, number: step_script(_assistant_prefix(body), number))
        self.bodies, self.outputs = [], []
        self.counts = Counter()
        self.lock = threading.Lock()
        self.number = itertools.count()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: bytes, kind: str = "application/json"):
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics":
                    with fake.lock:
                        lines = [f'{COUNTERS[k]}{{model_name="fake",is_streaming="false"}} {v}'
                                 for k, v in fake.counts.items()]
                    self._reply(("\n".join(["# TYPE sglang:prompt_tokens_total counter", *lines]) + "\n").encode(),
                                "text/plain")
                else:
                    self._reply(json.dumps({"data": [{"id": "fake-model"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._reply(json.dumps(fake.complete(body)).encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def complete(self, body):
        stops = body.get("stop")
        stops = [stops] if isinstance(stops, str) else list(stops or [])
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 10**6
        choices = []
        for index in range(body.get("n", 1)):
            text, finish = self.script(body, next(self.number)), "stop"
            cuts = [text.index(s) for s in stops if s in text]
            if cuts:
                text = text[: min(cuts)]
            words = text.split(" ")
            if len(words) > limit:
                text, finish = " ".join(words[:limit]), "length"
            choices.append({"index": index, "finish_reason": finish,
                            "message": {"role": "assistant", "content": text}})
            with self.lock:
                self.outputs.append(text)
                self.counts["generated_tokens"] += len(text.split(" "))
                self.counts["requests"] += 1
        prompt = sum(len(str(m.get("content", "")).split(" ")) for m in body["messages"])
        with self.lock:
            self.bodies.append(body)
            self.counts["prompt_tokens"] += prompt
        return {"id": "x", "object": "chat.completion", "model": body["model"], "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _assistant_prefix(body):
    last = body["messages"][-1]
    return last["content"] if last["role"] == "assistant" else ""


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def runtimes_on(fake, scorer=None):
    return PeerRuntimes(url=fake.url, model="fake-model", prompt=lambda q: f"Q: {q}\n\n", generator=fake,
                        peer_scorer=scorer or ScriptedScorer())


def assert_same_settings(body, max_tokens_key, max_tokens, search=SEARCH):
    assert body["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}, "sgl-tts's system prompt"
    assert body["temperature"] == search.temperature and body[max_tokens_key] == max_tokens
    assert body.get("top_p", 1.0) == 1.0, "no top_p but SGLang's default"


# ---- the answer key, counters ---------------------------------------------------------------------------------


def test_the_answer_key_is_the_programs_rule():
    assert answer_key("so 2 + 1 = 3\nThe answer is $\\boxed{3}$.") == "3"
    assert answer_key("so it is 2 + 1 = 3", "stop") == "3", "a text the model ended: its last number"
    assert answer_key("so it is 2 + 1 = 3", "length") is None, "a text cut at the token limit has no answer"
    assert vote_key("... $\\boxed{ 3 }$") == vote_key("other words, \\boxed{3}") == normalize_answer("3")
    assert vote_key("no number here") != vote_key("nor here"), "texts without an answer vote alone"


def test_prometheus_counters_are_summed_over_label_sets_and_differenced():
    text = ("# HELP sglang:prompt_tokens_total x\n# TYPE sglang:prompt_tokens_total counter\n"
            'sglang:prompt_tokens_total{model_name="m",is_streaming="false"} 10.0\n'
            'sglang:prompt_tokens_total{model_name="m",is_streaming="true"} 5.0\n'
            'sglang:prompt_tokens_total_created{model_name="m"} 1.7e9\n'
            'sglang:cached_tokens_total{cache_source="device"} 4\n'
            "sglang:num_requests_total 3\n")
    read = read_counters(text, COUNTERS)
    assert read == {"prompt_tokens": 15.0, "generated_tokens": 0.0, "cached_tokens": 4.0, "requests": 3.0}
    later = read_counters(text.replace(" 5.0", " 9.0").replace("total 3", "total 7"), COUNTERS)
    assert counter_delta(read, later) == {"prompt_tokens": 4.0, "generated_tokens": 0.0, "cached_tokens": 0.0,
                                          "requests": 4.0}


def test_a_top_p_the_peers_cannot_send_is_refused():
    check_settings(SEARCH)
    with pytest.raises(ValueError, match="search.top_p"):
        check_settings(dataclasses.replace(SEARCH, top_p=0.9))


def test_stopping_beneath_sgl_tts_programs_is_a_yaml_mapping_checked_key_by_key():
    from eval.peers import PeersOptions, run_config
    from sgl_tts.config import ConfigError
    from sgl_tts.search.stopping import Stopping

    config = run_config(PeersOptions(stopping="{rule: settled, consensus: 0.1, min_answers: 1, agree: 2, "
                                              "programs: [best_of_n]}"))
    assert config.search.stopping == Stopping(rule="settled", consensus=0.1, min_answers=1, agree=2,
                                              programs=("best_of_n",))
    assert config.concurrency == 1 and run_config(PeersOptions()).search.stopping == Stopping()
    with pytest.raises(ConfigError, match="search.stopping.agre"):
        run_config(PeersOptions(stopping="{rule: settled, agre: 2}"))
    with pytest.raises(ConfigError, match="stopping.agree must be at least 1"):
        run_config(PeersOptions(stopping="{rule: settled, agree: 0}"))
    with pytest.raises(ConfigError, match="--stopping: expected a YAML mapping"):
        run_config(PeersOptions(stopping="{rule: settled"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        run_config(PeersOptions(stopping="settled"))


# ---- its-hub ----------------------------------------------------------------------------------------------------


TEXTS_OF_3 = ["Adding: 1 + 2 = 3. The answer is $\\boxed{3}$.", "Sum three. The answer is $\\boxed{3}$.",
              "It is $\\boxed{3}$ then."]
TEXT_OF_5 = "The answer is $\\boxed{5}$."


def script_of(texts):
    return lambda body, number: texts[number % len(texts)]


@needs_its_hub
def test_its_hub_self_consistency_votes_by_the_answer_key_with_the_same_settings():
    """Three differently worded answers 3 against two identical 5s: its-hub's own projection (the text) would
    pick 5; the project's answer key picks 3. One request per sample, all with the run's settings."""
    fake = FakeServer(script_of([*TEXTS_OF_3, TEXT_OF_5, TEXT_OF_5]))
    try:
        runtimes = runtimes_on(fake)
        system = next(s for s in SYSTEMS if s.name == "its-hub SelfConsistency")
        row = measure_problem(system, PROBLEM, dataclasses.replace(SEARCH, n=5), runtimes)
    finally:
        fake.close()
    assert row["answer"] == "3" and row["correct"] is True
    assert len(fake.bodies) == 5 and all(body.get("n", 1) == 1 for body in fake.bodies)
    for body in fake.bodies:
        assert_same_settings(body, "max_completion_tokens", SEARCH.max_tokens)
    assert row["client_requests"]["generator"] == 5
    assert row["generator"] == {"prompt_tokens": fake.counts["prompt_tokens"], "requests": 5,
                                "generated_tokens": fake.counts["generated_tokens"], "cached_tokens": 0}


@needs_its_hub
def test_its_hub_best_of_n_takes_the_answer_the_prm_scores_highest(fake):
    scorer = ScriptedScorer()
    runtimes = runtimes_on(fake, scorer)
    system = next(s for s in SYSTEMS if s.name == "its-hub BestOfN + PRM")
    row = measure_problem(system, PROBLEM, SEARCH, runtimes)
    prompt = runtimes.prompt(PROBLEM.question)

    def score(text):
        steps = split_steps(text, SEARCH.step_delimiter, SEARCH.max_steps)
        return aggregate([scorer.step_score(prompt, steps[: i + 1]) for i in range(len(steps))], SEARCH.aggregation)

    assert len(set(fake.outputs)) > 1, "candidates to choose among"
    assert row["answer"] == answer_key(max(fake.outputs, key=score))
    assert all(first == 0 for _, first in scorer.scored), "whole paths, as a whole-path PRM client scores"
    assert row["client_requests"] == {"generator": SEARCH.n, "prm": len(set(fake.outputs))}
    for body in fake.bodies:
        assert_same_settings(body, "max_completion_tokens", SEARCH.max_tokens)


@needs_its_hub
@pytest.mark.parametrize("name", ["its-hub BeamSearch + PRM", "its-hub ParticleFiltering + PRM"])
def test_its_hub_step_search_steps_at_the_delimiter_within_the_step_limits(fake, name):
    scorer = ScriptedScorer()
    system = next(s for s in SYSTEMS if s.name == name)
    row = measure_problem(system, PROBLEM, SEARCH, runtimes_on(fake, scorer))
    assert row["answer"] in {"2", "3", "4"} and row["correct"] == (row["answer"] == "3")
    assert len(split_steps(row["text"], "\n\n", 99)) <= SEARCH.max_steps
    for body in fake.bodies:
        assert_same_settings(body, "max_completion_tokens", SEARCH.max_step_tokens)
        assert body["stop"] == SEARCH.step_delimiter
    continued = [b for b in fake.bodies if b["messages"][-1]["role"] == "assistant"]
    assert continued and all(b["continue_final_message"] for b in continued), "a path's steps so far, continued"
    assert scorer.calls and all(first == 0 for _, first in scorer.scored), "every path re-scored from step one"
    assert row["client_requests"]["prm"] == len(scorer.scored)
    assert step_generation(SEARCH).max_steps == SEARCH.max_steps - 1


# ---- optillm ----------------------------------------------------------------------------------------------------


OPTILLM_TEXTS = ["Early answer: 6 maybe.\nThe answer is $\\boxed{3}$.",
                 "Partial answer: 4, checking.\nThe answer is $\\boxed{3}$.", "The answer is $\\boxed{3}$.",
                 TEXT_OF_5, TEXT_OF_5]


@needs_optillm
@pytest.mark.parametrize("boxed, expected", [(False, "5"), (True, "3")])
def test_optillm_majority_voting_stock_and_with_boxed_extraction(boxed, expected):
    """Stock, the plugin votes on the text after "answer:" (two of the 3s say something else there), so the two
    5s win; with the boxed extraction the three 3s win. One request with n, the run's settings."""
    fake = FakeServer(script_of(OPTILLM_TEXTS))
    try:
        answer = optillm_solver(boxed)(runtimes_on(fake), PROBLEM, dataclasses.replace(SEARCH, n=5))
    finally:
        fake.close()
    assert answer.answer == expected
    assert len(fake.bodies) == 1 and fake.bodies[0]["n"] == 5
    assert_same_settings(fake.bodies[0], "max_tokens", SEARCH.max_tokens)


# ---- sgl-tts on the scripted backend ----------------------------------------------------------------------------


class ScriptedSession(Session):
    """A Session on the scripted backend and scorer (nothing started), keeping every result it returns."""

    def __init__(self, config):
        self.config, self.runtimes, self._reuse = config, {}, {}
        self.program = load_program(config.search.program)
        self.search_runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel()), scorer=ScriptedScorer(),
                                        prompt=lambda q: f"Q: {q}\n\n")
        self.solved, self.searches = [], []

    def solve(self, problem, search=None, context=None):
        result = super().solve(problem, search, context)
        self.solved.append(((search or self.config.search).program, result))
        self.searches.append(search)
        return result

    def close(self):
        pass


def test_sgl_tts_systems_report_their_own_answer_and_ledger(fake):
    session = ScriptedSession(RunConfig(search=SEARCH))
    runtimes = PeerRuntimes(url=fake.url, model="m", prompt=session.search_runtimes.prompt, generator=fake,
                            session=session)
    backend, scorer = session.search_runtimes.generator, session.search_runtimes.scorer
    row = measure_problem(next(s for s in SYSTEMS if s.name == "sgl-tts best_of_n argmax"), PROBLEM, SEARCH, runtimes)
    (program, result), = session.solved
    assert program == "best_of_n" and row["answer"] == result.answer
    answered = [c for c in result.candidates if c.answer is not None]
    assert result.answer == max(answered, key=lambda c: c.score).answer, "argmax: the best answered path's answer"
    assert row["client_requests"] == {"generator": len(backend.requests), "prm": scorer.requests}
    assert len(backend.requests) == SEARCH.n and scorer.requests == SEARCH.n
    assert row["generator"]["requests"] == 0, "the fake generator's counters saw none of the scripted requests"
    answer = sgl_tts_solver("self_consistency")(runtimes, PROBLEM, SEARCH)
    assert session.solved[-1][0] == "self_consistency" and answer.answer == session.solved[-1][1].answer


def test_first_to_end_is_the_runs_stopping_settled_by_the_first_answer(fake):
    """short-1@n beneath best-of-N: the run's stopping (its first-step cut and stage kept) with the vote settled by
    one answer, for this system only; the search answers with the first answer it heard."""
    from sgl_tts.search.stopping import Stopping

    run_stopping = Stopping(rule="both", consensus=0.9, min_answers=5, agree=3, prune=0.99, stage=2,
                            programs=("dvts",))
    assert first_to_end(run_stopping) == Stopping(rule="settled", consensus=0.9, min_answers=1, agree=1, prune=0.99,
                                                  stage=2)
    search = dataclasses.replace(SEARCH, stopping=Stopping(rule="settled", min_answers=3, agree=3, prune=0.01))
    session = ScriptedSession(RunConfig(search=search))
    runtimes = PeerRuntimes(url=fake.url, model="m", prompt=session.search_runtimes.prompt, generator=fake,
                            session=session)
    row = measure_problem(next(s for s in SYSTEMS if s.name == "sgl-tts best_of_n first to end"), PROBLEM, search,
                          runtimes)
    (program, result), = session.solved
    assert program == "best_of_n" and session.searches[0].stopping == first_to_end(search.stopping)
    assert result.finish_reason == "settled" and row["answer"] == result.answer
    assert row["client_requests"]["prm"] > 0, "the first-step cut reads the verifier"
    measure_problem(next(s for s in SYSTEMS if s.name == "sgl-tts best_of_n weighted"), PROBLEM, search, runtimes)
    assert session.searches[1].stopping == search.stopping, "the other sgl-tts systems keep the run's stopping"
    assert first_to_end_uncut(run_stopping) == dataclasses.replace(first_to_end(run_stopping), prune=0.0)
    row = measure_problem(next(s for s in SYSTEMS if s.name == "sgl-tts best_of_n first to end (no cut)"), PROBLEM,
                          search, runtimes)
    assert session.searches[2].stopping == first_to_end_uncut(search.stopping)
    assert row["client_requests"]["prm"] == 0, "no verifier call without the first-step cut"


# ---- the report -------------------------------------------------------------------------------------------------


def brute_front(points):
    return sorted((i for i, (c, a) in enumerate(points)
                   if not any((c2 <= c and a2 >= a and (c2, a2) != (c, a)) or ((c2, a2) == (c, a) and j < i)
                              for j, (c2, a2) in enumerate(points))), key=lambda i: (points[i][0], i))


def test_the_pareto_frontier_and_the_cost_to_reach_match_brute_force():
    rng = random.Random(3)
    for _ in range(300):
        points = [(rng.choice([1.0, 2.0, 3.0, 4.0, 5.0]), rng.choice([0.1, 0.2, 0.3, 0.4]))
                  for _ in range(rng.randint(0, 8))]
        assert pareto_front(points) == brute_front(points), points
        for wanted in (0.0, 0.15, 0.3, 0.5):
            reach = [c for c, a in points if a >= wanted]
            assert cost_to_reach(points, wanted) == (min(reach) if reach else None)
            first = min((i for i, (c, a) in enumerate(points) if a >= wanted and c == min(reach)), default=None)
            assert cheapest_reaching(points, wanted) == first, (points, wanted)
        for budget in (0.5, 2.0, 3.5, 5.0):
            within = [i for i, (c, _) in enumerate(points) if c <= budget]
            best = max((points[i][1] for i in within), default=None)
            chosen = most_accurate_within(points, budget)
            if best is None:
                assert chosen is None
            else:  # the most accurate within the budget; of equals the cheapest, then the first
                ties = [i for i in within if points[i][1] == best]
                cheapest = min(points[i][0] for i in ties)
                assert chosen == min(i for i in ties if points[i][0] == cheapest), (points, budget)


def brute_ratio_interval(ours, peer, resamples, seed):
    """The same resamples drawn one by one: each point's mean cost and accuracy over the drawn problems, then
    cost_to_reach over them, over the peer's mean cost; the 2.5% and 97.5% order statistics (inverted CDF)."""
    problems = len(peer[0])
    draws = np.random.default_rng(seed).integers(0, problems, size=(resamples, problems))
    ratios, reached = [], 0
    for draw in draws:
        mean = lambda values: sum(values[i] for i in draw) / problems  # noqa: E731
        points = [(mean(costs), mean([float(c) for c in correct])) for costs, correct in ours]
        wanted = mean([float(c) for c in peer[1]])
        reach = cost_to_reach(points, wanted - 1e-12)
        reached += reach is not None
        ratios.append(float("inf") if reach is None else reach / mean(peer[0]))
    ratios.sort()
    at = lambda q: ratios[max(0, int(np.ceil(q * resamples)) - 1)]  # noqa: E731
    return at(0.025), at(0.975), reached / resamples


def test_the_time_ratio_interval_matches_resampling_by_hand():
    rng = random.Random(5)
    for _ in range(20):
        problems = rng.randint(1, 12)
        point = lambda: ([rng.uniform(1, 9) for _ in range(problems)],  # noqa: E731
                         [rng.random() < 0.4 for _ in range(problems)])
        ours, peer = [point() for _ in range(rng.randint(1, 3))], point()
        low, high, reached = reach_ratio_interval(ours, peer, resamples=300, seed=7)
        b_low, b_high, b_reached = brute_ratio_interval(ours, peer, 300, 7)
        assert (low, high, reached) == pytest.approx((b_low, b_high, b_reached)), (ours, peer)
    # sgl-tts at half the time on every problem, always as accurate: the ratio is 0.5 in every resample
    costs = [2.0, 4.0, 6.0]
    assert reach_ratio_interval([([c / 2 for c in costs], [True, False, True])], (costs, [True, False, True]),
                                resamples=200) == (0.5, 0.5, 1.0)
    low, high, reached = reach_ratio_interval([(costs, [False] * 3)], (costs, [True, False, False]), resamples=200)
    assert high == float("inf") and reached < 1.0, "never right: reached only where the peer's draw missed too"
    with pytest.raises(ValueError, match="same 3 problem"):
        reach_ratio_interval([([1.0, 2.0], [True, False])], (costs, [True] * 3))
    with pytest.raises(ValueError, match="at least one point"):
        reach_ratio_interval([], (costs, [True] * 3))
    with pytest.raises(ValueError, match="same 3 problem"):  # points of different lengths: named, not numpy's error
        reach_ratio_interval([(costs, [True] * 3), ([1.0], [True])], (costs, [True] * 3))


def record(system, n, problem, correct, wall, generated=10):
    spec = next(s for s in SYSTEMS if s.name == system)
    return {"system": system, "family": spec.family, "algorithm": spec.algorithm, "pattern": spec.pattern, "n": n,
            "problem_id": problem, "correct": correct, "wall_s": wall,
            "generator": {"prompt_tokens": 50, "generated_tokens": generated, "cached_tokens": 20, "requests": 3},
            "prm": None, "client_requests": {"generator": 3, "prm": 0}}


def test_the_summary_pairs_with_the_reference_and_states_the_time_ratio(tmp_path):
    from eval.peers import peers_summary, plot_frontiers, report_markdown, run_order

    ours = [True, True, False, True, False, True, True, False]
    theirs = [True, False, False, False, True, False, True, False]
    records = [record("sgl-tts self_consistency", 4, f"q{i}", c, 2.0) for i, c in enumerate(ours)]
    records += [record("its-hub SelfConsistency", 4, f"q{i}", c, 5.0 + i) for i, c in enumerate(theirs)]
    records += [record("its-hub SelfConsistency", 4, "q0", False, 9.0) | {"failed": True}]  # not counted
    cells = peers_summary(records)
    peer = next(c for c in cells if c["system"] == "its-hub SelfConsistency")
    assert (peer["solved"], peer["trials"]) == (3, 8) and peer["interval"] == list(wilson_interval(3, 8))
    assert peer["vs_reference"]["p_value"] == mcnemar_exact(ours, theirs).p_value
    assert peer["mean_wall_s"] == pytest.approx(8.5) and peer["processed_tokens"] == 40
    assert peer["sgl_tts_time_ratio"] == pytest.approx(2.0 / 8.5), "sgl-tts reaches 5/8 >= 3/8 in 2 s"
    interval = peer["sgl_tts_time_ratio_interval"]
    assert interval["problems"] == 8 and interval["low"] <= 2.0 / 8.5 <= interval["high"]
    assert interval["high"] == float("inf") and 0.5 < interval["reached"] < 1, "some draws give sgl-tts fewer"
    text = report_markdown(cells, None)
    assert "its-hub SelfConsistency | 4 | 37.5% [" in text and "n concurrent requests" in text
    assert re.search(r"\| 0\.24x \[0\.\d\d-unreached\] \|", text), "the ratio with its interval"
    assert [p.name for p in plot_frontiers(cells, tmp_path)] == ["peers-time.png", "peers-tokens.png"]

    # particle filtering is paired with DVTS where DVTS ran, else with the step-search reference (beam search)
    pf, dvts, beam = "its-hub ParticleFiltering + PRM", "sgl-tts dvts", "sgl-tts beam_search"
    steps = [record(pf, 2, f"q{i}", c, 3.0) for i, c in enumerate(theirs)]
    steps += [record(dvts, 2, f"q{i}", c, 2.0) for i, c in enumerate(ours)]
    steps += [record(beam, n, f"q{i}", False, 2.0) for i in range(8) for n in (2, 4)]
    steps += [record(pf, 4, f"q{i}", c, 3.0) for i, c in enumerate(theirs)]
    paired = {(c["system"], c["n"]): c.get("vs_reference") for c in peers_summary(steps)}
    assert paired[(pf, 2)]["system"] == dvts and paired[(pf, 2)]["p_value"] == mcnemar_exact(ours, theirs).p_value
    assert paired[(pf, 4)]["system"] == beam and paired[(dvts, 2)]["system"] == beam
    assert "| vs sgl-tts dvts: -25.0 [" in report_markdown(peers_summary(steps), None)

    systems = SYSTEMS[:3]
    order = run_order(list(systems), ["a", "b", "c", "d"], [1, 2])
    assert Counter(order) == Counter(itertools.product([1, 2], "abcd", systems)) and len(order) == 24
    for index, problem in enumerate("abcd"):  # problem by problem, every arm of every n beside the others
        assert {(n, s) for n, p, s in order[6 * index: 6 * index + 6]} == set(itertools.product([1, 2], systems))
        assert all(p == problem for _, p, _ in order[6 * index: 6 * index + 6])
    firsts = [(n, system) for index, (n, _, system) in enumerate(order) if index % 6 == 0]
    assert len(set(firsts)) == 4, "a different arm runs first at each problem"
    ours, peer = next(s for s in SYSTEMS if s.family == "sgl-tts"), next(s for s in SYSTEMS if s.family != "sgl-tts")
    order = run_order([peer, ours], ["a", "b", "c"], [2, 3], peer_ns=[1])
    assert Counter((n, s.name) for n, _, s in order) == Counter({(1, peer.name): 3, (2, ours.name): 3,
                                                                 (3, ours.name): 3}), "the peers at --peer-ns only"
    assert [p for _, p, _ in order] == sorted("abc" * 3)
    from eval.peers import n_values

    assert n_values("16,8", "--ns") == [16, 8]
    for bad in ("", "1,x", "0,2", "2,,4"):
        with pytest.raises(ValueError, match=r"--peer-ns: expected comma-separated whole numbers of at least 1"):
            n_values(bad, "--peer-ns")


def test_every_peer_point_is_set_against_every_sgl_tts_point_whatever_the_algorithm(tmp_path):
    from eval.peers import LEAD_P, LEAD_TIME_RATIO, against_every_point, peers_summary, plot_libraries, \
        report_markdown

    rng = random.Random(11)
    peers = ["its-hub SelfConsistency", "its-hub BestOfN + PRM", "its-hub BeamSearch + PRM",
             "optillm majority_voting + boxed"]
    ours = ["sgl-tts best_of_n weighted", "sgl-tts self_consistency"]
    for _ in range(12):
        problems = 10
        records = []
        for system in rng.sample(peers, rng.randint(1, 4)) + rng.sample(ours, rng.randint(1, 2)):
            for n in rng.sample([1, 2, 4, 8], rng.randint(1, 3)):
                rate, wall = rng.random(), rng.choice([1.0, 2.0, 3.0, 4.0])
                records += [record(system, n, f"q{i}", rng.random() < rate, wall) for i in range(problems)]
        cells = peers_summary(records)
        mine = [c for c in cells if c["family"] == "sgl-tts"]
        rows = against_every_point(cells)
        assert sorted(id(r["cell"]) for r in rows) == sorted(id(c) for c in cells if c["family"] != "sgl-tts")
        for row in rows:
            cell = row["cell"]
            library = [c for c in cells if c["family"] == cell["family"]]
            dominated = any((o["mean_wall_s"] <= cell["mean_wall_s"] and o["accuracy"] >= cell["accuracy"]
                             and (o["mean_wall_s"], o["accuracy"]) != (cell["mean_wall_s"], cell["accuracy"]))
                            for o in library)
            earlier_equal = any((o["mean_wall_s"], o["accuracy"]) == (cell["mean_wall_s"], cell["accuracy"])
                                for o in library[:library.index(cell)])
            assert row["on_front"] == (not dominated and not earlier_equal)
            reaching = [c for c in mine if c["accuracy"] >= cell["accuracy"]]
            if reaching:
                fastest = min(c["mean_wall_s"] for c in reaching)
                assert row["ratio"] == pytest.approx(fastest / cell["mean_wall_s"])
                assert row["reaching"]["mean_wall_s"] == fastest and row["reaching"]["accuracy"] >= cell["accuracy"]
            else:
                assert row["ratio"] is None and row["reaching"] is None
            within = [c for c in mine if c["mean_wall_s"] <= cell["mean_wall_s"]]
            if within:
                assert row["within"]["accuracy"] == max(c["accuracy"] for c in within)
                theirs = [r["correct"] for r in sorted(records, key=lambda r: r["problem_id"])
                          if r["system"] == cell["system"] and r["n"] == cell["n"]]
                best = [r["correct"] for r in sorted(records, key=lambda r: r["problem_id"])
                        if r["system"] == row["within"]["system"] and r["n"] == row["within"]["n"]]
                assert row["versus"]["p_value"] == mcnemar_exact(theirs, best).p_value
                their_time = [r["wall_s"] for r in records if r["system"] == cell["system"] and r["n"] == cell["n"]]
                best_time = [r["wall_s"] for r in records
                             if r["system"] == row["within"]["system"] and r["n"] == row["within"]["n"]]
                assert row["within_time"]["ratio"] == pytest.approx(sum(best_time) / sum(their_time))
                assert row["within_time"]["low"] <= row["within_time"]["ratio"] <= row["within_time"]["high"]
                ahead = row["within"]["accuracy"] > cell["accuracy"] and row["versus"]["p_value"] < LEAD_P
            else:
                assert row["within"] is None and row["versus"] is None and row["within_time"] is None
                ahead = False
            faster = row["ratio"] is not None and row["ratio"] <= LEAD_TIME_RATIO
            assert row["lead"] == (ahead or faster)
            assert row["lead_by"] == [b for b, held in (("time", faster), ("accuracy", ahead)) if held]
    # a lead by time: sgl-tts reaches the peer's accuracy in 0.4x its time; by accuracy: 9 against 1 of 10 at once
    records = [record("its-hub BestOfN + PRM", 4, f"q{i}", i < 5, 5.0) for i in range(10)]
    records += [record("sgl-tts best_of_n weighted", 2, f"q{i}", i < 5, 2.0) for i in range(10)]
    records += [record("its-hub SelfConsistency", 1, f"q{i}", i == 0, 2.5) for i in range(10)]
    records += [record("sgl-tts self_consistency", 1, f"q{i}", i < 9, 2.5) for i in range(10)]
    cells = peers_summary(records)
    rows = {r["cell"]["system"]: r for r in against_every_point(cells)}
    best_of_n, consistency = rows["its-hub BestOfN + PRM"], rows["its-hub SelfConsistency"]
    assert best_of_n["ratio"] == pytest.approx(0.4) and best_of_n["lead"], "0.4x the time at the same 5/10"
    assert best_of_n["reaching"]["system"] == "sgl-tts best_of_n weighted", "the cheapest point reaching 5/10"
    assert consistency["ratio"] == pytest.approx(0.8) and consistency["lead"], "9 against 1 of 10 in 2.5 s"
    assert consistency["versus"]["p_value"] < LEAD_P and consistency["within"]["system"] == "sgl-tts self_consistency"
    text = report_markdown(cells, None)
    assert "Every peer point against every sgl-tts point" in text
    assert "| its-hub BestOfN + PRM | 4 | 5/10 | 5.00 | yes | 0.40x [" in text
    assert best_of_n["lead_by"] == ["time"] and consistency["lead_by"] == ["accuracy"]
    assert re.search(r"\| its-hub SelfConsistency \| 1 \| 1/10 .*\| 1.00x \[1.00-1.00\] \| .*\| accuracy \|$", text,
                     re.M), "the same time problem by problem: the ratio and its interval 1"
    assert [p.name for p in plot_libraries(cells, tmp_path)] == ["peers-libraries-time.png",
                                                             "peers-libraries-tokens.png"]
    assert plot_libraries([c for c in cells if c["family"] == "sgl-tts"], tmp_path) == [], "one library: no plot"


def test_runs_pooled_pair_the_systems_by_run_and_problem():
    from eval.peers import peers_summary, pooled_rows

    ours = [[True, False, True, True], [False, False, True, True]]
    theirs = [[False, False, True, False], [True, False, False, False]]
    runs = [[record("sgl-tts self_consistency", n, f"q{i}", c, 1.0) for n in (2, 8) for i, c in enumerate(mine)]
            + [record("its-hub SelfConsistency", 2, f"q{i}", c, 2.0) for i, c in enumerate(peer)]
            for mine, peer in zip(ours, theirs)]
    runs[1].append(record("its-hub SelfConsistency", 2, "q0", False, 2.0) | {"failed": True})  # not counted
    runs[0] += [record("optillm majority_voting", 2, f"q{i}", True, 1.0) for i in range(4)]  # one run only
    cells = {(c["system"], c["n"]): c for c in peers_summary(pooled_rows(runs, {2}))}
    assert set(cells) == {("sgl-tts self_consistency", 2), ("its-hub SelfConsistency", 2)}, \
        "n = 8 and the system of one run only left out"
    peer = cells[("its-hub SelfConsistency", 2)]
    assert (peer["solved"], peer["trials"]) == (2, 8) and sorted(peer["per_problem"])[:2] == ["r0/q0", "r0/q1"]
    assert peer["vs_reference"]["p_value"] == mcnemar_exact(ours[0] + ours[1], theirs[0] + theirs[1]).p_value
    assert peer["vs_reference"]["pairs"] == 8


def test_the_pooling_script_reads_every_run_and_draws_the_pooled_frontiers(tmp_path, monkeypatch, capsys):
    import runpy
    from pathlib import Path

    from eval.peers import RESULTS
    from eval.results import ResultStore

    outs = []
    for run, (mine, peer) in enumerate([([True, True, False], [False, True, False]), ([True, False, True],
                                                                                     [False, False, False])]):
        store = ResultStore(tmp_path / f"s{run}" / RESULTS)
        for i, (c_mine, c_peer) in enumerate(zip(mine, peer)):
            store.append(record("sgl-tts best_of_n weighted", 2, f"q{i}", c_mine, 1.0))
            store.append(record("its-hub BestOfN + PRM", 2, f"q{i}", c_peer, 2.0))
        outs.append(str(tmp_path / f"s{run}"))
    script = Path(__file__).resolve().parents[1] / "scripts" / "pool_peers.py"
    monkeypatch.setattr("sys.argv", [str(script), "--ns", "2", *outs, "--plot", str(tmp_path / "pooled")])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert re.search(r"\| its-hub BestOfN \+ PRM \| 2 \| 1/6 \|", out), "the peer's cell spans both runs: 1 of 6"
    assert re.search(r"\(4/6\)", out), "sgl-tts's cell: 4 of 6"
    assert all((tmp_path / "pooled" / name).stat().st_size > 0
               for name in ("peers-libraries-time.png", "peers-libraries-tokens.png"))


def test_the_cli_reaches_the_peers_bench(tmp_path, capsys):
    from sgl_tts.cli import main

    assert main(["bench", "peers", "--report-only", "--out", str(tmp_path)]) == 1
    assert re.search(r"no measured line", capsys.readouterr().out)
