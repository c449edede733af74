"""The program in docs/writing-programs.md, run exactly as written: loaded from a file and found by name."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import programs
from sgl_tts.problems import Problem
from sgl_tts.search.programs import load_program, program_names
from sgl_tts.search.api import Runtimes, SearchConfig
from sgl_tts.testing import ScriptedBackend, ScriptedModel, ScriptedScorer

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-programs.md"
PROMPT = "Q: what is two plus two?\n\n"
PROBLEM = Problem(id="p1", question="what is two plus two?", gold="4")


def doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def doc_program() -> str:
    blocks = [block for block in doc_blocks() if "greedy_step_program" in block]
    assert len(blocks) == 1, f"expected one greedy_step block in {DOC.name}, found {len(blocks)}"
    return blocks[0]


def without_docstring(code: str) -> str:
    return code.split('"""', 2)[2].strip()


def test_the_plain_program_in_the_doc_is_the_example_file():
    example = Path(__file__).resolve().parents[1] / "docs" / "examples" / "step_vote.py"
    blocks = [block for block in doc_blocks() if "@sgl.function\ndef program(" in block]
    assert len(blocks) == 1 and without_docstring(blocks[0]) == without_docstring(example.read_text())


def reference_greedy_step(model: ScriptedModel, config: SearchConfig) -> list[str]:
    """Brute force: at each step the best-scoring of the n children of the kept path."""
    variants: dict[str, int] = defaultdict(int)
    scorer = ScriptedScorer()
    steps: list[str] = []
    for _ in range(config.max_steps):
        children = []
        for _ in range(config.n):
            text = PROMPT + "".join(steps)
            step, ending = model.step(text, variants[text])
            variants[text] += 1
            child = steps + [step if ending == "eos" else step + model.delimiter]
            children.append((child, ending in ("answer", "eos")))
        steps, done = min(children, key=lambda c: (-scorer.step_score(PROMPT, c[0]), "".join(c[0])))
        if done:
            break
    return steps


def test_doc_program_is_short():
    lines = [line for line in doc_program().splitlines() if line.strip()]
    assert len(lines) <= 30, f"the doc promises a program of at most 30 lines, it has {len(lines)}"


@pytest.mark.parametrize("n,max_steps", [(4, 6), (3, 2), (1, 5)])
def test_doc_program_runs_from_a_file_and_matches_brute_force(tmp_path, n, max_steps):
    path = tmp_path / "greedy_step.py"
    path.write_text(doc_program())
    config = SearchConfig(program=str(path), n=n, max_steps=max_steps, max_tokens=10_000)
    runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: PROMPT)
    result = load_program(str(path))(PROBLEM, config, runtimes)
    assert result.program == "greedy_step" and len(result.candidates) == 1
    assert result.candidates[0].steps == reference_greedy_step(ScriptedModel(), config)
    assert result.verifier_calls == len(result.candidates[0].steps)


def test_doc_program_dropped_in_programs_is_found_by_name(tmp_path, monkeypatch):
    folder = tmp_path / "more_programs"
    folder.mkdir()
    (folder / "greedy_step.py").write_text(doc_program())
    monkeypatch.setattr(programs, "__path__", [*programs.__path__, str(folder)])
    monkeypatch.delitem(sys.modules, "programs.greedy_step", raising=False)
    try:
        assert "greedy_step" in program_names()
        run = load_program("greedy_step")
        runtimes = Runtimes(generator=ScriptedBackend(), scorer=ScriptedScorer(), prompt=lambda q: PROMPT)
        result = run(PROBLEM, SearchConfig(n=2, max_steps=3, max_tokens=1000), runtimes)
        assert result.program == "greedy_step" and 1 <= len(result.candidates[0].steps) <= 3
    finally:
        sys.modules.pop("programs.greedy_step", None)
