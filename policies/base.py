"""What a scheduler policy knows about a request, how that reaches SGLang, and the policy interface.

The search layer tags every generator request with a `BeamTag` and sends it as the request id
(`rid`): SGLang copies `GenerateReqInput.rid` unchanged into the scheduler's `Req.rid`, so the tag
reaches the waiting queue on every path (HTTP `/generate`, `Engine.generate`) and the same string is
the handle for `POST /abort_request`. See docs/policies.md for the format.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence, TypeVar
from urllib.parse import quote, unquote

T = TypeVar("T")

RID_PREFIX = "tts"
_FIELDS = 8  # prefix, problem, iteration, beam, parent, kind, bin, nonce


@dataclass(frozen=True)
class BeamTag:
    """One generator request's place in a search tree.

    problem_id: the problem (search) the request belongs to; any string.
    iteration: the step being generated (0 = first step after the prompt).
    beam_id: this beam's index in the search's beam list at `iteration` (see `parent_id`).
    parent_id: `beam_id` at `iteration - 1` of the beam this one forks from; None for the first step.
        The search keeps its beam list in parent order (children of parent 0, then of parent 1, ...)
        and numbers beams by position, so parent ids carry the tree order across iterations.
    speculative: a speculative extension (FastTTS §4.1) rather than standard work.
    priority_bin: the score bin j (1 = highest) of the beam being extended; 0 for standard work.
    """

    problem_id: str
    iteration: int
    beam_id: int
    parent_id: int | None = None
    speculative: bool = False
    priority_bin: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.problem_id, str) or not self.problem_id:
            raise ValueError(f"problem_id must be a non-empty string, got {self.problem_id!r}")
        if self.iteration < 0 or self.beam_id < 0:
            raise ValueError(f"iteration and beam_id must be >= 0, got {self.iteration}, {self.beam_id}")
        if self.parent_id is not None and self.parent_id < 0:
            raise ValueError(f"parent_id must be >= 0 or None, got {self.parent_id}")
        if self.priority_bin < 0:
            raise ValueError(f"priority_bin must be >= 0, got {self.priority_bin}")
        if self.speculative and self.priority_bin < 1:
            raise ValueError("a speculative request needs its score bin (priority_bin >= 1)")


def encode_rid(tag: BeamTag, nonce: str | None = None) -> str:
    """The request id carrying `tag`: `tts:<problem>:<iteration>:<beam>:<parent|->:<n|s>:<bin>:<nonce>`.

    The problem id is percent-encoded, so it may hold any character. The nonce (default: 12 random hex
    digits) keeps request ids unique, which SGLang requires.
    """
    nonce = uuid.uuid4().hex[:12] if nonce is None else nonce
    assert nonce and ":" not in nonce, f"the nonce must be non-empty and free of ':', got {nonce!r}"
    parent = "-" if tag.parent_id is None else str(tag.parent_id)
    kind = "s" if tag.speculative else "n"
    problem = quote(tag.problem_id, safe="")
    return f"{RID_PREFIX}:{problem}:{tag.iteration}:{tag.beam_id}:{parent}:{kind}:{tag.priority_bin}:{nonce}"


@lru_cache(maxsize=16384)
def decode_rid(rid: object) -> BeamTag | None:
    """The tag inside a request id, or None for an untagged or malformed one (never raises)."""
    if not isinstance(rid, str) or not rid.startswith(RID_PREFIX + ":"):
        return None
    parts = rid.split(":", _FIELDS - 1)
    if len(parts) != _FIELDS:
        return None
    _, problem, iteration, beam, parent, kind, priority_bin, _nonce = parts
    if kind not in ("n", "s"):
        return None
    try:
        return BeamTag(
            problem_id=unquote(problem),
            iteration=int(iteration),
            beam_id=int(beam),
            parent_id=None if parent == "-" else int(parent),
            speculative=kind == "s",
            priority_bin=int(priority_bin),
        )
    except ValueError:
        return None


TagOf = Callable[[T], "BeamTag | None"]


class OrderingPolicy(ABC):
    """Orders a scheduler's waiting queue. Pure: no I/O, may keep state between calls."""

    name: str = ""

    @abstractmethod
    def order(self, items: Sequence[T], tag_of: TagOf) -> list[T]:
        """`items` reordered (a permutation); `tag_of(item)` gives its tag or None if untagged."""


class FcfsOrder(OrderingPolicy):
    """First come, first served: the queue as it is (the baseline)."""

    name = "fcfs"

    def order(self, items: Sequence[T], tag_of: TagOf) -> list[T]:
        return list(items)
