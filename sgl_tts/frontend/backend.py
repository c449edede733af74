"""The SGLang frontend backend programs run on, and the prompt format.

`SearchBackend` is what sits beneath the DSL for every program, built-in or written by a user in plain
SGLang. It is transport only, shared by every search: each request carries its fork lineage
(`sgl_tts.frontend.lineage`) as its request id, so the scheduler's prefix-aware policy sees the search tree;
under priority scheduling standard requests carry the standard priority; and the request is reported to the
search the program state belongs to (`sglang_internals.search_of`: its ledger, observers, cancellation,
seed), which is created where the search starts (`sgl_tts.search.context.SearchContext`).

`TTSEndpoint` is SGLang's `RuntimeEndpoint` plus this: it adds the request fields in `_add_images`, the hook
`RuntimeEndpoint` calls on every request body, instead of copying `generate`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_tts.frontend.ledger import Request
from sgl_tts.frontend.lineage import node_of
from sgl_tts.frontend.sglang_internals import search_of
from policies.base import encode_rid

SYSTEM_PROMPT = (
    "Solve the math problem step by step. Put a blank line between steps. "
    "End with: The answer is $\\boxed{ANSWER}$."
)


class GeneratorError(RuntimeError):
    """A generator request failed (the runtime answered with an error, or stopped answering); names the
    runtime. Searches keep their finished candidates when this is raised (`sgl_tts.search.api`)."""


def request_seed(seed: int, number: int) -> int:
    """The sampling seed of request node `number` of a search seeded with `seed` (a stable 31-bit hash)."""
    digest = hashlib.sha256(f"{seed}:{number}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


_sending = threading.local()  # the rid of the request this thread is sending (a state's worker sends one at a time)


class SearchBackend:
    """Mixin for SGLang `BaseBackend`s: lineage tags, priority, and reporting to the state's search."""

    name = "generator"  # the runtime's name in request records
    standard_priority: int | None = None  # set when the runtime schedules by priority

    def rid(self, s: Any) -> str:
        """The request id of the request state `s` is sending: its lineage tag (labelled by its search, when it
        has one) and a nonce that makes it unique."""
        rid = getattr(_sending, "rid", None)
        if rid is None:
            search = search_of(s)
            rid = encode_rid(node_of(s, search.label if search is not None else "run").tag())
        return rid

    def request_fields(self, s: Any) -> dict[str, Any]:
        """Top-level /generate fields for a request of state `s`: its lineage rid and, under priority
        scheduling, the standard priority."""
        fields: dict[str, Any] = {"rid": self.rid(s)}
        if self.standard_priority is not None:
            fields["priority"] = self.standard_priority
        return fields

    def sampling_seed(self, s: Any) -> int | None:
        search = search_of(s)
        if search is None or search.seed is None:
            return None
        return request_seed(search.seed, node_of(s, search.label).number)

    def sent(self, s: Any, send: Callable[[], Any]) -> Any:
        """`send()` a request of state `s`, with the rid in flight for its search while it runs (a cancelled
        search refuses it)."""
        search = search_of(s)
        rid = self.rid(s)
        if search is not None:
            search.request_sent(rid)
        _sending.rid = rid
        try:
            return send()
        finally:
            _sending.rid = None
            if search is not None:
                search.request_done(rid)

    def answered(self, s: Any, text: str, began: float, meta: dict[str, Any], output: str = "") -> None:
        """A standard request for `text`, sent at perf_counter() `began`, answered with `output` and `meta`."""
        search = search_of(s)
        if search is not None:
            search.request_answered(Request.answered(self.name, text, output, meta, began), meta)


class TTSEndpoint(SearchBackend, RuntimeEndpoint):
    """SGLang's RuntimeEndpoint for a started `sgl_tts.runtime.server.Runtime`, with `SearchBackend`."""

    def __init__(self, runtime: Any, standard_priority: int | None = None, send_seed: bool = False):
        super().__init__(runtime.url)
        self.runtime = runtime
        self.standard_priority = standard_priority
        self.send_seed = send_seed  # SGLang honours sampling_seed only with --enable-deterministic-inference
        self.name = runtime.name

    def _add_images(self, s: Any, data: dict[str, Any]) -> None:
        super()._add_images(s, data)
        data.update(self.request_fields(s))
        seed = self.sampling_seed(s) if self.send_seed else None
        if seed is not None:
            data["sampling_params"]["sampling_seed"] = seed

    def generate(self, s: Any, sampling_params: Any):
        def send_and_record() -> tuple[str, dict[str, Any]]:
            # recorded while the rid is still in flight: a search that waits until none is (a cancel) has heard
            # every answer, the aborted ones included
            began = time.perf_counter()
            text, meta = self._call(super(TTSEndpoint, self).generate, s, sampling_params)
            self.answered(s, s.text_, began, meta, text)
            return text, meta

        return self.sent(s, send_and_record)

    def commit_lazy_operations(self, s: Any) -> None:
        self.sent(s, lambda: self._call(super(TTSEndpoint, self).commit_lazy_operations, s))

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except (OSError, RuntimeError) as exc:  # urllib's errors are OSErrors; an error answer is a RuntimeError
            self.runtime.check_alive()  # raises RuntimeDiedError (with the log's tail) when the server is gone
            raise GeneratorError(f"generator runtime '{self.runtime.name}' at {self.base_url} failed: "
                                 f"{exc}") from exc


@dataclass(frozen=True)
class Turn:
    """A message of a chat before its last user turn: role "user" or "assistant", and its text."""

    role: str
    content: str


@dataclass(frozen=True)
class Chat:
    """What a prompt puts before the question (the last user turn): the system prompt, then the earlier turns
    in order. A served request's system message replaces SYSTEM_PROMPT (`sgl_tts.serve.protocol`)."""

    system: str = SYSTEM_PROMPT
    turns: tuple[Turn, ...] = ()

    def messages(self, question: str) -> list[dict[str, str]]:
        """The chat with `question` as its last user turn, as chat-template messages."""
        return [{"role": "system", "content": self.system},
                *({"role": turn.role, "content": turn.content} for turn in self.turns),
                {"role": "user", "content": question}]


PLAIN_FORMAT = {"system": "{}\n\n", "user": "Question: {}\n\n", "assistant": "Answer:\n{}\n\n"}  # no template


def chat_prompt(tokenizer: Any, question: str, chat: Chat = Chat()) -> str:
    """The prompt text for `question` after `chat` in the model's chat format, ending where the answer begins
    (the generation prompt after the last user turn)."""
    messages = chat.messages(question)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(PLAIN_FORMAT[m["role"]].format(m["content"]) for m in messages) + "Answer:\n"


@dataclass(frozen=True)
class ChatPrompt:
    """`Runtimes.prompt` in a tokenizer's chat format: question -> `chat_prompt(tokenizer, question, chat)`. A
    served chat request runs on a copy with its own `chat` (`sgl_tts.serve.service.chat_runtimes`)."""

    tokenizer: Any
    chat: Chat = Chat()

    def __call__(self, question: str) -> str:
        return chat_prompt(self.tokenizer, question, self.chat)
