"""Experiment configs: loading, arms as overrides over a base RunConfig, units, and errors naming key and file."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from eval.experiment import ExperimentConfig, apply_overrides, load_experiment, plain
from eval.results import config_hash
from sgl_tts.config import ConfigError, load_dataclass
from sgl_tts.runtime.server import RuntimeConfig
from sgl_tts.app.session import RunConfig
from sgl_tts.search.api import SearchConfig

CONFIGS = Path(__file__).resolve().parents[1] / "eval" / "configs"


def write(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def minimal(**changes):
    data = {"name": "t", "arms": [{"name": "a", "baseline": True},
                                  {"name": "b", "overrides": {"search": {"program": "best_of_n"}}}]}
    data.update(changes)
    return data


def test_cpu_default_is_small_and_compares_two_arms():
    experiment = load_experiment(CONFIGS / "cpu-default.yaml")
    config = experiment.config
    assert config.backend == "sglang" and config.baseline == "best_of_n"
    assert {name: c.search.program for name, c in experiment.arm_configs.items()} == {
        "best_of_n": "best_of_n", "beam_search": "beam_search"}
    assert all(c.generator.model == "smollm2-135m" and c.generator.device == "cpu"
               for c in experiment.arm_configs.values())
    assert config.n_values == [4] and config.repetitions == 1
    assert [(d.name, d.limit) for d in config.datasets] == [("builtin", 3)]
    assert len(experiment.units()) == 2


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_config_loads(name):
    experiment = load_experiment(CONFIGS / name)
    assert experiment.units(), name


def test_overrides_change_only_the_named_fields():
    base = RunConfig(search=SearchConfig(n=4, beam_width=2, max_steps=6), concurrency=3)
    changed = apply_overrides(base, {"search": {"beam_width": 4}, "generator": {"max_total_tokens": 1024}})
    expected = dataclasses.replace(
        base, search=dataclasses.replace(base.search, beam_width=4),
        generator=dataclasses.replace(base.generator, max_total_tokens=1024))
    assert changed == expected
    assert changed.search.n == 4 and changed.concurrency == 3 and base.search.beam_width == 2


def test_overrides_fill_an_optional_nested_config_and_convert_like_the_loader():
    base = RunConfig()
    changed = apply_overrides(base, {"target": {"model": "tiny-random", "max_total_tokens": 2048},
                                     "search": {"temperature": 1}})
    assert changed.target == RuntimeConfig(model="tiny-random", max_total_tokens=2048)
    assert changed.search.temperature == 1.0 and isinstance(changed.search.temperature, float)
    # an existing nested config is changed in place, not replaced wholesale
    again = apply_overrides(changed, {"target": {"max_total_tokens": 4096}})
    assert again.target == RuntimeConfig(model="tiny-random", max_total_tokens=4096)


def test_unknown_override_key_names_key_and_file(tmp_path):
    data = minimal()
    data["arms"][1]["overrides"] = {"search": {"nn": 8}}
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    message = str(info.value)
    assert str(path) in message and "'arms[1].overrides.search.nn'" in message and "beam_width" in message


def test_override_of_wrong_type_or_invalid_value_is_refused(tmp_path):
    data = minimal()
    data["arms"][0]["overrides"] = {"search": {"n": "four"}}
    with pytest.raises(ConfigError, match=r"'arms\[0\]\.overrides\.search\.n' must be int"):
        load_experiment(write(tmp_path, data))
    data["arms"][0]["overrides"] = {"search": {"n": 0}}
    with pytest.raises(ConfigError, match=r"exp\.yaml.*n must be at least 1"):
        load_experiment(write(tmp_path, data))
    data["arms"][0]["overrides"] = {"search": 3}
    with pytest.raises(ConfigError, match=r"'arms\[0\]\.overrides\.search' must be a mapping"):
        load_experiment(write(tmp_path, data))


@pytest.mark.parametrize("changes,pattern", [
    ({"colour": "red"}, r"unknown key 'colour'"),
    ({"arms": []}, r"at least one arm"),
    ({"arms": [{"name": "a"}, {"name": "a"}]}, r"arm names must be unique"),
    ({"arms": [{"name": "a", "baseline": True}, {"name": "b", "baseline": True}]}, r"at most one arm"),
    ({"base": {"dataset": {"name": "gsm8k"}}}, r"top-level 'datasets'"),
    ({"arms": [{"name": "a", "overrides": {"dataset": {"name": "gsm8k"}}}]}, r"arms\[0\].*'datasets'"),
    ({"datasets": [{"name": "builtin"}, {"name": "builtin"}]}, r"labels must be unique"),
    ({"n_values": [4, 0]}, r"n_values must all be >= 1"),
    ({"repetitions": 0}, r"repetitions must be >= 1"),
    ({"backend": "vllm"}, r"'backend' must be one of 'sglang', 'scripted'"),
    ({"datasets": [{"name": "builtin", "limit": -1}]}, r"offset and limit"),
])
def test_bad_experiment_configs_name_the_problem_and_file(tmp_path, changes, pattern):
    path = write(tmp_path, minimal(**changes))
    with pytest.raises(ConfigError, match=pattern) as info:
        load_experiment(path)
    assert str(path) in str(info.value)


def test_units_are_the_product_with_n_and_seed_set():
    data = minimal(n_values=[2, 8], seeds=[0, 5], repetitions=3,
                   datasets=[{"name": "builtin", "label": "b1", "limit": 2}, {"name": "builtin", "offset": 2}])
    experiment = load_experiment_from(data)
    units = experiment.units()
    assert len(units) == 2 * 2 * 2 * 2 * 3
    assert len({u.key for u in units}) == len(units)
    assert [u.arm for u in units[:24]] == ["a"] * 24, "one arm's units are contiguous (one runtime start per arm)"
    for unit in units:
        assert unit.config.search.n == unit.n and unit.config.search.seed == unit.seed
        assert unit.config.search.program == ("beam_search" if unit.arm == "a" else "best_of_n")
    assert {u.dataset for u in units} == {"b1", "builtin"}


def test_without_n_values_each_arm_keeps_its_own_n():
    data = minimal()
    data["arms"][1]["overrides"] = {"search": {"n": 16}}
    assert [(u.arm, u.n) for u in load_experiment_from(data).units()] == [("a", 4), ("b", 16)]


def test_yaml_copy_round_trips_to_the_same_fingerprint(tmp_path):
    experiment = load_experiment(CONFIGS / "cpu-default.yaml")
    copy = write(tmp_path, plain(experiment.config), "copy.yaml")
    again = load_experiment(copy)
    assert config_hash(again.fingerprint()) == config_hash(experiment.fingerprint())
    assert again.arm_configs == experiment.arm_configs
    moved = dataclasses.replace(experiment.config, output_dir="elsewhere")
    assert "output_dir" not in experiment.fingerprint() and plain(moved)["output_dir"] == "elsewhere"


def load_experiment_from(data):
    from eval.experiment import resolve

    return resolve(load_dataclass(ExperimentConfig, data, "<test>"), "<test>")
