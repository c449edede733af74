"""The backend beneath the DSL: lineage tags from SGLang's fork tree, accounting from meta_info, seeds, and
per-run views, for a plain SGLang program (docs/examples/step_vote.py imports nothing of sgl-tts) as for a
built-in one; and the one module that touches SGLang internals."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from policies.base import decode_rid
from sgl_tts.frontend.backend import GeneratorError, TTSEndpoint, request_seed
from sgl_tts.frontend.sglang_internals import check_interface
from sgl_tts.problems import Problem
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.search.programs import load_program
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

ROOT = Path(__file__).resolve().parents[1]
STEP_VOTE = str(ROOT / "docs" / "examples" / "step_vote.py")
PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p/1", question="what is two plus two?", gold="4")
SEARCH = SearchConfig(n=4, beam_width=2, max_steps=4, max_step_tokens=48, max_tokens=192)


def test_the_sglang_internals_sgl_tts_relies_on_are_there():
    check_interface()  # fails naming the field or method an SGLang upgrade changed


def test_a_program_state_freed_while_threading_holds_its_shutdown_lock_does_not_hang():
    """The garbage collector may free a state inside threading's own bookkeeping (a new thread starting, with
    the shutdown lock held). SGLang's finalizer asked the ended worker `is_alive()`, which takes that lock, and
    the process hung (it stopped a CI run); the installed finalizer must not touch it."""
    import threading
    import time

    from sglang.lang.interpreter import ProgramState, StreamExecutor

    shutdown_lock = getattr(threading, "_shutdown_locks_lock", None)
    if shutdown_lock is None:
        pytest.skip("this Python's threading has no shutdown lock")
    executor = StreamExecutor(ScriptedBackend(ScriptedModel()), {}, None, None, False)
    executor.queue.put(None)  # the worker ends; nobody has asked it is_alive() yet
    deadline = time.monotonic() + 60
    while executor.worker._tstate_lock.locked():  # the thread's end, as threading itself will see it
        assert time.monotonic() < deadline, "the worker thread did not end"
        time.sleep(0.01)
    go, finalized = threading.Event(), threading.Event()

    def finalize():
        go.wait()
        type(executor).__del__(executor)
        ProgramState(executor).__del__()  # a ProgramState's finalizer ends its executor too
        finalized.set()

    threading.Thread(target=finalize, daemon=True).start()  # a daemon thread starts without the lock
    with shutdown_lock:
        go.set()
        done = finalized.wait(timeout=30)
    assert done, "the state's finalizer waited for threading's shutdown lock"


def test_the_example_plain_program_imports_nothing_of_sgl_tts():
    tree = ast.parse(Path(STEP_VOTE).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"collections", "sglang"}


def scripted_run(program, search=SEARCH, model=None):
    backend = ScriptedBackend(model or ScriptedModel(answer_depth=2, answer_chance=0.4))
    completions = []
    runtimes = Runtimes(generator=backend, scorer=ScriptedScorer(), prompt=lambda q: PROMPT)
    context = runtimes.new_search(search, PROBLEM.id, observers=[lambda r: completions.append(r.completion_tokens)])
    return load_program(program)(PROBLEM, search, runtimes, context), backend, completions


@pytest.mark.parametrize("program", [STEP_VOTE, "beam_search", "dvts", "dynamic_branching", "varying_granularity",
                                     "best_of_n"])
def test_every_request_carries_its_place_in_the_fork_tree(program):
    result, backend, _ = scripted_run(program)
    tags = [(decode_rid(r["fields"]["rid"]), r["text"]) for r in backend.requests]
    assert tags and all(tag is not None and not tag.speculative for tag, _ in tags)
    assert len({tag.problem_id for tag, _ in tags}) == 1 and tags[0][0].problem_id.startswith("p/1/")
    text_of = {tag.beam_id: text for tag, text in tags}
    siblings = defaultdict(set)
    for tag, text in tags:
        assert tag.iteration >= 1 and tag.parent_id is not None, "every request is a fork of an earlier state"
        siblings[tag.parent_id].add(text)
        if tag.parent_id in text_of:  # the parent generated too: a child's context extends the parent's
            assert text.startswith(text_of[tag.parent_id]) and tag.iteration >= 2
    assert any(len(texts) == 1 for texts in siblings.values()), "forks of one parent share its text"


@pytest.mark.parametrize("program", [STEP_VOTE, "beam_search", "best_of_n"])
def test_a_result_counts_every_token_the_server_reported(program):
    result, backend, completions = scripted_run(program)
    assert result.generated_tokens == sum(completions) > 0
    assert result.prompt_tokens == sum(len(r["text"]) for r in backend.requests), "the scripted prompt count"
    assert result.cached_tokens > 0 and 0 < result.cache_hit_rate <= 1, "forks are served from the cache"
    assert result.precise_goodput > 0 and all(c.tokens > 0 for c in result.candidates)


def test_a_plain_program_candidate_counts_the_tokens_on_its_path():
    result, backend, _ = scripted_run(STEP_VOTE)
    (candidate,) = result.candidates
    # step_vote generates each step in k forks; the chosen path holds one step per round.
    assert candidate.tokens == sum(len(step.replace("\n\n", " ").split()) for step in candidate.steps)
    assert candidate.tokens < result.generated_tokens, "the forks not chosen were generated too"
    assert result.answer == candidate.answer


def test_one_seed_reproduces_a_search_and_another_seed_changes_it():
    import dataclasses

    def candidates(seed):
        result, _, _ = scripted_run("beam_search", dataclasses.replace(SEARCH, seed=seed))
        return [(c.text, c.score) for c in result.candidates]

    assert candidates(0) == candidates(0)
    assert candidates(7) == candidates(7)
    assert candidates(7) != candidates(0)
    assert request_seed(7, 3) == request_seed(7, 3) != request_seed(7, 4)


def test_searches_on_one_shared_backend_count_apart():
    runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: PROMPT)
    first, second = runtimes.new_search(SEARCH, "a"), runtimes.new_search(SEARCH, "b")
    result = load_program("beam_search")(PROBLEM, SEARCH, runtimes, first)
    assert first.ledger.completion_tokens == result.generated_tokens > 0, "the search's requests count into it"
    assert second.ledger.requests == 0 and not hasattr(runtimes.generator, "ledger"), "and nowhere else"


class DeadRuntime:
    name, url = "generator", "http://127.0.0.1:9"

    def check_alive(self):
        pass  # the process is up, but it answers with errors


def test_an_endpoint_error_names_the_runtime_and_is_a_search_failure():
    from sgl_tts.search.api import RUNTIME_FAILURES

    endpoint = TTSEndpoint.__new__(TTSEndpoint)  # no server to ask for model info
    endpoint.runtime, endpoint.base_url = DeadRuntime(), DeadRuntime.url

    def failing(*args):
        raise RuntimeError({"error": "bad request"})

    with pytest.raises(GeneratorError, match="generator runtime 'generator' at http://127.0.0.1:9 failed"):
        endpoint._call(failing)
    assert issubclass(GeneratorError, RUNTIME_FAILURES)


def test_an_answer_is_heard_before_its_request_leaves_the_in_flight_set(monkeypatch):
    """A cancel aborts the requests in flight and waits until none is left, then reads the search's abort count:
    each answer (an abort here) must be recorded while its rid is still in flight."""
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sglang.lang.chat_template import get_chat_template

    endpoint = TTSEndpoint.__new__(TTSEndpoint)  # no server to ask for model info
    endpoint.runtime, endpoint.base_url, endpoint.name = DeadRuntime(), DeadRuntime.url, "generator"
    endpoint.standard_priority, endpoint.send_seed = None, False
    endpoint.chat_template, endpoint.api_key = get_chat_template("default"), None
    aborted = {"type": "abort", "message": "aborted by the client"}
    monkeypatch.setattr(RuntimeEndpoint, "generate", lambda self, s, sampling_params: (
        "", {"completion_tokens": 0, "prompt_tokens": 1, "cached_tokens": 0, "finish_reason": aborted}))
    monkeypatch.setattr(RuntimeEndpoint, "commit_lazy_operations", lambda self, s: None)  # a fork's prefix
    runtimes = Runtimes(generator=endpoint, scorer=ScriptedScorer(), prompt=lambda q: PROMPT)
    context = runtimes.new_search(SearchConfig(program="self_consistency", n=3, max_tokens=8), PROBLEM.id)
    heard_when_done = []
    request_done = context.request_done

    def done(rid):
        heard_when_done.append(context.aborted_requests)
        request_done(rid)

    monkeypatch.setattr(context, "request_done", done)
    load_program("self_consistency")(PROBLEM, context.config, runtimes, context)
    assert context.aborted_requests == 3
    assert sorted(heard_when_done)[-3:] == [1, 2, 3], heard_when_done
