"""PRM scorers behind the StepScorer interface: layouts, config, and scores against transformers references.

The logprob-tag scorers run on the shared tiny random-weight runtime and are compared with the model-card
recipes computed by transformers on the same weights; the classifier scorer runs on the shared tiny random-weight
Qwen2.5-Math-PRM-shaped runtime and is compared with `ReferencePRM`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_tts.config import ConfigError, load_yaml
from sgl_tts.scoring.prm import (ClassifierPRMScorer, MathShepherdScorer, RLHFlowScorer,
                                 classifier_runtime_config)
from sgl_tts.scoring.base import ScorerError
from sgl_tts.scoring.scorer_config import ScorerConfig
from sgl_tts.scoring.factory import SCORERS as SCORER_KINDS, make_scorer
from sgl_tts.scoring.likelihood import LikelihoodScorer

TOLERANCE = 1e-4  # fp32 on both sides
QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have now?"
PATHS = [
    ["Tom starts with 3 apples.\n\n", "He buys 4 more, so 3 + 4 = 7.\n\n", "The answer is $\\boxed{7}$."],
    ["Seven.\n\n"],
    [" 3 - 4 = -1\n\n", "So -1."],
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sgl_tts.runtime.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-random"))


@pytest.fixture(scope="module")
def prompt(tokenizer):
    from sgl_tts.frontend.backend import chat_prompt

    return chat_prompt(tokenizer, QUESTION)


class NoRuntime:
    name, url = "prm", "http://127.0.0.1:9"

    def check_alive(self):
        pass


# --- config and factory -------------------------------------------------------------------------------

def test_every_kind_is_made_by_the_factory(tokenizer):
    made = {kind: type(make_scorer(ScorerConfig(kind=kind), NoRuntime(), tokenizer))
            for kind in ("likelihood", "math_shepherd", "rlhflow")}
    assert made == {"likelihood": LikelihoodScorer, "math_shepherd": MathShepherdScorer, "rlhflow": RLHFlowScorer}
    assert set(SCORER_KINDS) == {"likelihood", "math_shepherd", "rlhflow", "classifier", "probe", "skywork"}


def test_unknown_scorer_kind_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as info:
        ScorerConfig(kind="orm")
    assert all(kind in str(info.value) for kind in SCORER_KINDS)
    path = tmp_path / "run.yaml"
    path.write_text("kind: orm\n")
    with pytest.raises(ConfigError, match=r"run.yaml.*likelihood, math_shepherd, rlhflow, classifier"):
        load_yaml(ScorerConfig, path)


@pytest.mark.parametrize("settings,field", [
    (dict(step_tag=""), "step_tag"), (dict(positive_token="-"), "positive_token and negative_token"),
    (dict(positive_token_id=-1), "positive_token_id"), (dict(positive_token_id=5, negative_token_id=5), "differ"),
    (dict(question_pattern="("), "question_pattern"), (dict(question_pattern="user"), "question_pattern"),
])
def test_bad_scorer_settings_are_rejected(settings, field):
    with pytest.raises(ValueError, match=field):
        ScorerConfig(kind="math_shepherd", **settings)


def test_token_ids_come_from_config_or_the_tokenizer(tokenizer):
    scorer = MathShepherdScorer(ScorerConfig(kind="math_shepherd"), NoRuntime(), tokenizer)
    assert (scorer.positive_id, scorer.negative_id) == (tokenizer.convert_tokens_to_ids("+"),
                                                        tokenizer.convert_tokens_to_ids("-"))
    explicit = MathShepherdScorer(ScorerConfig(kind="math_shepherd", positive_token_id=11, negative_token_id=12),
                                  NoRuntime(), tokenizer)
    assert (explicit.positive_id, explicit.negative_id) == (11, 12)
    with pytest.raises(ValueError, match="positive_token_id"):
        MathShepherdScorer(ScorerConfig(kind="math_shepherd", positive_token="correct step"), NoRuntime(), tokenizer)


# --- layouts --------------------------------------------------------------------------------------------

def test_math_shepherd_layout_tags_every_step(tokenizer):
    scorer = MathShepherdScorer(ScorerConfig(kind="math_shepherd"), NoRuntime(), tokenizer)
    text, offsets, special = scorer.layout("Q?", ["a\n\n", " b "])
    assert text == "Q? a ки\nb ки" and special
    assert [text[:o] for o in offsets] == ["Q? a ки", "Q? a ки\nb ки"]
    ids, positions = scorer.readout_positions(text, offsets, special)
    tag_last = tokenizer(" ки", add_special_tokens=False).input_ids[-1]
    assert [ids[p] for p in positions] == [tag_last, tag_last] and positions[-1] == len(ids) - 1


def test_rlhflow_layout_reads_where_each_plus_is_predicted(tokenizer):
    scorer = RLHFlowScorer(ScorerConfig(kind="rlhflow"), NoRuntime(), tokenizer)
    text, offsets, special = scorer.layout("Q?", ["a\n\n", "b"])
    conversation = [{"role": "user", "content": "Q? a"}, {"role": "assistant", "content": "+"},
                    {"role": "user", "content": "b"}, {"role": "assistant", "content": "+"}]
    assert text == tokenizer.apply_chat_template(conversation, tokenize=False) and not special
    assert all(text[o] == "+" and text[:o].endswith("assistant\n") for o in offsets) and len(offsets) == 2
    ids, positions = scorer.readout_positions(text, offsets, special)
    plus = tokenizer.convert_tokens_to_ids("+")
    assert [ids[p + 1] for p in positions] == [plus, plus], "the readout token is followed by the '+' verdict"


def test_readout_needs_a_token_boundary(tokenizer):
    scorer = MathShepherdScorer(ScorerConfig(kind="math_shepherd"), NoRuntime(), tokenizer)
    with pytest.raises(ValueError, match="no token boundary at character 2"):
        scorer.readout_positions("hello world", [2], False)


def test_question_is_found_in_the_generator_prompt(prompt, tokenizer):
    scorer = RLHFlowScorer(ScorerConfig(kind="rlhflow"), NoRuntime(), tokenizer)
    assert scorer.question_of(prompt) == QUESTION
    with pytest.raises(ValueError, match="question_pattern"):
        scorer.question_of("Question: what?\nAnswer:")
    custom = RLHFlowScorer(ScorerConfig(kind="rlhflow", question_pattern=r"Question: (.*?)\n"), NoRuntime(), tokenizer)
    assert custom.question_of("Question: what?\nAnswer:") == "what?"


def test_verdict_is_p_plus_over_p_plus_and_minus(tokenizer):
    import math

    scorer = MathShepherdScorer(ScorerConfig(kind="math_shepherd", positive_token_id=1, negative_token_id=2),
                                NoRuntime(), tokenizer)
    p_plus, p_minus = 0.03, 0.01
    entry = [[math.log(p_plus), 1, None], [math.log(p_minus), 2, None]]
    assert scorer.verdict(entry) == pytest.approx(p_plus / (p_plus + p_minus))
    assert scorer.verdict([[-1e4, 1, None], [0.0, 2, None]]) == 0.0


def test_unreachable_prm_runtime_is_a_scorer_error_naming_it(prompt, tokenizer):
    scorer = MathShepherdScorer(ScorerConfig(kind="math_shepherd"), NoRuntime(), tokenizer)
    with pytest.raises(ScorerError, match="scorer runtime 'prm' at http://127.0.0.1:9"):
        scorer.score(prompt, PATHS)
    assert scorer.score(prompt, [[], []]) == [[], []], "nothing to score, no request"


def test_shared_prefix_length_matches_a_brute_force_reference():
    import os
    import random

    from sgl_tts.scoring.base import shared_prefix_length

    rng = random.Random(5)
    for _ in range(200):
        stem = [rng.randrange(4) for _ in range(rng.randrange(6))]
        lists = [stem + [rng.randrange(4) for _ in range(rng.randrange(5))] for _ in range(rng.randrange(1, 5))]
        assert shared_prefix_length(lists) == len(os.path.commonprefix(lists)), lists


def test_a_batch_read_from_the_start_sends_its_shared_prefix_alone_first(tokenizer, prompt):
    """SGLang schedules a batch's requests together, so a prefix they share but the cache lacks would be computed
    once per request: the scorer sends it alone first, and only when several requests read from their start."""
    import os

    posted = []

    def post(route, payload):
        posted.append(payload)
        if "return_logprob" not in payload:
            return {"meta_info": {"prompt_tokens": len(payload["input_ids"]), "cached_tokens": 0}}
        entry = [[-0.1, scorer.positive_id, None], [-2.0, scorer.negative_id, None]]
        return [{"meta_info": {"prompt_tokens": len(ids), "cached_tokens": 0,
                               "input_token_ids_logprobs": [entry] * (len(ids) - start),
                               "output_token_ids_logprobs": [entry]}}
                for ids, start in zip(payload["input_ids"], payload["logprob_start_len"])]

    scorer = MathShepherdScorer(ScorerConfig(kind="math_shepherd"), NoRuntime(), tokenizer)
    scorer.post = post
    counted = scorer.score_counted(prompt, [path[:1] for path in PATHS])
    prefill, batch = posted
    assert prefill["input_ids"] == os.path.commonprefix(batch["input_ids"]) and prefill["input_ids"]
    assert counted.counts.requests == 1 + len(PATHS), "the prefill is counted with the batch"
    posted.clear()
    scorer.score(prompt, [path[:2] for path in PATHS])  # every path known up to its new step: already cached
    assert len(posted) == 1 and "return_logprob" in posted[0]
    posted.clear()
    scorer.set_incremental(True)
    scorer.score(prompt, [PATHS[0]])  # one request has nothing to share
    assert len(posted) == 1


def test_classifier_scorer_wraps_the_client(monkeypatch, prompt):
    from sgl_tts.scoring.prm_models import client
    from sgl_tts.scoring.prm_models.tiny import STEP_TOKEN

    calls = []

    def fake_rewards(url, texts, step_token_id, timeout):
        calls.append((url, list(texts), step_token_id, timeout))
        return [[0.25] * text.count(STEP_TOKEN) for text in texts]

    monkeypatch.setattr(client, "batch_classifier_step_rewards", fake_rewards)
    tokenizer = type("Tok", (), {"convert_tokens_to_ids": staticmethod(lambda t: 7 if t == STEP_TOKEN else 0),
                                 "unk_token_id": 0,
                                 "__call__": lambda self, text, add_special_tokens=False:
                                     SimpleNamespace(input_ids=list(text))})()
    scorer = ClassifierPRMScorer(ScorerConfig(kind="classifier"), NoRuntime(), tokenizer)
    paths = [["a\n\n", f"b {STEP_TOKEN}\n\n"], ["c"]]
    assert scorer.score(prompt, paths) == [[0.25, 0.25], [0.25]]
    url, texts, step_id, timeout = calls[0]
    assert (url, step_id, timeout) == (NoRuntime.url, 7, 600.0), "a runtime without a config: the default timeout"
    assert texts == [client.build_prm_text(QUESTION, ["a\n\n", "b \n\n"]), client.build_prm_text(QUESTION, ["c"])]
    with pytest.raises(ValueError, match="step_token"):
        ClassifierPRMScorer(ScorerConfig(kind="classifier", step_token="<nope>"), NoRuntime(), tokenizer)


def test_classifier_runtime_config_has_what_the_model_class_needs():
    from sgl_tts.scoring.prm_models import EXTERNAL_MODEL_ENV, SERVER_ARGS

    config = classifier_runtime_config("some/prm", max_total_tokens=4096)
    assert config.is_embedding and config.extra_args == list(SERVER_ARGS) and config.env == EXTERNAL_MODEL_ENV
    assert config.mem_fraction_static == 0.3 and config.max_total_tokens == 4096 and config.model == "some/prm"


# --- against transformers on real runtimes -------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_model(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from sgl_tts.runtime.models import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random"), dtype=torch.float32).eval()


def _log_probs(model, ids):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _p_plus(log_probs, position, plus, minus) -> float:
    import torch

    return torch.sigmoid(log_probs[position, plus] - log_probs[position, minus]).item()


def math_shepherd_reference(model, tokenizer, question, steps, tag, plus, minus):
    """The model card's recipe: tag every step, tokenize the whole text, read at each tag token."""
    text = f"{question} " + "\n".join(step.strip() + tag for step in steps)
    ids = tokenizer(text).input_ids
    tag_id = tokenizer(tag, add_special_tokens=False).input_ids[-1]
    log_probs = _log_probs(model, ids)
    return [_p_plus(log_probs, p, plus, minus) for p, token in enumerate(ids) if token == tag_id]


def rlhflow_reference(model, tokenizer, question, steps, plus, minus):
    """RLHFlow's recipe: one forward per step prefix of the chat, read where its last '+' is predicted."""
    verdict = tokenizer.convert_tokens_to_ids("+")
    conversation, rewards = [], []
    for index, step in enumerate(steps):
        conversation.append({"role": "user", "content": f"{question} {step.strip()}" if index == 0 else step.strip()})
        conversation.append({"role": "assistant", "content": "+"})
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        position = max(i for i, token in enumerate(ids) if token == verdict) - 1
        rewards.append(_p_plus(_log_probs(model, ids), position, plus, minus))
    return rewards


@pytest.mark.runtime
@pytest.mark.parametrize("settings", [dict(), dict(step_tag=" Step", positive_token=" yes", negative_token=" no")],
                         ids=["model-card-tokens", "other-tokens"])
def test_math_shepherd_scores_match_transformers(tiny_runtime, tokenizer, reference_model, prompt, settings):
    scorer = make_scorer(ScorerConfig(kind="math_shepherd", **settings), tiny_runtime, tokenizer)
    served = scorer.score(prompt, PATHS)
    for steps, got in zip(PATHS, served):
        want = math_shepherd_reference(reference_model, tokenizer, QUESTION, steps, scorer.config.step_tag,
                                       scorer.positive_id, scorer.negative_id)
        assert len(got) == len(want) == len(steps)
        assert got == pytest.approx(want, abs=TOLERANCE), f"{steps}: {got} vs {want}"
    assert len({round(s, 6) for path in served for s in path}) > 3, "scores vary: the check is not vacuous"


@pytest.mark.runtime
def test_rlhflow_scores_match_transformers(tiny_runtime, tokenizer, reference_model, prompt):
    scorer = make_scorer(ScorerConfig(kind="rlhflow"), tiny_runtime, tokenizer)
    served = scorer.score(prompt, PATHS)
    for steps, got in zip(PATHS, served):
        want = rlhflow_reference(reference_model, tokenizer, QUESTION, steps, scorer.positive_id, scorer.negative_id)
        assert got == pytest.approx(want, abs=TOLERANCE), f"{steps}: {got} vs {want}"
    # Token ids from config replace the tokenizer's: reading ' yes' / ' no' by id changes the scores.
    yes, no = (tokenizer(t, add_special_tokens=False).input_ids[0] for t in (" yes", " no"))
    by_id = make_scorer(ScorerConfig(kind="rlhflow", positive_token_id=yes, negative_token_id=no), tiny_runtime,
                        tokenizer)
    for steps, got in zip(PATHS, by_id.score(prompt, PATHS)):
        assert got == pytest.approx(rlhflow_reference(reference_model, tokenizer, QUESTION, steps, yes, no),
                                    abs=TOLERANCE)


@pytest.mark.runtime
def test_classifier_scorer_matches_reference_prm(tiny_prm, tiny_prm_runtime):
    from transformers import AutoTokenizer

    from sgl_tts.scoring.prm_models.client import build_prm_text
    from sgl_tts.scoring.prm_models.reference import ReferencePRM

    config = ScorerConfig(kind="classifier", runtime=classifier_runtime_config(str(tiny_prm)))
    assert tiny_prm_runtime.config == config.runtime, "the shared runtime is the one this scorer config starts"
    reference = ReferencePRM(tiny_prm)
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    scorer = make_scorer(config, tiny_prm_runtime, AutoTokenizer.from_pretrained(tiny_prm))
    served = scorer.score(prompt, PATHS)
    for steps, got in zip(PATHS, served):
        want = reference.step_rewards(build_prm_text(QUESTION, steps))
        assert len(got) == len(steps) and got == pytest.approx(want, abs=TOLERANCE), f"{got} vs {want}"


def test_a_runtime_that_does_not_answer_fails_after_its_request_timeout(tokenizer, prompt):
    """A scorer request to a runtime that accepts the connection but never answers fails after the runtime's
    `request_timeout_s` with an error naming the runtime, instead of hanging for the 600 s default."""
    import socket
    import time

    from sgl_tts.runtime.server import RuntimeConfig

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()

        class SilentRuntime(NoRuntime):
            url = f"http://127.0.0.1:{silent.getsockname()[1]}"
            config = RuntimeConfig(request_timeout_s=0.5)

        scorer = LikelihoodScorer(SilentRuntime(), tokenizer)
        started = time.monotonic()
        with pytest.raises(ScorerError, match="scorer runtime 'prm'"):
            scorer.score(prompt, [PATHS[0]])
        assert time.monotonic() - started < 30


def test_request_timeout_must_be_positive():
    from sgl_tts.runtime.server import RuntimeConfig

    with pytest.raises(ValueError, match="request_timeout_s"):
        RuntimeConfig(request_timeout_s=0)
