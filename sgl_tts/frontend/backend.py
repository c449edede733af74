"""The SGLang frontend backend programs run on, and the prompt format.

`SearchBackend` is what sits beneath the DSL for every program, built-in or written by a user in plain
SGLang: each request carries its fork lineage (`sgl_tts.frontend.lineage`) as its request id, so the
scheduler's prefix-aware policy sees the search tree; each request's `meta_info` goes into the run's
`RequestLedger`; under priority scheduling standard requests carry the standard priority; and a search that
grows paths with `expand` finds the run's step extension (FastTTS speculation) here.

`for_run()` gives one search its own view of a backend: the same runtime, a fresh ledger (that also counts
into the parent's), a fresh step extension and the search's seed.

`TTSEndpoint` is SGLang's `RuntimeEndpoint` plus this: it adds the request fields in `_add_images`, the hook
`RuntimeEndpoint` calls on every request body, instead of copying `generate`.
"""

from __future__ import annotations

import copy
import hashlib
import time
from typing import Any, Callable

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_tts.frontend.ledger import RequestLedger
from sgl_tts.frontend.lineage import node_of
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


class SearchBackend:
    """Mixin for SGLang `BaseBackend`s: lineage tags, accounting, per-run views (see the module docstring)."""

    run_label = "run"
    ledger: RequestLedger | None = None
    origin: Any = None  # the backend this per-run view was made from (itself when not a view)
    extension: Any = None  # the run's step extension (FastTTS S), used by sgl_tts.search.api.expand
    extension_factory: Callable[["SearchBackend"], Any] | None = None
    seed: int | None = None
    standard_priority: int | None = None  # set when the runtime schedules by priority
    rid_listener: Callable[[str], None] | None = None  # told every request id this view sends (sgl_tts.serve)
    observers: tuple = ()  # see `observe`

    def observe(self, callback: Callable[[str, float, dict[str, Any]], None]) -> None:
        """Call `callback(request text, seconds, meta_info)` after every standard request (views included)."""
        if "observers" not in self.__dict__:
            self.observers = []  # this backend's own list; per-run views (shallow copies) share it
        self.observers.append(callback)

    def for_run(self, seed: int | None = None, label: str | None = None) -> "SearchBackend":
        view = copy.copy(self)
        view.origin = self.origin if self.origin is not None else self
        view.ledger = self.ledger.child() if self.ledger is not None else RequestLedger()
        view.seed = seed if seed is not None else self.seed
        view.run_label = label or self.run_label
        view.extension = self.extension_factory(view) if self.extension_factory is not None else None
        return view

    def request_fields(self, s: Any) -> dict[str, Any]:
        """Top-level /generate fields for a request of state `s`: its lineage rid and, under priority
        scheduling, the standard priority."""
        fields: dict[str, Any] = {"rid": encode_rid(node_of(s, self.run_label).tag())}
        if self.standard_priority is not None:
            fields["priority"] = self.standard_priority
        if self.rid_listener is not None:
            self.rid_listener(fields["rid"])
        return fields

    def sampling_seed(self, s: Any) -> int | None:
        return None if self.seed is None else request_seed(self.seed, node_of(s, self.run_label).number)

    def record(self, meta: dict[str, Any], speculative: bool = False) -> None:
        if self.ledger is not None:
            self.ledger.record(meta, speculative)

    def finished(self, text: str, began: float, meta: dict[str, Any], output: str = "") -> None:
        """A standard request for `text`, sent at perf_counter() `began`, answered with `output` and `meta`."""
        if self.ledger is not None:
            self.ledger.record_request(text, output, meta)
        seconds = time.perf_counter() - began
        for callback in self.observers:
            callback(text, seconds, meta)


class TTSEndpoint(SearchBackend, RuntimeEndpoint):
    """SGLang's RuntimeEndpoint for a started `sgl_tts.runtime.server.Runtime`, with `SearchBackend`."""

    def __init__(self, runtime: Any, standard_priority: int | None = None, send_seed: bool = False,
                 extension_factory: Callable[[SearchBackend], Any] | None = None):
        super().__init__(runtime.url)
        self.runtime = runtime
        self.standard_priority = standard_priority
        self.send_seed = send_seed  # SGLang honours sampling_seed only with --enable-deterministic-inference
        self.extension_factory = extension_factory
        self.run_label = runtime.name

    def _add_images(self, s: Any, data: dict[str, Any]) -> None:
        super()._add_images(s, data)
        data.update(self.request_fields(s))
        seed = self.sampling_seed(s) if self.send_seed else None
        if seed is not None:
            data["sampling_params"]["sampling_seed"] = seed

    def generate(self, s: Any, sampling_params: Any):
        began = time.perf_counter()
        text, meta = self._call(super().generate, s, sampling_params)
        self.finished(s.text_, began, meta, text)
        return text, meta

    def commit_lazy_operations(self, s: Any) -> None:
        self._call(super().commit_lazy_operations, s)

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except (OSError, RuntimeError) as exc:  # urllib's errors are OSErrors; an error answer is a RuntimeError
            self.runtime.check_alive()  # raises RuntimeDiedError (with the log's tail) when the server is gone
            raise GeneratorError(f"generator runtime '{self.runtime.name}' at {self.base_url} failed: "
                                 f"{exc}") from exc


def chat_prompt(tokenizer: Any, question: str, system: str = SYSTEM_PROMPT) -> str:
    """The prompt text for `question` in the model's chat format, ending where the answer begins."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\nQuestion: {question}\n\nAnswer:\n"
