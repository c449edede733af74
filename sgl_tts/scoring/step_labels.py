"""Step-labelled solutions in ProcessBench format, and the split that training and evaluation share.

A record is `{"id", "problem", "steps": [str, ...], "label"}` where `label` is the index of the first wrong
step, or -1 when every step is right (ProcessBench, Zheng et al. 2024). Steps before the first wrong step
are correct, the first wrong step is wrong, steps after it carry no label.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sgl_tts.problems import DatasetError, data_root, read_jsonl

PROCESSBENCH_MATH = "processbench-math"
STEP_DELIMITER = "\n\n"  # what the search programs end a step with (SearchConfig.step_delimiter)
Part = Literal["train", "heldout", "all"]


@dataclass(frozen=True)
class LabelledSolution:
    id: str
    problem: str
    steps: tuple[str, ...]
    label: int  # index of the first wrong step, -1 when none

    @property
    def labelled_steps(self) -> int:
        """How many steps carry a label: up to and including the first wrong one."""
        return len(self.steps) if self.label < 0 else self.label + 1

    def search_steps(self) -> list[str]:
        """The steps as a search path holds them: every step but the last ends with the step delimiter."""
        return [step + STEP_DELIMITER for step in self.steps[:-1]] + list(self.steps[-1:])


def load_labelled(path: str | Path | None = None) -> list[LabelledSolution]:
    """Read a ProcessBench-format JSONL file (default: the shared processbench-math set)."""
    path = Path(path) if path else data_root() / PROCESSBENCH_MATH / "test.jsonl"
    solutions, seen = [], set()
    for line, record in read_jsonl(path)[0]:
        where = f"{path}:{line}"
        for name, kind in (("problem", str), ("steps", list), ("label", int)):
            if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool):
                raise DatasetError(f"{where}: field '{name}' must be {kind.__name__}, got {record.get(name)!r}")
        steps = record["steps"]
        if not steps or not all(isinstance(step, str) for step in steps):
            raise DatasetError(f"{where}: field 'steps' must be a non-empty list of strings")
        label = record["label"]
        if not -1 <= label < len(steps):
            raise DatasetError(f"{where}: field 'label' must be -1 or a step index below {len(steps)}, got {label}")
        identifier = str(record.get("id", f"line-{line}"))
        if identifier in seen:
            raise DatasetError(f"{where}: field 'id' {identifier!r} repeats an earlier record")
        seen.add(identifier)
        solutions.append(LabelledSolution(identifier, record["problem"], tuple(steps), label))
    if not solutions:
        raise DatasetError(f"{path}: no records")
    return solutions


def in_heldout(solution: LabelledSolution, heldout_fraction: float = 0.4) -> bool:
    """The fixed split: by a hash of the problem text, so that solutions of one problem stay together."""
    digest = hashlib.sha256(solution.problem.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def select_part(solutions: list[LabelledSolution], part: Part, heldout_fraction: float = 0.4
                ) -> list[LabelledSolution]:
    if part == "all":
        return list(solutions)
    if part not in ("train", "heldout"):
        raise ValueError(f"part must be train, heldout or all, got {part!r}")
    return [s for s in solutions if in_heldout(s, heldout_fraction) == (part == "heldout")]


def fold_of(solution: LabelledSolution, folds: int, salt: str = "fold") -> int:
    """A fixed fold in 0..folds-1 by a hash of the problem text (solutions of one problem share a fold)."""
    digest = hashlib.sha256(f"{salt}:{solution.problem}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % folds
