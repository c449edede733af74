"""Upper bounds of one search and of one served request, sized for one machine.

`Limits` is the run config's `limits:` section (the operator's; a request cannot change it). `check_limits`
is the one check of a `SearchConfig` against it, for a run config file and for a request alike: each refusal
is a `LimitError` naming the field, the value and the limit (`error.field` is the field).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# SearchConfig field (dotted: a field of a nested section) -> the Limits field that bounds it from above.
SEARCH_BOUNDS = {"n": "n", "beam_width": "n", "max_steps": "max_steps", "max_tokens": "max_tokens",
                 "max_step_tokens": "max_step_tokens", "lookahead": "lookahead", "granularity": "granularity",
                 "budget.deadline_s": "deadline_s", "budget.max_tokens": "search_tokens"}


@dataclass(frozen=True)
class Limits:
    # A search.
    n: int = 256  # paths of one search (and children per kept beam, beam_width)
    max_steps: int = 64
    max_tokens: int = 16_384  # per path
    max_step_tokens: int = 4096
    lookahead: int = 8
    granularity: int = 64
    deadline_s: float = 3600.0  # search.budget.deadline_s
    search_tokens: int = 4_194_304  # search.budget.max_tokens: generated tokens of one whole search
    # A served request (sgl-tts serve).
    body_bytes: int = 1 << 20  # past it: 413, before the body is parsed
    messages: int = 64
    message_chars: int = 65_536  # one message's content
    context_tokens: int | None = None  # prompt + max_tokens; None: the generator tokenizer's model_max_length

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is not None and value < 1:
                raise ValueError(f"limits.{item.name} must be at least 1, got {value}")


class LimitError(ValueError):
    """A value above its limit; `field` names it (as the request or the config file spells it)."""

    def __init__(self, field: str, value: object, limit: float, limit_name: str):
        super().__init__(f"'{field}' is {value}, above the limit {limit} (limits.{limit_name})")
        self.field = field


def check_limits(search: object, limits: Limits, prefix: str = "") -> None:
    """Raise LimitError for the first field of the search config `search` above `limits`; the field is named
    `prefix` + its name (`search.n` in a run config, `n` in a request)."""
    for field, limit_name in SEARCH_BOUNDS.items():
        value, limit = search, getattr(limits, limit_name)
        for name in field.split("."):
            value = getattr(value, name)
        if value is not None and value > limit:
            raise LimitError(prefix + field, value, limit, limit_name)
