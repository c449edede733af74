import math
import random

import numpy as np
import pytest

from programs.rsd import Settings
from sgl_tts.config import ConfigError, load_dataclass, load_yaml
from sgl_tts.rsd.acceptance import (
    WEIGHTINGS,
    FlopsCounter,
    StepRecord,
    accept_draft_step,
    accept_with_weight,
    draft_only_fraction,
    get_weighting,
    rejected_draft_tokens,
    summarize_run,
    target_invocation_rate,
    time_by_model,
    tokens_by_model,
    weight,
)


class FixedUniform:
    """A uniform source that always returns the same u and counts its draws."""

    def __init__(self, u):
        self.u = u
        self.draws = 0

    def random(self):
        self.draws += 1
        return self.u


# --- weighting functions ---------------------------------------------------------------------------------


def test_binary_threshold_is_inclusive():
    config = Settings()
    assert config.weighting == "binary" and config.delta == 0.7
    assert config.weight(0.7) == 1.0
    assert config.weight(math.nextafter(0.7, 0.0)) == 0.0
    assert config.weight(1.0) == 1.0 and config.weight(0.0) == 0.0
    assert accept_draft_step(0.7, config, FixedUniform(0.0))
    assert not accept_draft_step(0.6999, config, FixedUniform(0.0))


def test_delta_zero_and_one_are_draft_only_and_target_only():
    assert Settings(delta=0.0).weight(0.0) == 1.0
    assert Settings(delta=1.0).weight(0.999) == 0.0
    assert Settings(delta=1.0).weight(1.0) == 1.0


def test_constant_ignores_reward():
    config = Settings(weighting="constant", constant=0.6)
    assert [config.weight(r) for r in (0.0, 0.5, 1.0, -3.0)] == [0.6] * 4


def test_clipping():
    config = Settings(weighting="clipping")
    assert [config.weight(r) for r in (-0.2, 0.0, 0.42, 1.0, 1.3)] == [0.0, 0.0, 0.42, 1.0, 1.0]


def test_sigmoidal_is_r_over_one_plus_r():
    config = Settings(weighting="sigmoidal")
    assert config.weight(1.0) == pytest.approx(0.5)
    assert config.weight(0.25) == pytest.approx(0.2)
    assert config.weight(3.0) == pytest.approx(0.75)
    assert config.weight(0.0) == 0.0
    # max(0, .) keeps negative rewards at 0, also below -1 where r/(1+r) turns positive again
    assert config.weight(-0.5) == 0.0 and config.weight(-3.0) == 0.0


def test_logistic_values_and_monotone():
    config = Settings(weighting="logistic", logistic_alpha=1.0, delta=0.6)  # RSD Fig. 6 setting
    assert config.weight(0.6) == pytest.approx(0.5)
    assert config.weight(1.0) == pytest.approx(1.0 / (1.0 + math.exp(-0.4)))
    assert config.weight(0.0) == pytest.approx(1.0 / (1.0 + math.exp(0.6)))
    weights = [config.weight(r) for r in np.linspace(-2.0, 3.0, 101)]
    assert all(a < b for a, b in zip(weights, weights[1:]))
    steep = Settings(weighting="logistic", logistic_alpha=50.0, delta=0.7)
    assert steep.weight(0.6) < 0.01 and steep.weight(0.8) > 0.99
    assert Settings(weighting="logistic", logistic_alpha=1000.0).weight(-1e6) == 0.0  # no overflow


def test_every_weighting_maps_rewards_into_unit_interval():
    for name in WEIGHTINGS:
        config = Settings(weighting=name)
        for r in (-5.0, -1.0, 0.0, 0.3, 0.7, 1.0, 5.0):
            assert 0.0 <= config.weight(r) <= 1.0, (name, r)


def test_weight_reads_the_four_settings_of_any_object():
    from types import SimpleNamespace

    plain = SimpleNamespace(weighting="logistic", delta=0.6, constant=0.6, logistic_alpha=2.0)
    assert weight(0.9, plain) == Settings(weighting="logistic", delta=0.6, logistic_alpha=2.0).weight(0.9)
    assert weight(0.9, plain) == pytest.approx(1.0 / (1.0 + math.exp(-0.6)))


def test_unknown_weighting_lists_known_names():
    with pytest.raises(ValueError, match="unknown weighting .softmax.; known: binary, constant, clipping, sigmoidal, logistic"):
        get_weighting("softmax")


# --- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"delta": 1.5}, "delta"),
        ({"delta": -0.1}, "delta"),
        ({"constant": 1.2}, "constant"),
        ({"logistic_alpha": 0.0}, "logistic_alpha"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Settings(**kwargs)


def test_unknown_weighting_in_config_names_field_and_choices():
    with pytest.raises(ValueError) as info:
        Settings(weighting="softmax")
    message = str(info.value)
    assert "weighting" in message and "softmax" in message
    assert all(name in message for name in WEIGHTINGS)


def test_load_dataclass_turns_validation_into_config_error():
    config = load_dataclass(Settings, {"weighting": "logistic", "delta": 0.6}, "rsd.yaml")
    assert (config.weighting, config.delta) == ("logistic", 0.6)
    with pytest.raises(ConfigError, match=r"rsd\.yaml.*delta"):
        load_dataclass(Settings, {"delta": 2}, "rsd.yaml")
    with pytest.raises(ConfigError, match=r"rsd\.yaml.*weighting.*binary"):
        load_dataclass(Settings, {"weighting": "step"}, "rsd.yaml")


def test_load_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "rsd.yaml"
    path.write_text("weighting: binary\ndelta: 1.7\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(Settings, path)
    assert str(path) in str(info.value) and "delta" in str(info.value)


# --- Algorithm 2 -----------------------------------------------------------------------------------------


def test_weights_zero_and_one_are_deterministic_and_draw_nothing():
    source = FixedUniform(0.0)
    assert accept_with_weight(1.0, FixedUniform(0.999999)) is True
    assert accept_with_weight(0.0, source) is False
    assert source.draws == 0
    rng = random.Random(0)
    state = rng.getstate()
    decisions = [accept_draft_step(r, Settings(), rng) for r in (0.1, 0.7, 0.9, 0.69)]
    assert decisions == [False, True, True, False]
    assert rng.getstate() == state, "a binary weighting must not consume random numbers"


def test_fractional_weight_accepts_iff_u_below_weight():
    assert accept_with_weight(0.3, FixedUniform(0.29)) is True
    assert accept_with_weight(0.3, FixedUniform(0.3)) is False
    assert accept_with_weight(0.3, FixedUniform(0.31)) is False


def test_fractional_weight_acceptance_rate():
    rng = random.Random(11)
    rate = sum(accept_with_weight(0.3, rng) for _ in range(20_000)) / 20_000
    assert rate == pytest.approx(0.3, abs=0.013)  # about 4 standard deviations


def test_seeded_acceptance_is_reproducible():
    config = Settings(weighting="logistic", delta=0.6)
    rewards = [i / 50 for i in range(50)]

    def decisions(seed):
        rng = random.Random(seed)
        return [accept_draft_step(r, config, rng) for r in rewards]

    assert decisions(7) == decisions(7)
    assert decisions(7) != decisions(8)
    assert 0 < sum(decisions(7)) < len(rewards)


def test_numpy_generator_works_as_uniform_source():
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    a = [accept_with_weight(0.5, rng_a) for _ in range(100)]
    b = [accept_with_weight(0.5, rng_b) for _ in range(100)]
    assert a == b and 20 < sum(a) < 80


# --- records, statistics, FLOPs ----------------------------------------------------------------------------


def draft_step(score, tokens, prm_tokens, draft_time=0.0):
    return StepRecord("draft", score, True, tokens, 0, prm_tokens, draft_time_s=draft_time)


def target_step(score, draft_tokens, target_tokens, prm_tokens, target_time=0.0):
    return StepRecord("target", score, False, draft_tokens, target_tokens, prm_tokens, target_time_s=target_time)


PROBLEMS = [
    [draft_step(0.9, 30, 40, 0.5), draft_step(0.8, 20, 60, 0.25)],  # solved by the draft alone
    [draft_step(0.95, 25, 35), target_step(0.3, 40, 50, 75, 2.0)],
    [target_step(0.1, 10, 12, 20, 1.5)],
]


def test_draft_only_fraction_and_invocation_rate():
    assert draft_only_fraction(PROBLEMS) == pytest.approx(1 / 3)
    steps = [record for records in PROBLEMS for record in records]
    assert target_invocation_rate(steps) == pytest.approx(2 / 5)
    assert target_invocation_rate(PROBLEMS[0]) == 0.0
    assert target_invocation_rate(PROBLEMS[2]) == 1.0
    assert draft_only_fraction([[]]) == 1.0
    with pytest.raises(ValueError):
        target_invocation_rate([])
    with pytest.raises(ValueError):
        draft_only_fraction([])


def test_tokens_include_rejected_draft_tokens():
    steps = [record for records in PROBLEMS for record in records]
    assert tokens_by_model(steps) == {"draft": 30 + 20 + 25 + 40 + 10, "target": 62, "prm": 230}
    assert rejected_draft_tokens(steps) == 50
    assert time_by_model(steps) == pytest.approx({"draft": 0.75, "target": 3.5, "prm": 0.0})


def test_flops_two_n_per_token():
    counter = FlopsCounter(draft_params=1_500_000_000, target_params=7_000_000_000, prm_params=1_500_000_000)
    counter.add(draft=100, target=10, prm=50)
    counter.add(draft=20)
    # draft 2*1.5e9*120 = 3.6e11, target 2*7e9*10 = 1.4e11, PRM 2*1.5e9*50 = 1.5e11
    assert counter.flops_by_model() == {"draft": 360_000_000_000, "target": 140_000_000_000, "prm": 150_000_000_000}
    assert counter.total_flops() == 650_000_000_000


def test_summarize_run():
    stats = summarize_run(PROBLEMS, draft_params=1_000, target_params=10_000, prm_params=2_000)
    assert (stats.problems, stats.steps) == (3, 5)
    assert stats.draft_only_fraction == pytest.approx(1 / 3)
    assert stats.target_invocation_rate == pytest.approx(0.4)
    assert stats.rejected_draft_tokens == 50
    assert stats.flops == {"draft": 2 * 1_000 * 125, "target": 2 * 10_000 * 62, "prm": 2 * 2_000 * 230}
    assert stats.total_flops == 250_000 + 1_240_000 + 920_000


def test_step_record_rejects_contradictions():
    with pytest.raises(ValueError, match="writer"):
        StepRecord("target", 0.9, True, 10, 10, 10)
    with pytest.raises(ValueError, match="writer"):
        StepRecord("prm", 0.9, True, 10, 0, 10)
    with pytest.raises(ValueError, match="draft_tokens"):
        StepRecord("draft", 0.9, True, -1, 0, 10)
