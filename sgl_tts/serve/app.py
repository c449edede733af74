"""The HTTP routes: `/health`, `/metrics`, `/v1/models`, `/v1/chat/completions` (FastAPI).

Searches run on the service's threads; the handlers only await them, so a long search never delays
`/health`. A client that disconnects before its answer has its search cancelled (SearchService.cancel).
A runtime that is down makes `/health` 503 (with each runtime's state) and refuses new searches with 503; a
search that failed because a runtime died is 503 too, with Retry-After, so clients back off. While the server
shuts down (`SearchService.shut_down`), new searches are refused and the ones in flight are answered at once
with 503 `shutting_down` (a stream gets it as its last event, then `[DONE]`). Every request is logged (logger
`sgl_tts.serve`): method, path, status, duration and the search id.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from sgl_tts.config import ConfigError
from sgl_tts.serve.protocol import (EXTENSION, RequestError, answer_chunks, chunk, completion, error_body,
                                    parse_chat_request)
from sgl_tts.search.api import RUNTIME_FAILURES
from sgl_tts.serve.metrics import CONTENT_TYPE
from sgl_tts.serve.service import Busy, SearchJob, SearchService, ShuttingDown, Unavailable
from sgl_tts.search.context import SearchCancelled

log = logging.getLogger("sgl_tts.serve")
RETRY_AFTER_S = 1
RUNTIME_RETRY_AFTER_S = 5  # a runtime is down: a restart takes a while
ACCESS = "sgl_tts.access"  # the ASGI scope key of a request's access-log fields (the handler adds the search id)
KEEP_ALIVE_S = 15.0  # an SSE comment this often while a streamed search has nothing to report


class APIError(Exception):
    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None):
        self.status, self.body, self.headers = status, body, headers or {}


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the request body is read already, so the next ASGI message is the
    disconnect). Only for plain responses: a StreamingResponse reads the messages itself."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _outcome(job: SearchJob) -> asyncio.Future:
    """The job's result as an asyncio future whose error is always retrieved (a cancelled search's error
    has nobody waiting for it)."""
    future = asyncio.wrap_future(job.future)
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    return future


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes: by its Content-Length before reading, or while
    reading when it has none (chunked) or it is wrong."""
    too_large = APIError(413, error_body(f"the request body is over the limit {limit} bytes (limits.body_bytes)",
                                         param=None, code="request_too_large"))
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    received = bytearray()
    async for part in request.stream():
        received += part
        if len(received) > limit:
            raise too_large
    return bytes(received)


def _sse(data: Any) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def runtime_failure(exc: BaseException) -> BaseException | None:
    """The runtime failure (RUNTIME_FAILURES) behind `exc` (a program wraps it in SearchError), else None."""
    while exc is not None:
        if isinstance(exc, RUNTIME_FAILURES):
            return exc
        exc = exc.__cause__
    return None


def unavailable(message: str, code: str = "runtime_unavailable") -> "APIError":
    return APIError(503, error_body(message, "server_error", code=code),
                    headers={"Retry-After": str(RUNTIME_RETRY_AFTER_S)})


class AccessLog:
    """ASGI middleware: one log line per request, when its response has been sent."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        began, fields = time.monotonic(), scope.setdefault(ACCESS, {})
        status = {"code": 500}

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            log.info("%s %s %d %.3f s search=%s", scope["method"], scope["path"], status["code"],
                     time.monotonic() - began, fields.get("search_id", "-"))


def create_app(service: SearchService, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="sgl-tts", description="OpenAI-compatible chat completions answered by a search")
    app.add_middleware(AccessLog)

    # Every error in the OpenAI shape ({"error": {message, type, param, code}}), FastAPI's own included.
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, kind, code=str(exc.status_code)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"invalid request: {first.get('msg', exc)}", param=param), status_code=422)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            service.refused("unauthorized")
            raise APIError(401, error_body("missing or wrong API key (header 'Authorization: Bearer KEY')",
                                           "authentication_error", code="invalid_api_key"))

    @app.get("/health")
    async def health() -> Any:
        runtimes = service.health.health() if service.health is not None else {}
        down = [name for name, state in runtimes.items() if state["state"] != "up"]
        if down:
            body = error_body("runtime " + ", ".join(f"'{name}' is {runtimes[name]['state']}" for name in down),
                              "server_error", code="runtime_unavailable")
            return JSONResponse({**body, "status": "unavailable", "runtimes": runtimes}, status_code=503,
                                headers={"Retry-After": str(RUNTIME_RETRY_AFTER_S)})
        return {"status": "ok", **service.snapshot(), "runtimes": runtimes}

    @app.get("/metrics")
    async def metrics() -> Response:
        runtimes = service.health.health() if service.health is not None else {}
        return Response(service.metrics.render(runtimes), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sgl-tts"}
                                           for name in service.programs]}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(request: Request):
        try:
            raw = await _body(request, service.limits.body_bytes)
        except APIError:
            service.refused("limits")
            raise
        try:
            body = json.loads(raw)
        except ValueError as exc:
            service.refused("bad_request")
            raise APIError(400, error_body(f"the request body is not JSON: {exc}"))
        try:
            parsed = parse_chat_request(body, service.limits)
            search = service.search_config(parsed.program, parsed.settings)
            service.check_prompt(parsed.question, search, parsed.chat)
        except RequestError as exc:
            service.refused("bad_request")
            raise APIError(400, error_body(str(exc), param=exc.param))
        except ConfigError as exc:
            service.refused(getattr(exc, "reason", "bad_request"))
            field = _field_of(exc, parsed.settings)
            if field == "max_tokens" and "max_completion_tokens" in body:  # the request's spelling of max_tokens
                field = "max_completion_tokens"
            raise APIError(400, error_body(str(exc), param=field))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        on_progress = (lambda event: loop.call_soon_threadsafe(events.put_nowait, event)) if parsed.stream else None
        try:
            job = service.submit(parsed.program, search, parsed.question, on_progress=on_progress,
                                 chat=parsed.chat)
        except Busy as exc:
            raise APIError(429, error_body(f"busy: {exc}; retry later", "rate_limit_error", code="busy"),
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        except Unavailable as exc:
            raise unavailable(f"unavailable: {exc}; retry later")
        except ShuttingDown as exc:
            raise unavailable(f"unavailable: {exc}", code="shutting_down")
        request.scope.setdefault(ACCESS, {})["search_id"] = job.id
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if parsed.stream:
            return StreamingResponse(_stream(service, job, events, completion_id, parsed.include_usage),
                                     media_type="text/event-stream")
        finished = _outcome(job)
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            service.cancel(job)
            return JSONResponse(error_body("client disconnected", "cancelled"), status_code=499)
        gone.cancel()
        return JSONResponse(_result_or_error(job, lambda result: completion(completion_id, result, search)))

    return app


def _field_of(exc: ConfigError, settings: dict[str, Any]) -> str | None:
    """The request field a config error is about: its `key` (the loader's dotted key, the request field of a
    refused setting), else the one its message names."""
    if getattr(exc, "key", None):
        return exc.key
    names = [name for name in ("model", *settings) if f"'{name}'" in str(exc) or f" {name} " in str(exc)]
    return names[-1] if names else None


def _result_or_error(job: SearchJob, render):
    try:
        return render(job.future.result())
    except ShuttingDown as exc:
        raise unavailable(str(exc), code="shutting_down")
    except SearchCancelled as exc:
        raise APIError(499, error_body(str(exc), "cancelled"))
    except Exception as exc:  # the search failed: the error names the runtime or the program
        if runtime_failure(exc) is not None:  # a runtime died: the supervisor restarts it, the client retries
            raise unavailable(f"search {job.id} failed because a runtime failed: {exc}; retry later")
        raise APIError(500, error_body(f"search {job.id} failed: {exc}", "server_error"))


async def _stream(service: SearchService, job: SearchJob, events: asyncio.Queue, completion_id: str,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: start, a progress chunk after each scoring round, then the answer in the OpenAI
    chunk format and `[DONE]`. The search is cancelled if the stream ends before the answer: Starlette
    cancels this generator when the client disconnects (it listens for the disconnect itself, so nothing else
    may read the request's messages), and a server that does not listen would fail the next send, at the
    latest the keep-alive comment sent every KEEP_ALIVE_S."""
    created = int(time.time())
    finished = _outcome(job)
    answered = False
    try:
        yield _sse(chunk(completion_id, job.program, created, **{EXTENSION: {
            "event": "start", "search_id": job.id, "search": {"n": job.search.n, "program": job.program}}}))
        while not finished.done():
            next_event = asyncio.ensure_future(events.get())
            await asyncio.wait({finished, next_event}, timeout=KEEP_ALIVE_S, return_when=asyncio.FIRST_COMPLETED)
            if next_event.done():
                yield _sse(chunk(completion_id, job.program, created, **{EXTENSION: next_event.result()}))
            else:
                next_event.cancel()
                if not finished.done():
                    yield b": keep-alive\n\n"
        while not events.empty():
            yield _sse(chunk(completion_id, job.program, created, **{EXTENSION: events.get_nowait()}))
        try:
            chunks = _result_or_error(job, lambda result: answer_chunks(completion_id, result, job.search, created,
                                                                        include_usage))
        except APIError as exc:
            chunks = [exc.body]
        for item in chunks:
            yield _sse(item)
        yield _sse("[DONE]")
        answered = True
    finally:
        if not answered and not job.future.done():
            service.cancel(job)
