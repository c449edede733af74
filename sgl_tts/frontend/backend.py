"""The SGLang frontend backend programs run on, and the prompt format.

`SearchBackend` is what sits beneath the DSL for every program, built-in or written by a user in plain
SGLang. It is transport only, shared by every search: each request carries its fork lineage
(`sgl_tts.frontend.lineage`) as its request id, so the scheduler's prefix-aware policy sees the search tree;
under priority scheduling standard requests carry the standard priority; and the request is reported to the
search the program state belongs to (`sglang_internals.search_of`: its ledger, observers, cancellation,
seed), which is created where the search starts (`sgl_tts.search.context.SearchContext`).

Where the search cuts samples by their first step (`stopping.prune`, sgl_tts/search/stopping.py), a request that
writes a whole solution goes in two parts (`generate_sent`): to the first step delimiter, then, unless the
verifier scored that step below the cut, the rest, its prompt the first part's (in the radix cache) and its token
limit what is left. The program gets one answer, the two texts and counts joined; a cut sample's answer is its
first step, finished "abort" as a sample the search aborted is.

`TTSEndpoint` is SGLang's `RuntimeEndpoint` plus this: it adds the request fields in `_add_images`, the hook
`RuntimeEndpoint` calls on every request body, instead of copying `generate`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_tts.frontend.ledger import Request
from sgl_tts.frontend.lineage import node_of
from sgl_tts.frontend.sglang_internals import search_of
from policies.base import encode_rid

PRUNED = "first step scored below stopping.prune"  # the abort message of a sample cut after its first step

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

    def generate_sent(self, s: Any, sampling_params: Any,
                      generate_once: Callable[[Any, Any], tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
        """`generate_once(s, params)`, one request answered (text, meta), `sent` for state `s`: in two parts where
        the state's search cuts samples by their first step and this request writes a whole solution (it has no
        stop string of its own), else as one."""
        search = search_of(s)
        delimiter = getattr(getattr(search, "config", None), "step_delimiter", None)
        stops = sampling_params.stop
        own_stops = bool(stops) if isinstance(stops, str) else any(stops or ())
        if search is None or not search.prunes or not delimiter or own_stops:
            return self.sent(s, lambda: generate_once(s, sampling_params))
        return self.sent(s, lambda: self._generate_in_two(s, sampling_params, generate_once, search, delimiter))

    @staticmethod
    def _generate_in_two(s: Any, params: Any, generate_once: Callable[[Any, Any], tuple[str, dict[str, Any]]],
                         search: Any, delimiter: str) -> tuple[str, dict[str, Any]]:
        prompt = s.text_
        first, meta = generate_once(s, replace(params, stop=[delimiter]))
        reason = meta.get("finish_reason")
        if not (isinstance(reason, dict) and reason.get("type") == "stop" and reason.get("matched") == delimiter):
            return first, meta  # it ended within its first step (or was aborted there)
        first += delimiter  # SGLang trims the stop string; the step keeps it, as `split_steps` does
        if not search.first_step_kept(prompt, first):
            return first, {**meta, "finish_reason": {"type": "abort", "message": PRUNED}}
        if search.stopped is not None:  # stopped while the step was scored: the rest would be refused
            return first, {**meta, "finish_reason": {"type": "abort", "message": search.stopped}}
        limit = params.max_new_tokens
        left = None if limit is None else limit - int(meta.get("completion_tokens", 0))
        if left is not None and left <= 0:
            return first, {**meta, "finish_reason": {"type": "length", "length": limit}}
        s.text_ = prompt + first  # the rest's prompt; only this state's worker thread reads it while it runs
        try:
            rest, rest_meta = generate_once(s, replace(params, max_new_tokens=left))
        finally:
            s.text_ = prompt
        return first + rest, joined_meta(meta, rest_meta)

    def answered(self, s: Any, text: str, began: float, meta: dict[str, Any], output: str = "") -> None:
        """A standard request for `text`, sent at perf_counter() `began`, answered with `output` and `meta`."""
        search = search_of(s)
        if search is not None:
            search.request_answered(Request.answered(self.name, text, output, meta, began), meta)


def joined_meta(first: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """The meta of one answer sent in two parts: the rest's, with the counts summed and the per-token lists of
    both parts (`output_*`) joined."""
    joined = dict(rest)
    for key in ("completion_tokens", "prompt_tokens", "cached_tokens"):
        if key in first or key in rest:
            joined[key] = int(first.get(key) or 0) + int(rest.get(key) or 0)
    for key, value in first.items():
        if key.startswith("output_") and isinstance(value, list) and isinstance(rest.get(key), list):
            joined[key] = value + rest[key]
    return joined


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
        def send_and_record(s: Any, params: Any) -> tuple[str, dict[str, Any]]:
            # recorded while the rid is still in flight: a search that waits until none is (a cancel) has heard
            # every answer, the aborted ones included
            began = time.perf_counter()
            text, meta = self._call(super(TTSEndpoint, self).generate, s, params)
            self.answered(s, s.text_, began, meta, text)
            return text, meta

        return self.generate_sent(s, sampling_params, send_and_record)

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
