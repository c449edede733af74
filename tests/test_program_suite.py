"""One suite of search-program semantics, run on the scripted fake backend and on a real SGLang CPU runtime.

Invariants (budgets, counts, limits, well-formed records, clean "no answer") run on both backends; the
exact comparisons with brute-force enumerations of the scripted tree run on the fake only, where every
step is known in advance.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import random
import statistics
from collections import defaultdict
from typing import Callable, NamedTuple, Sequence

import pytest

from sgl_tts.problems import Problem
from programs.dynamic_branching import allocate
from sgl_tts.search.records import SearchResult
from sgl_tts.search.programs import load_program
from sgl_tts.runtime.server import RuntimeDiedError
from sgl_tts.scoring.base import ScorerError, StepScorer, aggregate
from sgl_tts.scoring.likelihood import LikelihoodScorer
from sgl_tts.search.api import ReasoningPath, Runtimes, SearchConfig, SearchError, build_result
from sgl_tts.search.context import SearchContext
from sgl_tts.search.selection import select
from sgl_tts.frontend.backend import GeneratorError
from sgl_tts.frontend.sglang_internals import running_program_states
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer, wait_until

PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")
PROGRAMS = ["best_of_n", "beam_search", "dvts", "dynamic_branching", "varying_granularity", "self_consistency"]
SCORED = [p for p in PROGRAMS if p != "self_consistency"]
NEVER_ANSWERS = ScriptedModel(answer_depth=10_000)
FINISH_REASONS = {"answer", "eos", "max_steps", "max_tokens"}


class RecordingScorer(StepScorer):
    """Delegates to `inner`, records how many paths each call scored, and can fail on its k-th call."""

    def __init__(self, inner: StepScorer, fail_on_call: int | None = None, runtime_name: str = "prm"):
        super().__init__()
        self.inner, self.fail_on_call, self.runtime_name = inner, fail_on_call, runtime_name
        self.sizes: list[int] = []
        self.steps_seen: list[list[int]] = []

    def score(self, prompt: str, paths: Sequence[Sequence[str]]) -> list[list[float]]:
        if self.fail_on_call is not None and len(self.sizes) + 1 == self.fail_on_call:
            raise ScorerError(f"scorer runtime '{self.runtime_name}' at http://127.0.0.1:9 failed: connection refused")
        self.sizes.append(len(paths))
        self.steps_seen.append([len(p) for p in paths])
        return self.inner.score(prompt, paths)


class ConstantScorer(ScriptedScorer):
    def step_score(self, prompt: str, steps: Sequence[str]) -> float:
        return 0.5


# --- the two backends ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Backend:
    name: str
    make: Callable[[ScriptedModel | None, StepScorer | None], Runtimes]

    @property
    def real(self) -> bool:
        return self.name == "sglang"

    def config(self, program: str, **overrides) -> SearchConfig:
        """A config for `program`; on the real runtime n, steps and step tokens are kept small."""
        settings = dict(program=program, n=8, beam_width=2, max_steps=6, max_step_tokens=64, max_tokens=10_000,
                        aggregation="last", selection="weighted")
        settings.update(overrides)
        if self.real:
            settings.update(n=4, max_steps=min(settings["max_steps"], 2),
                            max_step_tokens=min(settings["max_step_tokens"], 12),
                            max_tokens=min(settings["max_tokens"], 24))
        return SearchConfig(**settings)

    def runtimes(self, model: ScriptedModel | None = None, scorer: StepScorer | None = None,
                 record: bool = True) -> tuple[Runtimes, RecordingScorer | None]:
        runtimes = self.make(model, scorer)
        recorder = RecordingScorer(runtimes.scorer) if record and runtimes.scorer is not None else None
        if recorder is not None:
            runtimes = dataclasses.replace(runtimes, scorer=recorder)
        return runtimes, recorder


@pytest.fixture(params=["fake", pytest.param("sglang", marks=pytest.mark.runtime)])
def backend(request) -> Backend:
    if request.param == "fake":
        def make(model, scorer):
            return Runtimes(generator=ScriptedBackend(model or ScriptedModel()), scorer=scorer or ScriptedScorer(),
                            prompt=lambda question: PROMPT)
        return Backend("fake", make)
    shared = request.getfixturevalue("tiny_search_runtimes")  # the tiny random model never gives an answer
    return Backend("sglang", lambda model, scorer: dataclasses.replace(shared, scorer=scorer or shared.scorer))


def solve(program: str, config: SearchConfig, runtimes: Runtimes) -> SearchResult:
    return load_program(program)(PROBLEM, config, runtimes)


# --- invariants on both backends -------------------------------------------------------------------------

@pytest.mark.parametrize("program", PROGRAMS)
def test_result_is_well_formed(backend, program):
    config = backend.config(program)
    runtimes, recorder = backend.runtimes()
    result = solve(program, config, runtimes)

    assert result.program == program and result.error is None
    assert result.candidates, "a search always ends with candidates"
    for c in result.candidates:
        assert 1 <= len(c.steps) <= config.max_steps, f"{len(c.steps)} steps, limit {config.max_steps}"
        assert c.tokens <= config.max_tokens, f"{c.tokens} tokens, limit {config.max_tokens}"
        assert c.finish_reason in FINISH_REASONS, c.finish_reason
        expected_scores = 0 if program == "self_consistency" else len(c.steps)
        assert len(c.step_scores) == expected_scores, "one score per step (none without a verifier)"
        assert all(0.0 <= s <= 1.0 for s in c.step_scores)
        assert c.score == pytest.approx(aggregate(c.step_scores, config.aggregation))
        assert 0.0 <= c.completion_time_s <= result.total_time_s + 1e-6
    ranks = [(-c.score, c.text) for c in result.candidates]
    assert ranks == sorted(ranks), "candidates are recorded best first, ties by text"
    assert result.generated_tokens >= max(c.tokens for c in result.candidates)
    assert 0 <= result.cached_tokens <= result.prompt_tokens
    assert result.generator_time_s + result.verifier_time_s <= result.total_time_s + 1e-3
    selection = "majority" if program == "self_consistency" else config.selection
    assert result.answer == select(selection, [c.answer for c in result.candidates],
                                   [c.score for c in result.candidates])
    assert SearchResult.from_dict(result.to_dict()) == result
    assert result.verifier_calls == (len(recorder.sizes) if recorder else 0)
    if program == "self_consistency":
        assert recorder.sizes == [], "self-consistency never calls the verifier"

    # Budgets, program by program.
    n, width = config.n, config.beam_width
    if program in ("best_of_n", "self_consistency"):
        assert len(result.candidates) == n
    if program == "best_of_n":
        assert recorder.sizes == [n]
    if program == "dvts":
        assert len(result.candidates) == n // width, "one candidate per subtree"
        assert sorted(c.extra["subtree"] for c in result.candidates) == list(range(n // width))
        assert recorder.sizes[0] == n and all(s % width == 0 and s <= n for s in recorder.sizes)
    if program == "dynamic_branching":
        assert len(result.candidates) == n, "the budget of n paths is conserved"
        # A candidate that ended in iteration t has t + 1 steps; iteration t spawns n - (ended before t).
        for t, size in enumerate(recorder.sizes):
            assert size == n - sum(1 for c in result.candidates if len(c.steps) <= t), f"iteration {t}"
    if program in ("beam_search", "varying_granularity"):
        assert recorder.sizes[0] == n and all(s <= n for s in recorder.sizes)


@pytest.mark.parametrize("g", [1, 2, 3])
def test_varying_granularity_verifies_every_g_steps(backend, g):
    config = backend.config("varying_granularity", granularity=g)
    runtimes, recorder = backend.runtimes()
    result = solve("varying_granularity", config, runtimes)
    longest = max(len(c.steps) for c in result.candidates)
    assert result.verifier_calls == len(recorder.sizes) == math.ceil(longest / g)
    for round_index, steps in enumerate(recorder.steps_seen):
        assert max(steps) == min(config.max_steps, (round_index + 1) * g), "a round writes g steps"


LIMITS = [dict(max_steps=2, max_step_tokens=4, max_tokens=1000), dict(max_steps=50, max_step_tokens=3, max_tokens=7)]


@pytest.mark.parametrize("limits", LIMITS, ids=["steps", "tokens"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_every_program_stops_at_its_limits(backend, program, limits):
    config = backend.config(program, **limits)
    runtimes, _ = backend.runtimes(NEVER_ANSWERS)
    result = solve(program, config, runtimes)
    assert result.candidates
    for c in result.candidates:
        assert len(c.steps) <= config.max_steps and c.tokens <= config.max_tokens
        if not backend.real:
            assert c.finish_reason in {"max_steps", "max_tokens"}, c.finish_reason
    if not backend.real and limits["max_tokens"] < 100:
        assert all(c.tokens == config.max_tokens for c in result.candidates), "paths run up to the token cap"


@pytest.mark.parametrize("fewer", ["enough", "narrowed"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_every_program_takes_fewer_children_than_it_asked_for(program, fewer):
    """Beneath `stopping.enough` or a budget's narrowing `expand` returns fewer children than a program asked for;
    every program still ends with a well-formed result, and a step program writes fewer tokens than without."""
    from sgl_tts.search.budget import Budget
    from sgl_tts.search.stopping import Stopping

    plain_config = Backend("fake", None).config(program)
    setting = ({"stopping": Stopping(enough=0.3)} if fewer == "enough"
               else {"budget": Budget(deadline_s=1e9, narrow_below=1.0)})  # slack below 1 from the first step on
    results = []
    for config in (plain_config, dataclasses.replace(plain_config, **setting)):
        runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel()), scorer=ScriptedScorer(),
                            prompt=lambda question: PROMPT)
        results.append(solve(program, config, runtimes))
    plain, narrowed = results
    assert narrowed.error is None and narrowed.finish_reason == "complete" and narrowed.candidates
    for c in narrowed.candidates:
        assert 1 <= len(c.steps) <= plain_config.max_steps and c.finish_reason in FINISH_REASONS
        scored = 0 if program == "self_consistency" else len(c.steps)
        if fewer == "enough":
            assert len(c.step_scores) == scored
        else:  # a narrowed verifier call scores the better half of its paths; the others keep the scores they had
            assert len(c.step_scores) <= scored
    if program in ("best_of_n", "self_consistency"):  # whole samples: no step is expanded
        assert narrowed.generated_tokens == plain.generated_tokens
    else:
        assert narrowed.generated_tokens < plain.generated_tokens


@pytest.mark.parametrize("program", PROGRAMS)
def test_answer_that_never_appears_is_a_clean_no_answer(backend, program):
    runtimes, _ = backend.runtimes(NEVER_ANSWERS)
    result = solve(program, backend.config(program, max_steps=3, max_tokens=60), runtimes)
    assert result.error is None
    if backend.real and any(c.answer is not None for c in result.candidates):
        # the tiny random model sampled an answer phrase by chance (once in CI, best_of_n: "homemade choir"; its
        # sampling is not seeded on the CPU): the answer is then one of the paths'
        assert result.answer in {c.answer for c in result.candidates}
        return
    assert result.answer is None
    assert all(c.answer is None for c in result.candidates)


# --- brute-force references on the scripted tree (fake backend only) ----------------------------------

class Node(NamedTuple):
    steps: list[str]
    done: bool

    @property
    def text(self) -> str:
        return "".join(self.steps)


class ScriptedTree:
    """The scripted model's tree, enumerated without SGLang: the k-th child asked of a text is variant k."""

    def __init__(self, model: ScriptedModel, config: SearchConfig, scorer: ScriptedScorer | None = None):
        self.model, self.config = model, config
        self.scorer = scorer or ScriptedScorer()
        self.variants: dict[str, int] = defaultdict(int)

    def child(self, parent: Sequence[str]) -> Node:
        text = PROMPT + "".join(parent)
        variant = self.variants[text]
        self.variants[text] += 1
        step, ending = self.model.step(text, variant)
        steps = list(parent) + [step if ending == "eos" else step + self.model.delimiter]
        return Node(steps, ending in ("answer", "eos") or len(steps) >= self.config.max_steps)

    def score(self, node: Node) -> float:
        return self.scorer.step_score(PROMPT, node.steps)

    def rank(self, node: Node) -> tuple[float, str]:
        return (-self.score(node), node.text)


def fake(model: ScriptedModel | None = None, scorer: StepScorer | None = None) -> tuple[Runtimes, RecordingScorer]:
    return Backend("fake", lambda m, s: Runtimes(generator=ScriptedBackend(m or ScriptedModel()),
                                               scorer=s or ScriptedScorer(), prompt=lambda q: PROMPT)
                   ).runtimes(model, scorer)


def reference_dvts(model: ScriptedModel, config: SearchConfig, scorer: ScriptedScorer | None = None) -> list[Node]:
    """Each subtree on its own: deal the sorted first steps into groups of M, then keep the best child."""
    tree = ScriptedTree(model, config, scorer)
    width, subtrees = config.beam_width, config.n // config.beam_width
    firsts = sorted((tree.child([]) for _ in range(subtrees * width)), key=lambda node: node.text)
    paths = []
    for i in range(subtrees):
        best = min(firsts[i * width:(i + 1) * width], key=tree.rank)
        while not best.done:
            best = min((tree.child(best.steps) for _ in range(width)), key=tree.rank)
        paths.append(best)
    return paths


@pytest.mark.parametrize("program", PROGRAMS + ["deepconf"])
@pytest.mark.parametrize("context", ["own", "given", "stopping"])
def test_no_program_state_outlives_its_search(program, context):
    """Each path holds its SGLang program state, whose worker thread runs until the state is freed, and those
    threads hold the program's arguments (the search context, run_search's `finished` list): paths kept there
    would keep a thread per fork running for good (in `serve`, every search would add its forks' threads).
    With the search's own context, one given as `serve` gives it (kept by the caller), and one a stopping rule
    makes, every state of the finished searches ends."""
    from sgl_tts.search.stopping import Stopping

    runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel()), scorer=ScriptedScorer(),
                        prompt=lambda question: PROMPT)
    config = SearchConfig(program=program, n=4, beam_width=2, max_steps=3, max_step_tokens=64, max_tokens=10_000,
                          stopping=Stopping(rule="settled") if context == "stopping" else Stopping())
    kept = []
    for _ in range(2):
        given = runtimes.new_search(config, PROBLEM.id) if context == "given" else None
        kept.append(given)
        assert load_program(program)(PROBLEM, config, runtimes, given).candidates
    gc.collect()  # a freed state ends its thread once the request it was sending has returned (a stopped one's)
    wait_until(lambda: not running_program_states([runtimes.generator]), timeout=30.0)


@pytest.mark.parametrize("n,width,max_steps", [(8, 2, 6), (6, 3, 4), (4, 1, 5), (8, 4, 3)])
def test_dvts_matches_independent_greedy_subtrees(n, width, max_steps):
    config = SearchConfig(program="dvts", n=n, beam_width=width, max_steps=max_steps, max_tokens=10_000)
    runtimes, _ = fake()
    result = solve("dvts", config, runtimes)
    expected = reference_dvts(ScriptedModel(), config)
    by_subtree = {c.extra["subtree"]: c.text for c in result.candidates}
    assert by_subtree == {i: node.text for i, node in enumerate(expected)}
    assert result.answer == select("weighted", [c.answer for c in result.candidates],
                                   [c.score for c in result.candidates])


def test_dvts_subtrees_do_not_see_each_others_scores():
    """Changing every score inside subtree 0 changes nothing in the other subtrees."""
    config = SearchConfig(program="dvts", n=8, beam_width=2, max_steps=6, max_tokens=10_000)
    model = ScriptedModel()
    subtree0_firsts = {node.steps[0] for node in sorted(
        (ScriptedTree(model, config).child([]) for _ in range(8)), key=lambda node: node.text)[:2]}

    class Subtree0Reversed(ScriptedScorer):
        def step_score(self, prompt, steps):
            score = super().step_score(prompt, steps)
            return 1.0 - score if steps[0] in subtree0_firsts else score

    plain = solve("dvts", config, fake(model)[0])
    perturbed = solve("dvts", config, fake(model, Subtree0Reversed())[0])
    others = lambda result: {c.extra["subtree"]: c.text for c in result.candidates if c.extra["subtree"] != 0}
    assert others(plain) == others(perturbed) and len(others(plain)) == 3
    assert {c.extra["subtree"]: c.text for c in perturbed.candidates}[0] == reference_dvts(
        model, config, Subtree0Reversed())[0].text


def reference_dynamic_branching(model: ScriptedModel, config: SearchConfig) -> tuple[list[Node], list[int]]:
    tree = ScriptedTree(model, config)
    finished: list[Node] = []
    parents: list[tuple[list[str], int]] = [([], config.n)]
    active: list[Node] = []
    sizes = []
    for _ in range(config.max_steps):
        children = [tree.child(steps) for steps, count in parents for _ in range(count)]
        sizes.append(len(children))
        finished += [c for c in children if c.done]
        active = sorted((c for c in children if not c.done), key=tree.rank)
        counts = allocate(config.n - len(finished), [tree.score(c) for c in active], config.branching_temperature)
        parents = [(c.steps, k) for c, k in zip(active, counts) if k > 0]
        if not parents:
            break
    return finished + active, sizes


@pytest.mark.parametrize("n,max_steps,temperature", [(8, 6, 0.2), (6, 5, 0.05), (5, 4, 1.0), (12, 6, 0.1)])
def test_dynamic_branching_matches_reference(n, max_steps, temperature):
    config = SearchConfig(program="dynamic_branching", n=n, max_steps=max_steps, max_tokens=10_000,
                          branching_temperature=temperature)
    runtimes, recorder = fake()
    result = solve("dynamic_branching", config, runtimes)
    expected, sizes = reference_dynamic_branching(ScriptedModel(), config)
    assert sorted(c.text for c in result.candidates) == sorted(node.text for node in expected)
    assert recorder.sizes == sizes
    assert len(result.candidates) == n


def test_dynamic_branching_gives_strong_beams_more_children():
    """Without early finishes, every iteration spends exactly n children, spread by score."""
    config = SearchConfig(program="dynamic_branching", n=8, max_steps=4, max_tokens=10_000, branching_temperature=0.05)
    runtimes, recorder = fake(NEVER_ANSWERS)
    solve("dynamic_branching", config, runtimes)
    assert recorder.sizes == [8, 8, 8, 8]
    counts = allocate(8, [0.9, 0.5, 0.1], 0.05)
    assert counts[0] > counts[1] >= counts[2] and sum(counts) == 8


def test_allocation_is_the_closest_integer_split_of_the_budget():
    """Largest remainder gives the split nearest (L1) to the softmax quotas: check against all splits."""
    rng = random.Random(3)
    for _ in range(200):
        beams, budget, temperature = rng.randint(1, 4), rng.randint(0, 7), rng.choice([0.05, 0.2, 1.0])
        scores = sorted((rng.random() for _ in range(beams)), reverse=True)
        counts = allocate(budget, scores, temperature)
        weights = [math.exp(s / temperature) for s in scores]
        quotas = [budget * w / sum(weights) for w in weights]
        distance = lambda split: sum(abs(c - q) for c, q in zip(split, quotas))
        best = min(distance(split) for split in itertools.product(range(budget + 1), repeat=beams)
                   if sum(split) == budget)
        assert sum(counts) == budget and all(c >= 0 for c in counts)
        assert distance(counts) == pytest.approx(best)
        assert all(math.floor(q) <= c <= math.ceil(q) for c, q in zip(counts, quotas))
        assert counts == sorted(counts, reverse=True), "a better beam never gets fewer children"
    assert allocate(5, [], 0.2) == [] and allocate(3, [0.5, 0.5, 0.5, 0.5], 0.2) == [1, 1, 1, 0]


def reference_varying_granularity(model: ScriptedModel, config: SearchConfig,
                                  scorer: ScriptedScorer | None = None) -> tuple[list[Node], int]:
    tree = ScriptedTree(model, config, scorer)
    keep = config.n // config.beam_width
    beams: list[Node] = [Node([], False)]
    finished: list[Node] = []
    g, steps_done, verifications = config.granularity, 0, 0
    while beams and steps_done < config.max_steps:
        round_steps = min(g, config.max_steps - steps_done)
        fan = config.n if steps_done == 0 else config.beam_width
        children = [tree.child(b.steps) for b in beams for _ in range(fan)]
        for _ in range(round_steps - 1):
            children = [c if c.done else tree.child(c.steps) for c in children]
        steps_done += round_steps
        verifications += 1
        finished += [c for c in children if c.done]
        ranked = sorted((c for c in children if not c.done), key=tree.rank)
        beams, pruned = ranked[:keep], ranked[keep:]
        if config.adaptive_granularity and beams and pruned:
            margin = statistics.fmean(map(tree.score, beams)) - statistics.fmean(map(tree.score, pruned))
            g = min(2 * g, config.max_steps) if margin < config.granularity_margin else config.granularity
    return finished + beams, verifications


@pytest.mark.parametrize("g,adaptive,margin", [(1, False, 0.05), (2, False, 0.05), (3, False, 0.05),
                                               (1, True, 0.3), (2, True, 0.5), (1, True, 0.0)])
def test_varying_granularity_matches_reference(g, adaptive, margin):
    config = SearchConfig(program="varying_granularity", n=8, beam_width=2, max_steps=7, max_tokens=10_000,
                          granularity=g, adaptive_granularity=adaptive, granularity_margin=margin)
    runtimes, recorder = fake(ScriptedModel(answer_depth=4))
    result = solve("varying_granularity", config, runtimes)
    expected, verifications = reference_varying_granularity(ScriptedModel(answer_depth=4), config)
    assert sorted(c.text for c in result.candidates) == sorted(node.text for node in expected)
    assert result.verifier_calls == verifications


def test_adaptive_granularity_doubles_while_the_verifier_cannot_separate():
    config = SearchConfig(program="varying_granularity", n=4, max_steps=15, max_tokens=10_000, granularity=1,
                          adaptive_granularity=True)
    runtimes, recorder = fake(NEVER_ANSWERS, ConstantScorer())
    solve("varying_granularity", config, runtimes)
    assert [max(steps) for steps in recorder.steps_seen] == [1, 3, 7, 15], "g = 1, 2, 4, 8"


def test_adaptive_granularity_returns_to_the_base_once_the_verifier_separates():
    class BlindForTwoSteps(ScriptedScorer):
        def step_score(self, prompt, steps):
            return 0.5 if len(steps) < 3 else super().step_score(prompt, steps)

    config = SearchConfig(program="varying_granularity", n=8, max_steps=8, max_tokens=10_000, granularity=1,
                          adaptive_granularity=True)
    runtimes, recorder = fake(NEVER_ANSWERS, BlindForTwoSteps())
    solve("varying_granularity", config, runtimes)
    assert [max(steps) for steps in recorder.steps_seen] == [1, 3, 4, 5, 6, 7, 8], "g = 1, 2, then 1 again"


def test_varying_granularity_one_is_beam_search():
    config = SearchConfig(n=8, beam_width=2, max_steps=6, max_tokens=10_000, granularity=1)
    beam = solve("beam_search", config, fake()[0])
    vg = solve("varying_granularity", config, fake()[0])
    assert [c.text for c in beam.candidates] == [c.text for c in vg.candidates]
    assert beam.verifier_calls == vg.verifier_calls and beam.answer == vg.answer


def reference_beam_lookahead(model: ScriptedModel, config: SearchConfig) -> list[Node]:
    tree = ScriptedTree(model, config)
    keep = config.n // config.beam_width
    beams, finished = [Node([], False)], []
    for iteration in range(config.max_steps):
        fan = config.n if iteration == 0 else config.beam_width
        children = [tree.child(b.steps) for b in beams for _ in range(fan)]
        finished += [c for c in children if c.done]
        active = [c for c in children if not c.done]
        rollouts = list(active)
        for _ in range(config.lookahead):  # level by level, as the program does
            rollouts = [r if r.done else tree.child(r.steps) for r in rollouts]
        score = {c.text: tree.score(r) for c, r in zip(active, rollouts)}
        beams = sorted(active, key=lambda c: (-score[c.text], c.text))[:keep]
        if not beams:
            break
    return finished + beams


@pytest.mark.parametrize("lookahead", [1, 2])
def test_beam_search_lookahead_ranks_by_greedy_rollouts(lookahead):
    config = SearchConfig(n=8, beam_width=2, max_steps=5, max_tokens=10_000, lookahead=lookahead)
    result = solve("beam_search", config, fake()[0])
    expected = reference_beam_lookahead(ScriptedModel(), config)
    assert sorted(c.text for c in result.candidates) == sorted(node.text for node in expected)


# --- ties, runtime failures -----------------------------------------------------------------------------

class TiedModel(ScriptedModel):
    """Each sample answers at once: variant v answers v % 2, so n = 4 samples give a 2-2 tie."""

    def step(self, text: str, variant: int) -> tuple[str, str]:
        return f"v{variant} The answer is \\boxed{{{variant % 2}}}.", "answer"


@pytest.mark.parametrize("program,selection", [("self_consistency", "majority"), ("best_of_n", "majority"),
                                               ("best_of_n", "weighted"), ("beam_search", "weighted")])
def test_majority_and_weighted_ties_are_deterministic(program, selection):
    """Equal votes (or equal score sums) go to the best-ranked candidate's answer, whatever request ends first."""
    config = SearchConfig(program=program, n=4, max_steps=3, max_tokens=10_000, selection=selection)
    answers = set()
    for _ in range(6):
        result = solve(program, config, fake(TiedModel(), ConstantScorer())[0])
        assert sorted(c.answer for c in result.candidates) == ["0", "0", "1", "1"], "the tie is real"
        answers.add(result.answer)
    assert answers == {"0"}, "tied answers resolve to the first candidate in (score, text) order: v0 -> 0"


def test_build_result_ignores_the_order_paths_arrive_in():
    config = SearchConfig(selection="majority")
    paths = [ReasoningPath(state=None, steps=[f"s{i}"], step_scores=[0.5], answer=str(i % 2), finish_reason="answer")
             for i in range(4)]
    results = [build_result("p", "x", order, config, SearchContext(config)) for order in (paths, paths[::-1])]
    assert [c.text for c in results[0].candidates] == [c.text for c in results[1].candidates]
    assert results[0].answer == results[1].answer == "0"


@pytest.mark.parametrize("program,fail_on_call", [("beam_search", 3), ("dvts", 3), ("dynamic_branching", 3),
                                                  ("varying_granularity", 2), ("best_of_n", 1), ("beam_search", 1)])
def test_scorer_dying_mid_search_names_the_runtime_and_keeps_finished_candidates(program, fail_on_call):
    config = SearchConfig(program=program, n=8, beam_width=2, max_steps=6, max_tokens=10_000, granularity=2)
    full = solve(program, config, fake()[0])
    runtimes, _ = fake()
    runtimes = dataclasses.replace(runtimes, scorer=RecordingScorer(ScriptedScorer(), fail_on_call=fail_on_call))
    with pytest.raises(SearchError, match="scorer runtime 'prm'") as info:
        solve(program, config, runtimes)
    partial = info.value.result
    assert partial.error is not None and "'prm'" in partial.error and partial.program == program
    if program == "best_of_n":  # all samples were written before the one scorer call
        assert sorted(c.text for c in partial.candidates) == sorted(c.text for c in full.candidates)
        assert all(c.step_scores == [] for c in partial.candidates)
        return
    # Verifications before the failing one finished the paths of at most (fail_on_call - 1) rounds.
    steps_per_round = config.granularity if program == "varying_granularity" else 1
    horizon = (fail_on_call - 1) * steps_per_round
    expected = sorted(c.text for c in full.candidates if len(c.steps) <= horizon)
    assert sorted(c.text for c in partial.candidates) == expected
    assert all(c.finish_reason in {"answer", "eos"} for c in partial.candidates)
    if fail_on_call == 3:
        assert expected, "the scripted tree finishes some paths early, so the partial result is not empty"


def test_likelihood_scorer_on_a_dead_runtime_raises_search_error_naming_it():
    class DeadRuntime:
        name, url = "scorer", "http://127.0.0.1:9"

        def check_alive(self):
            raise RuntimeDiedError(f"runtime '{self.name}' at {self.url} exited with code -9")

    class ByteTokenizer:
        def __call__(self, text, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": list(text.encode())})()

    runtimes = fake()[0]
    runtimes = dataclasses.replace(runtimes, scorer=LikelihoodScorer(DeadRuntime(), ByteTokenizer()))
    with pytest.raises(SearchError, match="runtime 'scorer' at http://127.0.0.1:9 exited") as info:
        solve("beam_search", SearchConfig(n=4, max_steps=3, max_tokens=1000), runtimes)
    assert info.value.result.candidates == [] and info.value.result.generated_tokens > 0


def test_programs_that_need_a_verifier_say_so():
    for program in SCORED:
        if program == "best_of_n":
            continue  # best-of-N without a scorer is unscored sampling
        runtimes = dataclasses.replace(fake()[0], scorer=None)
        with pytest.raises(ValueError, match=f"{program} needs a scorer"):
            solve(program, SearchConfig(), runtimes)


def test_program_settings_are_validated():
    for field, value in [("granularity", 0), ("lookahead", -1), ("branching_temperature", 0.0),
                         ("granularity_margin", 1.5)]:
        with pytest.raises(ValueError, match=field):
            SearchConfig(**{field: value})


class DyingGenerator(ScriptedBackend):
    """The scripted generator whose runtime dies when the search asks for a step beyond `steps`."""

    def __init__(self, steps: int):
        super().__init__(ScriptedModel())
        self.steps = steps

    def generate(self, s, sampling_params):
        if s.text_.count(self.model.delimiter) - PROMPT.count(self.model.delimiter) >= self.steps:
            raise RuntimeDiedError("runtime 'generator' at http://127.0.0.1:9 exited with code -9")
        return super().generate(s, sampling_params)


@pytest.mark.parametrize("program", ["beam_search", "dvts", "dynamic_branching", "varying_granularity"])
def test_generator_dying_mid_search_keeps_finished_candidates(program):
    config = SearchConfig(program=program, n=8, beam_width=2, max_steps=6, max_tokens=10_000, granularity=1)
    full = solve(program, config, fake()[0])
    runtimes = dataclasses.replace(fake()[0], generator=DyingGenerator(steps=2))
    with pytest.raises(SearchError, match="runtime 'generator' at http://127.0.0.1:9 exited") as info:
        solve(program, config, runtimes)
    partial = info.value.result
    assert sorted(c.text for c in partial.candidates) == sorted(c.text for c in full.candidates if len(c.steps) <= 2)
    assert partial.candidates, "the scripted tree finishes some paths within two steps"


class ErroringGenerator(ScriptedBackend):
    """A generator whose live runtime answers the n-th request with an error (TTSEndpoint's GeneratorError)."""

    def __init__(self, after: int):
        super().__init__(ScriptedModel())
        self.after, self.calls = after, 0

    def generate(self, s, sampling_params):
        with self._lock:
            self.calls += 1
            failing = self.calls > self.after
        if failing:
            raise GeneratorError("generator runtime 'generator' at http://127.0.0.1:9 failed: HTTP 500")
        return super().generate(s, sampling_params)


@pytest.mark.parametrize("program", ["beam_search", "dvts", "best_of_n", "self_consistency"])
def test_a_runtime_answering_with_an_error_is_a_search_failure_with_a_partial_result(program):
    config = SearchConfig(program=program, n=4, beam_width=2, max_steps=6, max_tokens=10_000)
    runtimes = dataclasses.replace(fake()[0], generator=ErroringGenerator(after=2))
    with pytest.raises(SearchError, match="generator runtime 'generator' at http://127.0.0.1:9 failed") as info:
        solve(program, config, runtimes)
    assert info.value.result.error and info.value.result.program == program


def test_cli_lists_every_program(capsys):
    from sgl_tts.cli import main

    assert main(["programs"]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert set(PROGRAMS) | {"rsd", "deepconf"} <= set(listed)
    assert "independent subtrees" in listed["dvts"] and "no verifier" in listed["self_consistency"]
