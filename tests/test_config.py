import dataclasses
from typing import Callable, Literal

import pytest

from sgl_tts.config import ConfigError, load_dataclass, load_yaml
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import SearchConfig
from sgl_tts.app.session import RunConfig
from sgl_tts.runtime.server import RuntimeConfig, server_command


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_nested_config_loads(tmp_path):
    config = load_yaml(RunConfig, write(tmp_path, "search:\n  n: 8\n  beam_width: 4\ngenerator:\n  model: tiny-random\n"))
    assert config.search.n == 8 and config.search.beam_width == 4 and config.generator.model == "tiny-random"
    assert dataclasses.is_dataclass(config.scorer)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.search.n = 3


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "search:\n  beams: 8\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(RunConfig, path)
    assert "search.beams" in str(info.value) and str(path) in str(info.value)


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'search.n' must be int"):
        load_yaml(RunConfig, write(tmp_path, "search:\n  n: eight\n"))
    with pytest.raises(ConfigError, match=r"generator.device"):
        load_yaml(RunConfig, write(tmp_path, "generator:\n  device: tpu\n"))


def test_invalid_value_names_field_and_file(tmp_path):
    path = write(tmp_path, "search:\n  n: 0\n")
    with pytest.raises(ConfigError) as info:
        load_yaml(RunConfig, path)
    assert "n must be at least 1" in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ConfigError, match="aggregation"):
        load_dataclass(SearchConfig, {"aggregation": "median"}, "x.yaml")


def test_missing_file_is_clear():
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(RunConfig, "no/such/file.yaml")


def test_shipped_configs_load():
    from pathlib import Path

    shipped = sorted((Path(__file__).resolve().parent.parent / "sgl_tts" / "configs").glob("*.yaml"))
    assert {"cpu-default.yaml", "rsd-cpu.yaml", "cpu-likelihood.yaml", "serve-tiny.yaml"} <= {p.name for p in shipped}
    for path in shipped:
        load_yaml(RunConfig, path)


def test_aggregations():
    scores = [0.5, 0.8, 0.4]
    assert aggregate(scores, "last") == 0.4
    assert aggregate(scores, "min") == 0.4
    assert aggregate(scores, "prod") == pytest.approx(0.16)
    assert aggregate(scores, "mean") == pytest.approx(1.7 / 3)
    assert aggregate([], "mean") == 0.0
    with pytest.raises(ValueError, match="known: last, min, prod, mean"):
        aggregate(scores, "median")


def test_dict_values_are_type_checked_naming_key_and_file(tmp_path):
    config = load_yaml(RunConfig, write(tmp_path, "generator:\n  env:\n    OMP_WAIT_POLICY: PASSIVE\n"))
    assert config.generator.env == {"OMP_WAIT_POLICY": "PASSIVE"}
    bad = {
        "generator:\n  env:\n    OMP_NUM_THREADS: 4\n": r"'generator\.env\.OMP_NUM_THREADS' must be str, got 4",
        "scorer:\n  runtime:\n    env:\n      A: null\n": r"'scorer\.runtime\.env\.A' must be str, got None",
        "generator:\n  env:\n    1: x\n": r"'generator\.env' must be a mapping of str to str \(the key 1 is not str\)",
        "generator:\n  env: [A=1]\n": r"'generator\.env' must be a mapping of str to str, got \['A=1'\]",
        "generator:\n  extra_args: [--foo, 3]\n": r"'generator\.extra_args\[1\]' must be str, got 3",
    }
    for text, pattern in bad.items():
        path = write(tmp_path, text)
        with pytest.raises(ConfigError, match=pattern) as info:
            load_yaml(RunConfig, path)
        assert str(info.value).startswith(f"{path}: "), info.value


@dataclasses.dataclass(frozen=True)
class _Typed:
    pair: tuple[int, str] = (0, "")
    sizes: tuple[int, ...] = ()
    limits: dict[str, int] | None = None
    nested: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    ids: list[str | int] | None = None
    level: Literal[1, 2] = 1
    mode: Literal["a", "b"] | None = None


@pytest.mark.parametrize("data, expected", [
    ({"pair": [3, "x"], "sizes": [1, 2]}, {"pair": (3, "x"), "sizes": (1, 2)}),
    ({"limits": {"a": 1}, "nested": {"w": [1, 2.5]}}, {"limits": {"a": 1}, "nested": {"w": [1.0, 2.5]}}),
    ({"ids": ["a", 7], "level": 2, "mode": None}, {"ids": ["a", 7], "level": 2, "mode": None}),
])
def test_parametrised_types_convert(data, expected):
    loaded = load_dataclass(_Typed, data, "t.yaml")
    assert {name: getattr(loaded, name) for name in expected} == expected
    assert all(type(getattr(loaded, name)) is type(value) for name, value in expected.items())


@pytest.mark.parametrize("data, pattern", [
    ({"pair": [3]}, r"'pair' must be a list of 2 items \(int, str\), got \[3\]"),
    ({"pair": ["3", "x"]}, r"'pair\[0\]' must be int, got '3'"),
    ({"sizes": [1, "2"]}, r"'sizes\[1\]' must be int"),
    ({"limits": {"a": "1"}}, r"'limits\.a' must be int, got '1'"),  # the inner error, not "mapping or null"
    ({"limits": 5}, r"'limits' must be a mapping of str to int or null, got 5"),
    ({"nested": {"w": [1, "x"]}}, r"'nested\.w\[1\]' must be float"),
    ({"ids": [1.5]}, r"'ids\[0\]' must be str or int, got 1\.5"),
    ({"level": True}, r"'level' must be one of 1, 2, got True"),  # True == 1, but it is not the number 1
    ({"level": 3}, r"'level' must be one of 1, 2"),
    ({"mode": "c"}, r"'mode' must be one of 'a', 'b' or null, got 'c'"),
])
def test_parametrised_types_reject_bad_values_naming_the_key(data, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        load_dataclass(_Typed, data, "t.yaml")
    assert str(info.value).startswith("t.yaml: ")


def test_an_annotation_the_loader_cannot_check_is_a_loud_bug():
    @dataclasses.dataclass(frozen=True)
    class Unsupported:
        callback: Callable[[str], str] = str

    with pytest.raises(TypeError, match="cannot check values of type"):
        load_dataclass(Unsupported, {"callback": "print"}, "t.yaml")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_need_no_opt_in(host):
    assert RuntimeConfig(host=host).host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "10.0.0.1", "my-machine.example.org", ""])
def test_a_non_loopback_host_needs_allow_remote(tmp_path, host):
    path = write(tmp_path, f"generator:\n  host: '{host}'\n")
    with pytest.raises(ConfigError, match=r"host .* is not a loopback address.*allow_remote: true") as info:
        load_yaml(RunConfig, path)
    assert str(info.value).startswith(f"{path}: generator: host '{host}'")
    config = load_yaml(RunConfig, write(tmp_path, f"generator:\n  host: '{host}'\n  allow_remote: true\n"))
    assert config.generator.host == host and config.generator.allow_remote
    assert server_command(config.generator, "model", 30000)[5:7] == ["--host", host]


def test_extra_args_cannot_set_the_host():
    for extra_args in (["--host", "0.0.0.0"], ["--host=0.0.0.0"]):
        with pytest.raises(ValueError, match="extra_args must not set --host"):
            RuntimeConfig(extra_args=extra_args)
    assert RuntimeConfig(extra_args=["--hostname-is-not-a-flag"]).extra_args  # only --host itself is refused


def test_a_union_reports_the_error_inside_the_alternative_that_fits(tmp_path):
    cases = {
        "target:\n  modle: tiny-random\n": r"unknown key 'target\.modle'",
        "target:\n  env: {A: 1}\n": r"'target\.env\.A' must be str, got 1",
        "target:\n  host: 0.0.0.0\n": r"target: host '0\.0\.0\.0' is not a loopback address",
        "target: draft\n": r"'target' must be a mapping \(RuntimeConfig\) or one of 'generator' or null, got 'draft'",
    }
    for text, pattern in cases.items():
        with pytest.raises(ConfigError, match=pattern):
            load_yaml(RunConfig, write(tmp_path, text))


@pytest.mark.parametrize("text,pattern", [
    ("search:\n  n: 1000000\n", r"run\.yaml: .*'search\.n' is 1000000, above the limit 256 \(limits\.n\)"),
    ("search:\n  max_tokens: 1000000000\n", r"'search\.max_tokens' is 1000000000, above the limit 16384"),
    ("search:\n  max_steps: 65\n", r"'search\.max_steps' is 65, above the limit 64"),
    ("search:\n  max_step_tokens: 5000\n", r"'search\.max_step_tokens' is 5000, above the limit 4096"),
    ("search:\n  lookahead: 9\n", r"'search\.lookahead' is 9, above the limit 8"),
    ("search:\n  granularity: 65\n", r"'search\.granularity' is 65, above the limit 64"),
    ("search:\n  beam_width: 300\n", r"'search\.beam_width' is 300, above the limit 256 \(limits\.n\)"),
    ("limits:\n  n: 4\nsearch:\n  n: 8\n", r"'search\.n' is 8, above the limit 4 \(limits\.n\)"),
    ("limits:\n  n: 0\n", r"limits\.n must be at least 1, got 0"),
    ("limits:\n  n: .nan\n", r"'limits\.n' must be int"),
])
def test_a_run_config_above_its_limits_is_refused_naming_field_value_and_limit(tmp_path, text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_yaml(RunConfig, write(tmp_path, text))


def test_the_operator_raises_a_limit_in_the_run_config(tmp_path):
    config = load_yaml(RunConfig, write(tmp_path, "limits:\n  n: 512\nsearch:\n  n: 512\n  beam_width: 4\n"))
    assert config.search.n == 512 and config.limits.n == 512
    with pytest.raises(ValueError, match="'search.n' is 513"):
        dataclasses.replace(config, search=dataclasses.replace(config.search, n=513))  # `run --n` goes through it


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("key", ["temperature", "top_p", "granularity_margin", "branching_temperature"])
def test_non_finite_floats_are_refused_naming_the_key(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"'search\.{key}' must be a finite number"):
        load_yaml(RunConfig, write(tmp_path, f"search:\n  {key}: {value}\n"))


def test_non_finite_program_settings_are_refused_naming_the_key(tmp_path):
    from sgl_tts.app.session import load_run_config

    text = "target: generator\nsearch:\n  program: rsd\n  settings:\n    delta: .nan\n"
    with pytest.raises(ConfigError, match=r"'search\.settings\.delta' must be a finite number, got nan"):
        load_run_config(write(tmp_path, text))
