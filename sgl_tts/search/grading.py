"""Final-answer extraction and grading.

`extract_answer` pulls the final answer out of model text; `answers_equal` decides whether two answers are
the same mathematical object (math-verify, with a normalised string comparison as the fallback); `grade`
checks a predicted answer against a dataset's gold answer, in the form `graded_answer` gives it (the value
of an equation such as "7 + 2 = 9": "9"). Model output is treated as data only: it is
parsed by math-verify's LaTeX/expression parser, never evaluated as Python.

Timeouts: math-verify bounds its own work with `signal.alarm`, which only works in the main thread, and
search programs grade from worker threads. So every math-verify call runs in one helper process (started
on first use, one request at a time behind a lock), where it *is* the main thread and math-verify's own
signal timeouts apply. The parent also waits on the reply with a hard deadline and kills the helper when
it passes (covers work a signal cannot interrupt, such as a long C-level big-integer operation); the next
call starts a fresh helper. Answers longer than `MAX_MATH_VERIFY_CHARS` are never sent. Plain numbers
are compared in-process without the helper. Safe to call from any thread.

Verdicts are cached per (gold, predicted, timeout); a comparison that timed out (either deadline) or lost
its helper has no verdict and is never cached, so a later call tries again (on a busy machine it may finish).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # per comparison, hard deadline in the parent
MAX_MATH_VERIFY_CHARS = 500  # longer answers are compared as normalised strings only
HELPER_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take a while

CODE_DATASETS = ("humaneval",)


class GradingError(RuntimeError):
    """Grading cannot be done (no gold answer, a code dataset, or the math-verify helper cannot start)."""


# ---------------------------------------------------------------------------------------------------------
# Extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER_AMONG_WORDS = re.compile(r"(?:[A-Za-z]+\s+)*(-?[\d,]*\.?\d+)(?:\s+[A-Za-z][A-Za-z\s]*)?")
_IS_THE_ANSWER = re.compile(r"(-?[\d,]*\.?\d+)\s+is\s+(?:the|our)\s+(?:final\s+)?answer", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![A-Za-z_\d])-?\d[\d,]*(?:\.\d+)?")  # not the digits of a word such as "w12"
_SENTENCE_END = re.compile(r"\.\s")


def _braced(text: str, start: int) -> str | None:
    """The contents of the brace group opening at text[start], or None when unbalanced (text cut off)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # an escaped brace such as \{ does not open or close a group
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """The contents of the last complete top-level `\\boxed{...}` (a `\\boxed` inside another is part of it)."""
    last = None
    position = 0
    while (match := _BOXED.search(text, position)) is not None:
        end = match.end()
        if end < len(text) and text[end] == "{":
            content = _braced(text, end)
            position = end + len(content) + 2 if content is not None else end
        else:  # the brace-less form `\\boxed 5`
            content = re.match(r"[^\s$]*", text[end:]).group(0)
            position = end + len(content)
        if content and content.strip():
            last = content.strip()
    return last


def _clean_phrase_answer(raw: str) -> str | None:
    """Tidy the text after "The answer is" / "####": one sentence, no math delimiters, units and words around
    a lone number dropped ("indeed 12 eggs" -> "12")."""
    answer = raw.strip()
    sentence_end = _SENTENCE_END.search(answer)
    if sentence_end:
        answer = answer[: sentence_end.start()]
    for delimiter in ("**", "$", "\\(", "\\)", "\\[", "\\]"):
        answer = answer.replace(delimiter, "")
    answer = answer.strip().rstrip(".!;, ").strip()
    if answer.startswith("\\boxed"):  # a \boxed{ cut off before its closing brace
        return None
    lone_number = _NUMBER_AMONG_WORDS.fullmatch(answer)
    if lone_number:
        answer = lone_number.group(1)
    return answer or None


def extract_answer(text: str | None) -> str | None:
    """The final answer in `text`, or None.

    In order of preference: the last complete `\\boxed{...}` (nested braces allowed), the last GSM8K-style
    `#### X`, the last "The (final) answer is X", the last "X is the (final) answer". Returns the answer as
    written (LaTeX kept).
    """
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        matches = pattern.findall(text)
        for raw in reversed(matches):
            answer = _clean_phrase_answer(raw)
            if answer is not None:
                return answer
    stated_last = _IS_THE_ANSWER.findall(text)
    return stated_last[-1].replace(",", "") if stated_last else None


def answer_at_end(text: str | None, extract: Callable[[str], str | None] | None = None) -> str | None:
    """The answer of a solution the model ended by itself (end of sequence): `extract_answer`'s, else the last
    number of its last non-empty line ("So, 4 + 3 = 7." -> "7"). Small models often end with the result
    without a marked answer; a solution cut off by a token or step limit has no answer this way (its last
    number is wherever the cut fell), so use this only for solutions that ended. `extract`: the marked-answer
    extractor (default `extract_answer`)."""
    answer = (extract or extract_answer)(text) if text else None
    if answer is not None or not text:
        return answer
    lines = [line for line in text.splitlines() if line.strip()]
    numbers = _NUMBER.findall(lines[-1]) if lines else []
    return numbers[-1].replace(",", "") if numbers else None


# ---------------------------------------------------------------------------------------------------------
# Comparison

_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_OTHER_RELATION = re.compile(r"[<>≤≥≠≈]|[!:=]=|\\(?:[lg]eq?|neq?|[lg]t|approx|equiv|sim|cong)(?![A-Za-z])")
_LATEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", "$")


def normalize_answer(answer: str) -> str:
    """A canonical string form of an answer for the string-comparison fallback."""
    text = answer.strip()
    if text.startswith("\\boxed{") and _braced(text, len("\\boxed")) == text[len("\\boxed{") : -1]:
        text = text[len("\\boxed{") : -1]  # the whole answer is one \boxed{...}
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for noise in _LATEX_NOISE:
        text = text.replace(noise, "")
    text = re.sub(r"\s+", "", text).rstrip(".")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    number = _as_number(text)
    if number is not None:
        return _format_number(number)
    return text.lower()


def _as_number(text: str) -> Decimal | None:
    # Long digit strings stay strings: int() refuses to print more than 4300 digits.
    if len(text) > 100 or not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _format_number(number: Decimal) -> str:
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def _equation_sides(text: str) -> list[str] | None:
    """The sides of `text` when it is one equation or a chain of them (`a = b`, `a = b = c`): `=` outside any
    bracket, no other relation and no top-level `,` or `;` (a list of equations); else None."""
    if "=" not in text or _OTHER_RELATION.search(text):
        return None
    sides, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in ",;":
            return None
        elif depth == 0 and ch == "=":
            sides.append(text[start:i].strip())
            start = i + 1
    sides.append(text[start:].strip())
    return sides if all(sides) else None


def graded_answer(predicted: str | None, gold: str | None) -> str | None:
    """The form of `predicted` that `grade` compares with `gold`: when `predicted` is an equation and `gold` is
    none, its last side ("7 + 2 = 9" -> "9", "x = 5" -> "5"), the value math-verify would compare too; else
    `predicted` as it is. Reports show and store this form."""
    if predicted is None or (gold is not None and _equation_sides(str(gold)) is not None):
        return predicted
    sides = _equation_sides(predicted)
    return sides[-1] if sides else predicted


def answers_equal(a: str | None, b: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether two answers are the same: equal normalised strings, equal plain numbers, or math-verify says so.

    math-verify treats `a` as the gold side (it is asymmetric only for equations and assignments). A
    comparison that times out or cannot be parsed falls back to the normalised string comparison.
    """
    if a is None or b is None:
        return False
    norm_a, norm_b = normalize_answer(a), normalize_answer(b)
    if not norm_a or not norm_b:
        return False
    if norm_a == norm_b:
        return True
    if _as_number(norm_a) is not None and _as_number(norm_b) is not None:
        return False  # two different plain numbers
    if len(a) > MAX_MATH_VERIFY_CHARS or len(b) > MAX_MATH_VERIFY_CHARS:
        return False
    try:
        return bool(_math_verify_equal(a.strip(), b.strip(), float(timeout_s)))
    except ComparisonTimeout:
        return False  # the string comparison above said not equal; not cached, so a later call tries again


def grade(predicted: str | None, gold: str | None, dataset: str | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether `predicted` (an extracted answer, None = no answer) matches the dataset's `gold` answer, compared
    in its `graded_answer` form."""
    if dataset in CODE_DATASETS:
        raise GradingError(f"dataset '{dataset}' holds code problems: grade them by running tests in a sandbox")
    if gold is None:
        raise GradingError(f"no gold answer to grade against (dataset {dataset or 'unknown'})")
    if predicted is None:
        return False
    return answers_equal(str(gold), graded_answer(predicted, str(gold)), timeout_s)


# ---------------------------------------------------------------------------------------------------------
# The math-verify helper process


class ComparisonTimeout(Exception):
    """math-verify gave no verdict in time (or its helper died); raised through the cache so it is not stored."""


@functools.lru_cache(maxsize=8192)
def _math_verify_equal(gold: str, predicted: str, timeout_s: float) -> bool | None:
    """math-verify's verdict (None: it could not parse an answer). lru_cache keeps returned verdicts only, not
    raised exceptions, so a `ComparisonTimeout` is never cached."""
    return _HELPER.compare(gold, predicted, timeout_s)


class _MathVerifyHelper:
    """One child process running `_serve_math_verify`, fed one JSON request line at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self.restarts = 0  # how many helpers were killed for passing a deadline (for tests and logs)

    def compare(self, gold: str, predicted: str, timeout_s: float) -> bool | None:
        """True/False from math-verify; None when it could not parse. Raises `ComparisonTimeout` when math-verify's
        own timeout or the hard deadline passed, or the helper died."""
        request = json.dumps({"gold": gold, "predicted": predicted, "inner_timeout_s": max(1, int(timeout_s / 3))})
        with self._lock:
            proc = self._ensure_started()
            deadline = time.monotonic() + timeout_s
            try:
                proc.stdin.write(request.encode() + b"\n")
                proc.stdin.flush()
                line = self._read_line(proc, deadline)
            except OSError:
                line = None
            if line is None:
                logger.warning("math-verify comparison passed its %.1f s deadline; restarting the helper", timeout_s)
                self._stop()
                self.restarts += 1
                raise ComparisonTimeout(f"no verdict within the {timeout_s:.1f} s deadline")
        reply = json.loads(line)
        if reply["timed_out"]:
            raise ComparisonTimeout("math-verify's own timeout passed")
        return reply["equal"]

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        package_root = Path(__file__).resolve().parents[1]
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from sgl_tts.search.grading import _serve_math_verify; _serve_math_verify()"],
            cwd=package_root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # inherited: import errors stay visible
        )
        self._buffer = b""
        ready = self._read_line(self._proc, time.monotonic() + HELPER_STARTUP_TIMEOUT_S)
        if ready != "ready":
            self._stop()
            raise GradingError(f"the math-verify helper did not start (got {ready!r}); is math-verify installed?")
        return self._proc

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> str | None:
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the helper exited
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def close(self) -> None:
        with self._lock:
            self._stop()


_HELPER = _MathVerifyHelper()
atexit.register(_HELPER.close)


def shutdown() -> None:
    """Stop the math-verify helper process (it restarts on the next comparison)."""
    _HELPER.close()


def _serve_math_verify() -> None:
    """The helper's main loop: read {"gold", "predicted", "inner_timeout_s"} lines, answer with
    `_verify_request`'s {"equal", "timed_out"} (one line each)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    import math_verify  # noqa: F401  (imported before "ready": the first request should not pay for it)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every timeout
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        sys.stdout.write(json.dumps(_verify_request(json.loads(line))) + "\n")
        sys.stdout.flush()


def _verify_request(request: dict) -> dict:
    """{"equal": True/False, or None when an answer does not parse; "timed_out": whether math-verify's own
    signal timeout passed}. Must run in a main thread (math-verify times out with `signal.alarm`).

    math-verify's `raise_on_error=False` reports a timeout as "not equal", which would then be cached as a
    verdict; so errors are raised and sorted here: a timeout anywhere means no verdict, any other error in
    one (gold, predicted) pair of candidate parses makes that pair unequal (as math-verify's own `verify` does).
    """
    import itertools

    from math_verify import parse, verify
    from math_verify.errors import TimeoutException  # a BaseException, so `except Exception` misses it

    timeout = request["inner_timeout_s"]
    try:
        gold = parse("\\boxed{" + request["gold"] + "}", parsing_timeout=timeout, raise_on_error=True)
        predicted = parse("\\boxed{" + request["predicted"] + "}", parsing_timeout=timeout, raise_on_error=True)
    except TimeoutException:
        return {"equal": None, "timed_out": True}
    except Exception:
        return {"equal": None, "timed_out": False}
    if not gold or not predicted:
        return {"equal": None, "timed_out": False}
    timed_out = False
    for gold_parse, predicted_parse in itertools.product(gold, predicted):
        try:
            if verify(gold_parse, predicted_parse, timeout_seconds=timeout, raise_on_error=True):
                return {"equal": True, "timed_out": False}
        except TimeoutException:
            timed_out = True
        except Exception:
            continue
    return {"equal": None if timed_out else False, "timed_out": timed_out}
