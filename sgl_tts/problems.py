"""Benchmark problems: the shared JSONL test sets, any JSONL file, a Hugging Face dataset, or the builtin set.

`load_problems("aime24")` reads `<data root>/aime24/test.jsonl`; the data root is $SGL_TTS_DATA, else
`../shared/data` beside the repository. Each known dataset maps its own question, gold-answer and id
fields and normalises its gold answers (AIME "025" -> "25", AMC 36.0 -> "36", GSM8K text after "####"
without thousands commas, MATH LaTeX kept as written for math-verify).

Local JSONL is read line by line here rather than through `datasets`' json loader: that gives errors with
file and line number, counts skipped malformed lines, and writes no Arrow cache. `datasets` is used for hub
names only.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from sgl_tts.registry import Registry
from sgl_tts.search.records import parse_json_object


class DatasetError(ValueError):
    """A dataset cannot be found or read; the message names the dataset, file, line or field."""


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    gold: str | None  # normalised gold answer; None when the dataset has none (code problems)
    meta: dict[str, Any] = field(default_factory=dict)  # the record's other fields, as read


@dataclass(frozen=True)
class ProblemSet:
    source: str  # the dataset name, file path or hub name it came from
    problems: tuple[Problem, ...]
    skipped_lines: int = 0  # malformed lines skipped (only with skip_malformed=True)

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def __getitem__(self, index: int) -> Problem:
        return self.problems[index]


# ---------------------------------------------------------------------------------------------------------
# Gold normalisation


def _number_text(value: Any) -> str:
    """36.0 / "36.0" -> "36", "025" -> "25", 2.5 -> "2.5"; anything that is not a plain number unchanged."""
    text = str(value).strip()
    try:
        number = Decimal(text)
    except InvalidOperation:
        return text
    if not number.is_finite():
        return text
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def _gsm8k_gold(value: Any) -> str:
    text = str(value)
    if "####" not in text:
        raise ValueError("no '####' line in the answer")
    gold = text.rsplit("####", 1)[1].strip().replace(",", "")
    if not gold:
        raise ValueError("empty answer after '####'")
    return gold


def _latex_gold(value: Any) -> str:
    return str(value).strip()


def _plain_gold(value: Any) -> str:
    return _number_text(value) if isinstance(value, (int, float)) else str(value).strip()


GOLD_FORMATS: Registry[Callable[[Any], str]] = Registry("gold format", {
    "integer": _number_text,  # AIME and AMC: zero padding and ".0" dropped
    "gsm8k": _gsm8k_gold,
    "latex": _latex_gold,
    "plain": _plain_gold,
})


@dataclass(frozen=True)
class DatasetSpec:
    question_field: str | None  # None: the first of QUESTION_FIELDS the file has
    gold_field: str | None  # None: "answer" when the file has it, else no gold
    id_field: str | None  # None: the first of ID_FIELDS the file has, else the 0-based record index
    gold_format: str = "plain"
    has_gold: bool = True


QUESTION_FIELDS = ("problem", "question", "prompt")
ID_FIELDS = ("id", "unique_id", "task_id")

DATASETS: Registry[DatasetSpec] = Registry("dataset", {
    "aime24": DatasetSpec("problem", "answer", "id", "integer"),
    "amc23": DatasetSpec("problem", "answer", "id", "integer"),
    "math500": DatasetSpec("problem", "answer", "unique_id", "latex"),
    "gsm8k": DatasetSpec("question", "answer", None, "gsm8k"),
    "humaneval": DatasetSpec("prompt", None, "task_id", "plain", has_gold=False),
})
BUILTIN = "builtin"


# ---------------------------------------------------------------------------------------------------------
# Locations


def repository_root() -> Path:
    return Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """$SGL_TTS_DATA, else ../shared/data relative to the repository root."""
    env = os.environ.get("SGL_TTS_DATA")
    return Path(env) if env else repository_root().parent / "shared" / "data"


def dataset_path(name: str, root: str | Path | None = None) -> Path:
    if name not in DATASETS:
        raise DatasetError(DATASETS.unknown(name))
    return Path(root or data_root()) / name / "test.jsonl"


# ---------------------------------------------------------------------------------------------------------
# Reading


def read_jsonl(path: str | Path, skip_malformed: bool = False) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """(line number, record) for every JSON-object line of `path` (.jsonl or .jsonl.gz), and the skip count.

    A line that is not a JSON object raises DatasetError naming the file and line, or, with
    `skip_malformed`, is skipped and counted. Blank lines are ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    records: list[tuple[int, dict[str, Any]]] = []
    skipped = 0
    with opener(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            try:
                record = parse_json_object(raw)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if skip_malformed:
                    skipped += 1
                    continue
                raise DatasetError(f"{path}:{line_number}: malformed line: {exc}") from exc
            records.append((line_number, record))
    return records, skipped


def _read_hub(name: str, split: str) -> list[tuple[int, dict[str, Any]]]:
    offline_vars = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if any(os.environ.get(var, "").lower() in ("1", "true", "yes") for var in offline_vars):
        raise DatasetError(
            f"'{name}' is not a known dataset or a file, and the Hugging Face hub is offline "
            f"({' / '.join(offline_vars)} set); known datasets: {', '.join(sorted(DATASETS))}"
        )
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:  # fail in seconds rather than after the hub client's retries
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as exc:
        raise DatasetError(
            f"'{name}' is not a known dataset or a file, and the Hugging Face hub ({endpoint.hostname}) cannot be "
            f"reached: {exc}; known datasets: {', '.join(sorted(DATASETS))}"
        ) from exc
    try:
        import datasets

        rows = datasets.load_dataset(name, split=split)
    except Exception as exc:
        raise DatasetError(f"could not load '{name}' (split '{split}') from the Hugging Face hub: {exc}") from exc
    return [(index + 1, dict(row)) for index, row in enumerate(rows)]


def _resolve_field(explicit: str | None, candidates: Iterable[str], record: dict[str, Any]) -> str | None:
    if explicit is not None:
        return explicit
    return next((name for name in candidates if name in record), None)


def _to_problems(rows: list[tuple[int, dict[str, Any]]], spec: DatasetSpec, where: str) -> list[Problem]:
    """Map records to Problems; `where` names the file (or hub dataset) in error messages."""
    if spec.gold_format not in GOLD_FORMATS:
        raise DatasetError(GOLD_FORMATS.unknown(spec.gold_format))
    normalize = GOLD_FORMATS[spec.gold_format]
    problems: list[Problem] = []
    first_line_of_id: dict[str, int] = {}
    for index, (line, record) in enumerate(rows):
        question_field = _resolve_field(spec.question_field, QUESTION_FIELDS, record)
        id_field = _resolve_field(spec.id_field, ID_FIELDS, record)
        gold_field = _resolve_field(spec.gold_field, ("answer",), record) if spec.has_gold else None
        if question_field is None:
            raise DatasetError(
                f"{where}:{line}: no question field (tried {', '.join(QUESTION_FIELDS)}); "
                f"fields present: {', '.join(record)}"
            )
        for role, name in (("question", question_field), ("id", spec.id_field), ("gold", spec.gold_field)):
            if name is not None and name not in record and (role != "gold" or spec.has_gold):
                raise DatasetError(
                    f"{where}:{line}: {role} field '{name}' not found; fields present: {', '.join(record)}"
                )
        gold = None
        if gold_field is not None and record.get(gold_field) is not None:
            try:
                gold = normalize(record[gold_field])
            except ValueError as exc:
                raise DatasetError(f"{where}:{line}: bad gold answer in '{gold_field}': {exc}") from exc
        problem_id = str(record[id_field]) if id_field is not None else str(index)
        if problem_id in first_line_of_id:
            raise DatasetError(
                f"{where}:{line}: duplicate id '{problem_id}' (first on line {first_line_of_id[problem_id]})"
            )
        first_line_of_id[problem_id] = line
        meta = {key: value for key, value in record.items() if key != question_field}
        problems.append(Problem(id=problem_id, question=str(record[question_field]), gold=gold, meta=meta))
    return problems


def builtin_problems() -> list[Problem]:
    """The project's own short arithmetic word problems (sgl_tts/problems.yaml)."""
    text = resources.files("sgl_tts").joinpath("problems.yaml").read_text()
    problems = []
    for number, entry in enumerate(yaml.safe_load(text), start=1):
        missing = {"id", "question", "answer"} - set(entry)
        assert not missing, f"problems.yaml entry {number} lacks {sorted(missing)}"
        problems.append(Problem(id=str(entry["id"]), question=entry["question"], gold=_number_text(entry["answer"])))
    return problems


def _select(problems: list[Problem], ids: Iterable[str | int] | None, offset: int, limit: int | None,
            where: str) -> list[Problem]:
    if offset < 0 or (limit is not None and limit < 0):
        raise DatasetError(f"offset and limit must be >= 0, got offset={offset}, limit={limit}")
    if ids is not None:
        wanted = [str(i) for i in ids]
        present = {p.id for p in problems}
        missing = [i for i in wanted if i not in present]
        if missing:
            raise DatasetError(f"{where}: no problems with ids {', '.join(missing[:10])}")
        wanted_set = set(wanted)
        problems = [p for p in problems if p.id in wanted_set]
    end = None if limit is None else offset + limit
    return problems[offset:end]


def load_problems(
    source: str | Path,
    *,
    limit: int | None = None,
    offset: int = 0,
    ids: Iterable[str | int] | None = None,
    question_field: str | None = None,
    gold_field: str | None = None,
    id_field: str | None = None,
    gold_format: str | None = None,
    split: str = "test",
    skip_malformed: bool = False,
    root: str | Path | None = None,
) -> ProblemSet:
    """Problems from a dataset name (see DATASETS, or "builtin"), a JSONL path, or a hub dataset name.

    Field arguments override the dataset's mapping. Selection: `ids` (kept in file order), then `offset`,
    then `limit`. `root` overrides the data root for dataset names.
    """
    name = str(source)
    overrides = {
        key: value
        for key, value in (("question_field", question_field), ("gold_field", gold_field),
                           ("id_field", id_field), ("gold_format", gold_format))
        if value is not None
    }
    if name == BUILTIN:
        return ProblemSet(BUILTIN, tuple(_select(builtin_problems(), ids, offset, limit, BUILTIN)))
    spec = DATASETS.get(name, DatasetSpec(None, None, None))
    spec = dataclasses.replace(spec, **overrides)
    skipped = 0
    if name in DATASETS:
        path = dataset_path(name, root)
        if not path.is_file():
            raise DatasetError(f"dataset '{name}' not found at {path}; set $SGL_TTS_DATA to the data folder")
        rows, skipped = read_jsonl(path, skip_malformed)
        where = str(path)
    elif Path(name).is_file() or name.endswith((".jsonl", ".jsonl.gz", ".json")):
        rows, skipped = read_jsonl(name, skip_malformed)
        where = name
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        rows = _read_hub(name, split)
        where = name
    else:
        raise DatasetError(
            f"unknown dataset '{name}'; choices: {', '.join(sorted(DATASETS))}, {BUILTIN}, "
            "a .jsonl file, or a Hugging Face dataset name (owner/name)"
        )
    problems = _to_problems(rows, spec, where)
    return ProblemSet(where, tuple(_select(problems, ids, offset, limit, where)), skipped)
