"""The OpenAI chat-completions format, mapped onto searches.

Request: `model` names a registered search program; `messages` are applied through the generator's chat
template as in OpenAI's API (`sgl_tts.frontend.backend.chat_prompt`): a first message of role "system" (or
"developer") replaces the solver's default system prompt (`SYSTEM_PROMPT`), the user and assistant turns after
it follow in order, and the last message, the user's, is the question (the search's `Problem.question`): the
search grows its paths from the generation prompt after it. A message of another role or in another place is
a 400 naming it. The search settings (`n`, `beam_width`, `max_tokens`, `temperature`, `seed`, ... every
`SearchConfig` field but `program`) ride in the body beside the OpenAI fields; `max_completion_tokens` is
`max_tokens`; `stop` is refused (a search stops at its step delimiter and its answer). `n` is the search's n:
the reply has one choice. `budget` ({"deadline_s": 5, "max_tokens": 2000}, `sgl_tts.search.budget.Budget`) is
the whole search's deadline from the request's arrival and its generated-token budget, each at most the
operator's limit (`limits.deadline_s`, `limits.search_tokens`); `stopping` the stopping rules
(`sgl_tts.search.stopping.Stopping`). Only the keys given change the server's defaults.
Reply: the message is the selected solution; the choice's `finish_reason` is "stop", "length" (the selected
path hit its `max_tokens`, or the search its token budget) or "deadline" (the search's deadline stopped it and
it answered with what it had; not one of OpenAI's values); `sgl_tts.finish_reason` is the search's own
(`SearchResult.finish_reason`: complete, deadline, token_budget, settled, ranked); `usage` counts the whole search
(every path's generated tokens, the prompt tokens sent, and of those the cached ones); the `sgl_tts` field
carries the candidates with their step scores, and the timings.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from sgl_tts.frontend.backend import SYSTEM_PROMPT, Chat, Turn
from sgl_tts.search.api import SearchConfig
from sgl_tts.search.budget import DEADLINE, TOKEN_BUDGET
from sgl_tts.search.limits import Limits
from sgl_tts.search.records import SearchResult

OPENAI_FIELDS = ("model", "messages", "stream", "stream_options", "user", "max_completion_tokens", "stop")
SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(SearchConfig) if f.name != "program")
SYSTEM_ROLES = ("system", "developer")  # "developer": OpenAI's newer name for the system message
TURN_ROLES = ("user", "assistant")
EXTENSION = "sgl_tts"  # the reply field with what OpenAI's format has no place for


class RequestError(ValueError):
    """A request body that is not a chat-completions request we can answer; `param` names the field."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    program: str
    question: str  # the last user turn
    settings: dict[str, Any]  # search settings from the body, validated by SearchService.search_config
    stream: bool = False
    include_usage: bool = False
    chat: Chat = Chat()  # the system prompt and the turns before the question


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(where, f"'{where}' must be a string or a list of text parts")


def parse_messages(messages: Any, limits: Limits = Limits()) -> tuple[str, Chat]:
    """The question (the last message, the user's) and the chat before it, from a request's `messages`."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "'messages' must be a non-empty list of messages")
    if len(messages) > limits.messages:
        raise RequestError("messages", f"'messages' has {len(messages)} messages, above the limit "
                                       f"{limits.messages} (limits.messages)")
    texts = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(where, f"'{where}' must be an object with a 'role'")
        role = message["role"]
        if role not in SYSTEM_ROLES + TURN_ROLES:
            raise RequestError(where + ".role", f"'{where}' has the unknown role {role!r}; known roles: "
                                                f"{', '.join(SYSTEM_ROLES + TURN_ROLES)}")
        if role in SYSTEM_ROLES and index > 0:
            raise RequestError(where + ".role", f"'{where}' has role {role!r}: only the first message may be a "
                                                "system message (it replaces the solver's system prompt)")
        text = _text(message.get("content"), where + ".content")
        if len(text) > limits.message_chars:
            raise RequestError(where + ".content", f"'{where}.content' is {len(text)} characters, above the limit "
                                                   f"{limits.message_chars} (limits.message_chars)")
        texts.append(text)
    where = f"messages[{len(messages) - 1}]"
    if messages[-1]["role"] != "user":
        raise RequestError(where + ".role", f"the last message must have role 'user' (the question the search "
                                            f"answers), got {messages[-1]['role']!r}")
    if not texts[-1].strip():
        raise RequestError(where + ".content", "the question is empty")
    system = texts[0] if messages[0]["role"] in SYSTEM_ROLES else SYSTEM_PROMPT
    turns = tuple(Turn(m["role"], text) for m, text in zip(messages[:-1], texts) if m["role"] in TURN_ROLES)
    return texts[-1], Chat(system, turns)


def parse_chat_request(body: Any, limits: Limits = Limits()) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - set(OPENAI_FIELDS) - set(SEARCH_FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field '{unknown[0]}'; known fields: "
                                       f"{', '.join(OPENAI_FIELDS + SEARCH_FIELDS)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model", "'model' must be the name of a search program (GET /v1/models lists them)")
    if body.get("stop") is not None:
        raise RequestError("stop", "'stop' is not supported: a search ends its steps at 'step_delimiter' and its "
                                   "paths at their answer; leave 'stop' out")
    question, chat = parse_messages(body.get("messages"), limits)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options", "'stream_options' must be an object")
    settings = {k: body[k] for k in SEARCH_FIELDS if k in body}
    if body.get("max_completion_tokens") is not None:
        if "max_tokens" in settings and settings["max_tokens"] != body["max_completion_tokens"]:
            raise RequestError("max_completion_tokens", "'max_completion_tokens' is 'max_tokens' (per path): give "
                                                        "one of them, or the same value")
        settings["max_tokens"] = body["max_completion_tokens"]
    return ChatRequest(program=model, question=question, chat=chat, stream=stream,
                       include_usage=bool(options.get("include_usage", False)), settings=settings)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def selected_candidate(result: SearchResult):
    """The best-ranked candidate that gave the selected answer (candidates are best first), else the best."""
    for candidate in result.candidates:
        if result.answer is not None and candidate.answer == result.answer:
            return candidate
    return result.candidates[0] if result.candidates else None


def usage(result: SearchResult) -> dict[str, Any]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.generated_tokens,
            "total_tokens": result.prompt_tokens + result.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def extension(result: SearchResult, search: SearchConfig) -> dict[str, Any]:
    return {
        "event": "finish",
        "program": result.program,
        "answer": result.answer,
        "search": dataclasses.asdict(search),
        "candidates": [{"text": c.text, "answer": c.answer, "score": c.score, "step_scores": c.step_scores,
                        "steps": c.steps, "tokens": c.tokens, "finish_reason": c.finish_reason}
                       for c in result.candidates],
        "timings": {"total_s": result.total_time_s, "generator_s": result.generator_time_s,
                    "verifier_s": result.verifier_time_s},
        "iterations": result.iterations,
        "verifier_calls": result.verifier_calls,
        "cache_hit_rate": result.cache_hit_rate,
        "error": result.error,
        "finish_reason": result.finish_reason,
    }


def _finish_reason(result: SearchResult) -> str:
    """The choice's finish_reason (the module docstring)."""
    if result.finish_reason in (DEADLINE, TOKEN_BUDGET):
        return "deadline" if result.finish_reason == DEADLINE else "length"
    chosen = selected_candidate(result)
    return "length" if chosen is not None and chosen.finish_reason == "max_tokens" else "stop"


def completion(completion_id: str, result: SearchResult, search: SearchConfig, created: int | None = None
               ) -> dict[str, Any]:
    chosen = selected_candidate(result)
    return {
        "id": completion_id, "object": "chat.completion", "created": created or int(time.time()),
        "model": result.program,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": chosen.text if chosen else ""},
                     "finish_reason": _finish_reason(result), "logprobs": None}],
        "usage": usage(result),
        EXTENSION: extension(result, search),
    }


def chunk(completion_id: str, model: str, created: int, choices: list[dict[str, Any]] | None = None,
          **fields: Any) -> dict[str, Any]:
    """One `chat.completion.chunk`; progress chunks have no choices and carry the `sgl_tts` field."""
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices or [], **fields}


def answer_chunks(completion_id: str, result: SearchResult, search: SearchConfig, created: int,
                  include_usage: bool) -> list[dict[str, Any]]:
    """The streamed answer: the solution as one content delta, then the finish chunk with the extension, and
    when the client asked for it (stream_options.include_usage) a last chunk with no choices and the usage."""
    chosen = selected_candidate(result)
    content = chunk(completion_id, result.program, created,
                    [{"index": 0, "delta": {"role": "assistant", "content": chosen.text if chosen else ""},
                      "finish_reason": None}])
    finish = chunk(completion_id, result.program, created,
                   [{"index": 0, "delta": {}, "finish_reason": _finish_reason(result)}],
                   **{EXTENSION: extension(result, search)})
    if not include_usage:
        return [content, finish]
    return [content, finish, chunk(completion_id, result.program, created, usage=usage(result))]
