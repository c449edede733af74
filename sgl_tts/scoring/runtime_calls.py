"""Requests from a scorer to the SGLang runtime that serves its model, and what their failures say."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from sgl_tts.runtime.server import http_json, request_timeout
from sgl_tts.scoring.base import ScorerError


@contextmanager
def runtime_failures(runtime: Any) -> Iterator[None]:
    """Turn a failed request to a scorer runtime into a ScorerError naming it, or RuntimeDiedError if it died."""
    try:
        yield
    except OSError as exc:
        runtime.check_alive()  # a dead runtime raises RuntimeDiedError naming it
        raise ScorerError(f"scorer runtime '{runtime.name}' at {runtime.url} failed: {exc}") from exc


def post_to_runtime(runtime: Any, route: str, payload: dict[str, Any]) -> Any:
    """POST `payload` to a scorer runtime's `route` (`runtime_failures` on error)."""
    with runtime_failures(runtime):
        return http_json(runtime.url + route, payload, timeout=request_timeout(runtime))
