"""Experiment configs for `sgl-tts eval`: datasets, arms, n values, seeds, repetitions, output folder.

An experiment compares *arms* side by side in one run. Every arm is a named diff over one base `RunConfig`
(sgl_tts/app/session.py): `overrides` is a nested mapping over RunConfig's fields, applied with
`dataclasses.replace` level by level, so any field a layer adds later (FastTTS switches, a target runtime)
is overridable without a change here:

    base: {search: {program: beam_search, n: 4}, scorer: {kind: likelihood}}
    arms:
      - {name: baseline, baseline: true}
      - {name: bigger-beam, overrides: {search: {beam_width: 4}}}

The run is the product arms x datasets x n_values x seeds x repetitions; each cell is a `Unit`. `n_values`
set `search.n` (empty: each arm keeps its own); an arm's own `n_values` replace the experiment's for that arm
(a greedy reference at `n_values: [1]`); seeds set `search.seed`. `reference` names the arm every other cell
is compared with pair by pair in the accuracy-vs-budget report (eval/budget.py). Unknown keys and bad values raise
`ConfigError` naming the key and the file.

`backend: scripted` runs the programs on `sgl_tts.testing`'s scripted model and scorer instead of starting
SGLang runtimes: a demo and test backend (seconds, no model), with an artificial per-problem delay and a
simulated runtime death for the harness's own tests.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sgl_tts.config import ConfigError, _convert, load_yaml, to_dict
from sgl_tts.app.session import DatasetConfig, RunConfig, checked_program
from sgl_tts.search.programs import with_program_settings

BACKENDS = ("sglang", "scripted")


@dataclass(frozen=True)
class DatasetSelection:
    """A dataset and the slice of it to run (arguments of `sgl_tts.problems.load_problems`)."""

    name: str  # aime24, amc23, math500, gsm8k, humaneval, builtin, a .jsonl path, or a hub name
    label: str | None = None  # how reports and result lines name it; default: see `key`
    limit: int | None = None
    offset: int = 0
    ids: list[str | int] | None = None
    question_field: str | None = None
    gold_field: str | None = None
    id_field: str | None = None
    gold_format: str | None = None
    split: str = "test"
    skip_malformed: bool = False  # skip and count malformed JSONL lines instead of failing
    # one half of the slice: the problems at even (0, 2, ...) or odd positions, e.g. thresholds chosen on one
    # half and reported on the other (`half_of`); None: every problem
    half: Literal["even", "odd"] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or (self.limit is not None and self.limit < 0):
            raise ValueError(f"dataset '{self.name}': offset and limit must be >= 0")

    @property
    def key(self) -> str:
        """The label, else the name; a file's name without folder and extension (`data/toy.jsonl` -> `toy`)."""
        if self.label:
            return self.label
        if self.name.endswith((".jsonl", ".jsonl.gz", ".json")):
            return Path(self.name).name.split(".")[0]
        return self.name


def half_of(problems: list[Any], half: str | None) -> list[Any]:
    """The problems at even or odd positions of `problems` (`DatasetSelection.half`); all of them for None."""
    if half is None:
        return list(problems)
    return list(problems[{"even": 0, "odd": 1}[half]::2])


@dataclass(frozen=True)
class Arm:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # nested RunConfig fields to change
    baseline: bool = False  # the arm the report divides by (default: the first arm)
    n_values: list[int] | None = None  # None: the experiment's n_values; checked like them as arms[i].n_values
    # the arm this one is compared with pair by pair at each n both ran (e.g. a search with and without a
    # stopping rule), besides the experiment's `reference` (eval/budget.py)
    paired_with: str | None = None


@dataclass(frozen=True)
class ScriptedOptions:
    """The scripted test/demo backend (`backend: scripted`)."""

    delay_s: float = 0.0  # sleep before each problem (so a test's kill lands mid-run)
    die_on: list[str] = field(default_factory=list)  # problem ids at which the "runtime" dies, once each
    answer_depth: int = 2  # ScriptedModel: from this step on a path may answer
    answers: int = 4  # ScriptedModel: answers are drawn from 0..answers-1

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"scripted.delay_s must be >= 0, got {self.delay_s}")


def check_n_values(values: list[int], key: str) -> None:
    """n values are >= 1 and distinct; the error names `key` (`n_values`, `arms[2].n_values`)."""
    if any(n < 1 for n in values):
        raise ValueError(f"{key} must all be >= 1, got {values}")
    if len(set(values)) != len(values):
        raise ValueError(f"{key} must not repeat a value, got {values}")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str
    arms: list[Arm]
    base: RunConfig = field(default_factory=RunConfig)
    datasets: list[DatasetSelection] = field(default_factory=lambda: [DatasetSelection("builtin")])
    n_values: list[int] = field(default_factory=list)  # empty: each arm's own search.n
    reference: str | None = None  # the arm the budget report compares every cell with, paired (None: no comparison)
    seeds: list[int] = field(default_factory=lambda: [0])
    repetitions: int = 1
    output_dir: str = "results"  # a run folder <output_dir>/<name>-<UTC time> is made inside
    backend: Literal["sglang", "scripted"] = "sglang"
    scripted: ScriptedOptions = field(default_factory=ScriptedOptions)
    max_restarts: int = 2  # per arm: how often a runtime that died is restarted before the run gives up
    flush_cache: bool = True  # empty the radix cache between units, so no cell reuses another's prefixes
    reuse_runtimes: bool = True  # an arm whose runtime settings equal the previous arm's keeps its runtimes

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("'arms' needs at least one arm")
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        if sum(arm.baseline for arm in self.arms) > 1:
            raise ValueError(f"at most one arm can be the baseline, got {[a.name for a in self.arms if a.baseline]}")
        if not self.datasets:
            raise ValueError("'datasets' needs at least one dataset")
        labels = [d.key for d in self.datasets]
        if len(set(labels)) != len(labels):
            raise ValueError(f"dataset labels must be unique (set 'label' to tell slices apart), got {labels}")
        check_n_values(self.n_values, "n_values")
        for index, arm in enumerate(self.arms):
            if arm.n_values is not None:
                if not arm.n_values:
                    raise ValueError(f"arms[{index}].n_values ('{arm.name}') needs at least one value "
                                     "(leave it out to use the experiment's n_values)")
                check_n_values(arm.n_values, f"arms[{index}].n_values")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must not repeat a value, got {self.seeds}")
        for index, arm in enumerate(self.arms):
            if arm.paired_with is not None and (arm.paired_with not in names or arm.paired_with == arm.name):
                raise ValueError(f"arms[{index}].paired_with ('{arm.name}') must name another arm of {names}, "
                                 f"got {arm.paired_with!r}")
        if self.reference is not None and self.reference not in names:
            raise ValueError(f"reference must name one of the arms {names}, got {self.reference!r}")
        if not self.seeds:
            raise ValueError("'seeds' needs at least one seed")
        if self.repetitions < 1:
            raise ValueError(f"repetitions must be >= 1, got {self.repetitions}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.base.dataset != DatasetConfig():
            raise ValueError("set datasets in the top-level 'datasets' list, not in 'base.dataset'")

    @property
    def baseline(self) -> str:
        return next((arm.name for arm in self.arms if arm.baseline), self.arms[0].name)


@dataclass(frozen=True)
class Unit:
    """One cell of the run: an arm's resolved RunConfig solved over one dataset with one n, seed, repetition."""

    arm: str
    dataset: str  # DatasetSelection.key
    n: int
    seed: int
    repetition: int
    config: RunConfig

    @property
    def key(self) -> tuple[str, str, int, int, int]:
        return (self.arm, self.dataset, self.n, self.seed, self.repetition)


@dataclass(frozen=True)
class Experiment:
    """A loaded experiment: its config, the file it came from, and every arm's resolved RunConfig."""

    config: ExperimentConfig
    source: str
    arm_configs: dict[str, RunConfig]

    def arm_n_values(self, arm: Arm) -> list[int]:
        """The n values `arm` runs: its own n_values, else the experiment's, else its RunConfig's search.n."""
        return arm.n_values or self.config.n_values or [self.arm_configs[arm.name].search.n]

    def listed_n_values(self) -> list[int]:
        """Every n value the config lists (the experiment's and the arms' own), sorted; empty when none is."""
        if not self.config.n_values and not any(arm.n_values for arm in self.config.arms):
            return []
        return sorted({n for arm in self.config.arms for n in self.arm_n_values(arm)})

    def units(self) -> list[Unit]:
        """Every cell, arm by arm (one arm's runtimes serve all its cells)."""
        out = []
        for arm in self.config.arms:
            arm_config = self.arm_configs[arm.name]
            for dataset in self.config.datasets:
                for n in self.arm_n_values(arm):
                    for seed in self.config.seeds:
                        search = dataclasses.replace(arm_config.search, n=n, seed=seed)
                        config = dataclasses.replace(arm_config, search=search)
                        for repetition in range(self.config.repetitions):
                            out.append(Unit(arm.name, dataset.key, n, seed, repetition, config))
        return out

    def fingerprint(self) -> dict[str, Any]:
        """The config as plain data without the output folder: two runs may share a folder iff these match."""
        data = plain(self.config)
        data.pop("output_dir")
        return data


def plain(config: Any) -> dict[str, Any]:
    """A config as JSON-ready data (tuples become lists) for provenance, hashing and the YAML copy."""
    return json.loads(json.dumps(to_dict(config), default=str))


def apply_overrides(config: Any, overrides: dict[str, Any], source: str = "<config>", prefix: str = "") -> Any:
    """`config` with the nested `overrides` applied through `dataclasses.replace`, level by level.

    A mapping given for a dataclass-valued field changes only the keys it names; any other value replaces
    the field after the same type check as the YAML loader. Errors name the dotted key and `source`.
    """
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<overrides>'}' must be a mapping, got {overrides!r}")
    fields = {f.name for f in dataclasses.fields(config) if f.init}
    hints = typing.get_type_hints(type(config))
    changes = {}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; known keys here: {', '.join(sorted(fields))}")
        current = getattr(config, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[key] = apply_overrides(current, value, source, f"{prefix}{key}.")
        else:
            changes[key] = _convert(value, hints[key], prefix + key, source)
    try:
        return dataclasses.replace(config, **changes)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {prefix.rstrip('.') or type(config).__name__}: {exc}") from exc


def resolve(config: ExperimentConfig, source: str) -> Experiment:
    """Every arm's RunConfig, its program's settings and runtimes checked (`checked_program`). The base's
    settings are its program's before the arms override single keys of them."""
    try:
        base = dataclasses.replace(config.base, search=with_program_settings(config.base.search, source,
                                                                             "base.search.settings"))
    except KeyError as exc:  # an unknown program
        raise ConfigError(f"{source}: base: {exc.args[0]}") from None
    arm_configs = {}
    for index, arm in enumerate(config.arms):
        if "dataset" in arm.overrides:
            raise ConfigError(f"{source}: arms[{index}] ('{arm.name}'): datasets belong in the top-level "
                              "'datasets' list, not in an arm's overrides")
        prefix = f"arms[{index}].overrides."
        try:
            arm_configs[arm.name] = checked_program(apply_overrides(base, arm.overrides, source, prefix), source,
                                                    prefix + "search.settings")
        except KeyError as exc:
            raise ConfigError(f"{source}: arms[{index}] ('{arm.name}'): {exc.args[0]}") from None
    return Experiment(config, source, arm_configs)


def load_experiment(path: str | Path) -> Experiment:
    """Load and resolve an experiment YAML file; every arm is checked here, before anything starts."""
    return resolve(load_yaml(ExperimentConfig, path), str(path))
