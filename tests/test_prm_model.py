"""The step-classifier PRM class served by a real SGLang CPU runtime equals the transformers reference.

A tiny random-weight Qwen2.5-Math-PRM-shaped checkpoint is built into a temporary folder; the runtime (the
session's `tiny_prm_runtime`, shared with the classifier scorer's tests) loads `Qwen2ForProcessRewardModel` from
`sgl_tts.scoring.prm_models` through SGLANG_EXTERNAL_MODEL_PACKAGE.
"""

from __future__ import annotations

import pytest

from sgl_tts.scoring.prm_models.client import (
    batch_classifier_step_rewards,
    build_prm_text,
    classifier_step_rewards,
    prm_step_rewards,
)
from sgl_tts.scoring.prm_models.tiny import STEP_TOKEN, build_tiny_prm

TOLERANCE = 1e-4  # fp32 on both sides
PROBLEMS = [
    ("What is 2 + 2?", ["2 + 2 = 4."]),
    ("Add 13 and 29.", ["13 + 29 = 42.", "Check: 42 - 29 = 13, so the answer is 42."]),
    ("A train travels 60 km in 1.5 hours. What is its average speed?",
     ["Average speed is distance divided by time.", "60 / 1.5 = 40.", "The unit is km per hour.",
      "The answer is \\boxed{40} km/h."]),
]


@pytest.fixture(scope="module")
def reference(tiny_prm):
    from sgl_tts.scoring.prm_models.reference import ReferencePRM

    return ReferencePRM(tiny_prm)


@pytest.fixture(scope="module")
def prm_url(tiny_prm_runtime):
    return tiny_prm_runtime.url


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} rewards vs {len(b)} reference rewards"
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def test_prompt_format_puts_the_step_token_after_every_step():
    text = build_prm_text("Q?", [" a\n", "b"], system="S")
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
                    f"<|im_start|>assistant\na{STEP_TOKEN}b{STEP_TOKEN}<|im_end|>\n")


def test_tiny_checkpoint_is_deterministic(tmp_path):
    first, second = build_tiny_prm(tmp_path / "a", seed=3), build_tiny_prm(tmp_path / "b", seed=3)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs between builds"


def test_reference_gives_one_probability_per_step(reference):
    for question, steps in PROBLEMS:
        rewards = reference.step_rewards(build_prm_text(question, steps))
        assert len(rewards) == len(steps), f"{question!r}: {len(rewards)} rewards for {len(steps)} steps"
        assert all(0.0 < r < 1.0 for r in rewards), rewards
    spread = [r for q, s in PROBLEMS for r in reference.step_rewards(build_prm_text(q, s))]
    assert max(spread) - min(spread) > 0.1, f"tiny checkpoint rewards barely vary ({spread}): weak check"


@pytest.mark.runtime
def test_step_rewards_match_reference(prm_url, reference):
    for question, steps in PROBLEMS:
        served = prm_step_rewards(prm_url, question, steps, reference.step_token_id)
        expected = reference.step_rewards(build_prm_text(question, steps))
        assert len(served) == len(steps)
        assert _max_abs_diff(served, expected) <= TOLERANCE, f"{question!r}: {served} vs {expected}"


@pytest.mark.runtime
def test_batched_texts_and_ids_match_reference(prm_url, reference):
    texts = [build_prm_text(q, s) for q, s in PROBLEMS]
    ids = reference.tokenizer.encode(texts[2])
    prompts = [*texts, "no step token here", ids]
    served = batch_classifier_step_rewards(prm_url, prompts, reference.step_token_id)
    expected = [reference.step_rewards(p) for p in prompts]
    assert [len(r) for r in served] == [1, 2, 4, 0, 4]
    for got, want in zip(served, expected):
        assert _max_abs_diff(got, want) <= TOLERANCE, f"{got} vs {want}"
    assert classifier_step_rewards(prm_url, ids, reference.step_token_id) == pytest.approx(served[4], abs=TOLERANCE)


@pytest.mark.runtime
def test_plain_encode_reads_out_at_the_configured_step_token(prm_url, reference):
    from sgl_tts.runtime.server import http_json

    text = build_prm_text(*PROBLEMS[2])
    served = http_json(prm_url + "/encode", {"text": text})["embedding"]
    expected = reference.step_probabilities(text).tolist()
    assert len(served) == len(expected) == 4
    for got, want in zip(served, expected):
        assert got == pytest.approx(want, abs=TOLERANCE)
