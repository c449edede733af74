import dataclasses

import pytest

from sgl_tts.config import ConfigError, load_dataclass, load_yaml
from sgl_tts.scoring.base import aggregate
from sgl_tts.search.api import SearchConfig
from sgl_tts.app.session import RunConfig


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

    root = Path(__file__).resolve().parent.parent
    for path in (root / "configs").glob("*.yaml"):
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
