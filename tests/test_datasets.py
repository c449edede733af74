import dataclasses
import json

import pytest

from sgl_tts import problems as datasets
from sgl_tts.env_names import DATA, old_name
from sgl_tts.problems import DatasetError, builtin_problems, data_root, load_problems

needs_shared_data = pytest.mark.skipif(
    not (data_root() / "aime24" / "test.jsonl").is_file(), reason="shared benchmark data not present"
)


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_default_data_root_is_beside_the_repository(monkeypatch):
    for name in (DATA, old_name(DATA)):
        monkeypatch.delenv(name, raising=False)
    assert data_root() == datasets.repository_root().parent / "shared" / "data"


@needs_shared_data
def test_aime24_gold_zero_padding_removed():
    problems = load_problems("aime24")
    assert len(problems) == 30
    assert [(p.id, p.gold) for p in problems[:3]] == [("60", "204"), ("61", "113"), ("62", "371")]
    padded = load_problems("aime24", ids=["67"])[0]
    assert padded.meta["answer"] == "025" and padded.gold == "25"
    assert padded.question.startswith("There exist real numbers $x$ and $y$")


@needs_shared_data
def test_amc23_float_gold_made_integer():
    problems = load_problems("amc23", limit=2)
    assert [(p.id, p.gold) for p in problems] == [("0", "27"), ("1", "36")]
    assert problems[1].meta["answer"] == 36.0


@needs_shared_data
def test_gsm8k_gold_after_hashes_without_commas():
    problems = load_problems("gsm8k", limit=3)
    assert [(p.id, p.gold) for p in problems] == [("0", "18"), ("1", "3"), ("2", "70000")]
    assert problems[0].question.startswith("Janet")
    with_comma = load_problems("gsm8k", ids=["146"])[0]
    assert with_comma.meta["answer"].endswith("#### 2,125") and with_comma.gold == "2125"


@needs_shared_data
def test_math500_keeps_latex_gold():
    first = load_problems("math500", limit=1)[0]
    assert first.id == "test/precalculus/807.json"
    assert first.gold == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first.meta["level"] == 2 and "problem" not in first.meta


@needs_shared_data
def test_humaneval_has_no_gold():
    first = load_problems("humaneval", limit=1)[0]
    assert (first.id, first.gold) == ("HumanEval/0", None)
    assert first.meta["entry_point"] == "has_close_elements"


@needs_shared_data
def test_slicing():
    assert [p.id for p in load_problems("aime24", offset=1, limit=2)] == ["61", "62"]
    assert [p.id for p in load_problems("aime24", ids=[67, "60"])] == ["60", "67"], "ids keep file order"
    assert len(load_problems("aime24", offset=29, limit=5)) == 1
    with pytest.raises(DatasetError, match="no problems with ids 999"):
        load_problems("aime24", ids=["999"])


def test_data_root_from_environment(tmp_path, monkeypatch):
    (tmp_path / "aime24").mkdir()
    write_jsonl(tmp_path / "aime24" / "test.jsonl", [json.dumps({"id": 1, "problem": "q", "answer": "007"})])
    monkeypatch.setenv(DATA, str(tmp_path))
    assert [(p.id, p.gold) for p in load_problems("aime24")] == [("1", "7")]


def test_unknown_dataset_names_the_choices():
    with pytest.raises(DatasetError) as error:
        load_problems("aime25")
    assert "'aime25'" in str(error.value) and "aime24, amc23, gsm8k, humaneval, math500" in str(error.value)


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DatasetError, match="offline"):
        load_problems("someone/some-dataset")


def test_unknown_field_names_field_and_fields_present(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"problem": "q", "answer": "1"})])
    with pytest.raises(DatasetError) as error:
        load_problems(path, question_field="prompt_text")
    assert "'prompt_text'" in str(error.value) and "fields present: problem, answer" in str(error.value)


def test_malformed_line_error_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q1", "answer": 1}), "{not json", "",
                                              json.dumps(["a", "list"]), json.dumps({"question": "q2", "answer": 2})])
    with pytest.raises(DatasetError, match=f"{path}:2: malformed line"):
        load_problems(path)
    loaded = load_problems(path, skip_malformed=True)
    assert loaded.skipped_lines == 2
    assert [(p.id, p.question, p.gold) for p in loaded] == [("0", "q1", "1"), ("1", "q2", "2")]


def test_custom_jsonl_fields_and_gold_format(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"uid": "a", "text": "q", "sol": "work\n#### 1,500"})])
    problem = load_problems(path, question_field="text", id_field="uid", gold_field="sol", gold_format="gsm8k")[0]
    assert (problem.id, problem.question, problem.gold) == ("a", "q", "1500")
    with pytest.raises(DatasetError, match="unknown gold format 'roman'"):
        load_problems(path, question_field="text", gold_format="roman")


def test_bad_gold_and_duplicate_ids(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q", "answer": "no hashes"})])
    with pytest.raises(DatasetError, match=f"{path}:1: bad gold answer"):
        load_problems(path, gold_format="gsm8k")
    path = write_jsonl(tmp_path / "e.jsonl", [json.dumps({"id": 1, "question": "q"})] * 2)
    with pytest.raises(DatasetError, match="duplicate id '1' \\(first on line 1\\)"):
        load_problems(path)


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_problems(tmp_path / "absent.jsonl")


def _arithmetic(node):
    """The value of an expression of integers, +, - and * (parsed, never executed)."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    assert isinstance(node, ast.BinOp) and type(node.op) in ops, ast.dump(node)
    return ops[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))


def test_builtin_problems():
    import ast

    problems = builtin_problems()
    assert 18 <= len(problems) <= 24
    bare = [p for p in problems if p.question.startswith("What is ")]
    assert len(bare) == 10
    for problem in bare:
        expression = problem.question.removeprefix("What is ").removesuffix("?")
        assert str(_arithmetic(ast.parse(expression, mode="eval"))) == problem.gold, problem.id
    assert len({p.id for p in problems}) == len(problems)
    assert all(p.gold.isdigit() and p.question.endswith("?") for p in problems)
    assert [p.id for p in load_problems("builtin", limit=2)] == [p.id for p in problems[:2]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        problems[0].gold = "0"
