"""The graded problem set: deterministic by seed, balanced levels, every gold answer re-derived from the question."""

import ast
import itertools
import re
from collections import Counter

import pytest

from sgl_tts.graded_set import PER_LEVEL, SEED, WORD_LEVEL, WORD_TEMPLATES, evaluate, generate_graded_set
from sgl_tts.problems import GRADED, builtin_problems, graded_problems, load_problems
from sgl_tts.search.grading import extract_answer, grade

BINARY_OPERATIONS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y}
WORD_OPERATORS = {"gain": ["+"], "loss": ["-"], "groups": ["*"], "gain-loss": ["+", "-"],
                  "groups-plus": ["*", "+"], "groups-minus": ["*", "-"]}


def safe_arithmetic(text: str) -> int:
    """The value of an integer expression of + - * and parentheses, read through `ast` (nothing else allowed)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPERATIONS:
            return BINARY_OPERATIONS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not plain integer arithmetic: {ast.dump(node)}")

    return value(ast.parse(text, mode="eval"))


def numbers_in(text: str) -> list[int]:
    return [int(number) for number in re.findall(r"\d+", text)]


def test_safe_arithmetic_follows_precedence_and_refuses_anything_else():
    assert safe_arithmetic("6 * 3 + 4") == 22 and safe_arithmetic("4 + 6 * 3") == 22
    assert safe_arithmetic("(1 + 2) * 4") == 12 and safe_arithmetic("10 - 3 - 2") == 5
    for text in ("__import__('os')", "2 ** 8", "7 / 2", "x + 1", "1.5 + 1"):
        with pytest.raises(ValueError, match="not plain integer arithmetic"):
            safe_arithmetic(text)


def test_the_rule_is_deterministic_by_seed():
    assert generate_graded_set() == generate_graded_set(SEED)
    assert graded_problems() == graded_problems(SEED)
    other = generate_graded_set(SEED + 1)
    assert [p.question for p in other] != [p.question for p in generate_graded_set()]
    assert [p.id for p in other] == [p.id for p in generate_graded_set()], "ids depend on position only"


def test_the_bundled_set_is_pinned():
    """Regenerating on any Python version must give these exact questions (Random.randint/choice only)."""
    problems = {p.id: (p.question, p.gold) for p in load_problems(GRADED)}
    assert problems["L1-01"] == ("What is 4 + 1?", "5")
    assert problems["L2-07"] == ("What is 51 + 18?", "69")
    assert problems["L3-03"] == ("What is 5 + 6 * 11?", "71")
    assert problems["L4-04"] == (
        "Tom has 25 coins. He wins 11 more, and then he loses 3. How many coins does Tom have now?", "33")


def test_levels_ids_and_templates():
    problems = load_problems(GRADED)
    assert len(problems) == 4 * PER_LEVEL >= 60
    assert Counter(p.meta["level"] for p in problems) == {1: PER_LEVEL, 2: PER_LEVEL, 3: PER_LEVEL, 4: PER_LEVEL}
    assert len({p.id for p in problems}) == len(problems), "ids are unique"
    assert len({p.question for p in problems}) == len(problems), "questions are unique"
    for problem in problems:
        level = problem.meta["level"]
        assert type(level) is int and re.fullmatch(rf"L{level}-\d\d", problem.id), problem
        assert problem.meta["template"], problem
    word_templates = {p.meta["template"] for p in problems if p.meta["level"] == WORD_LEVEL}
    assert word_templates == {t.name for t in WORD_TEMPLATES} == set(WORD_OPERATORS)
    assert {p.meta["template"] for p in problems if p.meta["level"] == 3} == {
        f"a {x} b {y} c" for x in "+-*" for y in "+-*"}
    names = {p.question.split()[0] for p in problems if p.meta["level"] == WORD_LEVEL and
             not p.question.startswith("There")}
    assert len(names) >= 4, f"names vary: {names}"


def test_every_gold_answer_is_rederived_from_the_question():
    for problem in load_problems(GRADED):
        if problem.meta["level"] == WORD_LEVEL:
            # The question's numbers, in order, joined by the template's operations.
            numbers = numbers_in(problem.question)
            operators = WORD_OPERATORS[problem.meta["template"]]
            assert len(numbers) == len(operators) + 1, problem
            expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(operators, numbers[1:])])
            assert expression == problem.meta["expression"], problem
        else:
            match = re.fullmatch(r"What is ([\d +*-]+)\?", problem.question)
            assert match, problem
            expression = match.group(1)
            level = problem.meta["level"]
            assert len(numbers_in(expression)) == (3 if level == 3 else 2), problem
            if level == 1:
                assert all(1 <= n <= 9 for n in numbers_in(expression)), problem
            if level == 2:
                assert 10 <= numbers_in(expression)[0] <= 99, problem
        answer = safe_arithmetic(expression)
        assert answer >= 0 and problem.gold == str(answer), problem


def test_evaluate_matches_the_ast_reference_on_every_small_expression():
    for a, b, c in itertools.product(range(6), repeat=3):
        for x, y in itertools.product("+-*", repeat=2):
            reference = safe_arithmetic(f"{a} {x} {b} {y} {c}")
            # Refused: a negative value, or a negative partial sum before a last + or - term.
            refused = reference < 0 or (y != "*" and safe_arithmetic(f"{a} {x} {b}") < 0)
            assert evaluate([a, b, c], [x, y]) == (None if refused else reference), (a, x, b, y, c)
    with pytest.raises(ValueError, match="operators: expected one of"):
        evaluate([1, 2], ["/"])
    with pytest.raises(ValueError, match="operators: expected 1 for 2 numbers"):
        evaluate([1, 2], ["+", "+"])


def test_graded_answers_are_graded_like_builtin():
    for problem in load_problems(GRADED):
        answer = int(problem.gold)
        assert grade(extract_answer(f"So the answer is {answer}."), problem.gold, GRADED), problem
        assert grade(extract_answer(f"\\boxed{{{answer}}}"), problem.gold, GRADED), problem
        assert not grade(str(answer + 1), problem.gold, GRADED), problem


def test_builtin_is_unchanged_and_selection_works():
    builtin = builtin_problems()
    assert len(builtin) == 20 and builtin[0].id == "apples" and builtin[-1].id == "add-multiply"
    assert [p.id for p in load_problems(GRADED, ids=["L3-02", "L1-05"])] == ["L1-05", "L3-02"]
    assert [p.id for p in load_problems(GRADED, offset=20, limit=2)] == ["L2-01", "L2-02"]
