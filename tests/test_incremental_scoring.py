"""Incremental step scoring (sgl_tts.scoring.base): a memo of scored paths, only new steps sent to the model.

Fast tier: the scripted scorer and fake /generate runtimes (deterministic logprobs from the token ids) check
that incremental scores equal full re-scoring, that the request asks for logprobs from the first new step
only, that the memo is bounded and thread-safe, and that search programs give the same results either way.
Runtime tier: the likelihood and Math-Shepherd scorers on the tiny random runtime, incremental against full
re-scoring and against transformers, with the radix cache serving the known steps from the second call on.
"""

from __future__ import annotations

import hashlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from sgl_tts.scoring.base import ScoreCounts, ScorerError, StepMemo, StepScorer
from sgl_tts.scoring.scorer_config import ScorerConfig
from sgl_tts.scoring.factory import make_scorer
from sgl_tts.scoring.likelihood import LikelihoodScorer
from sgl_tts.scoring.prm import MathShepherdScorer
from sgl_tts.search import SearchConfig
from sgl_tts.search.programs import load_program
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

PROMPT = "Q: what is two plus two?\n\n"
GROWTH = [  # three search iterations: each path extends one of the previous call's paths by a step
    [["a\n\n"], ["b\n\n"], ["a\n\n"]],
    [["a\n\n", "c\n\n"], ["a\n\n", "d\n\n"], ["b\n\n", "c\n\n"], ["a\n\n", "c\n\n"]],
    [["a\n\n", "c\n\n", "e"], ["b\n\n", "c\n\n", "f"], ["a\n\n", "d\n\n", "e"]],
]


def assert_close(actual, expected, **tolerance):
    """Per-path step scores equal up to `tolerance` (pytest.approx does not take nested lists)."""
    assert [len(a) for a in actual] == [len(e) for e in expected]
    assert [x for a in actual for x in a] == pytest.approx([x for e in expected for x in e], **tolerance)


def reference(prompt, paths, scorer=ScriptedScorer()):
    return [[scorer.step_score(prompt, steps[: i + 1]) for i in range(len(steps))] for steps in paths]


# --- the memo and the scripted scorer ---------------------------------------------------------------------

def test_incremental_scores_equal_full_rescoring_and_score_only_new_steps():
    incremental, full = ScriptedScorer(), ScriptedScorer()
    full.set_incremental(False)
    for paths in GROWTH:
        assert incremental.score(PROMPT, paths) == full.score(PROMPT, paths) == reference(PROMPT, paths)
    assert incremental.scored == [
        (("a\n\n",), 0), (("b\n\n",), 0),  # the duplicate "a" is scored once
        (("a\n\n", "c\n\n"), 1), (("a\n\n", "d\n\n"), 1), (("b\n\n", "c\n\n"), 1),
        (("a\n\n", "c\n\n", "e"), 2), (("b\n\n", "c\n\n", "f"), 2), (("a\n\n", "d\n\n", "e"), 2),
    ]
    assert all(first == 0 for _, first in full.scored) and len(full.scored) == sum(map(len, GROWTH))
    incremental.memo.check_integrity()


def test_counts_say_what_the_call_cost():
    scorer = ScriptedScorer()
    scorer.score(PROMPT, GROWTH[0])
    result = scorer.score_counted(PROMPT, GROWTH[1])
    assert result.scores == reference(PROMPT, GROWTH[1])
    counts = result.counts.as_dict()
    # 4 paths of 2 steps; 3 distinct, each with its first step known; the scripted scorer counts characters.
    assert counts == {"paths": 4, "steps": 8, "scored_steps": 3, "requests": 3,
                      "input_tokens": 3 * 6, "cached_tokens": 3 * 3}
    assert (scorer.tokens_processed, scorer.tokens_cached) == (3 + 3 + 18, 9)
    unchanged = scorer.score_counted(PROMPT, GROWTH[1]).counts
    assert (unchanged.scored_steps, unchanged.requests, unchanged.input_tokens) == (0, 0, 0), "all memoized"


def test_prompt_is_part_of_the_key():
    scorer = ScriptedScorer()
    scorer.score(PROMPT, GROWTH[0])
    other = "Q: and three plus three?\n\n"
    assert scorer.score(other, GROWTH[1]) == reference(other, GROWTH[1])
    assert all(first == 0 for _, first in scorer.scored[-3:])


def test_memo_is_bounded_least_recently_used_first():
    memo = StepMemo(max_paths=3)
    for name in "abcd":
        memo.put(PROMPT, (name,), [0.5])
    assert len(memo) == 3 and memo.longest_prefix(PROMPT, ("a",)) == ()
    assert memo.longest_prefix(PROMPT, ("b", "x")) == (0.5,)  # "b" used: now "c" is the oldest
    memo.put(PROMPT, ("e",), [0.25])
    assert memo.longest_prefix(PROMPT, ("c",)) == () and memo.longest_prefix(PROMPT, ("b",)) == (0.5,)
    memo.check_integrity()
    with pytest.raises(ValueError, match="at least 1"):
        StepMemo(0)


def test_longest_memoized_prefix_wins():
    memo = StepMemo()
    memo.put(PROMPT, ("a",), [0.1])
    memo.put(PROMPT, ("a", "b", "c"), [0.1, 0.2, 0.3])
    assert memo.longest_prefix(PROMPT, ("a", "b", "c", "d")) == (0.1, 0.2, 0.3)
    assert memo.longest_prefix(PROMPT, ("a", "b", "x")) == (0.1, 0.2), "a prefix of a memoized path counts"
    assert memo.longest_prefix(PROMPT, ("x",)) == ()


def test_memo_is_thread_safe_and_stays_bounded():
    scorer = ScriptedScorer()
    scorer.set_incremental(True, memo_paths=16)
    barrier = threading.Barrier(8)

    def search(worker: int) -> bool:
        barrier.wait()
        ok = True
        paths = [[f"s{worker % 3}-{k}\n\n"] for k in range(4)]
        for depth in range(12):
            ok &= scorer.score(PROMPT, paths) == reference(PROMPT, paths)
            paths = [p + [f"d{depth}-{k % 2}\n\n"] for k, p in enumerate(paths)]
        return ok

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(search, range(8)))
    assert len(scorer.memo) <= 16
    scorer.memo.check_integrity()


def test_config_switch_reaches_the_scorer():
    tokenizer = SimpleNamespace()
    runtime = SimpleNamespace(name="scorer", url="http://127.0.0.1:9")
    scorer = make_scorer(ScorerConfig(incremental=False, memo_paths=7), runtime, tokenizer)
    assert scorer.incremental is False and scorer.memo.max_paths == 7
    assert make_scorer(ScorerConfig(), runtime, tokenizer).incremental is True
    with pytest.raises(ValueError, match="memo_paths"):
        ScorerConfig(memo_paths=0)


class WholePathScorer(StepScorer):
    """Overrides `score`: scores whole paths every call, as before incremental scoring."""

    def score(self, prompt, paths):
        return [[0.5] * len(p) for p in paths]


class WrongLengthScorer(StepScorer):
    def score_new_steps(self, prompt, paths, first_new, counts):
        return [[0.5] * len(p) for p in paths]  # ignores first_new


def test_scorers_that_score_whole_paths_still_work_and_wrong_lengths_are_caught():
    scored = WholePathScorer().score_counted(PROMPT, GROWTH[1])
    assert scored.scores == [[0.5, 0.5]] * 4 and (scored.counts.paths, scored.counts.steps) == (4, 8)
    scorer = WrongLengthScorer()
    scorer.score(PROMPT, GROWTH[0])
    with pytest.raises(ScorerError, match="2 scores for 1 new steps"):
        scorer.score(PROMPT, GROWTH[1])


@pytest.mark.parametrize("program", ["beam_search", "dvts", "dynamic_branching", "best_of_n"])
def test_programs_give_the_same_result_with_incremental_scoring(program):
    config = SearchConfig(program=program, n=8, beam_width=2, max_steps=5, max_tokens=10_000)
    problem = SimpleNamespace(id="p1", question="what is two plus two?", gold="4")
    results = {}
    for incremental in (True, False):
        scorer = ScriptedScorer()
        scorer.set_incremental(incremental)
        from sgl_tts.search import Runtimes

        runtimes = Runtimes(generator=ScriptedBackend(ScriptedModel()), scorer=scorer, prompt=lambda q: PROMPT)
        result = load_program(program)(problem, config, runtimes)
        results[incremental] = [(c.text, c.step_scores) for c in result.candidates], result.answer
        if incremental and program != "best_of_n":
            later = [first for steps, first in scorer.scored if len(steps) > 1]
            assert later and all(first == len(steps) - 1 for steps, first in scorer.scored if len(steps) > 1), \
                "after the first iteration every path is scored from its new step only"
    assert results[True] == results[False]


# --- fake runtimes: what the scorers ask SGLang for ------------------------------------------------------

class CharTokenizer:
    """One token per character (id = code point); enough for the likelihood scorer's and the tag PRMs' needs."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        encoded = SimpleNamespace(input_ids=[ord(c) for c in text])
        if return_offsets_mapping:
            encoded.offset_mapping = [(i, i + 1) for i in range(len(text))]
        return encoded


def fake_logprob(prefix: list[int], token: int) -> float:
    """A deterministic 'model': log-probability of `token` after `prefix`, in (-5, 0)."""
    digest = hashlib.sha256(repr((prefix[-6:], len(prefix), token)).encode()).digest()
    return -5 * (int.from_bytes(digest[:4], "big") / 2**32)


class FakeGenerate:
    """Answers /generate like SGLang: input logprobs from logprob_start_len on (entry 0 is None), and
    cached_tokens = the longest prefix seen before, capped at logprob_start_len (as SGLang caps it)."""

    def __init__(self):
        self.payloads = []
        self.seen: list[list[int]] = []
        self.lock = threading.Lock()

    def one(self, ids, start, token_ids):
        with self.lock:
            cached = max((next((k for k, (a, b) in enumerate(zip(ids, s)) if a != b), min(len(ids), len(s)))
                          for s in self.seen), default=0)
            self.seen.append(list(ids))
        meta = {"prompt_tokens": len(ids), "cached_tokens": min(cached, len(ids) - 1 if start is None else start,
                                                                len(ids) - 1)}
        if start is None:  # no logprobs asked: a prefill to be cached
            return {"meta_info": meta}
        if token_ids is None:
            meta["input_token_logprobs"] = [[None if t == start else fake_logprob(ids[:t], ids[t]), ids[t], None]
                                            for t in range(start, len(ids))]
        else:
            meta["input_token_ids_logprobs"] = [[[fake_logprob(ids[:t], k), k, None] for k in token_ids]
                                                for t in range(start, len(ids))]
            meta["output_token_ids_logprobs"] = [[[fake_logprob(ids, k), k, None] for k in token_ids]]
        return {"meta_info": meta}

    def __call__(self, url, payload, timeout=None):
        with self.lock:
            self.payloads.append(payload)
        ids, start = payload["input_ids"], payload.get("logprob_start_len")
        token_ids = payload.get("token_ids_logprob")
        if isinstance(ids[0], list):
            return [self.one(i, s, token_ids) for i, s in zip(ids, start)]
        return self.one(ids, start, token_ids)


def likelihood_reference(prompt: str, steps: list[str]) -> list[float]:
    ids, scores = [ord(c) for c in prompt], []
    for step in steps:
        values = [fake_logprob(ids + [ord(c) for c in step[:k]], ord(step[k])) for k in range(len(step))]
        scores.append(math.exp(sum(values) / len(values)))
        ids += [ord(c) for c in step]
    return scores


@pytest.fixture
def fake_generate(monkeypatch):
    import sgl_tts.runtime.server as server
    import sgl_tts.scoring.runtime_calls as runtime_calls

    fake = FakeGenerate()
    monkeypatch.setattr(server, "http_json", fake)
    monkeypatch.setattr(runtime_calls, "http_json", fake)
    return fake


RUNTIME = SimpleNamespace(name="scorer", url="http://127.0.0.1:9", check_alive=lambda: None)


def test_likelihood_asks_for_logprobs_from_the_first_new_step(fake_generate):
    incremental = LikelihoodScorer(RUNTIME, CharTokenizer())
    full = LikelihoodScorer(RUNTIME, CharTokenizer())
    full.set_incremental(False)
    for index, paths in enumerate(GROWTH):
        expected = [likelihood_reference(PROMPT, p) for p in paths]
        for scorer in (full, incremental):
            fake_generate.payloads.clear()
            scored = scorer.score_counted(PROMPT, paths)
            counts = scored.counts
            assert_close(scored.scores, expected, abs=1e-12)
            starts = sorted(p["logprob_start_len"] for p in fake_generate.payloads)
            if scorer is full:
                assert starts == [len(PROMPT) - 1] * len(paths)
            else:
                first_new = {tuple(p): len(PROMPT) + sum(map(len, p[:-1])) - 1 for p in paths}
                assert starts == sorted(first_new.values()), "one request per distinct path, from its new step"
                if index:
                    assert counts.cached_tokens > 0 and counts.cached_tokens == counts.input_tokens - sum(
                        len(p[-1]) + 1 for p in {tuple(p): p for p in paths}.values())


class FakeTagScorer(MathShepherdScorer):
    def __init__(self):
        config = ScorerConfig(kind="math_shepherd", step_tag="#", positive_token_id=43, negative_token_id=45,
                              question_pattern=r"Q: (.*?)\n")
        super().__init__(config, RUNTIME, CharTokenizer())


def tag_reference(question: str, steps: list[str]) -> list[float]:
    text, scores = f"{question} ", []
    for index, step in enumerate(steps):
        text += ("\n" if index else "") + step.strip() + "#"
        ids = [ord(c) for c in text]
        scores.append(1 / (1 + math.exp(fake_logprob(ids, 45) - fake_logprob(ids, 43))))
    return scores


def test_tag_prm_reads_only_the_new_steps_tags(fake_generate):
    incremental, full = FakeTagScorer(), FakeTagScorer()
    full.set_incremental(False)
    question = "what is two plus two?"
    for index, paths in enumerate(GROWTH):
        expected = [tag_reference(question, p) for p in paths]
        assert_close(full.score(PROMPT, paths), expected, abs=1e-12)
        fake_generate.payloads.clear()
        assert_close(incremental.score(PROMPT, paths), expected, abs=1e-12)
        *prefill, payload = fake_generate.payloads
        # the first call reads every path from its start: the question they share goes alone first
        assert [p["input_ids"] for p in prefill] == ([[ord(c) for c in f"{question} "]] if index == 0 else [])
        # The readout of a step is its tag's position: the length of the text up to the tag, minus one.
        texts = {tuple(p): f"{question} " + "\n".join(s.strip() + "#" for s in p[:-1]) for p in paths}
        tags = [len(text) + (1 if len(p) > 1 else 0) + len(p[-1].strip()) for p, text in texts.items()]
        assert payload["logprob_start_len"] == tags


# --- a real runtime ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from sgl_tts.runtime.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-random"))


REAL_GROWTH = [
    [["Tom starts with 3 apples.\n\n"], ["He has three.\n\n"]],
    [["Tom starts with 3 apples.\n\n", "He buys 4 more, so 3 + 4 = 7.\n\n"],
     ["He has three.\n\n", "Then seven.\n\n"]],
    [["Tom starts with 3 apples.\n\n", "He buys 4 more, so 3 + 4 = 7.\n\n", "The answer is $\\boxed{7}$."],
     ["He has three.\n\n", "Then seven.\n\n", "So 7."]],
]


def likelihood_transformers(model, tokenizer, prompt, steps):
    import torch

    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    bounds = []
    for step in steps:
        start = len(ids)
        ids = ids + tokenizer(step, add_special_tokens=False).input_ids
        bounds.append((start, len(ids)))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [math.exp(sum(log_probs[t - 1, ids[t]].item() for t in range(a, b)) / (b - a)) for a, b in bounds]


@pytest.mark.runtime
def test_likelihood_incremental_equals_full_and_transformers_on_a_runtime(tiny_runtime, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.bench.fasttts import flush_caches

    model = AutoModelForCausalLM.from_pretrained(tiny_runtime.model_path, dtype=torch.float32).eval()
    prompt = chat_prompt(tiny_tokenizer, "Tom has 3 apples and buys 4 more. How many apples does he have now?")
    incremental = LikelihoodScorer(tiny_runtime, tiny_tokenizer)
    full = LikelihoodScorer(tiny_runtime, tiny_tokenizer)
    full.set_incremental(False)
    flush_caches({"tiny": tiny_runtime})
    cached = []
    for paths in REAL_GROWTH:
        expected = [likelihood_transformers(model, tiny_tokenizer, prompt, p) for p in paths]
        scored = incremental.score_counted(prompt, paths)
        cached.append(scored.counts)
        assert_close(scored.scores, expected, rel=1e-4)  # incremental against transformers
        assert_close(full.score(prompt, paths), scored.scores, rel=1e-4)  # against full re-scoring
    prompt_tokens = len(tiny_tokenizer(prompt, add_special_tokens=False).input_ids)
    for counts, paths in zip(cached[1:], REAL_GROWTH[1:]):
        new_tokens = sum(len(tiny_tokenizer(p[-1], add_special_tokens=False).input_ids) for p in paths)
        assert counts.cached_tokens > len(paths) * prompt_tokens, "the earlier steps come from the radix cache"
        assert counts.input_tokens - counts.cached_tokens <= new_tokens + len(paths), \
            "only the new steps (and one token before each) are computed"


@pytest.mark.runtime
def test_math_shepherd_incremental_equals_full_on_a_runtime(tiny_runtime, tiny_tokenizer):
    from sgl_tts.frontend.backend import chat_prompt
    from sgl_tts.bench.fasttts import flush_caches

    prompt = chat_prompt(tiny_tokenizer, "Tom has 3 apples and buys 4 more. How many apples does he have now?")
    config = ScorerConfig(kind="math_shepherd")
    incremental = make_scorer(config, tiny_runtime, tiny_tokenizer)
    full = make_scorer(ScorerConfig(kind="math_shepherd", incremental=False), tiny_runtime, tiny_tokenizer)
    flush_caches({"tiny": tiny_runtime})
    counts = []
    for paths in REAL_GROWTH:
        scored = incremental.score_counted(prompt, paths)
        counts.append(scored.counts)
        assert_close(full.score(prompt, paths), scored.scores, rel=1e-4)
    assert all(c.cached_tokens > 0 for c in counts[1:]), [c.as_dict() for c in counts]


def classifier_expected(model_dir, question, paths):
    from sgl_tts.scoring.prm_models.client import build_prm_text
    from sgl_tts.scoring.prm_models.reference import ReferencePRM

    reference_prm = ReferencePRM(model_dir)
    return [reference_prm.step_rewards(build_prm_text(question, [s.strip() for s in p])) for p in paths]


def skywork_expected(model_dir, question, paths):
    from sgl_tts.scoring.prm_models.reference import ReferenceValuePRM

    reference_prm = ReferenceValuePRM(model_dir)
    rewards = [reference_prm.line_rewards(question, "\n".join(s.strip() for s in p)) for p in paths]
    assert all(len(r) == len(p) for r, p in zip(rewards, paths)), "one line per step in REAL_GROWTH"
    return rewards


@pytest.mark.runtime
@pytest.mark.parametrize("kind, value_head, expected_of", [("classifier", False, classifier_expected),
                                                           ("skywork", True, skywork_expected)])
def test_folded_prm_matches_its_reference_and_uses_the_radix_cache(tmp_path_factory, kind, value_head, expected_of):
    """This project's PRM model classes (Qwen2.5-Math-PRM's classifier, Skywork's value head) served in
    generation mode, the head folded into the LM head and read through logprobs on a radix-cached runtime,
    give the transformers reference's step rewards, incrementally and in full, and serve the known steps
    from the cache."""
    from transformers import AutoTokenizer

    from sgl_tts.runtime.server import Runtime
    from sgl_tts.scoring.prm import classifier_runtime_config
    from sgl_tts.scoring.prm_models.tiny import build_tiny_prm

    model_dir = build_tiny_prm(tmp_path_factory.mktemp(f"tiny-{kind}"), seed=0, value_head=value_head)
    question = "Tom has 3 apples and buys 4 more. How many apples does he have now?"
    prompt = f"<|im_start|>user\n{question}<|im_end|>\n"
    runtime_config = classifier_runtime_config(str(model_dir), cached=True, startup_timeout_s=1200)
    assert not runtime_config.is_embedding and "--disable-radix-cache" not in runtime_config.extra_args
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with Runtime.start(runtime_config, name="prm", log_dir=tmp_path_factory.mktemp("prm-logs")) as runtime:
        incremental = make_scorer(ScorerConfig(kind=kind), runtime, tokenizer)
        full = make_scorer(ScorerConfig(kind=kind, incremental=False), runtime, tokenizer)
        counts = []
        for paths in REAL_GROWTH:
            expected = expected_of(model_dir, question, paths)
            scored = incremental.score_counted(prompt, paths)
            counts.append(scored.counts)
            assert_close(scored.scores, expected, abs=1e-4)
            assert_close(full.score(prompt, paths), expected, abs=1e-4)
    assert all(c.cached_tokens > 0 for c in counts[1:]), [c.as_dict() for c in counts]
    assert len({round(x, 3) for r in expected for x in r}) > 1, "rewards should differ between steps"


def test_skywork_layout_is_the_models_own_reading(tmp_path):
    """The scorer's ids are Skywork's layout of the whole solution (every line tokenized on its own and ended
    by the newline token), and each step is read at its last line's newline; a multi-line step and an empty
    step included."""
    from transformers import AutoTokenizer

    from sgl_tts.scoring.prm import SkyworkPRMScorer
    from sgl_tts.scoring.prm_models.reference import ReferenceValuePRM
    from sgl_tts.scoring.prm_models.tiny import build_tiny_prm

    model_dir = build_tiny_prm(tmp_path, seed=0, value_head=True)
    reference_prm = ReferenceValuePRM(model_dir)
    runtime = SimpleNamespace(config=SimpleNamespace(is_embedding=False), url="http://127.0.0.1:1", name="prm")
    scorer = SkyworkPRMScorer(ScorerConfig(kind="skywork"), runtime, AutoTokenizer.from_pretrained(model_dir))
    steps = ["Tom starts with 3 apples.\n\n", "He buys 4 more.\nSo 3 + 4 = 7.\n\n", "", "The answer is 7."]
    ids, positions = scorer.encode("How many apples?", steps)
    reference_ids, flags = reference_prm.encode("How many apples?", "\n".join(s.strip() for s in steps))
    assert ids == reference_ids
    assert positions == [flags[0], flags[2], flags[3], flags[4]]  # step 2 has two lines
    assert scorer.encode("How many apples?", steps[:2]) == (ids[:positions[1] + 1], positions[:2])  # a prefix
    with pytest.raises(ValueError, match="generation mode"):
        SkyworkPRMScorer(ScorerConfig(kind="skywork"), SimpleNamespace(config=SimpleNamespace(is_embedding=True)),
                         scorer.tokenizer)


def test_bench_call_log_records_each_call_and_the_table_compares_the_arms():
    from sgl_tts.bench.verifier_scoring import CallLog, format_table

    calls = {}
    for arm, incremental in (("full", False), ("incremental", True)):
        inner = ScriptedScorer()
        inner.set_incremental(incremental)
        log = CallLog(inner)
        for paths in GROWTH:
            assert log.score(PROMPT, paths) == reference(PROMPT, paths)
        calls[arm] = [log.take()]
        assert log.take() == []
    assert [c["scored_steps"] for c in calls["full"][0]] == [3, 8, 9]
    assert [c["scored_steps"] for c in calls["incremental"][0]] == [2, 3, 3]
    assert [c["cached_tokens"] for c in calls["incremental"][0]][1:] == [9, 3 * 6]
    table = format_table(calls)
    assert "3 (3-3)" in table and "0.33x" in table  # iteration 3: 3 of 9 steps scored


def test_an_evicted_path_takes_its_prefixes_with_it():
    memo = StepMemo(max_paths=1)
    memo.put(PROMPT, ("a", "b", "c"), [0.1, 0.2, 0.3])
    assert memo.longest_prefix(PROMPT, ("a",)) == (0.1,)
    memo.put(PROMPT, ("x", "y"), [0.5, 0.6])
    assert memo.longest_prefix(PROMPT, ("a", "b")) == () and memo.longest_prefix(PROMPT, ("x",)) == (0.5,)
    memo.check_integrity()
