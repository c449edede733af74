"""Frozen config dataclasses and a strict YAML loader.

Every layer of the project has its own frozen dataclass. `load_dataclass` builds one (and the dataclasses
nested inside it) from a mapping; an unknown key, a missing required key or a value of the wrong type
raises `ConfigError` naming the dotted key and the source file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is unknown, missing or invalid. The message names the key and the file."""


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if origin in (list, tuple):
        return f"a list of {_describe(get_args(tp)[0])}" if get_args(tp) else "a list"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, source: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming `key`."""
    def fail() -> ConfigError:
        return ConfigError(f"{source}: '{key}' must be {_describe(tp)}, got {value!r}")

    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise fail()
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, source)
            except ConfigError:
                continue
        raise fail()
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise fail()
        return load_dataclass(tp, value, source, prefix=key + ".")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise fail()
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [_convert(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise fail()
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise fail()
    return value


def load_dataclass(cls: type[T], data: dict[str, Any] | None, source: str = "<config>", prefix: str = "") -> T:
    """Build the frozen dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<top level>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}'; known keys here: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], prefix + name, source)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing required key '{prefix}{name}'")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {prefix.rstrip('.') or cls.__name__}: {exc}") from exc


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load the YAML file at `path` into `cls`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return load_dataclass(cls, data, str(path))


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain data (for provenance records and hashing)."""
    return dataclasses.asdict(config)
