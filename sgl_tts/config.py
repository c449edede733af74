"""Frozen config dataclasses and a strict YAML loader.

Every layer of the project has its own frozen dataclass. `load_dataclass` builds one (and the dataclasses
nested inside it) from a mapping; an unknown key, a missing required key or a value of the wrong type
raises `ConfigError` naming the dotted key and the source file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is unknown, missing or invalid. The message names the key and the file."""


class FieldValueError(ValueError):
    """A config dataclass's check of one of its fields failed (raised in `__post_init__`); the loader's
    ConfigError then carries the dotted key of `field` as its `key`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _describe(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return "any value"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} items ({', '.join(_describe(a) for a in args)})"
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}" if args else "a list"
    if origin is dict:
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}" if args else "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, source: str) -> Any:
    """Convert a YAML value to the annotated type, or raise ConfigError naming `key` (the dotted path to the
    value, items as `key[i]`, mapping entries as `key.name`) and `source`."""
    def fail(expected: str | None = None) -> ConfigError:
        error = ConfigError(f"{source}: '{key}' must be {expected or _describe(tp)}, got {value!r}")
        error.key = key
        return error

    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        # `type(...) is` as well as `==`: YAML's true would otherwise pass for Literal[1] (True == 1).
        if any(value == allowed and type(value) is type(allowed) for allowed in args):
            return value
        raise fail()
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, source)
            except ConfigError as exc:
                errors.append(exc)
        # A value of the right shape that failed further in (`env.PORT` of an Optional mapping, an unknown key
        # in a dataclass alternative) is reported there, not as "must be X or Y" for the whole value. Only
        # `fail()` at this level tags an error with this very key.
        deeper = [exc for exc in errors if getattr(exc, "key", None) != key]
        raise deeper[0] if deeper else fail()
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise fail()
        return load_dataclass(tp, value, source, prefix=key + ".")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise fail()
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: tuple[int, str]
            if len(value) != len(args):
                raise fail()
            item_types = args
        else:
            item_types = [args[0] if args else Any] * len(value)
        items = [_convert(item, item_tp, f"{key}[{i}]", source) for i, (item, item_tp) in
                 enumerate(zip(value, item_types))]
        return tuple(items) if tuple in (origin, tp) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise fail()
        key_tp, value_tp = args or (Any, Any)
        converted = {}
        for name, item in value.items():
            try:
                name = _convert(name, key_tp, key, source)
            except ConfigError:
                raise fail(f"{_describe(tp)} (the key {name!r} is not {_describe(key_tp)})") from None
            converted[name] = _convert(item, value_tp, f"{key}.{name}", source)
        return converted
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail()
    if tp is float:
        # NaN and infinities are refused: JSON's NaN/Infinity and YAML's .nan/.inf parse, and `nan < 0` is False,
        # so a range check after this would let them through.
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise fail("a finite number" if isinstance(value, float) else None)
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    if isinstance(tp, type) and origin is None:
        if isinstance(value, tp):
            return value
        raise fail()
    # A field annotation this loader does not know how to check (a bug in the config class, not in the file).
    raise TypeError(f"{source}: '{key}': the config loader cannot check values of type {tp!r}")


def load_dataclass(cls: type[T], data: dict[str, Any] | None, source: str = "<config>", prefix: str = "") -> T:
    """Build the frozen dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<top level>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        error = ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}'; known keys here: {', '.join(sorted(fields))}"
        )
        error.key = prefix + unknown[0]
        raise error
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
        error = ConfigError(f"{source}: {prefix.rstrip('.') or cls.__name__}: {exc}")
        if isinstance(exc, FieldValueError):
            error.key = prefix + exc.field
        raise error from exc


def find_config(path: str | Path, packaged: Path) -> Path:
    """`path` when it is a file; else, for a relative path, the config of that file name (".yaml" optional) in
    the folder `packaged` of configs shipped with the package, so that `cpu-default` and the checkout's old
    `configs/cpu-default.yaml` are found from any directory, as an installed command's configs would be."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    for name in (path.name, path.name + ".yaml"):
        if (packaged / name).is_file():
            return packaged / name
    known = ", ".join(sorted(p.stem for p in packaged.glob("*.yaml")))
    raise ConfigError(f"config file not found: {path} (and no packaged config named '{path.stem}'; "
                      f"packaged: {known or 'none'})")


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


def parse_json_object(line: bytes) -> dict[str, Any]:
    """One JSONL line as a dict; ValueError (JSONDecodeError and UnicodeDecodeError are ValueErrors) when it
    is not UTF-8 JSON or not an object."""
    record = json.loads(line.decode("utf-8"))
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record
