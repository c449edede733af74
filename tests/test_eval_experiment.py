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


def test_cpu_default_is_a_small_slice_of_the_budget_experiment():
    experiment = load_experiment(CONFIGS / "cpu-default.yaml")
    budget = load_experiment(CONFIGS / "budget-cpu.yaml")
    config = experiment.config
    assert config.backend == "sglang" and config.reference == "greedy" and budget.config.reference == "greedy"
    assert {name: c.search.program for name, c in experiment.arm_configs.items()} == {
        "greedy": "self_consistency", "self_consistency": "self_consistency", "beam_search": "beam_search"}
    for name, arm_config in experiment.arm_configs.items():
        assert arm_config == budget.arm_configs[name], f"arm '{name}' differs from budget-cpu.yaml's"
        assert arm_config.generator.model == "smollm2-135m" and arm_config.generator.device == "cpu"
        assert arm_config.scorer.kind == "probe" and arm_config.scorer.runtime.model == "smollm2-135m-probe"
        assert not (arm_config.fasttts.prefix_order or arm_config.fasttts.memory_plan or arm_config.fasttts.speculative)
    assert experiment.arm_configs["greedy"].search.temperature == 0.0
    assert [(u.arm, u.n, u.seed) for u in experiment.units()] == [
        ("greedy", 1, 0), ("self_consistency", 4, 0), ("beam_search", 4, 0)]
    [dataset] = config.datasets
    assert dataset.name == "graded" and len(dataset.ids) == 8
    assert {i.split("-")[0] for i in dataset.ids} == {"L1", "L2"}


def test_budget_experiment_runs_every_arm_over_its_n_values():
    experiment = load_experiment(CONFIGS / "budget-cpu.yaml")
    cells = {}
    for unit in experiment.units():
        cells.setdefault(unit.arm, set()).add(unit.n)
        assert unit.config.search.n == unit.n
    assert cells == {"greedy": {1}, "best_of_n": {1, 2, 4, 8, 16}, "self_consistency": {1, 2, 4, 8, 16},
                     "beam_search": {2, 4, 8, 16}, "dvts": {2, 4, 8, 16}}
    assert experiment.arm_configs["best_of_n"].search.selection == "weighted"
    assert len(experiment.units()) == 19 * 2
    [dataset] = experiment.config.datasets
    assert dataset.name == "graded" and dataset.limit is None and dataset.ids is None and dataset.offset == 0


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


def test_an_arm_overrides_single_program_settings_and_needs_the_programs_runtimes(tmp_path):
    from programs.rsd import Settings

    data = minimal(base={"target": "generator", "search": {"program": "rsd", "settings": {"weighting": "logistic"}}})
    data["arms"] = [{"name": "a", "baseline": True},
                    {"name": "b", "overrides": {"search": {"settings": {"delta": 0.4}}}},
                    {"name": "c", "overrides": {"search": {"program": "beam_search", "settings": None}}}]
    arms = load_experiment(write(tmp_path, data)).arm_configs
    assert arms["a"].search.settings == Settings(weighting="logistic")
    assert arms["b"].search.settings == Settings(weighting="logistic", delta=0.4)
    assert arms["c"].search.settings is None
    data["arms"][1]["overrides"] = {"search": {"settings": {"delta": 1.4}}}
    with pytest.raises(ConfigError, match=r"exp\.yaml: arms\[1\]\.overrides\.search\.settings: delta must be in"):
        load_experiment(write(tmp_path, data))
    data["arms"][1]["overrides"] = {"search": {"settings": {"omega": 1}}}
    with pytest.raises(ConfigError, match=r"unknown key 'arms\[1\]\.overrides\.search\.settings\.omega'"):
        load_experiment(write(tmp_path, data))
    data["arms"][1]["overrides"] = {"target": None}
    with pytest.raises(ConfigError, match=r"exp\.yaml: program 'rsd' needs 'target'"):
        load_experiment(write(tmp_path, data))
    data["arms"][1]["overrides"] = {"search": {"program": "dvts"}}
    with pytest.raises(ConfigError, match=r"program 'dvts' takes no settings"):
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
    ({"n_values": [4, 4]}, r"n_values must not repeat"),
    ({"arms": [{"name": "a"}, {"name": "b", "n_values": [2, 0]}]}, r"'?arms\[1\]\.n_values'? must all be >= 1"),
    ({"arms": [{"name": "a", "n_values": [1, 1]}]}, r"'?arms\[0\]\.n_values'? must not repeat"),
    ({"arms": [{"name": "a", "n_values": []}]}, r"arms\[0\]\.n_values .* needs at least one value"),
    ({"arms": [{"name": "a", "n_values": "4"}]}, r"'arms\[0\]\.n_values' must be"),
    ({"reference": "nobody"}, r"reference must name one of the arms \['a', 'b'\], got 'nobody'"),
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


def test_an_arm_with_its_own_n_values_runs_exactly_those():
    data = minimal(n_values=[2, 8], seeds=[0, 3], repetitions=2)
    data["arms"].append({"name": "greedy", "n_values": [1], "overrides": {"search": {"temperature": 0.0}}})
    data["arms"][1]["n_values"] = [4, 16, 32]
    experiment = load_experiment_from(data)
    units = experiment.units()
    per_arm = {}
    for unit in units:
        per_arm.setdefault(unit.arm, []).append((unit.n, unit.seed, unit.repetition))
        assert unit.config.search.n == unit.n and unit.config.search.seed == unit.seed
    product = lambda ns: [(n, s, r) for n in ns for s in (0, 3) for r in (0, 1)]
    assert per_arm == {"a": product([2, 8]), "b": product([4, 16, 32]), "greedy": product([1])}
    assert len({u.key for u in units}) == len(units) == 4 * (2 + 3 + 1)
    assert experiment.listed_n_values() == [1, 2, 4, 8, 16, 32]
    assert {u.config.search.temperature for u in units if u.arm == "greedy"} == {0.0}


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
