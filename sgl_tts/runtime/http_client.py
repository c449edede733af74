"""HTTP to SGLang runtimes: one pooled client for the process, and errors that keep the runtime's own message.

Every request the project sends to a runtime (a server or a router) outside SGLang's frontend goes through
`request`: one `httpx.Client`, made at first use and shared by every thread (httpx's client is thread-safe), so
calls to a runtime reuse its connections instead of opening one each. The timeout is per call.

A failure is an OSError, as urllib's were, so a caller's `except OSError` covers every way a call can fail:
- an error answer (4xx, 5xx) raises `RuntimeHTTPError`, whose message has the status and the runtime's own
  error text (SGLang's JSON error or the plain body, truncated);
- no connection or a broken one raises ConnectionError, no answer in time TimeoutError.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import httpx

# An idle connection is dropped after this many seconds, before SGLang's server closes it (uvicorn's keep-alive,
# SGLANG_TIMEOUT_KEEP_ALIVE, is 5 s): a request is never sent on a connection the server is closing.
KEEPALIVE_EXPIRY_S = 3.0
# Idle connections kept for reuse. Open connections are not capped: each calling thread holds at most one at a
# time, so the callers' thread pools bound them, and a cap would only queue a request behind others.
MAX_IDLE_CONNECTIONS = 64
ERROR_TEXT_CHARS = 1000  # of a runtime's error text in an exception's message

_client: httpx.Client | None = None
_client_lock = threading.Lock()


class RuntimeHTTPError(OSError):
    """A runtime answered with an error status. `status` is the HTTP status, `text` the runtime's own error
    message (`error_text`)."""

    def __init__(self, method: str, url: str, status: int, reason: str, text: str):
        super().__init__(f"{method} {url}: HTTP {status} {reason}" + (f": {text}" if text else ""))
        self.url, self.status, self.text = url, status, text


def client() -> httpx.Client:
    """The process's client, made at first use. Proxy settings from the environment are ignored (`trust_env`):
    runtimes are reached directly."""
    global _client
    if _client is None:
        with _client_lock:
            if _client is None:
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=MAX_IDLE_CONNECTIONS,
                                      keepalive_expiry=KEEPALIVE_EXPIRY_S)
                _client = httpx.Client(limits=limits, trust_env=False)
    return _client


def _forget_client() -> None:
    """In a forked child: the parent's client (its sockets, and a lock another thread may have held at the fork)
    is not used; the child makes its own at first use."""
    global _client, _client_lock
    _client, _client_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_client)


def request(method: str, url: str, payload: Any = None, timeout: float = 600.0) -> httpx.Response:
    """Send `method` to `url` with `payload` as a JSON body (none when None); the answer, when its status is
    not an error. `timeout` bounds the connect, each read and each write, and the wait for a connection."""
    try:
        response = client().request(method, url, json=payload, timeout=timeout)
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"{method} {url}: no answer within {timeout:g} s ({type(exc).__name__})") from exc
    except httpx.RequestError as exc:
        raise ConnectionError(f"{method} {url}: {exc or type(exc).__name__}") from exc
    if response.is_error:
        raise RuntimeHTTPError(method, url, response.status_code, response.reason_phrase, error_text(response))
    return response


def http_json(url: str, payload: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    """POST `payload` (or GET when None) and decode the JSON answer (None for an empty body; a body that is not
    JSON raises json.JSONDecodeError, a ValueError)."""
    response = request("GET" if payload is None else "POST", url, payload, timeout)
    return response.json() if response.content.strip() else None


def http_text(url: str, timeout: float = 600.0) -> str:
    """GET `url` and return the answer as text (such as Prometheus metrics)."""
    return request("GET", url, timeout=timeout).text


def error_text(response: httpx.Response, limit: int = ERROR_TEXT_CHARS) -> str:
    """The runtime's own message in an error answer, at most `limit` characters: from SGLang's JSON errors
    ({"error": {"message": ...}}, {"error": ...}, FastAPI's {"detail": ...}, {"message": ...}) the message,
    from any other body its text."""
    text = response.text.strip()
    try:
        message = _message(json.loads(text))
    except ValueError:
        message = text
    return message if len(message) <= limit else message[:limit] + "..."


def _message(body: Any) -> str:
    """The message in a decoded JSON error body: the first of its "error", "detail" and "message" fields that is
    set, looked into in turn; a body without one as JSON."""
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if body.get(key):
                return _message(body[key])
    return body if isinstance(body, str) else json.dumps(body)
